"""World, groups and the in-process backend outside the shared collective suite."""
import os
import re
import subprocess
import sys
import time

import numpy as np
import pytest

import axonhpc as ax
from axonhpc.backends.local import LocalAbort
from axonhpc.errors import CollectiveMismatchError, CollectiveTimeoutError
from axonhpc.settings import LauncherEnv
from support.paths import ROOT

MPIEXEC = os.path.join(os.path.dirname(sys.executable), "mpiexec")


def test_mock_world_and_group_need_no_mpi():
    world = ax.World.mock()
    assert (world.rank, world.world_size, world.local_rank, world.num_nodes) == (0, 1, 0, 1)
    x = np.arange(4.0)
    ax.all_reduce(x, group=world.default_group)
    assert x.tolist() == [0, 1, 2, 3]
    assert world.node_of == (0,) and world.default_group.on_one_node
    pg = ax.ProcessGroup.mock()
    assert (pg.rank, pg.size, pg.ranks, pg.is_member) == (0, 1, (0,), True)
    assert ax.all_gather(np.array([7]), group=pg).tolist() == [[7]]


def test_import_does_not_start_mpi_or_load_extras():
    code = ("import sys, axonhpc; "
            "bad = [m for m in ('mpi4py.MPI', 'cupy', 'ml_dtypes', 'torch') if m in sys.modules]; "
            "print(bad); sys.exit(1 if bad else 0)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr


def test_a_groups_timeout_is_checked_when_set():
    # A NaN or negative timeout was kept and meant waiting forever, or timing out at once.
    pg = ax.ProcessGroup.mock()
    for bad in (float("nan"), -1, 0, float("inf")):
        with pytest.raises(ax.errors.InvalidArgumentError, match=f"timeout must be a finite number of seconds > 0, "
                                                                 f"or None for ax.settings.timeout, got {bad!r}"):
            pg.timeout = bad
    with pytest.raises(ax.errors.ArgumentTypeError, match="timeout must be a number of seconds or None, got str '3'"):
        pg.timeout = "3"
    pg.timeout = 2
    assert pg.timeout == 2.0 and isinstance(pg.timeout, float) and pg.effective_timeout() == 2.0
    pg.timeout = None
    assert pg.timeout is None


def test_run_local_returns_results_in_rank_order():
    assert ax.run_local(lambda w: (w.rank, w.world_size), world_size=3) == [(0, 3), (1, 3), (2, 3)]


def test_run_local_failure_wakes_waiting_ranks():
    """A rank that raises must not leave the others waiting in a collective."""

    def body(world):
        if world.rank == 1:
            raise RuntimeError("rank one broke")
        ax.all_reduce(np.ones(2))  # would wait forever for rank 1

    start = time.monotonic()
    with pytest.raises(RuntimeError, match="rank one broke"):
        ax.run_local(body, world_size=3)
    assert time.monotonic() - start < 30


def test_local_backend_reports_mismatched_collectives_on_every_rank():
    def body(world):
        with pytest.raises(CollectiveMismatchError, match="rank 0 called all_reduce.*rank 1 called broadcast"):
            if world.rank == 0:
                ax.all_reduce(np.ones(2))
            else:
                ax.broadcast(np.ones(2), 0)
        return True

    assert ax.run_local(body, world_size=2) == [True, True]


def test_local_timeout_names_missing_ranks():
    def body(world):
        pg = world.default_group
        if world.rank == 0:
            pg.timeout = 0.3
            with pytest.raises(CollectiveTimeoutError, match=r"timed out.*missing ranks: \[1, 2\]"):
                ax.all_reduce(np.ones(2), group=pg)
            # The user's call is named, not the agreement check's all-reduce that timed out inside it.
            with pytest.raises(CollectiveTimeoutError, match=r"^barrier #1 on group world \[0, 1, 2\] timed out"):
                ax.barrier(group=pg)
            world.backend.abort_quietly("test over")
        else:
            with pytest.raises(LocalAbort):
                ax.recv(np.empty(1), 0)  # waits until rank 0 ends the world
        return world.rank

    assert ax.run_local(body, world_size=3) == [0, 1, 2]


def test_async_wait_timeout_on_local_backend():
    def body(world):
        if world.rank == 0:
            work = ax.all_reduce(np.ones(2), async_op=True)
            assert not work.is_completed()
            with pytest.raises(CollectiveTimeoutError, match=r"missing ranks: \[1\]"):
                work.wait(timeout=0.2)
            world.backend.abort_quietly("done")
        else:
            with pytest.raises(LocalAbort):
                ax.recv(np.empty(1), 0)
        return True

    assert ax.run_local(body, world_size=2) == [True, True]


def test_launcher_problems_detect_srun_mpi_none():
    world = ax.World.mock()
    world.launcher = LauncherEnv("slurm", 0, 4, 0, 0, 1, "17")
    problems = world.launcher_problems()
    assert len(problems) == 1 and "started 4 tasks but MPI reports a world of 1" in problems[0]
    assert "srun --mpi=none" in problems[0]
    world.launcher = LauncherEnv("pmi", 0, 1, None, None, None, None)
    assert world.launcher_problems() == []


def _run_mpi_script(code, n, env_extra=None, timeout=60):
    env = dict(os.environ, **(env_extra or {}))
    env.pop("PMI_RANK", None), env.pop("PMI_SIZE", None)
    cmd = [MPIEXEC, "-n", str(n), sys.executable, "-c", code] if n else [sys.executable, "-c", code]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, cwd=ROOT)


