"""Collective assertions for multi-rank tests: every rank fails together, none hangs."""
import traceback


def collectively(world, check):
    """Run ``check()`` on every rank, then fail on every rank if any rank failed.

    The verdicts travel over mpi4py's own COMM_WORLD (not axonhpc), so a bug in
    the library under test cannot hide a failure; each rank's message is
    included, so rank 0's console shows what went wrong on rank 2.
    """
    from mpi4py import MPI

    try:
        check()
        mine = None
    except BaseException:  # noqa: BLE001 - reported collectively below
        mine = traceback.format_exc()
    verdicts = MPI.COMM_WORLD.allgather(mine)
    failed = [(rank, text) for rank, text in enumerate(verdicts) if text is not None]
    if failed:
        report = "\n".join(f"--- rank {rank} ---\n{text}" for rank, text in failed)
        raise AssertionError(f"failed on ranks {[r for r, _ in failed]} of {len(verdicts)}:\n{report}")
