"""Byte-level text from the Python standard library's own source, for language-model training.

[Note: a corpus every machine already has]
Every Python carries its standard library as ``.py`` files, so this corpus needs no download. Files are read
sorted by relative path as raw bytes (vocabulary 256), and a seeded fraction is held out by file, so the split
is the same on every machine with the same Python version.
"""
from __future__ import annotations

import math
import os
import sysconfig
from typing import Iterator, List, Optional, Tuple

import numpy as np

from ..errors import ConfigurationError
from .sampler import DistributedSampler

VOCAB_SIZE = 256
_SKIP_DIRS = frozenset({"site-packages", "dist-packages", "__pycache__"})


def stdlib_source_files(root: Optional[str] = None) -> List[str]:
    """The ``.py`` files under ``root`` (default: the standard library), as sorted relative paths.

    site-packages, dist-packages and __pycache__ are skipped; separators are "/".
    """
    root = sysconfig.get_paths()["stdlib"] if root is None else root
    out = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in _SKIP_DIRS]
        rel = os.path.relpath(dirpath, root)
        for name in filenames:
            if name.endswith(".py"):
                out.append(name if rel == "." else os.path.join(rel, name).replace(os.sep, "/"))
    return sorted(out)


def sample_windows(tokens: np.ndarray, batch_size: int, context: int,
                   rng: np.random.Generator) -> Tuple[np.ndarray, np.ndarray]:
    """``batch_size`` random windows as ``(inputs, targets)``, int64 (batch_size, context), targets shifted by one.

    Raises:
        ConfigurationError: non-positive sizes, or fewer than ``context + 1`` tokens.
    """
    if batch_size <= 0 or context <= 0:
        raise ConfigurationError(f"sample_windows needs positive batch_size and context, got "
                                 f"batch_size={batch_size}, context={context}")
    if len(tokens) < context + 1:
        raise ConfigurationError(f"sample_windows needs at least context + 1 = {context + 1} tokens, "
                                 f"got {len(tokens)}")
    starts = rng.integers(0, len(tokens) - context, size=batch_size)
    windows = tokens[starts[:, None] + np.arange(context + 1)].astype(np.int64)
    return windows[:, :-1], windows[:, 1:]


