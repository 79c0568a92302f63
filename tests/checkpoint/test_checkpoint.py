"""Checkpoints: round trips, training resumption, corruption, pickle refusal, atomic writes, groups."""
import json
import os
import pickle
import zipfile

import numpy as np
import pytest

from axonhpc import nn, optim
from axonhpc.checkpoint import capture_rng_state, latest, load, restore_rng_state, save
from axonhpc.checkpoint.format import META_ENTRY, encode
from axonhpc.errors import CheckpointError, ConfigurationError, NotAMemberError
from axonhpc.groups import ProcessGroup, run_local

try:
    import ml_dtypes
except ImportError:  # the bf16 extra is optional
    ml_dtypes = None

needs_ml_dtypes = pytest.mark.skipif(ml_dtypes is None, reason="ml_dtypes (axonhpc[bf16]) not installed")

ONE = ProcessGroup.mock()  # single-process tests need no MPI world


def roundtrip(tmp_path, state, name="ckpt.npz"):
    path = tmp_path / name
    save(path, state, group=ONE)
    return load(path, group=ONE)


def assert_same_array(got, want):
    assert type(got) is np.ndarray
    assert got.dtype == want.dtype and got.shape == want.shape
    # Compare bytes, so -0.0 vs 0.0 and NaN payloads count too.
    assert got.tobytes() == np.ascontiguousarray(want).tobytes()


# ------------------------------------------------------------------------------------ round trips

DTYPES = ["float16", "float32", "float64", "int8", "int32", "int64", "uint8", "uint16", "uint64",
          "bool", "complex64", ">f8"]


def sample(dtype, shape, seed=0):
    """A random array (a 0-d array, never a numpy scalar, for shape ())."""
    rng = np.random.default_rng(seed)
    dtype = np.dtype(dtype)
    if dtype.kind == "b":
        values = rng.random(shape) > 0.5
    elif dtype.kind in "iu":
        info = np.iinfo(dtype)
        values = rng.integers(info.min, info.max, size=shape, dtype=dtype, endpoint=True)
    else:
        values = rng.standard_normal(shape) * 100
        if dtype.kind == "c":
            values = values + 1j * rng.standard_normal(shape)
    return np.asarray(values).astype(dtype)


@pytest.mark.parametrize("dtype", DTYPES + [pytest.param("bfloat16", marks=needs_ml_dtypes)])
def test_every_dtype_and_shape_round_trips(tmp_path, dtype):
    dt = np.dtype(ml_dtypes.bfloat16) if dtype == "bfloat16" else np.dtype(dtype)
    source = np.float32 if dtype == "bfloat16" else dt  # ml_dtypes has no random generator
    arrays = {f"shape{shape}": sample(source, shape).astype(dt) for shape in [(), (0,), (3, 0, 2), (7,), (2, 3, 4)]}
    arrays["fortran"] = np.asfortranarray(sample(source, (3, 5)).astype(dt))
    arrays["strided"] = sample(source, (6, 4)).astype(dt)[::2, 1::2]
    out = roundtrip(tmp_path, arrays)
    assert list(out) == list(arrays)
    for key, want in arrays.items():
        assert_same_array(out[key], want)
        assert out[key].flags.c_contiguous and out[key].flags.writeable


