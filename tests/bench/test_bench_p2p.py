"""``axonhpc bench p2p`` on real ranks: each timed round trip delivers the peer's message, and the table shows it."""
import numpy as np
import pytest

from axonhpc.bench.p2p import format_table, round_trips, run_sizes
from support.mpi_assert import collectively

pytestmark = pytest.mark.mpi(min_size=2)


def test_every_round_trip_delivers_the_peers_message(mpi_world):
    from mpi4py import MPI

    def check():
        raw = MPI.COMM_WORLD.Dup()
        rank = raw.Get_rank()
        for count in (1, 300):
            x = np.full(count, float(rank))
            for name in ("send_recv", "isend_irecv", "raw_send_recv", "raw_isend_irecv"):
                y = np.full(count, -1.0)
                round_trips(rank, raw, x, y)[name]()
                if rank <= 1:
                    assert (y == 1 - rank).all(), (name, y[:3])
        raw.Free()
    collectively(mpi_world, check)


def test_the_table_has_a_row_per_size(mpi_world):
    def check():
        rows = run_sizes([8, 4096], rounds=1)
        assert [r["bytes"] for r in rows] == [8, 4096]
        for r in rows:
            assert all(r[k] > 0 for k in ("send_recv", "isend_irecv", "raw_send_recv", "raw_isend_irecv"))
        table = format_table(rows).splitlines()
        assert "send/recv" in table[1] and len(table) == 4
    collectively(mpi_world, check)
