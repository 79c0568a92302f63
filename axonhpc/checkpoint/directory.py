"""Checkpoint directories: one file per writing rank, an index, and an atomic switch into place.

[Note: the protocol]
Every rank writes its file into ``path.tmp-<token>`` and the ranks agree that all are written; only then
does rank 0 write ``index.npz`` and rename the directory into place (an existing one aside first). A crash
leaves the previous checkpoint or the new one, never a mixture; a directory without ``index.npz`` is never
taken for a checkpoint.

[Note: save tokens]
Each directory save draws one random 128-bit token (rank 0, broadcast), which names the temporary directory
and is recorded in the metadata of every file of that save, the index included (index formats ``.../2``). A
load compares each member file's token with the index's, so a directory stitched from two saves (one rank's
file restored from an older checkpoint) is refused naming the file and both tokens, not loaded as a mixture.
Indexes of format ``.../1`` predate tokens: they still load, without this check.

[Note: reading an index from an untrusted directory]
File names are never taken from an index: they are computed from checked integers, and every file is opened
through ``member_path``, so a checkpoint cannot make a reader open ``/etc/passwd``.
"""
from __future__ import annotations

import os
import re
import secrets
import shutil
from typing import Any, Callable, Optional, Tuple

from ..errors import CheckpointError
from ..groups import resolve_group
from ..groups.agreement import agree
from .format import checkpoint_path, encode
from .io import all_gather_over, broadcast_text, failed_on, fsync_directory, loading, read_saved, write_atomic

INDEX = "index.npz"
PER_RANK_FORMAT = "axonhpc.per-rank/2"  # /1: before save tokens (still read)
MAX_WORLD_SIZE = 1 << 24  # more ranks than any job has run; a larger "world size" is a corrupt index
_TOKEN = re.compile(r"[0-9a-f]{32}")  # a save token: 16 random bytes in hex (see the module note)


def check_file_name(name: Any, what: str) -> str:
    """``name`` if it is a plain file name (no directory part, not ``.`` or ``..``); else CheckpointError."""
    if (not isinstance(name, str) or name in ("", ".", "..") or "\0" in name or "/" in name
            or os.sep in name or (os.altsep is not None and os.altsep in name) or os.path.isabs(name)):
        raise CheckpointError(f"{what}: {name!r} is not a plain file name inside the checkpoint directory")
    return name


def member_path(path: str, name: Any, what: str) -> str:
    """``path/name``, checked to be a plain name that does not resolve outside ``path`` (else CheckpointError)."""
    check_file_name(name, f"{path!r}: the {what}")
    full = os.path.join(path, name)
    root, real = os.path.realpath(path), os.path.realpath(full)
    if os.path.commonpath([root, real]) != root:
        raise CheckpointError(f"{path!r}: the {what} {name!r} resolves to {real!r}, outside the checkpoint "
                              f"directory {root!r} (a symlink?); refused")
    return full


def index_int(index: dict, key: str, path: str, low: int, high: int) -> int:
    """``index[key]``, checked to be an int in ``[low, high]``; else CheckpointError naming the key."""
    value = index.get(key, None)
    if type(value) is not int or not low <= value <= high:
        shown = repr(value) if len(repr(value)) <= 80 else repr(value)[:80] + "..."
        raise CheckpointError(f"{path!r}: the index records {key}={shown}; expected an integer from {low} "
                              f"to {high} (a corrupt or crafted index)")
    return value


def report(pg: Any, problem: Optional[BaseException], what: str) -> None:
    """Collective: raise on every rank if any rank failed (its own error where it failed)."""
    agree(pg, problem, failed_on(what), gather=all_gather_over(pg))


def _as_checkpoint_error(exc: Exception, what: str) -> CheckpointError:
    return exc if isinstance(exc, CheckpointError) else CheckpointError(f"{what}: {type(exc).__name__}: {exc}")


