"""``ProcessGroup.destroy`` and ``Mesh.destroy``: threads (1-4 ranks), and MPI with shared memory on and off."""
import numpy as np
import pytest

import axonhpc as ax
from axonhpc.errors import CollectiveTimeoutError, GroupDestroyedError, UsageError
from support.destroy_cases import CASES
from support.runner import case_tests

test_destroy_case_on_threads, test_destroy_case_on_mpi_ranks = case_tests(
    CASES, shm=["auto", "off"], threads_marks=(pytest.mark.timeout(300),), mpi_marks=(pytest.mark.timeout(300),))


def test_a_mock_worlds_group_is_destroyed_and_its_default_group_refused():
    world = ax.World.mock()
    group = world.new_group([0], name="solo")
    x = np.ones(3)
    ax.all_reduce(x, group=group)
    group.destroy()
    with pytest.raises(GroupDestroyedError, match=r"all_reduce: process group solo \(ranks \[0\]\) was destroyed"):
        ax.all_reduce(x, group=group)
    with pytest.raises(UsageError, match="default group"):
        ax.ProcessGroup.mock().destroy()


def test_a_member_that_never_destroys_is_named_by_the_timeout():
    """The members meet in ``destroy`` under the group's timeout: one that never comes is named, and the group
    is left whole on the others (nothing was freed)."""

    def body(world):
        group = world.new_group([0, 1, 2])
        group.timeout = 1.0
        if world.rank == 2:
            return "skipped"
        try:
            group.destroy()
        except CollectiveTimeoutError as exc:
            assert not group.destroyed and group.member_backend is not None
            return str(exc)
        return "destroyed"

    seen = ax.run_local(body, world_size=3)
    assert seen[2] == "skipped"
    for text in seen[:2]:
        assert text.startswith("destroy of group group[0, 1, 2]") and "timed out" in text, text
        assert "missing ranks: [2]" in text, text


def test_a_member_in_another_checked_call_is_told_and_nothing_is_freed():
    from axonhpc.groups.agreement import compare

    def body(world):
        group = world.new_group([0, 1])
        if world.rank == 0:
            with pytest.raises(UsageError, match=r"not every member called destroy .*rank 1 passed split\(3\)"):
                group.destroy()
        else:
            assert compare(group, True, "split(3)", same=True) is not None  # a check of another call
        assert not group.destroyed
        x = np.ones(2)
        ax.all_reduce(x, group=group)  # the group still works
        group.destroy()
        return x[0]

    assert ax.run_local(body, world_size=2) == [2.0, 2.0]


@pytest.mark.parametrize("world_size", [2, 3])
def test_a_group_on_nccl_destroys_its_nccl_communicator(world_size, monkeypatch):
    """Over the fake NCCL (threads, no GPU): the group's NCCL communicator is destroyed with its host side,
    and a device call afterwards raises GroupDestroyedError."""
    import sys

    from support.fake_cuda import install, run_device_world
    from support.strict_cupy import device

    class Modules:
        def __setitem__(self, name, module):
            monkeypatch.setitem(sys.modules, name, module)

    cupy, nccl = install(Modules())

    def body(world):
        group = world.new_group(list(range(world.world_size)))
        x = device(np.full(4, world.rank + 1.0))
        ax.all_reduce(x, group=group)
        h = np.ones(2)
        ax.all_reduce(h, group=group)
        pending = ax.all_reduce(x, group=group, async_op=True)  # destroy waits for it
        backend = group.member_backend
        group.destroy()
        assert pending.is_completed()
        with pytest.raises(GroupDestroyedError, match="was destroyed"):
            ax.all_reduce(x, group=group)
        return backend.device._comm is None, float(x.get()[0])

    destroys = lambda: sum(1 for entry in nccl.calls if entry[1] == "destroy")  # noqa: E731
    n = world_size
    total = n * (n + 1) / 2
    for gone, value in run_device_world(body, world_size, nccl, cupy):
        assert gone
        assert value == total * n  # two all-reduces of x: the second of the sums
    assert destroys() == world_size  # the group's communicator on each rank; the world's is kept
