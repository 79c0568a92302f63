"""Finding the newest checkpoint of a run by the step number in its file name."""
from __future__ import annotations

import os
import re
from typing import Optional

from ..errors import ConfigurationError


def _step_regex(pattern: str) -> "re.Pattern[str]":
    parts = pattern.split("*")
    if len(parts) != 2 or os.sep in pattern:
        raise ConfigurationError(f"checkpoint name pattern {pattern!r} must be a file name with exactly one '*' "
                                 f"standing for the step number, like 'ckpt-*.npz'")
    return re.compile(re.escape(parts[0]) + r"(\d+)" + re.escape(parts[1]))


def latest(dirpath: "str | os.PathLike[str]", pattern: str = "ckpt-*.npz") -> Optional[str]:
    """The checkpoint in ``dirpath`` with the highest step number, or None if there is none.

    A checkpoint is a file, or a directory written by ``save_per_rank`` /
    ``save_sharded`` (``pattern="ckpt-*"``) that holds its ``index.npz``.

    Steps are compared as numbers, so ``ckpt-100.npz`` is newer than
    ``ckpt-99.npz`` with or without zero padding. Names where the ``*`` part is
    not all digits, and the temporary files of a save in progress
    (``ckpt-000012.npz.tmp-...``), do not match.

    Args:
        dirpath: directory to look in; a directory that does not exist yet
            (the first run of a job) has no checkpoint.
        pattern: file name with one ``*`` where the step number stands.

    Returns:
        The path (``dirpath`` joined with the file name), or None. Equal steps
        written differently (``ckpt-12``, ``ckpt-0012``) are broken by name.

    Raises:
        ConfigurationError: ``pattern`` has no ``*``, more than one, or a path separator.
    """
    regex = _step_regex(pattern)
    dirpath = os.fspath(dirpath)
    try:
        names = os.listdir(dirpath)
    except FileNotFoundError:
        return None
    best = None
    for name in names:
        m = regex.fullmatch(name)
        full = os.path.join(dirpath, name)
        # a file, or a checkpoint directory that is complete (its index is written last)
        if m and (os.path.isfile(full) or os.path.isfile(os.path.join(full, "index.npz"))):
            key = (int(m.group(1)), name)
            if best is None or key > best:
                best = key
    return None if best is None else os.path.join(dirpath, best[1])
