"""``groups.agreement.all_or_none``: a check that fails on some ranks raises on every rank, on thread ranks."""
import pytest

import axonhpc as ax
from axonhpc.errors import CheckpointError, ConfigurationError, ModelMismatchError
from axonhpc.groups.agreement import agree, all_or_none


def refused(failed):
    return ModelMismatchError(f"refused by {failed}")


def outcome(block, **options):
    """Run ``block(rank)`` inside ``all_or_none`` on 3 thread ranks: each rank's error (type, text), or "ok"."""
    def body(world):
        try:
            with all_or_none(world.default_group, refused, **options) as vote:
                block(world.rank, vote)
        except Exception as exc:  # noqa: BLE001 - what each rank raised is the result
            return type(exc).__name__, str(exc), exc.__cause__
        return "ok"

    return ax.run_local(body, world_size=3)


def fail_on(*ranks):
    def block(rank, vote):
        if rank in ranks:
            raise ConfigurationError(f"bad size on rank {rank}")
    return block


def test_when_every_rank_passes_nothing_is_raised():
    assert outcome(fail_on()) == ["ok"] * 3


def test_one_failing_rank_raises_its_own_error_and_the_others_one_naming_it():
    got = outcome(fail_on(1))
    assert got[1][:2] == ("ConfigurationError", "bad size on rank 1")
    for r in (0, 2):
        assert got[r][:2] == ("ModelMismatchError", "refused by [(1, 'ConfigurationError: bad size on rank 1')]")


def test_ranks_that_all_fail_each_raise_their_own():
    got = outcome(fail_on(0, 1, 2))
    assert [g[:2] for g in got] == [("ConfigurationError", f"bad size on rank {r}") for r in range(3)]


def test_alike_raises_the_same_error_everywhere_from_each_failed_ranks_own():
    got = outcome(fail_on(0, 2), alike=True)
    text = "refused by [(0, 'ConfigurationError: bad size on rank 0'), (2, 'ConfigurationError: bad size on rank 2')]"
    assert [g[:2] for g in got] == [("ModelMismatchError", text)] * 3
    assert isinstance(got[0][2], ConfigurationError) and got[1][2] is None


def test_an_error_outside_catch_propagates_at_once_without_the_exchange():
    def block(rank, vote):
        raise KeyError(rank)  # on every rank: none waits for another

    assert [g[:2] for g in outcome(block)] == [("KeyError", str(r)) for r in range(3)]
    assert [g[:2] for g in outcome(fail_on(0, 1, 2), catch=CheckpointError)] == \
        [("ConfigurationError", f"bad size on rank {r}") for r in range(3)]


def test_texts_are_compared_when_differ_is_given():
    def differ(seen):
        return ModelMismatchError(f"differ: {[text for _, text in seen]}")

    def texts(*given):
        def block(rank, vote):
            vote.text = given[rank]
        return block

    assert outcome(texts("a", "a", "a"), differ=differ) == ["ok"] * 3
    got = outcome(texts("a", "b", "a"), differ=differ)
    assert [g[:2] for g in got] == [("ModelMismatchError", "differ: ['a', 'b', 'a']")] * 3
    got = outcome(lambda rank, vote: fail_on(2)(rank, vote) or texts("a", "b", "c")(rank, vote), differ=differ)
    assert got[2][0] == "ConfigurationError" and got[0][1].startswith("refused by [(2, ")  # a failure comes first


def test_agree_takes_a_problem_found_before_and_a_transport():
    def body(world):
        problem = ConfigurationError("found earlier") if world.rank == 0 else None
        try:
            agree(world.default_group, problem, refused, gather=lambda mine: ax.all_gather(mine))
        except Exception as exc:  # noqa: BLE001
            return str(exc)
        return "ok"

    got = ax.run_local(body, world_size=2)
    assert got == ["found earlier", "refused by [(0, 'ConfigurationError: found earlier')]"]


def test_one_rank_raises_its_own_error_without_an_exchange():
    group = ax.ProcessGroup.mock()
    with all_or_none(group, refused):
        pass
    with pytest.raises(ConfigurationError, match="mine"):
        with all_or_none(group, refused):
            raise ConfigurationError("mine")
    with pytest.raises(ModelMismatchError, match=r"refused by \[\(0, 'ConfigurationError: mine'\)\]"):
        agree(group, ConfigurationError("mine"), refused, alike=True)
