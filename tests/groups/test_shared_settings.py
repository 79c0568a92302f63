"""Settings every rank must share are compared when the world is built ([Note: settings the ranks must share]).

Ranks with the debug mode, a timeout or the shared-memory path on some ranks only used to wait forever in
different calls (the debug exchange beside the all-reduce; ``MPI_Win_allocate_shared`` inside ``init``).
"""
import numpy as np
import pytest

from axonhpc.errors import ConfigurationError
from axonhpc.groups import shared_settings
from axonhpc.settings import settings
from support.settings_override import override


def test_each_shared_setting_has_a_code_and_the_same_settings_pass():
    table = np.stack([shared_settings.codes()] * 3)
    shared_settings.check(table, [0, 1, 2])
    assert table.shape[1] == len(shared_settings.SHARED)
    for name in shared_settings.SHARED:
        assert hasattr(settings, name), name


def test_a_difference_names_the_setting_and_the_ranks_holding_each_value():
    same = shared_settings.codes()
    with override(debug=True, timeout=30.0, shm_collectives="off", straggler_every=7):
        other = shared_settings.codes()
    with pytest.raises(ConfigurationError) as info:
        shared_settings.check(np.stack([other, same, same]), [0, 1, 2])
    text = str(info.value)
    assert "debug=on on ranks [0], debug=off on ranks [1, 2]" in text, text
    assert "timeout=set on ranks [0], timeout=off on ranks [1, 2]" in text, text
    assert "shm_collectives='off' on ranks [0], shm_collectives='auto' on ranks [1, 2]" in text, text
    assert "straggler_every=7 on ranks [0], straggler_every=1000 on ranks [1, 2]" in text, text
    assert "check_collectives" not in text  # the same everywhere: not named
    with override(timeout=5.0):  # another timeout is still a timeout: the calls are made alike
        five = shared_settings.codes()
    with override(timeout=30.0):
        shared_settings.check(np.stack([five, shared_settings.codes()]), [0, 1])


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("setting", [{"debug": True}, {"timeout": 30.0}, {"shm_collectives": "off"},
                                     {"check_collectives": False}])
def test_a_world_whose_ranks_differ_in_a_shared_setting_is_refused_on_every_rank(mpi_world, setting):
    from mpi4py import MPI

    from axonhpc.backends.mpi import MPIBackend
    from axonhpc.groups.world import World

    name = next(iter(setting))
    backend = MPIBackend(MPI.COMM_WORLD)
    try:
        with override(**(setting if mpi_world.rank == mpi_world.world_size - 1 else {})):
            with pytest.raises(ConfigurationError, match=rf"{name}=.* on ranks \[{mpi_world.world_size - 1}\]"):
                World(backend)
    finally:
        backend.free()
    backend = MPIBackend(MPI.COMM_WORLD)
    try:
        with override(**setting):  # alike on every rank: fine
            assert World(backend).world_size == mpi_world.world_size
    finally:
        backend.free()
