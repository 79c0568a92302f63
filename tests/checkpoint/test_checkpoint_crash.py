"""A process SIGKILLed while saving a checkpoint leaves the previous one intact, bit for bit.

A child process (plain python, one rank, no MPI) saves checkpoint A, then
starts saving a large checkpoint B (64 MiB) to the same path; the test kills
it with SIGKILL once the temporary file holds 0, 20, 40, 60 and 80 % of B's
data, and once more after the last byte (in the fsync before the rename), for
``save`` (one file) and ``save_per_rank`` (a directory). Afterwards the path
must load as A exactly, ``latest`` must not pick up the leftovers, and the
leftovers (truncated checkpoints) must be refused with a CheckpointError; a
leftover of a kill in the fsync may be a complete B under its temporary name,
which nothing reads. If the save wins a race with the kill, the path must hold
B whole (never a mixture); at most one of the six kills may miss.
"""
import glob
import os
import signal

import numpy as np
import pytest

from axonhpc import checkpoint
from axonhpc.checkpoint import latest, load, load_per_rank
from axonhpc.errors import CheckpointError
from axonhpc.groups import ProcessGroup
from support.crash_child import expect_line, kill_when_written, start_child

ONE = ProcessGroup.mock()
FRACTIONS = [0.0, 0.2, 0.4, 0.6, 0.8]  # of B's size written when the kill is sent
B_ARRAYS, B_ELEMENTS = 16, 1 << 19  # 16 float64 arrays of 4 MiB: 64 MiB
B_BYTES = B_ARRAYS * B_ELEMENTS * 8

CHILD = r"""
import sys
import numpy as np
from axonhpc.checkpoint import save, save_per_rank
from axonhpc.groups import ProcessGroup

mode, path = sys.argv[1], sys.argv[2]
ONE = ProcessGroup.mock()
exec(sys.argv[3])  # defines state_a() and state_b()
if mode == "file":
    save(path, state_a(), group=ONE)
else:
    save_per_rank(path, state_a(), group=ONE, extra={"which": "A"})
print("A saved", flush=True)
b = state_b()
print("B built", flush=True)
if mode == "file":
    save(path, b, group=ONE)
else:
    save_per_rank(path, b, group=ONE, extra={"which": "B"})
print("B saved", flush=True)
"""

STATES = f"""
def state_a():
    rng = np.random.default_rng(1)
    model = {{"w": rng.standard_normal((64, 32)), "b": np.arange(5, dtype=np.float32)}}
    return {{"which": "A", "step": 1, "model": model, "rng": rng.integers(0, 2**63, size=4, dtype=np.uint64)}}

def state_b():
    model = {{f"p{{i}}": np.full({B_ELEMENTS}, float(i)) for i in range({B_ARRAYS})}}
    return {{"which": "B", "step": 2, "model": model}}
"""


def state_a():
    namespace = {"np": np}
    exec(STATES, namespace)
    return namespace["state_a"]()


def assert_is_a(state):
    want = state_a()
    assert state["which"] == "A" and state["step"] == 1
    for key in ("w", "b"):
        got = state["model"][key]
        assert got.dtype == want["model"][key].dtype and got.tobytes() == want["model"][key].tobytes()
    assert state["rng"].tobytes() == want["rng"].tobytes()


def kill_mid_write(mode, path, fraction):
    """Run the child; SIGKILL it once its temporary file holds ``fraction`` of B. Returns what happened.

    With ``fraction`` 1 the kill aims at the moment between the last byte and
    the rename (the fsync): once the file holds B and has stopped growing for
    20 ms. The child may win the race and finish (there, or when this watcher
    is descheduled for long), which the caller accepts.
    """
    child = start_child(CHILD, mode, path, STATES)
    try:
        expect_line(child, b"A saved\n")
    except AssertionError:
        child.kill()
        raise
    snapshot = open(path, "rb").read() if mode == "file" else None
    pattern = f"{path}.tmp-*" if mode == "file" else f"{path}.tmp-*/rank-*.tmp-*"
    code, size = kill_when_written(child, pattern, int(fraction * B_BYTES),
                                   settled_for=0.02 if fraction >= 1 else None, timeout=30)
    leftovers = glob.glob(pattern)
    return {"code": code, "size_seen": size, "leftovers": leftovers,
            "leftover_sizes": [os.path.getsize(p) for p in leftovers], "snapshot": snapshot}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("mode", ["file", "directory"])
