"""Checkpoints of global arrays held in pieces: saved under one parallel layout, loaded under any other.

The names of sliced checkpoints, importable from here; each lives in the
module of its one idea, with that idea's notes:

- ``boxes``: ``Box``, the block of a global array a rank holds, and
  ``flat_range_boxes``, FSDP's flat shards as boxes ([Note: boxes],
  [Note: flat shards]);
- ``slice_index``: the index and the files on disk, ``INDEX_FORMAT``,
  ``MAX_PIECES_PER_FILE``, ``slice_file`` ([Note: the index]);
- ``slice_save``: ``plan_slices``, ``prepare_slices`` and ``save_slices``
  ([Note: what a save checks, and who writes]);
- ``slice_load``: ``load_slices`` and ``read_full`` ([Note: reading only what
  is needed]).
"""
from . import slice_index
from .boxes import Box, flat_range_boxes
from .slice_index import INDEX_FORMAT, MAX_PIECES_PER_FILE, slice_file
from .slice_load import load_slices, read_full
from .slice_save import plan_slices, prepare_slices, save_slices

# A public name outside ``__all__``, importable from here as before the module was split.
MAX_DIM = slice_index.MAX_DIM

__all__ = ["Box", "save_slices", "load_slices", "read_full", "plan_slices", "prepare_slices", "flat_range_boxes",
           "slice_file", "INDEX_FORMAT", "MAX_PIECES_PER_FILE"]
