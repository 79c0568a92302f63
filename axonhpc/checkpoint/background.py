"""Checkpoints saved in the background: copy the state to host memory, return, write in a thread.

[Note: no communication in the writer thread]
The calling thread keeps issuing collectives while a save is written; one from the writer thread would
interleave differently on each rank. So the writer only encodes and writes this rank's file. All agreement
(the temporary name, the slice plan, whether every write worked) happens in the calling thread's ``save*``,
``wait``, ``poll`` and ``close``; a failed write raises the same ``CheckpointError`` on every rank, and
only after that does rank 0 write a directory's index.

[Note: when a checkpoint becomes visible]
A directory's index may be written only after every rank's file is, so until finished it is
``<path>.tmp-<token>``, which ``latest`` never picks: a killed process leaves the previous checkpoint loadable.

[Note: one save in flight]
Each save first finishes the previous one, so memory is bounded by one host copy of the state. The copy is
needed because the caller may change its arrays once ``save`` returns (``copy=False`` skips it for fresh
copies; device arrays are always copied).
"""
from __future__ import annotations

import functools
import os
import shutil
import threading
from typing import Any, Callable, Optional, Tuple

import numpy as np

from .._dtypes import is_cupy_array
from ..collectives import all_reduce
from ..backends import ReduceOp
from ..errors import CheckpointError, ConfigurationError
from ..groups import ProcessGroup, resolve_group
from ..groups.agreement import Failed, agree
from .directory import (PER_RANK_FORMAT, begin_directory, put_in_place, rank_file, temporary_directory,
                        write_member)
from .format import MAX_DEPTH, checkpoint_path
from .io import all_gather_over, share_outcome, write_file
from .sharded import shard_file, sharded_index
from .sliced import prepare_slices


def host_copy(state: Any, copy: bool = True) -> Any:
    """``state`` with every array in host memory, owned by the result (``copy=False`` keeps numpy arrays as they are)."""
    return _copy_node(state, copy, set(), 0)


def _copy_node(value: Any, copy: bool, open_ids: set, depth: int) -> Any:
    if is_cupy_array(value):
        return value.get()
    if isinstance(value, np.ndarray):
        return np.array(value, order="C", copy=True) if copy else value
    if not isinstance(value, (dict, list, tuple)) or id(value) in open_ids or depth >= MAX_DEPTH:
        return value  # immutable scalars; or a cycle / excess depth, which encoding refuses with the key
    open_ids.add(id(value))
    try:
        if isinstance(value, dict):
            return {key: _copy_node(item, copy, open_ids, depth + 1) for key, item in value.items()}
        items = [_copy_node(item, copy, open_ids, depth + 1) for item in value]
        return tuple(items) if isinstance(value, tuple) else items
    finally:
        open_ids.discard(id(value))


class _Save:
    """One save in flight: the writer thread (if this rank writes) and what finishing it needs."""

    def __init__(self, path: str, pg: ProcessGroup, work: Optional[Callable[[], Any]],
                 token: Optional[str] = None, index: Any = None):
        self.path = path
        self.pg = pg
        self.token = token  # None for a single file; a directory's temporary name otherwise
        self.index = index
        self.outcome: Any = None  # what ``work`` returned: None, or the failure to report
        self.thread: Optional[threading.Thread] = None
        if work is not None:
            self.thread = threading.Thread(target=self._run, args=(work,), daemon=False,
                                           name=f"axonhpc-checkpoint {os.path.basename(path)}")
            self.thread.start()

    def _run(self, work: Callable[[], Any]) -> None:
        try:
            self.outcome = work()
        except BaseException as exc:  # noqa: BLE001 - anything the thread meets is reported at wait
            problem = CheckpointError(f"saving checkpoint {self.path!r} failed on group rank {self.pg.rank}: "
                                      f"{type(exc).__name__}: {exc}")
            problem.__cause__ = exc
            self.outcome = (problem, str(problem)) if self.token is None else problem

    def written(self) -> bool:
        """True once this rank's writing has ended (or there was none)."""
        return self.thread is None or not self.thread.is_alive()

    def join(self) -> None:
        """Block until this rank's writing has ended."""
        if self.thread is not None:
            self.thread.join()


def _agree(pg: ProcessGroup, problem: Optional[BaseException], what: str) -> None:
    """Collective: if any rank failed, raise one CheckpointError with every failing rank's message, on every rank."""
    def refused(failed: Failed) -> CheckpointError:
        detail = "; ".join(f"group rank {r}: {why}" for r, why in failed)
        return CheckpointError(f"{what} failed on group ranks {[r for r, _ in failed]}: {detail}")

    agree(pg, problem, refused, alike=True, gather=all_gather_over(pg))


