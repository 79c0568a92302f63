"""Checkpoints saved in the background: copy the state to host memory, return, write in a thread.

``AsyncCheckpointer(group)`` has the saves of ``io``, ``directory``, ``sharded``
and ``sliced`` with the same files and the same guarantees, but each save
returns as soon as the state is copied: encoding (a sha256 per array),
writing, fsync and the atomic rename run in a writer thread while training
goes on.

[Note: no communication in the writer thread]
The calling thread keeps issuing collectives on the same groups while a save
is written, and every rank must issue its collectives in the same order (the
debug mode checks it and raises ``CollectiveMismatchError``). A collective
from the writer thread would interleave with those in an order that differs
from rank to rank, so the writer thread does local file I/O only: it encodes
and writes this rank's file (``io.write_file``, ``directory.write_member``)
and records the outcome. Everything that needs the ranks to agree runs in
the calling thread, in the calls that are collective: ``save`` (agreeing on
a directory's temporary name, as the synchronous save does first; for
``save_slices`` also exchanging the descriptions of the pieces and planning
who writes which box, so a refused layout raises at the call on every rank),
``wait``, ``poll`` (one small all-reduce: has every rank's write ended?),
``close``, and the next ``save``, which begins by finishing the last. There
the ranks share their outcomes, so a failed write raises the same
``CheckpointError`` on every rank, and only then does group rank 0 write a
directory's index and switch it into place.

[Note: when a checkpoint becomes visible]
A file (``save``) is renamed into place by rank 0's writer thread when its
last byte is synced, without waiting for anyone; the ranks learn whether it
worked at ``wait``. A directory (``save_per_rank``, ``save_sharded``,
``save_slices``) appears only when it is finished in the calling thread
(``wait``, a ``poll`` that finds every write ended, ``close`` or the next
save), because its index may be written only after every rank's file is.
Until then it is ``<path>.tmp-<token>``, which ``latest`` never picks and
``clean_interrupted`` removes; so a process killed at any moment leaves the
previous checkpoint intact and loadable (the directory protocol of
``directory``, the atomic writes of ``io``).

[Note: one save in flight]
Each save starts by finishing the previous one (``wait``), so at most one
save is in flight per checkpointer and the memory it costs is bounded by one
host copy of the state being written (the arrays are made C-contiguous by the
copy, so the encoder copies nothing more). A copy is needed because the
caller may change or free its arrays as soon as ``save`` returns; states that
are fresh copies already (``state_dict()``, ``optimizer.state_dict()``) can
skip it with ``copy=False``. Device (cupy) arrays are always copied to the
host, in the calling thread. ``save_slices`` copies only the boxes this rank
writes (not the replicas a lower rank writes).
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
from .sharded import INDEX_FORMAT, shard_file
from .sliced import prepare_slices


def host_copy(state: Any, copy: bool = True) -> Any:
    """``state`` with its containers rebuilt and every array in host memory, owned by the result.

    Args:
        state: a checkpointable state (nested dicts, lists, tuples, arrays, scalars).
        copy: copy numpy arrays (C-contiguous); False keeps them (for fresh
            copies such as a ``state_dict()``). Device (cupy) arrays are
            always copied to the host.

    Returns:
        The copy. Values a checkpoint cannot hold are kept as they are, so
        encoding them raises the usual ``CheckpointError`` naming the key.
    """
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
    """Save checkpoints in the background, one at a time (see the module notes).

    Every method but ``abandon`` is collective over the group: all ranks call
    them in the same order, each from the one thread that trains on it. Use it as a context manager, or call ``close``
    at the end, so the last save is finished::

        with AsyncCheckpointer() as saver:
            for step in range(steps):
                train_step()
                if step % 100 == 0:
                    saver.save_per_rank(f"run/ckpt-{step}", my_state)

    Args:
        group: the ranks that take part (None: the default group of the current world).

    Raises:
        NotAMemberError: this rank is not in ``group``.
    """

    def __init__(self, group: Optional[ProcessGroup] = None):
        self.group = resolve_group(group).require_member("AsyncCheckpointer")
        self._save: Optional[_Save] = None

    @property
    def pending(self) -> Optional[str]:
        """The path of the save in flight (written or not, not yet finished), or None."""
        return None if self._save is None else self._save.path

    def save(self, path: "str | os.PathLike[str]", state: Any, copy: bool = True) -> None:
        """Collective: start saving ``state`` to the file ``path`` as ``checkpoint.save`` would.

        Finishes the previous save first. On group rank 0 the state is
        copied to host memory before this returns; the writer thread then
        encodes it and writes ``path`` atomically. Other ranks' states are not
        read (they may be None) and they start no thread.

        Args:
            path: file to write; replaced atomically when the write completes.
            state: as ``checkpoint.save`` takes; free to change once this returns.
            copy: False if the arrays are fresh copies nobody changes (see the module note).

        Raises:
            CheckpointError: on every rank, if the previous save failed (this one is then not started).
        """
        self.wait()
        pg = self.group
        path = checkpoint_path(path)
        work = None
        if pg.rank == 0:
            work = functools.partial(write_file, path, host_copy(state, copy), pg)
        self._save = _Save(path, pg, work)

    def save_per_rank(self, path: "str | os.PathLike[str]", state: Any, extra: Any = None,
                      copy: bool = True) -> None:
        """Collective: start saving a ``checkpoint.save_per_rank`` directory (every rank its own state).

        Finishes the previous save first, then agrees on the temporary
        directory (as the synchronous save does), copies ``state`` and
        ``extra`` and returns; each rank's file is written in its writer
        thread. The index and the switch into place come when the save is
        finished (``wait``, ``poll``, ``close``, the next save).

        Args:
            path: the checkpoint directory; replaced when the save is finished.
            state: this rank's plain state; free to change once this returns.
            extra: shared plain state (rank 0's goes into the index).
            copy: False if the arrays are fresh copies nobody changes.

        Raises:
            CheckpointError: on every rank, if the previous save failed or the
                temporary directory cannot be created.
        """
        self.wait()
        pg = self.group
        index = {"format": PER_RANK_FORMAT, "world_size": pg.size, "extra": host_copy(extra, copy)}
        self._start_directory(checkpoint_path(path), (rank_file(pg.rank, pg.size), host_copy(state, copy)), index)

    def save_sharded(self, path: "str | os.PathLike[str]", fsdp: Any, optimizer: Any = None,
                     extra: Any = None) -> None:
        """Collective: start saving a ``checkpoint.save_sharded`` directory of an FSDP model.

        The same directory as the synchronous save (each shard writer's file,
        an index of the units, loadable at any world size), written in the
        background: this rank's shards are taken (already copies) before it
        returns.

        Args:
            path: the checkpoint directory; replaced when the save is finished.
            fsdp: the FullyShardedDataParallel; its group must be this checkpointer's.
            optimizer: the optimizer over ``fsdp.parameters()``, or None.
            extra: more plain state (rank 0's is kept).

        Raises:
            ConfigurationError: ``fsdp`` works on another group (on this rank, before any message).
            CheckpointError: on every rank, if the previous save failed or the
                temporary directory cannot be created.
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
        index = {"format": INDEX_FORMAT, "shard_world_size": fsdp.shard_world_size,
                 "units": {u.name: int(u.numel) for u in fsdp.units}, "extra": host_copy(extra)}
        self._start_directory(checkpoint_path(path), mine, index)

    def save_slices(self, path: "str | os.PathLike[str]", pieces: Any, extra: Any = None,
                    copy: bool = True) -> None:
        """Collective: start saving a ``checkpoint.save_slices`` directory (global arrays in pieces).

        The same checks as the synchronous save, raised alike on every rank
        before anything is written (and no save is then in flight), and the
        same directory, loadable by ``load_slices`` under any layout. The
        description exchange and the plan run here, in the calling thread;
        the boxes this rank writes are then copied to host memory and its
        file is written by the writer thread. The index and the switch into
        place come when the save is finished (``wait``, ``poll``, ``close``,
        the next save).

        Args:
            path: the checkpoint directory; replaced when the save is finished.
            pieces: as ``checkpoint.save_slices`` takes them (a ``(Box,
                array)`` or a list of them per name); free to change once
                this returns.
            extra: shared plain state (group rank 0's goes into the index).
            copy: False if the numpy arrays are fresh copies nobody changes
                (cupy arrays are always copied to the host).

        Raises:
            CheckpointError: on every rank, if the previous save failed, a
                piece or the layout is refused (as ``save_slices``), or the
                temporary directory cannot be created.
        """
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
        """Agree on the temporary directory and start this rank's write of ``mine`` (``(file name, state)``).

        ``failed``: this rank could not make its state; nothing is written,
        and ``failed`` is reported at ``wait`` as a failed write would be.
        """
        pg = self.group
        token = begin_directory(path, pg, None if mine is None else mine[0])
        work = None
        if mine is not None and failed is None:
            work = functools.partial(write_member, path, token, pg.rank, *mine)
        self._save = _Save(path, pg, work, token=token, index=index)
        if failed is not None:  # no thread was started to set it
            self._save.outcome = failed

    def poll(self) -> bool:
        """Collective: finish the save in flight if every rank's write has ended; never blocks on a write.

        Costs one small all-reduce while a save is in flight (nothing when
        none is), so a training loop can call it after every step to make a
        directory checkpoint appear soon after its files are written.

        Returns:
            True if this call finished a save (it is now in place), else False.

        Raises:
            CheckpointError: on every rank, as ``wait``, if the finished save failed.
        """
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
        """Collective: block until the save in flight is written on every rank, and finish it.

        For a directory, group rank 0 then writes the index and switches it
        into place. Afterwards nothing is in flight, whether the save worked or not.

        Returns:
            The path of the checkpoint now in place, or None if no save was in flight.

        Raises:
            CheckpointError: on every rank alike, naming every rank that
                failed and why (an unwritable directory, a full disk, a value
                a checkpoint cannot hold); a failed directory save leaves no
                temporary directory and the previous checkpoint at ``path``.
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
        """Local, no communication: wait for this rank's writer thread and drop the save unfinished.

        For an error path, where the other ranks may not reach a collective:
        a file save may have landed (rank 0 renames it itself); a directory's
        files stay under ``<path>.tmp-<token>``, never taken for a checkpoint,
        and ``clean_interrupted`` removes them.
        """
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