def begin_directory(path: str, pg: Any, my_name: Optional[str]) -> str:
    """Collective: check the names, agree on the save token (module note), make the temporary directory; returns it."""
    if my_name is not None:
        check_file_name(my_name, f"saving checkpoint {path!r}: the file of group rank {pg.rank}")
        if my_name == INDEX:
            raise CheckpointError(f"saving checkpoint {path!r}: a rank's file may not be named {INDEX!r}")
    token = broadcast_text(secrets.token_hex(16) if pg.rank == 0 else None, pg) if pg.size > 1 \
        else secrets.token_hex(16)
    tmp = temporary_directory(path, token)
    problem: Optional[BaseException] = None
    if pg.rank == 0:
        try:
            os.makedirs(tmp)
        except OSError as exc:
            problem = CheckpointError(f"cannot create checkpoint directory {tmp!r}: {exc}")
    report(pg, problem, f"creating {tmp!r}")
    return token


def temporary_directory(path: str, token: str) -> str:
    """Where the files of a directory save with ``token`` are written before the switch: ``path.tmp-<token>``."""
    return f"{path}.tmp-{token}"


def write_member(path: str, token: str, rank: int, name: str, state: Any) -> Optional[CheckpointError]:
    """Local: encode ``state`` and write it atomically as ``name`` in the temporary directory.

    No communication, so a writer thread can call it. Returns None, or the CheckpointError to report.
    """
    try:
        write_atomic(os.path.join(temporary_directory(path, token), name), encode(state, save=token))
    except Exception as exc:  # noqa: BLE001 - every failure is reported to every rank
        return _as_checkpoint_error(exc, f"writing {name} of {path!r} failed on group rank {rank}")
    return None


def put_in_place(path: str, token: str, index: Callable[[], Any]) -> Optional[CheckpointError]:
    """Local, group rank 0, once every rank's file is written: the index, then the atomic switch.

    Returns None, or the CheckpointError to report; on failure ``path`` is left as it was.
    """
    tmp = temporary_directory(path, token)
    try:
        write_atomic(os.path.join(tmp, INDEX), encode(index(), save=token))
        fsync_directory(tmp)
        old = f"{path}.old-{token}"
        if os.path.exists(path):
            os.rename(path, old)
        os.rename(tmp, path)
        fsync_directory(os.path.dirname(os.path.abspath(path)))
        shutil.rmtree(old, ignore_errors=True)
    except Exception as exc:  # noqa: BLE001
        shutil.rmtree(tmp, ignore_errors=True)
        return _as_checkpoint_error(exc, f"finishing checkpoint {path!r} failed on rank 0")
    return None


def save_directory(path: "str | os.PathLike[str]", pg: Any, my_file: Optional[Tuple[str, Callable[[], Any]]],
                   index: Callable[[], Any]) -> None:
    """Collective: write a checkpoint directory by the module note's protocol; CheckpointError everywhere if any rank failed."""
    path = checkpoint_path(path)
    token = begin_directory(path, pg, None if my_file is None else my_file[0])
    problem: Optional[BaseException] = None
    if my_file is not None:
        name, state = my_file
        try:
            problem = write_member(path, token, pg.rank, name, state())
        except Exception as exc:  # noqa: BLE001 - state() itself failed: reported to every rank too
            problem = _as_checkpoint_error(exc, f"writing {name} of {path!r} failed on group rank {pg.rank}")
    try:
        report(pg, problem, f"saving the files of {path!r}")
    except CheckpointError:
        if pg.rank == 0:
            shutil.rmtree(temporary_directory(path, token), ignore_errors=True)
        raise
    report(pg, put_in_place(path, token, index) if pg.rank == 0 else None, f"finishing {path!r}")


def read_index(path: str, expected_format: str) -> Tuple[dict, bytes, Optional[str]]:
    """The index of a checkpoint directory, the sha256 of its metadata, and its save token.

    ``expected_format`` is the current ``name/version``; an index of an earlier version of the same name is read
    too, and its token is None (not checked: see the module note); "" if a current index records none. Raises
    CheckpointError if missing or malformed.
    """
    index, digest, token = read_saved(member_path(path, INDEX, "index"))
    name, _, version = expected_format.rpartition("/")
    older = [f"{name}/{v}" for v in range(1, int(version))]
    found = index.get("format") if isinstance(index, dict) else None
    if not isinstance(index, dict) or (found != expected_format and found not in older):
        raise CheckpointError(f"{path!r} is not a checkpoint of format {expected_format!r} (its index says "
                              f"{found!r})")
    if "extra" not in index:
        raise CheckpointError(f"{path!r}: the index has no 'extra' entry (keys {sorted(index)[:10]}); a corrupt "
                              f"or crafted index")
    if found in older:
        return index, digest, None
    if token is None:
        return index, digest, ""  # no member file can match it: refused when one is read (check_save)
    if not isinstance(token, str) or not _TOKEN.fullmatch(token):
        shown = repr(token) if len(repr(token)) <= 80 else repr(token)[:80] + "..."
        raise CheckpointError(f"{path!r}: the index (format {found!r}) records the save token {shown}; expected 32 "
                              f"hex digits (a corrupt or crafted index)")
    return index, digest, token


