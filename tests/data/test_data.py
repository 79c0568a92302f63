"""DistributedSampler and DataLoader: coverage across ranks, padding, epochs, batches, errors."""
import math
from collections import Counter

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from axonhpc.data import DataLoader, DistributedSampler
from axonhpc.errors import ConfigurationError, RankError, ShapeError


def all_ranks(n, replicas, **kwargs):
    return [list(DistributedSampler(n, replicas, r, **kwargs)) for r in range(replicas)]


@settings(max_examples=200, deadline=None)
@given(n=st.integers(0, 60), replicas=st.integers(1, 7), shuffle=st.booleans(), seed=st.integers(0, 5),
       epoch=st.integers(0, 3))
def test_without_drop_last_every_index_once_plus_documented_padding(n, replicas, shuffle, seed, epoch):
    shares = []
    for r in range(replicas):
        s = DistributedSampler(n, replicas, r, shuffle=shuffle, seed=seed)
        s.set_epoch(epoch)
        shares.append(list(s))
        assert len(shares[-1]) == len(s) == math.ceil(n / replicas)
    counts = Counter(i for share in shares for i in share)
    assert set(counts) == set(range(n))
    # Padding repeats the start of the epoch's order, cyclically.
    order = [shares[k % replicas][k // replicas] for k in range(len(shares[0]) * replicas)]
    if n:
        assert order[n:] == [order[k % n] for k in range(n, len(order))]
    else:
        assert order == []
    assert sorted(order[:n]) == list(range(n))


@settings(max_examples=200, deadline=None)
@given(n=st.integers(0, 60), replicas=st.integers(1, 7), shuffle=st.booleans(), seed=st.integers(0, 5))
def test_with_drop_last_disjoint_equal_shares(n, replicas, shuffle, seed):
    shares = all_ranks(n, replicas, shuffle=shuffle, seed=seed, drop_last=True)
    flat = [i for share in shares for i in share]
    assert all(len(share) == n // replicas for share in shares)
    assert len(flat) == len(set(flat)) == replicas * (n // replicas)
    assert set(flat) <= set(range(n))


def test_unshuffled_layout_matches_pytorch():
    assert all_ranks(10, 3, shuffle=False) == [[0, 3, 6, 9], [1, 4, 7, 0], [2, 5, 8, 1]]
    assert all_ranks(10, 3, shuffle=False, drop_last=True) == [[0, 3, 6], [1, 4, 7], [2, 5, 8]]
    assert all_ranks(2, 5, shuffle=False) == [[0], [1], [0], [1], [0]]
    assert all_ranks(0, 2) == [[], []]


def test_epochs_and_seeds():
    def epoch_order(seed, epoch, replicas=3):
        shares = []
        for r in range(replicas):
            s = DistributedSampler(30, replicas, r, seed=seed)
            s.set_epoch(epoch)
            shares.append(list(s))
        return shares

    assert epoch_order(0, 0) == epoch_order(0, 0)  # every rank (and rerun) agrees
    assert epoch_order(0, 0) != epoch_order(0, 1)
    assert epoch_order(0, 0) != epoch_order(1, 0)
    assert epoch_order(0, 1) == epoch_order(1, 0)  # the permutation is seeded with seed + epoch
    np.testing.assert_array_equal(
        [x for share in zip(*epoch_order(4, 2)) for x in share], np.random.default_rng(6).permutation(30))


def test_sampler_validation():
    with pytest.raises(RankError, match="rank 3 .*num_replicas=3"):
        DistributedSampler(10, 3, 3)
    with pytest.raises(RankError, match="rank -1"):
        DistributedSampler(10, 3, -1)
    with pytest.raises(ConfigurationError, match="num_replicas must be >= 1, got 0"):
        DistributedSampler(10, 0, 0)
    with pytest.raises(ConfigurationError, match="-5"):
        DistributedSampler(-5, 1, 0)
    with pytest.raises(TypeError, match="n must be an int"):
        DistributedSampler(10.0, 1, 0)
    assert issubclass(RankError, ValueError)


# ---------------------------------------------------------------- DataLoader

def test_loader_batches_follow_sampler_order():
    x = np.arange(20).reshape(10, 2) * 1.0
    y = np.arange(10) + 100
    sampler = DistributedSampler(10, 3, 1, shuffle=True, seed=3)
    loader = DataLoader((x, y), batch_size=3, sampler=sampler)
    order = list(sampler)
    batches = list(loader)
    assert len(loader) == len(batches) == 2
    assert [len(b[1]) for b in batches] == [3, 1]
    got = np.concatenate([b[1] for b in batches]) - 100
    assert got.tolist() == order
    for xb, yb in batches:
        assert isinstance(xb, np.ndarray) and xb.shape[1:] == (2,)
        np.testing.assert_array_equal(xb, x[yb - 100])


def test_loader_over_all_ranks_covers_dataset_once():
    data = np.arange(24)
    seen = []
    for rank in range(4):
        loader = DataLoader(data, batch_size=5, sampler=DistributedSampler(24, 4, rank, seed=9))
        seen.extend(np.concatenate(list(loader)).tolist())
    assert sorted(seen) == list(range(24))


def test_loader_single_array_and_drop_last():
    data = np.arange(10)
    loader = DataLoader(data, batch_size=4)
    batches = list(loader)
    assert all(isinstance(b, np.ndarray) for b in batches)
    assert [b.tolist() for b in batches] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]
    dropping = DataLoader([data], batch_size=4, drop_last=True)
    assert len(dropping) == 2
    assert [b[0].tolist() for b in dropping] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert len(DataLoader(np.arange(8), batch_size=4, drop_last=True)) == 2


def test_loader_shuffle_differs_per_pass_and_repeats_for_seed():
    data = np.arange(50)

    def passes(loader, k):
        return [np.concatenate(list(loader)).tolist() for _ in range(k)]

    first, second = passes(DataLoader(data, 7, shuffle=True, seed=1), 2)
    assert sorted(first) == list(range(50)) and first != second
    assert passes(DataLoader(data, 7, shuffle=True, seed=1), 2) == [first, second]
    assert passes(DataLoader(data, 7, shuffle=True, seed=2), 1)[0] != first
    loader = DataLoader(data, 7, shuffle=True, seed=1)
    loader.set_epoch(1)
    assert passes(loader, 1)[0] == second


def test_loader_set_epoch_reaches_sampler():
    sampler = DistributedSampler(12, 2, 0, seed=0)
    loader = DataLoader(np.arange(12), 6, sampler=sampler)
    loader.set_epoch(5)
    assert sampler.epoch == 5
    assert np.concatenate(list(loader)).tolist() == list(sampler)


def test_loader_validation():
    with pytest.raises(ShapeError, match=r"lengths \[10, 9\]"):
        DataLoader((np.zeros(10), np.zeros(9)), 2)
    with pytest.raises(ConfigurationError, match="batch_size"):
        DataLoader(np.zeros(10), 0)
    with pytest.raises(ConfigurationError, match="sampler"):
        DataLoader(np.zeros(10), 2, sampler=DistributedSampler(10, 1, 0), shuffle=True)
    with pytest.raises(ShapeError, match="leading"):
        DataLoader(np.float64(3.0), 2)
    with pytest.raises(ConfigurationError):
        DataLoader((), 2)


@pytest.mark.parametrize("n", [100, 20])
def test_loader_refuses_a_distributed_sampler_over_another_length(n):
    # more samples than rows indexed past the arrays (a bare IndexError); fewer left rows out silently
    with pytest.raises(ShapeError, match=rf"DistributedSampler over n={n} samples, but the arrays have length 50"):
        DataLoader(np.arange(50), 8, sampler=DistributedSampler(n, 2, 0))


@pytest.mark.parametrize("bad", [10, -1])
def test_loader_refuses_a_sampler_index_outside_the_arrays(bad):
    loader = DataLoader((np.arange(10), np.arange(10)), 4, sampler=[3, 1, bad, 0])
    assert len(loader) == 1
    with pytest.raises(ShapeError, match=rf"index {bad}, outside the arrays' length 10"):
        list(loader)
