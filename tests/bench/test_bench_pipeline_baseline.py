"""The raw mpi4py GPipe that ``axonhpc bench pipeline`` times as its baseline computes the right gradients.

A baseline that did less work than the pipeline would flatter neither side honestly: after one raw step,
every rank's stage holds the gradients of the same blocks of the whole model run on one rank.
"""
import numpy as np
import pytest

from axonhpc.bench.pipeline import _blocks, _one_rank_step, _raw_gpipe_step
from axonhpc.nn import MSELoss, Sequential
from support.mpi_assert import collectively

pytestmark = pytest.mark.mpi(min_size=2)


def test_the_raw_gpipe_baseline_gives_the_one_rank_gradients(mpi_world):
    from mpi4py import MPI

    def check():
        comm = MPI.COMM_WORLD.Dup()
        try:
            rank, p, m, width, blocks = comm.Get_rank(), comm.Get_size(), 3, 5, 2
            rng = np.random.default_rng(7)
            xs = np.split(rng.standard_normal((6, width)), m)
            ys = np.split(rng.standard_normal((6, width)), m)
            stage = Sequential(*_blocks(width, blocks, rank * blocks))
            _raw_gpipe_step(comm, stage, MSELoss(), xs, ys)
            whole = Sequential(*_blocks(width, p * blocks, 0))
            _one_rank_step(whole, MSELoss(), xs, ys)
            mine = whole.parameters()[rank * 2 * blocks:(rank + 1) * 2 * blocks]  # weight and bias per block
            assert len(mine) == len(stage.parameters())
            for ours, expected in zip(stage.parameters(), mine):
                np.testing.assert_allclose(ours.grad, expected.grad, rtol=1e-12, atol=1e-14)
        finally:
            comm.Free()
    collectively(mpi_world, check)