def test_init_warns_when_slurm_says_more_tasks_than_mpi():
    """The 'srun --mpi=none' mistake: SLURM started 4 tasks, MPI sees a world of one."""
    out = _run_mpi_script("import axonhpc as ax; w = ax.init(); print('size', w.world_size)", 0,
                          {"SLURM_NTASKS": "4", "SLURM_PROCID": "2"})
    assert out.returncode == 0, out.stderr
    assert "size 1" in out.stdout
    assert "started 4 tasks but MPI reports a world of 1" in out.stderr


def test_init_is_idempotent_and_applies_overrides():
    out = _run_mpi_script(
        "import axonhpc as ax; a = ax.init(); b = ax.init(debug=True, timeout=5); "
        "print(a is b, ax.settings.debug, ax.settings.timeout)", 0)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["True", "True", "5.0"]


def test_uncaught_exception_on_one_rank_ends_the_job():
    """Rank 1 dies while rank 0 waits in a barrier: the job must end, not hang."""
    code = ("import time, numpy as np, axonhpc as ax\n"
            "w = ax.init()\n"
            "if w.rank == 1:\n"
            "    raise RuntimeError('boom on rank one')\n"
            "ax.barrier()\n"
            "print('rank 0 should never get here')\n")
    start = time.monotonic()
    out = _run_mpi_script(code, 2, {"AXONHPC_ABORT_ON_EXCEPTION": "1"}, timeout=120)
    assert out.returncode != 0
    assert "boom on rank one" in out.stderr and "uncaught exception on rank 1" in out.stderr
    assert "should never get here" not in out.stdout
    assert time.monotonic() - start < 60


def _nccl_problem():
    from axonhpc.backends.devices import device_facts, device_problem

    return device_problem(device_facts())


def test_init_rejects_unknown_backends_and_nccl_where_it_cannot_work():
    with pytest.raises(ValueError, match="unknown backend 'gloo'"):
        ax.groups.runtime.init(backend="gloo", comm=object())
    problem = _nccl_problem()
    if problem is None:
        pytest.skip("cupy, a CUDA device and NCCL are here: test_init_nccl_on_one_rank_with_a_gpu covers it")
    # no cupy, no CUDA device or no NCCL: refused, saying which, before the communicator is touched
    with pytest.raises(ax.errors.BackendUnavailableError,
                       match=re.escape(f"backend 'nccl' cannot work here: {problem} (NCCL needs cupy")):
        ax.groups.runtime.init(backend="nccl", comm=object())


@pytest.mark.gpu
@pytest.mark.skipif(_nccl_problem() is not None, reason="needs cupy, a CUDA device and NCCL")
def test_init_nccl_on_one_rank_with_a_gpu():
    """Where NCCL can work, a one-rank job takes it for cupy arrays and MPI for numpy arrays."""
    code = ("import cupy, numpy as np, axonhpc as ax\n"
            "w = ax.init(backend='nccl')\n"
            "x = cupy.full(4, 3.0, dtype=cupy.float32); ax.all_reduce(x)\n"
            "y = np.full(2, 5); ax.all_reduce(y)\n"
            "print(w.backend.name, x.get().tolist(), y.tolist())\n")
    out = _run_mpi_script(code, 0, timeout=180)
    assert out.returncode == 0, out.stdout + out.stderr
    assert out.stdout.splitlines()[-1] == "mpi+nccl [3.0, 3.0, 3.0, 3.0] [5, 5]", out.stdout
