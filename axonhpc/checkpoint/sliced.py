"""Checkpoints of global arrays held in pieces: saved under one parallel layout, loaded under any other.

The names importable from here live in ``boxes`` (``Box``, ``flat_range_boxes``), ``slice_index`` (the
files and the index), ``slice_save`` and ``slice_load``, each with its notes.
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
