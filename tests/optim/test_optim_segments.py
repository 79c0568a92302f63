"""Segmented Parameters ([Note: segmented parameters] in ``optim.segments``): slices of a flat row of several
parameters, stepped bit for bit as the parameters one by one, those without a gradient left alone."""
import numpy as np
import pytest

from axonhpc import optim
from axonhpc.cuda import capture
from axonhpc.errors import ConfigurationError, GraphCaptureError, StateDictError
from axonhpc.nn import Parameter
from axonhpc.optim.segments import Segments

SIZES = [5, 3, 4]  # a row of 12 elements, cut in two slices [0, 7) and [7, 12)
SLICES = [(0, 7), (7, 12)]
USED = [[1, 0, 1], [1, 1, 0], [0, 1, 1], [1, 0, 0], [1, 1, 1], [1, 1, 1], [0, 0, 1]]

OPTIMIZERS = {
    "sgd": lambda ps, fused: optim.SGD(ps, lr=0.1, momentum=0.9, weight_decay=0.1, fused=fused),
    "sgd_dampened": lambda ps, fused: optim.SGD(ps, lr=0.1, momentum=0.9, dampening=0.3, weight_decay=0.1,
                                                fused=fused),
    "nesterov": lambda ps, fused: optim.SGD(ps, lr=0.1, momentum=0.9, nesterov=True, fused=fused),
    "sgd_plain": lambda ps, fused: optim.SGD(ps, lr=0.1, fused=fused),
    "adam": lambda ps, fused: optim.Adam(ps, lr=0.05, weight_decay=0.1, fused=fused),
    "adamw": lambda ps, fused: optim.AdamW(ps, lr=0.05, fused=fused),
}


def _slices(row):
    """The two segmented slices of ``row`` (copies), each with its spans."""
    offsets = np.cumsum([0] + SIZES)
    out = []
    for a, b in SLICES:
        spans = [(i, max(a, offsets[i]) - a, min(b, offsets[i + 1]) - max(a, offsets[i]))
                 for i in range(len(SIZES)) if max(a, offsets[i]) < min(b, offsets[i + 1])]
        p = Parameter(row[a:b].copy())
        p.segments = Segments(len(SIZES), spans)
        out.append(p)
    return out


def _train(kind, fused, used=USED):
    """One optimizer over the parameters one by one, one over each slice; returns both, stepped alike."""
    rng = np.random.default_rng(0)
    whole = [Parameter(rng.standard_normal(n)) for n in SIZES]
    slices = _slices(np.concatenate([p.data for p in whole]))
    ref = OPTIMIZERS[kind](whole, fused)
    opts = [OPTIMIZERS[kind]([p], fused) for p in slices]
    for flags in used:
        grads = [rng.standard_normal(n) for n in SIZES]
        for p, g, f in zip(whole, grads, flags):
            p.grad = g.copy() if f else None
        ref.step()
        row = np.concatenate([g if f else np.zeros_like(g) for g, f in zip(grads, flags)])
        for (a, b), p, opt in zip(SLICES, slices, opts):
            p.grad = row[a:b].copy()
            p.segments.set_with_grad(flags)
            opt.step()
        got = np.concatenate([p.data for p in slices])
        np.testing.assert_array_equal(got, np.concatenate([p.data for p in whole]))
    return ref, opts


@pytest.mark.parametrize("fused", [None, False])
@pytest.mark.parametrize("kind", sorted(OPTIMIZERS))
def test_slices_step_as_the_parameters_one_by_one(kind, fused):
    ref, opts = _train(kind, fused)
    for key in ref.state_keys or ():
        if key == "step" or not ref.state[0]:
            continue
        row = np.concatenate([s[key] for s in ref.state])
        got = np.concatenate([opt.state[0][key] for opt in opts])
        np.testing.assert_array_equal(got, row, err_msg=key)
    if kind.startswith("adam"):  # the counts of each parameter, on both slices (one holds no piece of #2)
        counts = [s["step"] for s in ref.state]
        assert counts == [5, 4, 5]
        for opt in opts:
            assert [e["step"] for e in opt.state[0]["segments"]] == counts
            assert opt.state[0]["step"] == counts[0]
    else:  # every parameter has stepped: the ordinary state again
        assert all("segments" not in opt.state[0] for opt in opts)


