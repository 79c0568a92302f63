"""Checkpoints: nested training state in one ``.npz`` file, written atomically, read without pickle.

``save(path, state, group=None)`` / ``load(path, group=None)`` store nested
dicts, lists and tuples of numpy arrays and scalars (a model's and an
optimizer's ``state_dict()``, the epoch, rng states). See ``format`` for the
file layout and ``io`` for atomic writes and what each rank of a group does.
``save_slices`` / ``load_slices`` (``sliced``) store global arrays held in
pieces (``Box``) and load them under any other parallel layout;
``save_model_slices`` / ``load_model_slices`` do it for a model and its
optimizer (``ParallelGPT.parameter_boxes()``). ``AsyncCheckpointer``
(``background``) saves in a writer thread while training goes on.
"""
from .background import AsyncCheckpointer
from .directory import load_per_rank, save_per_rank
from .format import FORMAT_VERSION
from .io import load, save
from .model_slices import load_model_slices, save_model_slices
from .paths import clean_interrupted, latest
from .rng import capture_rng_state, restore_rng_state
from .sharded import load_sharded, save_sharded
from .sliced import Box, load_slices, read_full, save_slices

__all__ = ["save", "load", "latest", "clean_interrupted", "capture_rng_state", "restore_rng_state", "save_sharded", "load_sharded",
           "save_per_rank", "load_per_rank", "save_slices", "load_slices", "read_full", "Box",
           "save_model_slices", "load_model_slices", "AsyncCheckpointer", "FORMAT_VERSION"]
