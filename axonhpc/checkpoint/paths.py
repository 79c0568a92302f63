"""Finding the newest checkpoint of a run by the step number in its file name."""
from __future__ import annotations

import os
import re
import shutil
from typing import List, Optional

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


_LEFTOVER = re.compile(r"(?P<base>.+)\.(?P<kind>tmp|old)-[0-9A-Za-z-]+")


def _complete(path: str) -> bool:
    return os.path.isfile(path) or os.path.isfile(os.path.join(path, "index.npz"))


def clean_interrupted(dirpath: "str | os.PathLike[str]") -> List[str]:
    """Tidy what killed saves left in ``dirpath``; returns one line per entry it handled.

    - ``X.tmp-<token>``: a save that never finished (never taken for a
      checkpoint): removed.
    - ``X.old-<token>``: the checkpoint that was at ``X``, renamed aside in the
      instant before its replacement took its place: removed if ``X`` is
      complete, otherwise renamed back to ``X``, so nothing is lost.

    Not collective: call it from one process per directory, before anything
    saves there (``DistributedTrainer.fit`` does, on its rank 0).
    """
    dirpath = os.fspath(dirpath)
    try:
        names = sorted(os.listdir(dirpath))
    except FileNotFoundError:
        return []
    done = []
    for name in names:
        m = _LEFTOVER.fullmatch(name)
        if m is None:
            continue
        full, base = os.path.join(dirpath, name), os.path.join(dirpath, m.group("base"))
        if m.group("kind") == "old" and not _complete(base) and _complete(full):
            if os.path.isdir(base):
                shutil.rmtree(base, ignore_errors=True)  # an incomplete directory where the checkpoint belongs
            os.rename(full, base)
            done.append(f"restored {m.group('base')} from {name}")
            continue
        if os.path.isdir(full):
            shutil.rmtree(full, ignore_errors=True)
        else:
            os.unlink(full)
        done.append(f"removed {name}")
    return done