def test_scalars_containers_and_key_order_round_trip(tmp_path):
    state = {
        "epoch": 3, "negative": -7, "huge": 2**200 + 1, "rate": 0.1, "third": 1 / 3,
        "nan": float("nan"), "inf": float("inf"), "-inf": float("-inf"), "flag": True, "off": False,
        "name": "résumé ✓", "empty": "", "nothing": None,
        "list": [1, "two", [3.0, None], {"x": np.arange(2)}], "tuple": (1, (2, 3)), "empty_list": [],
        "empty_tuple": (), "empty_dict": {},
        "np_scalars": [np.float32(1.5), np.int64(-4), np.bool_(True), np.float64(2.25), np.uint8(255)],
        "np_str": np.str_("plain"),
        "keys": {"0.weight": 1, "a/b": 2, "": 3, "__meta__": 4, "z": 5, "a": 6},
    }
    out = roundtrip(tmp_path, state)
    assert list(out) == list(state) and list(out["keys"]) == list(state["keys"])
    for key in ("epoch", "negative", "huge", "rate", "third", "inf", "-inf", "flag", "off", "name",
                "empty", "nothing", "tuple", "empty_list", "empty_tuple", "empty_dict", "keys"):
        assert out[key] == state[key] and type(out[key]) is type(state[key]), key
    assert np.isnan(out["nan"]) and type(out["nan"]) is float
    assert out["list"][:3] == [1, "two", [3.0, None]]
    assert_same_array(out["list"][3]["x"], np.arange(2))
    for got, want in zip(out["np_scalars"], state["np_scalars"]):
        assert type(got) is type(want) and got == want
    assert out["np_str"] == "plain" and type(out["np_str"]) is str


def test_metadata_is_standard_json_with_integers_as_strings(tmp_path):
    path = tmp_path / "c.npz"
    save(path, {"big": 2**100, "nan": float("nan"), "w": np.ones(2)}, group=ONE)
    with np.load(path, allow_pickle=False) as archive:
        assert sorted(archive.files) == [META_ENTRY, "a0"]
        text = archive[META_ENTRY].tobytes().decode()

    def refuse(token):
        raise AssertionError(f"non-standard JSON token {token}")

    meta = json.loads(text, parse_constant=refuse)
    assert meta["format"] == "axonhpc-checkpoint" and meta["version"] == 1
    items = dict(meta["tree"]["items"])
    assert items["big"] == {"t": "int", "v": str(2**100)}
    assert items["nan"] == {"t": "float", "v": "nan"}
    assert items["w"]["dtype"] == "<f8" and items["w"]["shape"] == [2] and len(items["w"]["sha256"]) == 64


@needs_ml_dtypes
def test_bfloat16_is_stored_as_a_uint16_view(tmp_path):
    x = np.array([1.0, -2.5, 3.0e38, np.inf], dtype=ml_dtypes.bfloat16)
    path = tmp_path / "c.npz"
    save(path, {"x": x}, group=ONE)
    with np.load(path, allow_pickle=False) as archive:
        assert archive["a0"].dtype == np.uint16
        assert archive["a0"].tobytes() == x.tobytes()
    assert_same_array(load(path, group=ONE)["x"], x)


# ------------------------------------------------------------------------------------ training resumption

def _model():
    return nn.Sequential(nn.Linear(4, 8, seed=0), nn.ReLU(), nn.Linear(8, 2, seed=1))


def _train(model, opt, rng, steps):
    loss_fn = nn.MSELoss()
    for _ in range(steps):
        x = rng.standard_normal((5, 4)).astype(np.float32)
        y = rng.standard_normal((5, 2)).astype(np.float32)
        loss_fn(model(x), y)
        opt.zero_grad()
        model.backward(loss_fn.backward())
        opt.step()


def test_model_optimizer_and_rng_resume_bit_for_bit(tmp_path):
    model = _model()
    opt = optim.Adam(model.parameters(), lr=1e-2, betas=(0.8, 0.99))
    data_rng = np.random.default_rng(42)
    _train(model, opt, data_rng, 3)
    path = tmp_path / "ckpt-000003.npz"
    save(path, {"model": model.state_dict(), "optimizer": opt.state_dict(), "step": 3,
                "rng": capture_rng_state(data_rng)}, group=ONE)
    _train(model, opt, data_rng, 3)
    expected = [p.data.copy() for p in model.parameters()]

    resumed = _model()
    resumed_opt = optim.Adam(resumed.parameters(), lr=1.0)  # hyperparameters come from the checkpoint
    state = load(path, group=ONE)
    resumed.load_state_dict(state["model"])
    resumed_opt.load_state_dict(state["optimizer"])
    resumed_rng = restore_rng_state(state["rng"])
    assert state["step"] == 3 and resumed_opt.lr == 1e-2 and resumed_opt.betas == (0.8, 0.99)
    _train(resumed, resumed_opt, resumed_rng, 3)
    for got, want in zip(resumed.parameters(), expected):
        assert np.array_equal(got.data, want) and got.data.dtype == want.dtype