def saved_extra(path: str) -> Any:
    """The ``extra`` recorded in the index of checkpoint directory ``path``, whatever its format; None if the index
    cannot be read or records none (the load that follows says why, in its own words)."""
    try:
        index = read_saved(member_path(path, INDEX, "index"))[0]
    except (CheckpointError, OSError):
        return None
    return index.get("extra") if isinstance(index, dict) else None


def check_save(path: str, name: str, what: str, expected: Optional[str], found: Any) -> None:
    """Raise CheckpointError if member file ``name`` comes from another save than the index.

    ``expected``: ``read_index``'s token (None: a ``.../1`` index, not checked; "": the index records none).
    """
    if expected is None or (expected and found == expected):
        return
    if found is None:
        written = "records no save token (written by an older axonhpc, or not by a directory save)"
    else:
        shown = repr(found) if len(repr(found)) <= 80 else repr(found)[:80] + "..."
        written = f"was written by save {shown}"
    by = f"by save {expected!r}" if expected else "with no save token (rewritten by hand?)"
    raise CheckpointError(f"{path!r}: the {what} {name!r} {written}, but the index was written {by}: the "
                          f"directory mixes files of different saves (one copied in from another checkpoint?), so "
                          f"it is refused; save the checkpoint again or restore the whole directory")


def read_member(path: str, name: str, what: str, save: Optional[str]) -> Any:
    """The state in member file ``name`` of the directory ``path``, checked to come from the index's save ``save``."""
    state, _, found = read_saved(member_path(path, name, what))
    check_save(path, name, what, save, found)
    return state


def rank_file(rank: int, world_size: int) -> str:
    """File name of one rank's state: ``rank-00002-of-00004.npz``."""
    return f"rank-{rank:05d}-of-{world_size:05d}.npz"


def save_per_rank(path: "str | os.PathLike[str]", state: Any, group: Any = None, extra: Any = None) -> None:
    """Collective: every rank writes its own ``state``; ``extra`` (rank 0's) goes into the index.

    ``path`` is a directory, replaced if it exists. Raises CheckpointError on every rank if any rank failed.
    """
    pg = resolve_group(group).require_member("checkpoint save_per_rank")
    save_directory(path, pg, (rank_file(pg.rank, pg.size), lambda: state),
                   lambda: {"format": PER_RANK_FORMAT, "world_size": pg.size, "extra": extra})


def load_per_rank(path: "str | os.PathLike[str]", group: Any = None) -> Tuple[Any, Any]:
    """Collective: this rank's state and the shared ``extra`` from a ``save_per_rank`` directory.

    Raises CheckpointError on every rank if any rank cannot read its file, the world size differs, a file comes
    from another save than the index (a stitched directory), or the ranks read different checkpoints.
    """
    path = checkpoint_path(path)
    pg = resolve_group(group).require_member("checkpoint load_per_rank")
    with loading(pg, path) as vote:
        index, digest, save = read_index(path, PER_RANK_FORMAT)
        vote.text = digest.hex()
        saved_world = index_int(index, "world_size", path, 1, MAX_WORLD_SIZE)
        if saved_world != pg.size:
            raise CheckpointError(f"{path!r} was saved by {saved_world} ranks; this group has {pg.size} "
                                  "(per-rank states load only at the same world size)")
        state = read_member(path, rank_file(pg.rank, pg.size), f"rank file of rank {pg.rank}", save)
        extra = index["extra"]
    return state, extra


__all__ = ["save_directory", "begin_directory", "write_member", "put_in_place", "temporary_directory", "read_index",
           "report", "save_per_rank", "load_per_rank", "rank_file", "INDEX", "MAX_WORLD_SIZE", "check_file_name",
           "index_int", "member_path", "read_member", "check_save", "saved_extra"]
