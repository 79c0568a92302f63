"""Checks before any message, alike on every rank: thread ranks (run_local) and MPI ranks (under mpiexec)."""
import numpy as np
import pytest

import axonhpc as ax
from axonhpc.backends import shm as shm_backend
from axonhpc.errors import SharedMemoryError
from support.local_check_cases import CASES
from support.mpi_assert import collectively
from support.runner import case_tests


test_case_on_threads, test_case_on_mpi_ranks = case_tests(CASES)


def _windows(pg):
    backend = getattr(pg.backend, "host", pg.backend)
    return len(getattr(backend, shm_backend._ARRAYS, None) or [])


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("short", ["every rank", "rank 0 only"])
def test_shared_memory_array_beyond_dev_shm_is_refused_on_every_rank(mpi_world, monkeypatch, short):
    """Too little room in /dev/shm (as statvfs tells it) on any rank: every rank raises before anything is written."""
    pg = mpi_world.default_group
    if not pg.on_one_node or ax.settings.shm_collectives == "off":
        pytest.skip("shared memory needs every rank on one node")
    before = _windows(pg)

    def check():
        if short == "every rank" or mpi_world.rank == 0:
            monkeypatch.setattr(shm_backend, "free_shm_bytes", lambda path=shm_backend.SHM_DIR: 1 << 20)
        try:
            with pytest.raises(SharedMemoryError) as info:
                ax.shared_memory_array((1 << 20,), np.float64)  # 8 MiB per rank, 1 MiB free
        finally:
            monkeypatch.undo()
        text = str(info.value)
        assert "of 8388608 bytes" in text and f"the {pg.size} ranks of this node" in text
        assert "only 1048576 bytes (1.0 MiB) are free" in text and "/dev/shm" in text
        assert _windows(pg) == before  # nothing was allocated
        a = ax.shared_memory_array((4,), np.float64)  # the group is in step, and a fitting array works
        a[:] = mpi_world.rank + 1.0
        ax.all_reduce(a)
        assert a.tolist() == [pg.size * (pg.size + 1) / 2] * 4

    collectively(mpi_world, check)


def test_free_shm_bytes_reads_statvfs(tmp_path):
    import os

    st = os.statvfs(tmp_path)
    assert shm_backend.free_shm_bytes(str(tmp_path)) == st.f_bavail * st.f_frsize
    assert shm_backend.free_shm_bytes(str(tmp_path / "missing")) is None


@pytest.mark.mpi(min_size=2)
def test_bucket_size_measurement_falls_back_to_private_memory_when_dev_shm_is_small(mpi_world, monkeypatch):
    """DDP's start-up measurement asks for a 64 MiB window; a small /dev/shm must not stop DDP (issue 18)."""
    from axonhpc.parallel.ddp.autotune import CANDIDATES, measure_bucket_bytes

    pg = mpi_world.default_group
    if not pg.on_one_node or ax.settings.shm_collectives == "off":
        pytest.skip("shared memory needs every rank on one node")
    before = _windows(pg)

    def check():
        monkeypatch.setattr(shm_backend, "free_shm_bytes", lambda path=shm_backend.SHM_DIR: 1 << 16)
        try:
            chosen, rows = measure_bucket_bytes(pg, np.float32, 1 << 20, budget_s=0.2)
        finally:
            monkeypatch.undo()
        assert chosen in CANDIDATES and rows and all(row["gbs"] > 0 for row in rows)
        assert _windows(pg) == before  # measured in private memory: no window was made

    collectively(mpi_world, check)
