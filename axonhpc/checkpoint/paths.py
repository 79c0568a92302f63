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


# What ``latest`` finds by default: single-file checkpoints (``save``) and checkpoint directories
# (``save_per_rank``, ``save_sharded``, and so ``DistributedTrainer``'s ``ckpt-NNNNNNNN``).
DEFAULT_PATTERNS = ("ckpt-*.npz", "ckpt-*")


def latest(dirpath: "str | os.PathLike[str]", pattern: Optional[str] = None) -> Optional[str]:
    """The checkpoint in ``dirpath`` with the highest step number, or None if there is none.

    A checkpoint is a file, or a directory written by ``save_per_rank`` /
    ``save_sharded`` that holds its ``index.npz`` (its index is written last,
    so a directory without one is a save that did not finish). With the
    default ``pattern`` both kinds are found: ``ckpt-<step>.npz`` files
    written by ``save`` and ``ckpt-<step>`` directories, such as the
    ``ckpt-00000012`` that ``DistributedTrainer`` writes; the highest step
    wins whichever kind it is.

    Steps are compared as numbers, so ``ckpt-100.npz`` is newer than
    ``ckpt-99.npz`` with or without zero padding. Names where the ``*`` part is
    not all digits, and the temporary files of a save in progress
    (``ckpt-000012.npz.tmp-...``), do not match.

    Args:
        dirpath: directory to look in; a directory that does not exist yet
            (the first run of a job) has no checkpoint.
        pattern: file name with one ``*`` where the step number stands
            (``"ckpt-*.npz"``: files only, as before; ``"ckpt-*"``: names
            without a suffix); None: both of ``DEFAULT_PATTERNS``.

    Returns:
        The path (``dirpath`` joined with the name), or None. Equal steps
        written differently (``ckpt-12``, ``ckpt-0012``, ``ckpt-12.npz``) are
        broken by name.

    Raises:
        ConfigurationError: ``pattern`` has no ``*``, more than one, or a path separator.
    """
    regexes = [_step_regex(p) for p in (DEFAULT_PATTERNS if pattern is None else (pattern,))]
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
