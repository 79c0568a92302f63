"""Who trains after a loss on a dp x tp x pp mesh (``elastic.replicas``): places filled, or replicas dropped."""
from axonhpc.elastic import replicas


def test_a_lost_place_is_filled_by_a_spare_in_order():
    assert replicas.fill([0, 1, 2, 3], [0, 2, 3, 4, 5]) == [0, 4, 2, 3]
    assert replicas.fill([0, 1, 2, 3], [0, 3]) == [0, None, None, 3]


def test_with_tp_and_pp_one_a_replica_is_a_rank():
    working, dp = replicas.plan([0, None, 2, 3], (4, 1, 1))
    assert (working, dp) == ([0, 2, 3], 3)


def test_the_replica_with_an_empty_place_is_dropped_and_the_mesh_keeps_its_order():
    # dp=3, tp=2, pp=2: place = (p * 3 + d) * 2 + t; rank 7 is (p=1, d=0, t=1).
    places = list(range(12))
    places[7] = None
    working, dp = replicas.plan(places, (3, 2, 2))
    assert dp == 2
    assert working == [2, 3, 4, 5, 8, 9, 10, 11]  # replica 0 (ranks 0, 1, 6) is out; stage 0 before stage 1


def test_every_replica_broken_leaves_no_dp():
    assert replicas.plan([None, 1, 2, None], (2, 2, 1)) == ([], 0)


def test_the_fsdp_keeper_is_the_next_dp_rank_at_the_same_tp_and_pp():
    shape = (3, 2, 2)
    assert replicas.neighbour(7, shape, 1) == 9   # (1, 0, 1) -> (1, 1, 1)
    assert replicas.neighbour(11, shape, 1) == 7  # (1, 2, 1) -> (1, 0, 1)
    assert replicas.neighbour(7, shape, -1) == 11


def test_shards_no_one_brings_are_named():
    shape = (4, 1, 1)
    assert replicas.unkept_shards([0, 1, 2, 3], [0, 3], [1, 2], shape) == ["dp rank 1 and its keeper 2 both failed"]
    assert replicas.unkept_shards([0, 1, 2, 3], [0, 2], [1, 3], shape) == []
    # dp=3, tp=2: ranks 1 and 2 lost drop replicas 0 and 1; replica 0's shards were kept by replica 1 only.
    assert replicas.unkept_shards([0, 1, 2, 3, 4, 5], [4, 5], [1, 2], (3, 2, 1)) == [
        "dp rank 0 and its keeper 1 are both out of the run (a replica dropped)"]
