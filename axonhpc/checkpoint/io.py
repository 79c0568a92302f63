"""``save`` and ``load``: atomic checkpoint files and what the ranks of a group do.

[Note: atomic writes]
Written under a temporary name, fsynced, then ``os.replace``d over ``path`` and the directory fsynced, so a
crash or power loss leaves the previous checkpoint or the new one, never a half-written file.

[Note: groups]
``save``: group rank 0 writes and broadcasts its outcome, so a failed write raises the same ``CheckpointError``
everywhere instead of leaving the others in a barrier. ``load``: every rank reads the file itself, then the
ranks agree on (ok?, sha256 of the metadata): a failure anywhere, or ranks that read different files (a
node-local path, a file replaced mid-load), raises on every rank.
"""
from __future__ import annotations

import contextlib
import functools
import hashlib
import os
import threading
from typing import Any, ContextManager, List, Optional, Tuple, Union

import numpy as np

from ..collectives import all_gather, broadcast
from ..errors import CheckpointError
from ..groups import ProcessGroup, resolve_group
from ..groups.agreement import Failed, Gather, Refused, Vote, all_or_none
from .archive import EntryRefused, open_archive
from .format import MAX_META_BYTES, META_ENTRY, checkpoint_path, decode, encode, parse_meta

PathLike = Union[str, "os.PathLike[str]"]


def _member_group(group: Optional[ProcessGroup], op: str) -> ProcessGroup:
    return resolve_group(group).require_member(f"checkpoint {op}")


def fsync_directory(directory: str) -> None:
    if os.name != "posix":
        return  # directories cannot be opened for fsync elsewhere; the rename is still atomic
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    except OSError:
        pass  # some network filesystems refuse fsync on a directory; the data itself is synced
    finally:
        os.close(fd)


def write_atomic(path: str, entries: dict) -> None:
    """Write ``entries`` as an npz file at exactly ``path`` through a temporary file and a rename.

    On OSError the temporary file is removed and ``path`` is left as it was.
    """
    tmp = f"{path}.tmp-{os.getpid()}-{threading.get_ident()}"
    try:
        with open(tmp, "wb") as f:
            np.savez(f, **entries)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    fsync_directory(os.path.dirname(os.path.abspath(path)))


def broadcast_text(text: Optional[str], pg: ProcessGroup) -> Optional[str]:
    """Group rank 0's ``text`` (or None) on every rank: a length header, then the UTF-8 bytes."""
    header = np.zeros(1, dtype=np.int64)
    data = b""
    if pg.rank == 0 and text is not None:
        data = text.encode("utf-8") or b" "  # length 0 means "no text", so never send an empty one
        header[0] = len(data)
    broadcast(header, 0, group=pg)
    if header[0] == 0:
        return None
    buffer = np.frombuffer(data, dtype=np.uint8).copy() if pg.rank == 0 else np.empty(int(header[0]), np.uint8)
    broadcast(buffer, 0, group=pg)
    return buffer.tobytes().decode("utf-8")


def gather_text(text: str, pg: ProcessGroup) -> List[str]:
    """Collective: every rank's ``text``, in group rank order (a length, then the padded UTF-8 bytes)."""
    data = np.frombuffer(text.encode("utf-8"), dtype=np.uint8)
    sizes = all_gather(np.array([data.size], dtype=np.int64), group=pg).reshape(-1)
    buffer = np.zeros(int(sizes.max()), dtype=np.uint8)
    buffer[:data.size] = data
    table = all_gather(buffer, group=pg)
    return [table[r, :int(sizes[r])].tobytes().decode("utf-8") for r in range(pg.size)]


def write_file(path: str, state: Any, pg: ProcessGroup) -> Optional[Tuple[BaseException, str]]:
    """Group rank 0's local part of ``save`` (no communication); None, or ``(exception, message)`` for ``share_outcome``."""
    try:
        write_atomic(path, encode(state))
    except Exception as exc:  # noqa: BLE001 - every failure is reported to every rank by share_outcome
        detail = str(exc) if isinstance(exc, CheckpointError) else f"{type(exc).__name__}: {exc}"
        return exc, f"saving checkpoint {path!r} failed on group rank 0 (global rank {pg.ranks[0]}): {detail}"
    return None


def share_outcome(path: str, pg: ProcessGroup, failure: Optional[Tuple[BaseException, str]]) -> None:
    """Collective: raise the same ``CheckpointError`` on every rank if group rank 0's write failed.

    ``failure`` is what ``write_file`` returned on rank 0, and is read there only.
    """
    problem, message = failure if failure is not None else (None, None)
    if pg.size > 1:
        message = broadcast_text(message, pg)
    if message is not None:
        raise CheckpointError(message) from problem