# ------------------------------------------------------------------------------------ refusing bad state

class Opaque:
    pass


def _cyclic():
    x = [1]
    x.append(x)
    return x


@pytest.mark.parametrize("state,where,what", [
    ({"model": {"w": np.array([Opaque()], dtype=object)}}, "state['model']['w']", "object"),
    ({"names": np.array(["a", "b"])}, "state['names']", "<U1"),
    ({"rec": np.zeros(2, dtype=[("a", "f4")])}, "state['rec']", "dtype"),
    ({"x": [1, Opaque()]}, "state['x'][1]", "Opaque"),
    ({"x": {1: 2}}, "state['x']", "dict key 1"),
    ({"x": {1, 2}}, "state['x']", "set"),
    ({"loop": _cyclic()}, "state['loop'][1]", "contains itself"),
])
def test_unsupported_values_are_refused_naming_the_key(tmp_path, state, where, what):
    path = tmp_path / "c.npz"
    with pytest.raises(CheckpointError) as info:
        save(path, state, group=ONE)
    assert where in str(info.value) and what in str(info.value)
    assert os.listdir(tmp_path) == []  # nothing written, not even a temporary file


# ------------------------------------------------------------------------------------ corrupt and foreign files

def _rewrite(path, entries):
    """Write an npz by hand (as an attacker or a broken tool would)."""
    with open(path, "wb") as f:
        np.savez(f, **entries)


def test_flipped_byte_in_array_data_is_detected(tmp_path):
    marker = np.arange(1000, dtype=np.float64) + 0.5
    path = tmp_path / "c.npz"
    save(path, {"model": {"w": marker}, "epoch": 1}, group=ONE)
    raw = bytearray(path.read_bytes())
    at = bytes(raw).find(marker.tobytes())
    assert at > 0
    raw[at + 4000] ^= 0x10
    path.write_bytes(bytes(raw))
    with pytest.raises(CheckpointError) as info:
        load(path, group=ONE)
    assert str(path) in str(info.value) and "state['model']['w']" in str(info.value)


def test_flipped_byte_in_metadata_is_detected(tmp_path):
    path = tmp_path / "c.npz"
    save(path, {"epoch": 12345}, group=ONE)
    raw = bytearray(path.read_bytes())
    at = bytes(raw).find(b'"12345"')
    assert at > 0
    raw[at + 1] ^= 0x01
    path.write_bytes(bytes(raw))
    with pytest.raises(CheckpointError, match="__meta__"):
        load(path, group=ONE)


def test_checksum_catches_what_the_zip_crc_cannot(tmp_path):
    """Arrays swapped under intact zip CRCs (a file stitched from two checkpoints) fail the sha256."""
    path = tmp_path / "c.npz"
    entries = encode({"opt": {"state": [{"exp_avg": np.zeros(4)}]}})
    entries["a0"] = np.ones(4)
    _rewrite(path, entries)
    with pytest.raises(CheckpointError, match=r"state\['opt'\]\['state'\]\[0\]\['exp_avg'\]: checksum mismatch"):
        load(path, group=ONE)


@pytest.mark.parametrize("replacement,message", [
    (np.zeros(4, dtype=np.float32), "holds float32 of shape (4,), the metadata records float64"),
    (np.zeros(5), "holds float64 of shape (5,)"),
])
def test_dtype_or_shape_that_differs_from_the_metadata_is_refused(tmp_path, replacement, message):
    path = tmp_path / "c.npz"
    entries = encode({"w": np.zeros(4)})
    entries["a0"] = replacement
    _rewrite(path, entries)
    with pytest.raises(CheckpointError) as info:
        load(path, group=ONE)
    assert message in str(info.value) and "state['w']" in str(info.value)


