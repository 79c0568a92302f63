"""BLAS/OpenMP pools sized per rank by default (axonhpc.threads): the plan, and real jobs under mpiexec.

The jobs run ``tests/support/jobs/threads_job.py`` on 2 ranks from an environment without the thread variables
(as a user who sets none) and read back what each rank's BLAS pool was set to (threadpoolctl) and what
rank 0 logged. No time is asserted.
"""
import json
import os
import subprocess
import sys
import tempfile

import numpy as np
import pytest

from axonhpc.settings import THREAD_VARIABLES, THREADS_SET_BY
from axonhpc.threads import affinity_words, launch_environment, plan_threads, sharing_ranks, usable_cores
from support.paths import JOBS, ROOT

JOB = os.path.join(JOBS, "threads_job.py")
BIN = os.path.dirname(sys.executable)
MPIEXEC = os.path.join(BIN, "mpiexec")
needs_mpiexec = pytest.mark.skipif(not os.path.exists(MPIEXEC), reason="no mpiexec in this environment")


def test_the_plan_divides_the_usable_cores_among_the_ranks_that_share_them():
    plan = plan_threads(8, 2, environ={})
    assert (plan.threads, plan.chosen, plan.user) == (4, True, {})
    assert plan_threads(3, 2, environ={}).threads == 1  # rounded down
    assert plan_threads(2, 4, environ={}).threads == 1  # at least one
    assert "4 (8 usable core(s) shared by 2 rank(s) of this node); set OMP_NUM_THREADS to choose" in plan.describe()


def test_a_thread_variable_the_user_set_wins():
    for name in THREAD_VARIABLES:
        plan = plan_threads(8, 2, environ={name: "3"})
        assert not plan.chosen and plan.user == {name: "3"}
        assert "as set by the user" in plan.describe() and f"{name}=3" in plan.describe()
    assert plan_threads(8, 2, environ={"OMP_NUM_THREADS": "3"}).threads == 3
    # axonhpc launch's own values are not the user's: init still sizes by affinity
    launched = plan_threads(8, 2, environ={"OMP_NUM_THREADS": "4", THREADS_SET_BY: "axonhpc launch"})
    assert launched.chosen and launched.threads == 4
    off = plan_threads(8, 2, environ={}, enabled=False)
    assert not off.chosen and off.threads is None and "AXONHPC_SIZE_THREAD_POOLS=0" in off.describe()


def test_affinity_masks_overlap_only_where_cores_are_shared():
    a, b, c = affinity_words([0, 1]), affinity_words([1, 2]), affinity_words([64, 1087])
    assert sharing_ranks(a, [a, b, c]) == 2 and sharing_ranks(c, [a, b, c]) == 1
    np.testing.assert_array_equal(affinity_words([1087]), affinity_words([63]))  # past 1023: id mod 1024
    assert len(usable_cores()) >= 1


def test_launch_sets_the_variables_unless_the_user_did():
    env = launch_environment(2, environ={}, cores=8)
    assert env == {**{name: "4" for name in THREAD_VARIABLES}, THREADS_SET_BY: "axonhpc launch"}
    assert launch_environment(3, environ={}, cores=2)["OMP_NUM_THREADS"] == "1"
    assert launch_environment(2, environ={"MKL_NUM_THREADS": "2"}, cores=8) == {}


def _bare_env(**extra):
    env = {k: v for k, v in os.environ.items() if k not in THREAD_VARIABLES + (THREADS_SET_BY, "AXONHPC_LOG_LEVEL")}
    env.update(extra)
    return env


def _job(env, *args, launcher=None):
    with tempfile.TemporaryDirectory() as tmp:
        cmd = (launcher or [MPIEXEC, "-n", "2", sys.executable]) + [JOB, "--out", tmp, *args]
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=240, cwd=ROOT, env=env)
        assert out.returncode == 0, out.stdout + out.stderr
        ranks = []
        for rank in range(2):
            with open(os.path.join(tmp, f"rank{rank}.json")) as f:
                ranks.append(json.load(f))
    return ranks, out.stderr


@needs_mpiexec
def test_init_sizes_the_pools_by_default_and_rank_0_logs_it_once():
    ranks, log = _job(_bare_env())
    want = max(1, len(usable_cores()) // 2)
    for r in ranks:
        assert r["chosen"] and r["sharing"] == 2 and r["threads"] == want and r["blas"] == [want], r
    lines = [line for line in log.splitlines() if "BLAS/OpenMP threads per rank" in line]
    assert len(lines) == 1 and "rank 0/2" in lines[0], log
    assert f"BLAS/OpenMP threads per rank: {want} (" in lines[0] and "set OMP_NUM_THREADS" in lines[0]


@needs_mpiexec
def test_the_users_variable_is_left_as_set():
    ranks, log = _job(_bare_env(OMP_NUM_THREADS="2", OPENBLAS_NUM_THREADS="2"))
    assert all(not r["chosen"] and r["threads"] == 2 and r["blas"] == [2] for r in ranks), ranks
    assert "as set by the user (OMP_NUM_THREADS=2, OPENBLAS_NUM_THREADS=2)" in log


@needs_mpiexec
def test_the_pools_are_sized_by_the_affinity_every_rank_reports():
    overlapping, _ = _job(_bare_env(), "--fake-cores", "8")  # both ranks may use CPUs 0-7
    assert [(r["cores"], r["sharing"], r["threads"]) for r in overlapping] == [(8, 2, 4)] * 2
    disjoint, _ = _job(_bare_env(), "--fake-disjoint", "3")  # rank 0: CPUs 0-2, rank 1: CPUs 3-5
    assert [(r["cores"], r["sharing"], r["threads"]) for r in disjoint] == [(3, 1, 3)] * 2


@needs_mpiexec
def test_the_sizing_can_be_turned_off():
    ranks, log = _job(_bare_env(AXONHPC_SIZE_THREAD_POOLS="0"))
    assert all(not r["chosen"] and r["threads"] is None for r in ranks), ranks
    assert "the libraries' defaults (AXONHPC_SIZE_THREAD_POOLS=0)" in log


@needs_mpiexec
def test_axonhpc_launch_sets_the_variables_before_python_starts():
    launcher = [os.path.join(BIN, "axonhpc"), "launch", "-n", "2", "--"]
    ranks, log = _job(_bare_env(), launcher=launcher)
    want = max(1, len(usable_cores()) // 2)
    assert all(r["chosen"] and r["blas"] == [want] for r in ranks), ranks
    ranks, log = _job(_bare_env(OMP_NUM_THREADS="2"), launcher=launcher)
    assert all(not r["chosen"] and r["blas"] == [2] for r in ranks), ranks


def test_info_shows_the_choice():
    out = subprocess.run([os.path.join(BIN, "axonhpc"), "info"], capture_output=True, text=True, timeout=120,
                         cwd=ROOT, env=_bare_env())
    assert out.returncode == 0, out.stderr
    line = next(line for line in out.stdout.splitlines() if line.startswith("threads"))
    assert f"{len(usable_cores())} usable core(s) shared by 1 rank(s)" in line, out.stdout