def save(path: PathLike, state: Any, group: Optional[ProcessGroup] = None) -> None:
    """Collective: write ``state`` to ``path`` atomically (group rank 0 writes, every rank returns after).

    Args:
        state: nested dicts (str keys), lists and tuples of numpy arrays and plain scalars, e.g.
            ``{"model": model.state_dict(), "epoch": 3}``. Only group rank 0's is read.

    Raises:
        CheckpointError: on every rank, if rank 0 could not encode or write the state.
        NotAMemberError: this rank is not in ``group``.
    """
    path = checkpoint_path(path)
    pg = _member_group(group, "save")
    share_outcome(path, pg, write_file(path, state, pg) if pg.rank == 0 else None)


def read_file(path: str) -> Tuple[Any, bytes]:
    """The state in ``path`` and the sha256 of its metadata; every failure is a CheckpointError (see ``archive``)."""
    state, digest, _ = read_saved(path)
    return state, digest


def read_saved(path: str) -> Tuple[Any, bytes, Any]:
    """``read_file``, and the save token its metadata records (None if it records none: see ``format.encode``)."""
    source = f"checkpoint {path!r}"
    with open_archive(path, source) as archive:
        names = archive.names
        if META_ENTRY not in names:
            raise CheckpointError(f"{source}: not an axonhpc checkpoint (no {META_ENTRY!r} entry; "
                                  f"entries: {names[:10]})")
        try:
            raw = archive.read(META_ENTRY, max_bytes=MAX_META_BYTES)
        except EntryRefused as exc:  # a pickled, oversized or corrupt metadata entry
            raise CheckpointError(f"{source}: entry {META_ENTRY!r} cannot be read ({exc})") from exc
        try:
            meta = parse_meta(raw, source)
            state = decode(meta, archive, names, source)
        except RecursionError as exc:  # crafted metadata nested deeper than Python recurses
            raise CheckpointError(f"{source}: the metadata is nested too deeply to read") from exc
    return state, hashlib.sha256(raw.tobytes()).digest(), meta.get("save")


def all_gather_over(pg: ProcessGroup) -> Gather:
    """``all_or_none``'s transport for a checkpoint: the collective all-gather (the group's timeout applies)."""
    return functools.partial(all_gather, group=pg)


def failed_on(what: str, then: str = "") -> Refused:
    """``all_or_none``'s error for the ranks that did not fail: ``{what} failed on group ranks [1] (...){then}``."""
    return lambda failed: CheckpointError(f"{what} failed on group ranks {[r for r, _ in failed]} "
                                          f"(see the error raised there){then}")


def loading(pg: ProcessGroup, path: str) -> ContextManager[Vote]:
    """Collective: run the block (this rank's read), then raise on every rank if any failed or read another file.

    The block sets ``vote.text`` to the hex sha256 of the metadata it read.
    """
    def differ(seen: List[Tuple[bool, str]]) -> CheckpointError:
        groups: dict = {}
        for r, (_, digest) in enumerate(seen):
            groups.setdefault(digest[:16], []).append(r)
        read = "; ".join(f"ranks {ranks} read metadata sha256 {h}..." for h, ranks in groups.items())
        return CheckpointError(f"the ranks read different checkpoints at {path!r}: {read} (is the path on a "
                               f"filesystem every rank shares, and was it replaced during the load?)")

    def refused(failed: Failed) -> CheckpointError:
        # What failed where, so that every rank's error names the file and the reason, not only the failed rank's.
        detail = "; ".join(f"group rank {r}: {why}" for r, why in failed)
        return CheckpointError(f"loading checkpoint {path!r} failed on group ranks {[r for r, _ in failed]} (see the "
                               f"error raised there), so no rank uses it: {detail}")

    # Exception: any failure to read (an OSError the archive did not turn into a CheckpointError) is refused alike.
    return all_or_none(pg, refused, differ, catch=Exception, gather=all_gather_over(pg))


def load(path: PathLike, group: Optional[ProcessGroup] = None) -> Any:
    """Collective: read a checkpoint written by ``save`` (every rank reads ``path``); never unpickles.

    Raises:
        CheckpointError: on every rank, if any rank finds the file missing, not a checkpoint, of a newer format,
            inconsistent or corrupt, or the ranks read different files.
        NotAMemberError: this rank is not in ``group``.
    """
    path = checkpoint_path(path)
    pg = _member_group(group, "load")
    with loading(pg, path) as vote:
        state, digest = read_file(path)
        vote.text = digest.hex()
    return state
