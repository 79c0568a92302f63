"""Finding the newest checkpoint of a run by the step number in its file name."""
from __future__ import annotations

import os
import re
import shutil
from typing import List, Optional

from ..errors import ConfigurationError


def step_regex(pattern: str) -> "re.Pattern[str]":
    parts = pattern.split("*")
    if len(parts) != 2 or os.sep in pattern:
        raise ConfigurationError(f"checkpoint name pattern {pattern!r} must be a file name with exactly one '*' "
                                 f"standing for the step number, like 'ckpt-*.npz'")
    return re.compile(re.escape(parts[0]) + r"(\d+)" + re.escape(parts[1]))


# What ``latest`` finds by default: single-file checkpoints (``save``) and checkpoint directories
# (``save_per_rank``, ``save_sharded``, and so ``DistributedTrainer``'s ``ckpt-NNNNNNNN``).
DEFAULT_PATTERNS = ("ckpt-*.npz", "ckpt-*")


def latest(dirpath: "str | os.PathLike[str]", pattern: Optional[str] = None) -> Optional[str]:
    """The checkpoint in ``dirpath`` with the highest step number, or None if there is none.

    A checkpoint is a file, or a directory that holds its ``index.npz`` (written last, so a directory without
    one is an unfinished save). The default patterns find both ``ckpt-<step>.npz`` files and ``ckpt-<step>``
    directories (as ``DistributedTrainer`` writes). Steps compare as numbers (``ckpt-100`` is newer than
    ``ckpt-99``, padded or not); ties are broken by name. A missing ``dirpath`` has no checkpoint.

    Args:
        pattern: file name with one ``*`` where the step number stands (``"ckpt-*.npz"``: files only);
            None: both of ``DEFAULT_PATTERNS``.

    Raises:
        ConfigurationError: ``pattern`` has no ``*``, more than one, or a path separator.
    """
    regexes = [step_regex(p) for p in (DEFAULT_PATTERNS if pattern is None else (pattern,))]
    dirpath = os.fspath(dirpath)
    try:
        names = os.listdir(dirpath)
    except FileNotFoundError:
        return None
    best = None
    for name in names:
        for regex in regexes:
            m = regex.fullmatch(name)
            # a file, or a checkpoint directory that is complete (its index is written last)
            if m and _complete(os.path.join(dirpath, name)):
                key = (int(m.group(1)), name)
                if best is None or key > best:
                    best = key
                break
    return None if best is None else os.path.join(dirpath, best[1])


_LEFTOVER = re.compile(r"(?P<base>.+)\.(?P<kind>tmp|old)-[0-9A-Za-z-]+")


def _complete(path: str) -> bool:
    return os.path.isfile(path) or os.path.isfile(os.path.join(path, "index.npz"))


def clean_interrupted(dirpath: "str | os.PathLike[str]") -> List[str]:
    """Tidy what killed saves left in ``dirpath``; returns one line per entry it handled.

    ``X.tmp-<token>`` (an unfinished save) is removed; ``X.old-<token>`` (the checkpoint renamed aside just
    before its replacement took its place) is removed if ``X`` is complete, else renamed back to ``X``.
    Not collective: call it from one process per directory, before anything saves there.
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
