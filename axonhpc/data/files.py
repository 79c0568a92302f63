"""A user's own corpus from disk, memory-mapped: text as bytes, or token files in nanoGPT's layout.

[Note: what --data reads]
``FileCorpus(path)`` has ``TextCorpus``'s attributes, so ``TextWindows`` cuts the same windows:

- **a token file** (``.bin``): flat uint16 tokens, as nanoGPT's ``prepare.py`` writes them; a folder
  with ``train.bin`` and ``val.bin`` gives the splits, a single file holds its last ``held_out``
  fraction out. The vocabulary is ``vocab_size``, else the largest token + 1 (one pass).
- **a text file**: its bytes (vocabulary 256), the last ``held_out`` fraction held out.
- **a folder of text files**: every regular file, sorted by relative path; a seeded ``held_out``
  fraction of the files held out, as ``TextCorpus`` does.

Files are ``np.memmap``-ed read-only, so a corpus larger than memory trains (a batch reads only its
windows' pages), except a folder of text files, concatenated in memory. nanoGPT's ``meta.pkl`` is
never read (no pickle); pass the vocabulary size instead.
"""
from __future__ import annotations

import math
import os
from typing import List, Optional

import numpy as np

from ..errors import ConfigurationError, NotFoundError, ShapeError
from .text import VOCAB_SIZE


def _map(path: str, dtype: np.dtype) -> np.ndarray:
    size = os.path.getsize(path)
    if size % np.dtype(dtype).itemsize:
        raise ShapeError(f"{path}: {size} bytes is not a whole number of {np.dtype(dtype).name} tokens; a token "
                         f"file is a flat array of uint16 (nanoGPT's train.bin layout)")
    if size == 0:
        raise ShapeError(f"{path} is empty")
    return np.memmap(path, dtype=dtype, mode="r")


def _files_under(root: str) -> List[str]:
    out = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if not d.startswith("."))
        for name in filenames:
            full = os.path.join(dirpath, name)
            if not name.startswith(".") and os.path.isfile(full):
                out.append(os.path.relpath(full, root).replace(os.sep, "/"))
    return sorted(out)


class FileCorpus:
    """Train and held-out tokens from ``path`` (see the module note).

    Args:
        path: a ``.bin`` token file, a folder with ``train.bin`` and ``val.bin``, a text file, or a folder
            of text files.
        held_out: the fraction held out where the path does not say (a single file: its last part; a
            folder of text files: that fraction of the files).
        vocab_size: the vocabulary of token files (default: the largest token + 1); text is 256 bytes.

    Attributes:
        train, val: 1-D token arrays (``np.memmap`` where the data is one file on disk).
        kind: "tokens" or "bytes".

    Raises:
        NotFoundError: ``path`` does not exist.
        ConfigurationError: ``held_out`` outside (0, 1); a split of fewer than 2 tokens; a folder with one
            of train.bin and val.bin but not the other, or with fewer than two files; tokens beyond
            ``vocab_size``.
        ShapeError: a token file whose size is not a whole number of uint16, or an empty file.
    """

    def __init__(self, path: str, held_out: float = 0.1, seed: int = 0, vocab_size: Optional[int] = None) -> None:
        if not os.path.exists(path):
            raise NotFoundError(f"--data {path!r} does not exist (a .bin token file, a folder with train.bin and "
                                f"val.bin, a text file or a folder of text files)")
        if not 0.0 < held_out < 1.0:
            raise ConfigurationError(f"FileCorpus held_out must be in (0, 1), got {held_out}")
        self.path = path
        splits = [os.path.join(path, name) for name in ("train.bin", "val.bin")] if os.path.isdir(path) else []
        present = [os.path.exists(p) for p in splits]
        if any(present) and not all(present):
            raise ConfigurationError(f"{path} holds {'train.bin' if present[0] else 'val.bin'} but not "
                                     f"{'val.bin' if present[0] else 'train.bin'}; nanoGPT's layout has both")
        if all(present) and present:
            self.kind = "tokens"
            self.train, self.val = _map(splits[0], np.uint16), _map(splits[1], np.uint16)
        elif os.path.isfile(path) and path.endswith(".bin"):
            self.kind = "tokens"
            self.train, self.val = self._tail_split(_map(path, np.uint16), held_out)
        elif os.path.isfile(path):
            self.kind = "bytes"
            self.train, self.val = self._tail_split(_map(path, np.uint8), held_out)
        else:
            self.kind = "bytes"
            self.train, self.val = self._folder(path, held_out, seed)
        for name, tokens in (("train", self.train), ("held-out", self.val)):
            if len(tokens) < 2:
                raise ConfigurationError(f"{path}: the {name} split has {len(tokens)} token(s); it needs at least 2")
        if self.kind == "bytes":
            self.vocab_size = VOCAB_SIZE
        else:
            largest = int(max(self.train.max(), self.val.max()))
            if vocab_size is not None and largest >= vocab_size:
                raise ConfigurationError(f"{path}: token {largest} is beyond vocab_size={vocab_size}")
            self.vocab_size = int(vocab_size) if vocab_size is not None else largest + 1

    @staticmethod
    def _tail_split(tokens: np.ndarray, held_out: float):
        cut = len(tokens) - max(1, math.floor(held_out * len(tokens)))
        return tokens[:cut], tokens[cut:]

    @staticmethod
    def _folder(path: str, held_out: float, seed: int):
        names = _files_under(path)
        if len(names) < 2:
            raise ConfigurationError(f"{path}: a folder of text needs at least two files to split, found "
                                     f"{len(names)}")
        n_val = min(len(names) - 1, max(1, math.floor(held_out * len(names) + 0.5)))
        val_idx = set(np.random.default_rng(seed).choice(len(names), size=n_val, replace=False).tolist())
        texts = []
        for name in names:
            with open(os.path.join(path, name), "rb") as f:
                texts.append(f.read())
        train = np.frombuffer(b"".join(t for i, t in enumerate(texts) if i not in val_idx), dtype=np.uint8)
        val = np.frombuffer(b"".join(t for i, t in enumerate(texts) if i in val_idx), dtype=np.uint8)
        return train, val

    def __repr__(self) -> str:
        return (f"FileCorpus({self.path!r}: {self.kind}, vocabulary {self.vocab_size}, train={len(self.train)} "
                f"tokens, val={len(self.val)} tokens)")


__all__ = ["FileCorpus"]