def test_entries_missing_or_unexpected_are_refused(tmp_path):
    path = tmp_path / "c.npz"
    entries = encode({"w": np.zeros(4)})
    _rewrite(path, {META_ENTRY: entries[META_ENTRY]})
    with pytest.raises(CheckpointError, match=r"state\['w'\]: entry 'a0' is missing"):
        load(path, group=ONE)
    _rewrite(path, dict(entries, extra=np.zeros(1)))
    with pytest.raises(CheckpointError, match=r"entries \['extra'\] are not described"):
        load(path, group=ONE)


class _Trap:
    """Unpickling this creates a marker file: proof that code ran."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.mkdir, (self.marker,))


def test_a_pickle_renamed_npz_is_refused_without_running_it(tmp_path):
    marker = str(tmp_path / "pwned")
    path = tmp_path / "ckpt.npz"
    path.write_bytes(pickle.dumps({"model": _Trap(marker)}))
    with pytest.raises(CheckpointError, match="without pickle"):
        load(path, group=ONE)
    assert not os.path.exists(marker)


def test_an_object_array_entry_is_refused_without_running_it(tmp_path):
    marker = str(tmp_path / "pwned")
    path = tmp_path / "ckpt.npz"
    entries = encode({"model": {"w": np.zeros(1)}})
    entries["a0"] = np.array([_Trap(marker)], dtype=object)
    _rewrite(path, entries)  # np.savez pickles object arrays when writing
    with pytest.raises(CheckpointError) as info:
        load(path, group=ONE)
    assert "state['model']['w']" in str(info.value) and "allow_pickle" in str(info.value)
    assert not os.path.exists(marker)


def test_pickled_metadata_is_refused_without_running_it(tmp_path):
    marker = str(tmp_path / "pwned")
    path = tmp_path / "ckpt.npz"
    _rewrite(path, {META_ENTRY: np.array([_Trap(marker)], dtype=object)})
    with pytest.raises(CheckpointError, match="'__meta__' cannot be read"):
        load(path, group=ONE)
    assert not os.path.exists(marker)


def test_foreign_and_missing_files_are_refused(tmp_path):
    cases = {
        "plain.npz": (lambda p: np.savez(p, w=np.zeros(2)), "not an axonhpc checkpoint"),
        "single.npz": (lambda p: np.save(open(p, "wb"), np.zeros(2)), "single .npy array"),
        "text.npz": (lambda p: open(p, "w").write("hello"), "cannot be read as an npz archive"),
        "meta-not-json.npz": (lambda p: _rewrite(p, {META_ENTRY: np.frombuffer(b"{oops", np.uint8)}),
                              "not valid JSON"),
        "meta-wrong-type.npz": (lambda p: _rewrite(p, {META_ENTRY: np.zeros(3, np.float32)}), "not the uint8"),
        "truncated.npz": (lambda p: (save(p, {"w": np.zeros(100)}, group=ONE),
                                     open(p, "r+b").truncate(os.path.getsize(p) // 2)), "cannot be read"),
    }
    for name, (make, message) in cases.items():
        path = str(tmp_path / name)
        make(path)
        with pytest.raises(CheckpointError, match=message):
            load(path, group=ONE)
    with pytest.raises(CheckpointError, match="no such file"):
        load(tmp_path / "absent.npz", group=ONE)


def test_a_newer_format_version_is_refused(tmp_path):
    entries = encode({"w": 1})
    meta = json.loads(entries[META_ENTRY].tobytes())
    meta["version"] = 99
    path = tmp_path / "future.npz"
    _rewrite(path, {META_ENTRY: np.frombuffer(json.dumps(meta).encode(), np.uint8)})
    with pytest.raises(CheckpointError, match="format version 99; this axonhpc reads versions 1 to 1"):
        load(path, group=ONE)


# ------------------------------------------------------------------------------------ atomic replacement

def test_a_crash_mid_write_leaves_the_previous_checkpoint(tmp_path, monkeypatch):
    path = tmp_path / "ckpt.npz"
    save(path, {"epoch": 1, "w": np.arange(3.0)}, group=ONE)
    before = path.read_bytes()

    def partial_savez(f, **entries):
        f.write(b"PK\x03\x04 half of a zip")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(np, "savez", partial_savez)
    with pytest.raises(CheckpointError, match="No space left on device") as info:
        save(path, {"epoch": 2, "w": np.arange(4.0)}, group=ONE)
    assert isinstance(info.value.__cause__, OSError)
    assert os.listdir(tmp_path) == ["ckpt.npz"]  # the temporary file is gone
    assert path.read_bytes() == before
    assert load(path, group=ONE)["epoch"] == 1


def test_a_failed_rename_leaves_the_previous_checkpoint(tmp_path, monkeypatch):
    path = tmp_path / "ckpt.npz"
    save(path, {"epoch": 1}, group=ONE)

    def no_replace(src, dst):
        assert os.path.getsize(src) > 0  # the new file was complete before the rename
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(os, "replace", no_replace)
    with pytest.raises(CheckpointError, match="PermissionError"):
        save(path, {"epoch": 2}, group=ONE)
    monkeypatch.undo()
    assert os.listdir(tmp_path) == ["ckpt.npz"]
    assert load(path, group=ONE) == {"epoch": 1}


def test_save_replaces_and_writes_the_exact_name(tmp_path):
    path = tmp_path / "model.ckpt"  # no .npz appended, unlike np.savez with a name
    save(path, {"epoch": 1}, group=ONE)
    save(path, {"epoch": 2}, group=ONE)
    assert os.listdir(tmp_path) == ["model.ckpt"]
    assert zipfile.is_zipfile(path) and load(path, group=ONE) == {"epoch": 2}


# ------------------------------------------------------------------------------------ groups

@pytest.mark.timeout(60)
def test_rank0_writes_and_every_rank_loads_the_same(tmp_path):
    path = str(tmp_path / "ckpt.npz")

    def body(world):
        r = world.rank
        # Only rank 0's state counts; the others' differ on purpose (or are None).
        save(path, {"rank": r, "w": np.full(3, float(r))} if r != 2 else None)
        out = load(path)
        return out["rank"], out["w"].tolist()

    assert run_local(body, world_size=3) == [(0, [0.0, 0.0, 0.0])] * 3
    assert os.listdir(tmp_path) == ["ckpt.npz"]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("problem", ["missing directory", "unsupported value"])
def test_a_rank0_write_failure_raises_the_same_error_on_every_rank(tmp_path, problem):
    if problem == "missing directory":
        path, state = str(tmp_path / "no" / "such" / "dir" / "ckpt.npz"), {"w": np.zeros(2)}
    else:
        path, state = str(tmp_path / "ckpt.npz"), {"w": Opaque()}

    def body(world):
        try:
            save(path, state)
        except CheckpointError as exc:
            return str(exc)
        return None

    messages = run_local(body, world_size=3)
    assert messages[0] is not None and messages == [messages[0]] * 3
    assert "failed on group rank 0" in messages[0]
    assert ("FileNotFoundError" if problem == "missing directory" else "state['w']") in messages[0]


@pytest.mark.timeout(60)
def test_a_rank_that_cannot_load_makes_every_rank_raise(tmp_path):
    good = str(tmp_path / "ckpt.npz")
    save(good, {"epoch": 1}, group=ONE)

    def body(world):
        try:
            load(good if world.rank != 1 else str(tmp_path / "elsewhere.npz"))
        except CheckpointError as exc:
            return str(exc)
        return None

    messages = run_local(body, world_size=3)
    assert "no such file" in messages[1]
    for r in (0, 2):
        assert "failed on group ranks [1]" in messages[r]


@pytest.mark.timeout(60)
def test_ranks_reading_different_files_all_raise(tmp_path):
    """What a node-local path looks like: each rank finds a valid but different checkpoint."""
    for r in range(3):
        save(tmp_path / f"node{r % 2}.npz", {"epoch": r % 2}, group=ONE)

    def body(world):
        try:
            load(str(tmp_path / f"node{world.rank % 2}.npz"))
        except CheckpointError as exc:
            return str(exc)
        return None

    messages = run_local(body, world_size=3)
    assert all(m is not None and "read different checkpoints" in m for m in messages)
    assert "ranks [0, 2]" in messages[0] and "ranks [1]" in messages[0]


@pytest.mark.timeout(60)
def test_subgroup_save_and_non_member(tmp_path):
    path = str(tmp_path / "ckpt.npz")

    def body(world):
        pg = world.new_group([1, 2])
        if not pg.is_member:
            with pytest.raises(NotAMemberError, match="not a member"):
                save(path, {"x": 0}, group=pg)
            return None
        save(path, {"writer": world.rank}, group=pg)  # group rank 0 is global rank 1
        return load(path, group=pg)["writer"]

    assert run_local(body, world_size=3) == [None, 1, 1]


# ------------------------------------------------------------------------------------ rng state

@pytest.mark.parametrize("bit_generator", ["PCG64", "PCG64DXSM", "MT19937", "Philox", "SFC64"])
def test_generator_state_round_trips_through_a_checkpoint(tmp_path, bit_generator):
    gen = np.random.Generator(getattr(np.random, bit_generator)(7))
    gen.random(3)
    gen.integers(0, 10, size=1, dtype=np.uint32)  # leaves a buffered 32-bit half in some generators
    state = roundtrip(tmp_path, {"rng": capture_rng_state(gen)})["rng"]
    expected = gen.random(5)

    fresh = restore_rng_state(state)
    assert type(fresh.bit_generator).__name__ == bit_generator
    assert np.array_equal(fresh.random(5), expected)
    other = np.random.Generator(getattr(np.random, bit_generator)(99))
    assert restore_rng_state(state, other) is other
    assert np.array_equal(other.random(5), expected)


def test_random_state_and_global_rng_round_trip(tmp_path):
    rs = np.random.RandomState(3)
    rs.standard_normal()  # a cached Gaussian is part of the legacy state
    np.random.seed(11)
    np.random.standard_normal()
    out = roundtrip(tmp_path, {"rs": capture_rng_state(rs), "global": capture_rng_state(None)})
    expected_rs, expected_global = rs.standard_normal(4), np.random.standard_normal(4)

    np.random.seed(0)
    assert restore_rng_state(out["global"]) is None
    assert np.array_equal(np.random.standard_normal(4), expected_global)
    assert np.array_equal(restore_rng_state(out["rs"]).standard_normal(4), expected_rs)


def test_rng_state_mismatches_are_refused():
    pcg = capture_rng_state(np.random.default_rng(0))
    with pytest.raises(CheckpointError, match="'PCG64', the generator uses 'MT19937'"):
        restore_rng_state(pcg, np.random.Generator(np.random.MT19937(0)))
    with pytest.raises(CheckpointError, match="cannot restore it into a RandomState"):
        restore_rng_state(pcg, np.random.RandomState(0))
    with pytest.raises(CheckpointError, match="not an rng state"):
        restore_rng_state({"epoch": 1})
    with pytest.raises(CheckpointError, match="'Nope', which numpy does not provide"):
        restore_rng_state({"kind": "generator", "state": {"bit_generator": "Nope"}})
    with pytest.raises(TypeError, match="got int"):
        capture_rng_state(3)


# ------------------------------------------------------------------------------------ latest

def test_latest_picks_the_highest_step_number(tmp_path):
    assert latest(tmp_path / "not-yet") is None
    assert latest(tmp_path) is None
    for name in ["ckpt-99.npz", "ckpt-000100.npz", "ckpt-7.npz", "ckpt-000101.npz.tmp-12-34",
                 "ckpt-latest.npz", "ckpt-200.npz.bak", "other-500.npz"]:
        (tmp_path / name).write_bytes(b"")
    (tmp_path / "ckpt-900.npz").mkdir()  # a directory is not a checkpoint
    assert latest(tmp_path) == os.path.join(str(tmp_path), "ckpt-000100.npz")
    assert latest(str(tmp_path), "other-*.npz") == os.path.join(str(tmp_path), "other-500.npz")
    assert latest(tmp_path, "step*") is None


def test_latest_finds_checkpoint_directories_and_files_by_default(tmp_path):
    """The default finds ``ckpt-<step>`` directories (save_per_rank, save_sharded, the trainer) as well as files."""
    assert latest(tmp_path) is None
    for step in (7, 12):
        (tmp_path / f"ckpt-{step:08d}").mkdir()
        (tmp_path / f"ckpt-{step:08d}" / "index.npz").write_bytes(b"")
    (tmp_path / "ckpt-00000030").mkdir()  # no index.npz: a save that never finished
    (tmp_path / "ckpt-00000031.tmp-1-2").mkdir()
    (tmp_path / "ckpt-9.npz").write_bytes(b"")
    assert latest(tmp_path) == os.path.join(str(tmp_path), "ckpt-00000012")
    assert latest(tmp_path, "ckpt-*") == os.path.join(str(tmp_path), "ckpt-00000012")
    assert latest(tmp_path, "ckpt-*.npz") == os.path.join(str(tmp_path), "ckpt-9.npz")  # files only, as before
    (tmp_path / "ckpt-13.npz").write_bytes(b"")
    assert latest(tmp_path) == os.path.join(str(tmp_path), "ckpt-13.npz")  # the highest step, whichever kind


def test_latest_with_default_arguments_finds_what_the_trainer_writes(tmp_path):
    import axonhpc as ax

    rng = np.random.default_rng(0)
    x, y = rng.standard_normal((16, 4)).astype(np.float32), rng.integers(0, 3, 16)
    steps = []

    def fit(world):  # every thread-rank builds its own model, as every process would
        model = nn.Sequential(nn.Linear(4, 3, seed=0))
        trainer = ax.DistributedTrainer(model, optim.SGD(model.parameters(), lr=0.1), nn.CrossEntropyLoss(),
                                        verbose=False, progress=False, keep_checkpoints=5)
        trainer.fit((x, y), 2, batch_size=4, checkpoint_dir=str(tmp_path))
        steps.append(trainer.global_step)

    ax.run_local(fit, world_size=2)
    written = sorted(name for name in os.listdir(tmp_path) if name.startswith("ckpt-"))
    assert len(written) == 2 and all(os.path.isfile(tmp_path / name / "index.npz") for name in written)
    assert steps == [steps[0]] * 2 and written[-1] == f"ckpt-{steps[0]:08d}"
    assert latest(tmp_path) == os.path.join(str(tmp_path), written[-1])


@pytest.mark.parametrize("pattern", ["ckpt.npz", "ckpt-*-*.npz", "sub/ckpt-*.npz"])
def test_latest_refuses_patterns_without_one_star(tmp_path, pattern):
    with pytest.raises(ConfigurationError, match="exactly one"):
        latest(tmp_path, pattern)


def test_absurdly_nested_metadata_is_refused(tmp_path):
    depth = 100_000
    text = '{"format": "axonhpc-checkpoint", "version": 1, "tree": ' + '{"t": "list", "items": [' * depth
    text += "]}" * depth + "}"
    path = tmp_path / "deep.npz"
    _rewrite(path, {META_ENTRY: np.frombuffer(text.encode(), np.uint8)})
    with pytest.raises(CheckpointError, match="nested too deeply"):
        load(path, group=ONE)