def test_a_parameter_never_stepped_has_no_entry_and_its_piece_stays():
    rng = np.random.default_rng(1)
    (p,) = _slices(rng.standard_normal(12))[:1]
    before = p.data.copy()
    opt = optim.Adam([p], lr=0.1, weight_decay=0.1)
    p.grad = rng.standard_normal(7)
    p.segments.set_with_grad([True, False, True])
    opt.step()
    assert opt.state[0]["segments"] == [{"step": 1}, None, {"step": 1}]
    np.testing.assert_array_equal(p.data[5:7], before[5:7])
    assert not opt.state[0]["exp_avg"][5:7].any() and not opt.state[0]["exp_avg_sq"][5:7].any()
    assert not np.array_equal(p.data[:5], before[:5])


def test_all_flags_true_is_the_ordinary_path():
    (p,) = _slices(np.arange(12.0))[:1]
    p.segments.set_with_grad([True, True, True])
    assert p.segments.with_grad is None and not p.segments.needs_split({})
    opt = optim.Adam([p], lr=0.1)
    p.grad = np.ones(7)
    opt.step()
    assert set(opt.state[0]) == {"step", "exp_avg", "exp_avg_sq"}


def test_state_dict_round_trip_keeps_the_entries():
    _, opts = _train("adam", None)
    saved = opts[1].state_dict()
    entries = saved["state"][0]["segments"]
    assert entries == opts[1].state[0]["segments"] and entries is not opts[1].state[0]["segments"]
    (p,) = _slices(np.zeros(12))[1:]
    fresh = optim.Adam([p], lr=0.05, weight_decay=0.1)
    fresh.load_state_dict(saved)
    assert fresh.state[0]["segments"] == entries
    np.testing.assert_array_equal(fresh.state[0]["exp_avg"], opts[1].state[0]["exp_avg"])


def test_bad_entries_are_refused():
    _, opts = _train("adam", None)
    saved = opts[0].state_dict()
    (p,) = _slices(np.zeros(12))[:1]
    target = optim.Adam([p], lr=0.05, weight_decay=0.1)
    short = {**saved, "state": [{**saved["state"][0], "segments": saved["state"][0]["segments"][:2]}]}
    with pytest.raises(StateDictError, match="state 'segments' has 2 entries, the Parameter holds pieces of 3"):
        target.load_state_dict(short)
    negative = {**saved, "state": [{**saved["state"][0], "segments": [{"step": -1}, None, None]}]}
    with pytest.raises(StateDictError, match="'step' of entry 0 of 'segments' is -1"):
        target.load_state_dict(negative)
    plain = optim.Adam([Parameter(np.zeros(7))], lr=0.05, weight_decay=0.1)
    with pytest.raises(StateDictError, match="is not a segmented Parameter"):
        plain.load_state_dict(saved)
    assert target.state == [{}] and plain.state == [{}]


def test_a_split_step_is_refused_in_a_graph_capture(monkeypatch):
    (p,) = _slices(np.arange(12.0))[:1]
    opt = optim.SGD([p], lr=0.1, momentum=0.9)
    p.grad = np.ones(7)
    p.segments.set_with_grad([True, False, True])
    before = p.data.copy()
    monkeypatch.setattr(capture, "capturing", lambda: True)
    with pytest.raises(GraphCaptureError, match="updated piece by piece, which a CUDA graph cannot replay"):
        opt.step()
    np.testing.assert_array_equal(p.data, before)


def test_bad_segments_are_refused():
    with pytest.raises(ConfigurationError, match=r"span \(3, 0, 2\) is not a piece of one of 3 parameters"):
        Segments(3, [(3, 0, 2)])
    with pytest.raises(ConfigurationError, match=r"span \(1, 4, 2\)"):
        Segments(3, [(1, 0, 2), (1, 4, 2)])
    with pytest.raises(ConfigurationError, match="2 gradient flags for 3 parameters"):
        Segments(3, [(0, 0, 2)]).set_with_grad([True, False])
