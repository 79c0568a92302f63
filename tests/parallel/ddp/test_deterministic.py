"""Deterministic mode and DDP's measured bucket size, on MPI ranks.

Deterministic: float all-reduce and reduce-scatter give the same bits run
after run whatever the timing (random delays before each call), through the
shared-memory kernels on one node and through the ring when shared memory is
off (standing in for several nodes), at every message size.
"""
import time

import numpy as np
import pytest

import axonhpc as ax
from axonhpc.parallel.ddp import autotune
from support.mpi_assert import collectively
from support.settings_override import override

pytestmark = pytest.mark.mpi(min_size=2)


def _runs(world, call, repeats=4):
    rng = np.random.default_rng(100 + world.rank)
    results = []
    for _ in range(repeats):
        time.sleep(float(rng.random()) * 0.01)  # a different arrival order each time
        results.append(call())
    return results


@pytest.mark.parametrize("shm", ["auto", "off"])
def test_same_bits_run_after_run(mpi_world, shm):
    n = mpi_world.world_size

    def check():
        with override(deterministic=True, shm_collectives=shm):
            for dtype in (np.float32, np.float64, np.float16):
                for size in (1, 1000, 70001):
                    base = (np.random.default_rng(mpi_world.rank).standard_normal(size * n) * 1e3).astype(dtype)
                    for op in ("SUM", "AVG"):
                        def reduce():
                            y = base.copy()
                            ax.all_reduce(y, op)
                            return y
                        runs = _runs(mpi_world, reduce)
                        for y in runs[1:]:
                            np.testing.assert_array_equal(y, runs[0], err_msg=f"all_reduce {op} {dtype} {size}")
                        everyone = ax.all_gather(runs[0])
                        assert all(np.array_equal(row, everyone[0]) for row in everyone)
                        parts = _runs(mpi_world, lambda: ax.reduce_scatter(base, op))
                        for part in parts[1:]:
                            np.testing.assert_array_equal(part, parts[0], err_msg=f"reduce_scatter {op} {dtype}")
                        exact = np.asarray(runs[0], dtype=np.float64).reshape(n, -1)[mpi_world.rank]
                        tol = 1e-2 if dtype == np.float16 else 1e-5
                        np.testing.assert_allclose(parts[0].astype(np.float64), exact, rtol=tol, atol=tol * 1e3)
        if shm == "off":  # the ring carried them: its private channel exists
            assert "ring" in mpi_world.default_group.collective_state.channels
    collectively(mpi_world, check)


def test_bucket_size_is_measured_once_and_agreed(mpi_world):
    def check():
        group = mpi_world.new_group(list(range(mpi_world.world_size)), name="autotune")
        chosen, rows = autotune.measure_bucket_bytes(group, np.float32, 64 << 20, budget_s=0.5)
        assert chosen in autotune.CANDIDATES and rows and rows[0]["bytes"] == autotune.CANDIDATES[0]
        best = max(row["gbs"] for row in rows)
        assert next(r for r in rows if r["bytes"] == chosen)["gbs"] >= autotune.GOOD_ENOUGH * best
        everyone = ax.all_gather(np.array([chosen], dtype=np.int64))
        assert np.all(everyone == chosen)  # every rank decides on the same numbers
        ddp = ax.DDP(ax.nn.Linear(64, 64, dtype=np.float32, seed=0), group=group)
        again = ax.DDP(ax.nn.Linear(64, 64, dtype=np.float32, seed=0), group=group)
        assert ddp.bucket_bytes == again.bucket_bytes  # measured once per group and dtype
        assert autotune.measured(group) == {np.dtype(np.float32).str: ddp.bucket_bytes}
        with override(bucket_size_mb="3"):
            assert ax.DDP(ax.nn.Linear(4, 4, dtype=np.float32, seed=0), group=group).bucket_bytes == 3 << 20
        with override(deterministic=True):
            fresh = mpi_world.new_group(list(range(mpi_world.world_size)), name="fixed")
            assert ax.DDP(ax.nn.Linear(4, 4, dtype=np.float32, seed=0), group=fresh).bucket_bytes == 25 << 20
    collectively(mpi_world, check)