def test_sigkill_while_saving_leaves_the_previous_checkpoint(tmp_path, mode):
    outcomes, killed = [], 0
    for fraction in FRACTIONS + [1.0]:
        run = tmp_path / f"run-{fraction}"
        run.mkdir()
        path = str(run / ("ckpt-000001.npz" if mode == "file" else "ckpt-000001"))
        got = kill_mid_write(mode, path, fraction)
        if got["code"] == 0:  # B was complete and renamed before the kill: B, whole, and no leftovers
            state = load(path, group=ONE) if mode == "file" else load_per_rank(path, group=ONE)[0]
            assert state["which"] == "B" and len(state["model"]) == B_ARRAYS and not got["leftovers"]
            outcomes.append(f"kill aimed at {fraction:.0%}: the save had already completed; B loads whole")
            continue
        assert got["code"] == -signal.SIGKILL, got
        killed += 1
        assert len(got["leftovers"]) == 1 and got["leftover_sizes"][0] <= B_BYTES + 65536, got
        if mode == "file":
            assert open(path, "rb").read() == got["snapshot"]  # the file at path is A's, byte for byte
            assert_is_a(load(path, group=ONE))
            assert latest(str(run)) == path
        else:
            state, extra = load_per_rank(path, group=ONE)
            assert_is_a(state)
            assert extra == {"which": "A"}
            assert latest(str(run), "ckpt-*") == path
            assert sorted(os.listdir(path)) == ["index.npz", "rank-00000-of-00001.npz"]
        leftover = got["leftovers"][0]
        if got["size_seen"] > B_BYTES:
            # Killed in the fsync: the temporary file may be a complete B under its temporary name.
            # It is never what load(path) or latest() sees (checked above); read directly it is B or refused.
            try:
                whole = load(leftover, group=ONE)
            except CheckpointError as exc:
                verdict = f"refused ({str(exc)[len(leftover) + 14:][:60]})"
            else:
                assert whole["which"] == "B" and len(whole["model"]) == B_ARRAYS
                verdict = "a complete B under the temporary name (killed in the fsync), not picked up"
        else:
            # What the killed save left behind is a truncated checkpoint: refused, never read as one.
            with pytest.raises(CheckpointError) as info:
                load(leftover, group=ONE)
            assert leftover in str(info.value)
            verdict = f"refused ({str(info.value)[len(leftover) + 14:][:60]})"
        outcomes.append(f"kill at >= {got['size_seen']} bytes written (target {fraction:.0%} of the data), "
                        f"leftover {got['leftover_sizes'][0]} bytes: {verdict}")
    print(f"\n{mode}: {killed} of {len(outcomes)} saves SIGKILLed, previous checkpoint intact after each:\n  "
          + "\n  ".join(outcomes))
    assert killed >= len(FRACTIONS), outcomes  # the kills did land mid-save (only the fsync one may miss)


def test_truncated_copies_of_a_checkpoint_are_refused(tmp_path):
    from axonhpc.checkpoint import save

    path = str(tmp_path / "ckpt.npz")
    save(path, state_a(), group=ONE)
    data = open(path, "rb").read()
    for fraction in FRACTIONS + [0.9, 0.99]:
        cut = str(tmp_path / f"cut-{fraction}.npz")
        with open(cut, "wb") as f:
            f.write(data[:int(fraction * len(data))])
        with pytest.raises(CheckpointError, match="cannot be read|no such file|truncated") as info:
            load(cut, group=ONE)
        assert cut in str(info.value)
    assert_is_a(load(path, group=ONE))


def test_clean_interrupted_removes_temporaries_and_restores_renamed_checkpoints(tmp_path):
    from axonhpc.checkpoint import clean_interrupted, latest

    checkpoint.save(str(tmp_path / "ckpt-00000001.npz"), {"a": np.arange(3)})
    (tmp_path / "ckpt-00000002.npz.tmp-123-456").write_bytes(b"half a file")
    (tmp_path / "ckpt-00000003.tmp-abcdef").mkdir()  # a directory save that never finished
    # The instant between the two renames of an overwrite: the only copy sits at .old-<token>.
    checkpoint.save(str(tmp_path / "ckpt-00000004.npz.old-feed"), {"a": np.arange(4)})
    # An overwrite that did finish, with its .old-<token> still there.
    checkpoint.save(str(tmp_path / "ckpt-00000005.npz"), {"a": np.arange(5)})
    checkpoint.save(str(tmp_path / "ckpt-00000005.npz.old-beef"), {"a": np.arange(1)})
    done = clean_interrupted(str(tmp_path))
    assert sorted(done) == sorted([
        "removed ckpt-00000002.npz.tmp-123-456", "removed ckpt-00000003.tmp-abcdef",
        "restored ckpt-00000004.npz from ckpt-00000004.npz.old-feed", "removed ckpt-00000005.npz.old-beef"])
    assert sorted(os.listdir(tmp_path)) == ["ckpt-00000001.npz", "ckpt-00000004.npz", "ckpt-00000005.npz"]
    np.testing.assert_array_equal(checkpoint.load(str(tmp_path / "ckpt-00000004.npz"))["a"], np.arange(4))
    assert latest(str(tmp_path)).endswith("ckpt-00000005.npz")
    assert clean_interrupted(str(tmp_path)) == [] and clean_interrupted(str(tmp_path / "absent")) == []