class AsyncCheckpointer:
    """Save checkpoints in the background, one at a time; every method but ``abandon`` is collective over ``group``.

    Use it as a context manager, or call ``close`` at the end, so the last save is finished.
    """

    def __init__(self, group: Optional[ProcessGroup] = None):
        self.group = resolve_group(group).require_member("AsyncCheckpointer")
        self._save: Optional[_Save] = None

    @property
    def pending(self) -> Optional[str]:
        """The path of the save in flight (written or not, not yet finished), or None."""
        return None if self._save is None else self._save.path

    def save(self, path: "str | os.PathLike[str]", state: Any, copy: bool = True) -> None:
        """Collective: start saving ``state`` (group rank 0's) to the file ``path``, finishing the previous save first."""
        self.wait()
        pg = self.group
        path = checkpoint_path(path)
        work = None
        if pg.rank == 0:
            work = functools.partial(write_file, path, host_copy(state, copy), pg)
        self._save = _Save(path, pg, work)

    def save_per_rank(self, path: "str | os.PathLike[str]", state: Any, extra: Any = None,
                      copy: bool = True) -> None:
        """Collective: start saving a ``checkpoint.save_per_rank`` directory; in place once the save is finished.

        Raises ``CheckpointError`` on every rank if the previous save failed or the temporary directory cannot be made.
        """
        self.wait()
        pg = self.group
        index = {"format": PER_RANK_FORMAT, "world_size": pg.size, "extra": host_copy(extra, copy)}
        self._start_directory(checkpoint_path(path), (rank_file(pg.rank, pg.size), host_copy(state, copy)), index)

    def save_sharded(self, path: "str | os.PathLike[str]", fsdp: Any, optimizer: Any = None,
                     extra: Any = None) -> None:
        """Collective: start saving a ``checkpoint.save_sharded`` directory of an FSDP model.

        Raises:
            ConfigurationError: ``fsdp`` works on another group (on this rank, before any message).
            CheckpointError: on every rank, if the previous save failed or the temporary directory cannot be made.
        """
        if tuple(fsdp.group.ranks) != tuple(self.group.ranks):
            raise ConfigurationError(f"save_sharded: the FSDP model works on ranks {list(fsdp.group.ranks)}, this "
                                     f"AsyncCheckpointer on ranks {list(self.group.ranks)}; use one made with "
                                     f"group=fsdp.group")
        self.wait()
        mine = None
        if fsdp.is_shard_writer:  # sharded_state_dict holds copies (parallel.fsdp.state.sharded_state): no second copy
            mine = (shard_file(fsdp.shard_rank, fsdp.shard_world_size),
                    host_copy(fsdp.sharded_state_dict(optimizer), copy=False))
        self._start_directory(checkpoint_path(path), mine, sharded_index(fsdp, host_copy(extra)))

    def save_slices(self, path: "str | os.PathLike[str]", pieces: Any, extra: Any = None,
                    copy: bool = True) -> None:
        """Collective: start saving a ``checkpoint.save_slices`` directory; a refused layout raises here, on every rank."""
        self.wait()
        pg = self.group
        path = checkpoint_path(path)
        mine, index = prepare_slices(path, pieces, pg, host_copy(extra, copy), copy)
        failed = None
        if mine is not None:
            name, state = mine
            try:
                mine = (name, state())  # to host memory, in this thread, before returning
            except Exception as exc:  # noqa: BLE001 - a collective follows: every rank hears of it at wait
                failed = CheckpointError(f"saving checkpoint {path!r} failed on group rank {pg.rank}: copying "
                                         f"its pieces to host memory: {type(exc).__name__}: {exc}")
        self._start_directory(path, mine, index(), failed)

    def _start_directory(self, path: str, mine: Optional[Tuple[str, Any]], index: Any,
                         failed: Optional[CheckpointError] = None) -> None:
        """Agree on the temporary directory and start this rank's write of ``mine``; ``failed`` is reported at ``wait``."""
        pg = self.group
        token = begin_directory(path, pg, None if mine is None else mine[0])
        work = None
        if mine is not None and failed is None:
            work = functools.partial(write_member, path, token, pg.rank, *mine)
        self._save = _Save(path, pg, work, token=token, index=index)
        if failed is not None:  # no thread was started to set it
            self._save.outcome = failed

    def poll(self) -> bool:
        """Collective: finish the save in flight if every rank's write has ended (one small all-reduce); True if it did."""
        current = self._save
        if current is None:
            return False
        flag = np.array([0.0 if current.written() else 1.0])
        if current.pg.size > 1:
            all_reduce(flag, ReduceOp.MAX, current.pg)
        if flag[0]:
            return False
        self.wait()
        return True

    def wait(self) -> Optional[str]:
        """Collective: wait for the save in flight on every rank and finish it; the path now in place, or None.

        Raises ``CheckpointError`` on every rank alike, naming each failed rank (the previous checkpoint stays).
        """
        current, self._save = self._save, None
        if current is None:
            return None
        current.join()
        pg = current.pg
        if current.token is None:
            share_outcome(current.path, pg, current.outcome)
            return current.path
        try:
            _agree(pg, current.outcome, f"saving the files of {current.path!r}")
        except CheckpointError:
            if pg.rank == 0:
                shutil.rmtree(temporary_directory(current.path, current.token), ignore_errors=True)
            raise
        finished = put_in_place(current.path, current.token, lambda: current.index) if pg.rank == 0 else None
        _agree(pg, finished, f"finishing checkpoint {current.path!r}")
        return current.path

    def abandon(self) -> None:
        """Local: wait for this rank's writer and drop the save unfinished (for error paths; ``clean_interrupted`` tidies)."""
        current, self._save = self._save, None
        if current is not None:
            current.join()

    def close(self) -> None:
        """Collective: finish the save in flight (``wait``)."""
        self.wait()

    def __enter__(self) -> "AsyncCheckpointer":
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        if exc_type is None:
            self.close()
        else:
            self.abandon()  # the other ranks may not be in a collective: finish nothing


__all__ = ["AsyncCheckpointer", "host_copy"]