class TextWindows:
    """A data-parallel rank's batches of next-token windows, the same global batches on any number of ranks.

    Global batch k is positions ``[k * B, (k + 1) * B)`` of a ``DistributedSampler``'s order, and rank r takes
    those congruent to r modulo ``num_replicas``. ``batch(step)`` is a pure function of the step, so a resumed
    run reads exactly the batches the uninterrupted one would.

    Args:
        global_batch: windows per step over all ranks; ``num_replicas`` divides it.
        shuffle: reshuffle every epoch (False: in order, for held-out data).

    Raises:
        ConfigurationError: non-positive sizes, ``num_replicas`` not dividing ``global_batch``, or fewer
            than ``global_batch`` windows.
    """

    def __init__(self, tokens: np.ndarray, context: int, global_batch: int, num_replicas: int = 1, rank: int = 0,
                 shuffle: bool = True, seed: int = 0) -> None:
        if context <= 0 or global_batch <= 0 or num_replicas <= 0 or global_batch % num_replicas:
            raise ConfigurationError(f"TextWindows needs positive context and global_batch divisible by "
                                     f"num_replicas, got context={context}, global_batch={global_batch}, "
                                     f"num_replicas={num_replicas}")
        self.tokens = tokens
        self.context = int(context)
        self.global_batch = int(global_batch)
        self.local_batch = self.global_batch // num_replicas
        self.num_windows = max(0, (len(tokens) - 1) // self.context)
        if self.num_windows < self.global_batch:
            raise ConfigurationError(f"TextWindows: {len(tokens)} tokens make {self.num_windows} windows of "
                                     f"context {context}, fewer than one global batch of {global_batch}")
        self.steps_per_epoch = self.num_windows // self.global_batch
        self.sampler = DistributedSampler(self.num_windows, num_replicas, rank, shuffle=shuffle, seed=seed)
        self._epoch: Optional[int] = None
        self._order = np.empty(0, dtype=np.int64)

    def batch(self, step: int) -> Tuple[np.ndarray, np.ndarray]:
        """This rank's inputs and targets of global step ``step``: int64 (B / num_replicas, context) each."""
        epoch, k = divmod(int(step), self.steps_per_epoch)
        if epoch != self._epoch:
            self.sampler.set_epoch(epoch)
            self._order = self.sampler.indices()
            self._epoch = epoch
        b = self.local_batch
        starts = self._order[k * b:(k + 1) * b] * self.context
        windows = self.tokens[starts[:, None] + np.arange(self.context + 1)].astype(np.int64)
        return windows[:, :-1], windows[:, 1:]

    def __repr__(self) -> str:
        return (f"TextWindows({self.num_windows} windows of {self.context}, global batch {self.global_batch}, "
                f"{self.steps_per_epoch} steps per epoch, rank {self.sampler.rank} of {self.sampler.num_replicas})")


class TextCorpus:
    """Bytes of the standard library's source, split by file into train and held-out tokens.

    Args:
        max_bytes: read files (in sorted order) until this many bytes, the last file cut.
        held_out: fraction of the files held out (at least one file each side).
        root: folder to read instead of the standard library.

    Attributes:
        train, val: uint8 token arrays.
        train_files, val_files: the relative paths in each split.

    Raises:
        ConfigurationError: ``max_bytes`` < 1, ``held_out`` outside (0, 1), or fewer than two files.
    """

    vocab_size = VOCAB_SIZE

    def __init__(self, max_bytes: int = 4_000_000, held_out: float = 0.1, seed: int = 0,
                 root: Optional[str] = None) -> None:
        if max_bytes < 1:
            raise ConfigurationError(f"TextCorpus max_bytes must be >= 1, got {max_bytes}")
        if not 0.0 < held_out < 1.0:
            raise ConfigurationError(f"TextCorpus held_out must be in (0, 1), got {held_out}")
        root = sysconfig.get_paths()["stdlib"] if root is None else root
        texts, names, total = [], [], 0
        for rel in stdlib_source_files(root):
            if total >= max_bytes:
                break
            with open(os.path.join(root, rel), "rb") as f:
                data = f.read(max_bytes - total)
            if data:
                texts.append(data)
                names.append(rel)
                total += len(data)
        if len(names) < 2:
            raise ConfigurationError(f"TextCorpus needs at least 2 non-empty .py files under {root!r} within "
                                     f"max_bytes={max_bytes}, found {len(names)}")
        n_val = min(len(names) - 1, max(1, math.floor(held_out * len(names) + 0.5)))
        val_idx = set(np.random.default_rng(seed).choice(len(names), size=n_val, replace=False).tolist())
        self.train_files = [n for i, n in enumerate(names) if i not in val_idx]
        self.val_files = [n for i, n in enumerate(names) if i in val_idx]
        self.train = np.frombuffer(b"".join(t for i, t in enumerate(texts) if i not in val_idx), dtype=np.uint8)
        self.val = np.frombuffer(b"".join(t for i, t in enumerate(texts) if i in val_idx), dtype=np.uint8)

    def split(self, name: str) -> np.ndarray:
        """The tokens of ``"train"`` or ``"val"``; ConfigurationError for another name."""
        if name not in ("train", "val"):
            raise ConfigurationError(f"TextCorpus split must be 'train' or 'val', got {name!r}")
        return self.train if name == "train" else self.val

    def batches(self, split: str, batch_size: int, context: int,
                seed: int = 0) -> Iterator[Tuple[np.ndarray, np.ndarray]]:
        """Endless ``(inputs, targets)`` batches of random windows (``sample_windows``) from one split.

        ``seed``: the same seed gives the same batches. Yields int64 arrays (batch_size, context).
        """
        tokens = self.split(split)
        rng = np.random.default_rng(seed)
        while True:
            yield sample_windows(tokens, batch_size, context, rng)

    def __repr__(self) -> str:
        return (f"TextCorpus(train={len(self.train)} bytes in {len(self.train_files)} files, "
                f"val={len(self.val)} bytes in {len(self.val_files)} files)")


__all__ = ["TextCorpus", "TextWindows", "sample_windows", "stdlib_source_files", "VOCAB_SIZE"]
