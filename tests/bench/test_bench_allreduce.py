"""``axonhpc bench allreduce`` on real ranks: its tables are built from timed calls that give right answers."""
import pytest

from axonhpc.bench.allreduce import format_collectives_table, format_table, run_collectives, run_sizes
from support.mpi_assert import collectively

pytestmark = pytest.mark.mpi(min_size=2)


def test_allreduce_and_collectives_tables(mpi_world):
    def check():
        rows = run_sizes([4096, 1 << 20], rounds=1)
        assert [r["bytes"] for r in rows] == [4096, 1 << 20]
        for r in rows:
            assert r["ours_us"] > 0 and r["raw_us"] > 0 and r["mpi_path_us"] > 0 and r["copy_gbs"] > 0
            assert r["ratio"] == pytest.approx(r["raw_us"] / r["ours_us"])
            assert r["of_bound"] == pytest.approx(r["bytes"] / r["copy_gbs"] / 1e9 / (r["ours_us"] / 1e6))
        n = mpi_world.world_size
        others = run_collectives([4096, 4 << 20], rounds=1)  # 4 MiB gathers over the slots' cap: MPI
        assert [r["bytes"] for r in others] == [4096 // 4 // n * 4 * n, (4 << 20) // 4 // n * 4 * n]
        for r in others:
            assert all(r[k] > 0 for k in ("all_gather", "raw_all_gather", "reduce_scatter", "raw_broadcast"))
        table = format_collectives_table(others, n).splitlines()
        assert f"{n} ranks" in table[0] and "all_gather us" in table[1] and len(table) == 4
        assert len(format_table(rows, n).splitlines()) == 4
    collectively(mpi_world, check)


def test_setting_cost_tables_time_both_paths_and_restore_the_settings(mpi_world):
    import axonhpc as ax
    from axonhpc.bench.allreduce import format_cost_table, run_setting_cost

    def check():
        before = (ax.settings.shm_collectives, ax.settings.check_collectives, ax.settings.straggler_every)
        for name, off, on, what in (("check_collectives", False, True, "the agreement check"),
                                    ("straggler_every", 0, 7, "the straggler comparison")):
            rows = run_setting_cost([4096], 1, name, off, on)
            assert [r["bytes"] for r in rows] == [4096]
            assert all(rows[0][k] > 0 for k in ("shm_on", "shm_off", "mpi_on", "mpi_off", "raw"))
            table = format_cost_table(rows, mpi_world.world_size, what).splitlines()
            assert what in table[0] and "added" in table[1] and len(table) == 3
        assert (ax.settings.shm_collectives, ax.settings.check_collectives, ax.settings.straggler_every) == before
    collectively(mpi_world, check)
