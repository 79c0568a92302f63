"""The slow rank named while the job runs (collectives.stragglers), by the trainer per epoch, and by the doctor.

A straggler is made with an injected sleep on one rank, on thread ranks and
on MPI ranks; the others must not be named.
"""
import json
import os
import subprocess
import sys
import time

import numpy as np
import pytest

import axonhpc as ax
from axonhpc import nn, optim
from axonhpc.collectives import stragglers
from axonhpc.observe.doctor import lateness
from support.settings_override import override

SLEEP = 0.004  # seconds the slow rank sleeps before each call: well above the 1 ms margin


def _calls(world, slow, count):
    x = np.ones(256)
    for _ in range(count):
        if world.rank == slow:
            time.sleep(SLEEP)
        ax.all_reduce(x)
    return stragglers.summary(world.default_group)


@pytest.mark.parametrize("world_size,slow", [(2, 1), (3, 0), (4, 2)])
def test_a_rank_that_sleeps_before_every_call_is_named_on_group_rank_0(world_size, slow):
    with override(straggler_every=40):
        out = ax.run_local(lambda world: _calls(world, slow, 80), world_size=world_size)
    facts = out[0]
    assert facts["straggler"] == slow and facts["calls"] == 80, facts
    assert facts["ranks"][slow]["share"] >= stragglers.SHARE
    assert 0.5 * SLEEP * 1e3 < facts["ranks"][slow]["late_ms"] < 20 * SLEEP * 1e3
    assert all(o == {"calls": 0, "ranks": {}, "straggler": None} for o in out[1:])  # rank 0 counts
    assert stragglers.summary.__doc__


def test_no_rank_is_named_when_none_is_slow_and_nothing_is_compared_when_off():
    with override(straggler_every=40):
        out = ax.run_local(lambda world: _calls(world, -1, 80), world_size=3)
    assert out[0]["straggler"] is None and out[0]["calls"] == 80, out[0]
    with override(straggler_every=0):
        out = ax.run_local(lambda world: _calls(world, 1, 50), world_size=2)
    assert out[0]["calls"] == 0


class _SlowBackward(nn.Module):
    """Identity whose backward sleeps on one rank: a rank slower to compute its gradients."""

    def __init__(self, slow):
        super().__init__()
        self.slow = slow

    def forward(self, x):
        return x

    def backward(self, grad):
        if ax.current_world().rank == self.slow:
            time.sleep(SLEEP)
        return grad


def test_the_trainer_reports_the_straggler_of_each_epoch():
    def body(world):
        layers = []
        for i in range(5):
            layers += [nn.Linear(8, 8, bias=False, dtype=np.float64, seed=i), _SlowBackward(1)]  # a bucket each
        model = nn.Sequential(*layers)
        seen = []
        trainer = ax.DistributedTrainer(model, optim.SGD(model.parameters(), lr=0.01), nn.MSELoss(), progress=False,
                                        verbose=False, bucket_size_mb=1e-4,
                                        on_step=lambda t, step, loss: time.sleep(SLEEP) if world.rank == 1 else None,
                                        on_epoch=lambda t, record: seen.append(record))
        rng = np.random.default_rng(0)
        x, y = rng.standard_normal((64, 8)), rng.standard_normal((64, 8))
        trainer.fit((x, y), epochs=2, batch_size=4)
        return seen

    with override(straggler_every=20):
        out = ax.run_local(body, world_size=2)
    for records in out:  # every rank's record says the same
        assert [r["straggler"] for r in records] == [1, 1], records
        assert all(r["straggler_share"] >= 0.8 and r["straggler_late_ms"] > 1.0 for r in records), records
    same = [[{k: v for k, v in r.items() if k != "seconds"} for r in records] for records in out]
    assert same[0] == same[1]


def test_the_doctor_names_the_rank_last_by_the_corrected_clocks():
    def dump(rank, offset, delays):
        return {"rank": rank, "clock_offset": offset, "records": [
            {"t": 100.0 + k - offset + d, "group": "world", "ranks": [0, 1, 2], "seq": k, "op": "all_reduce"}
            for k, d in enumerate(delays)]}

    # rank 2's clock runs 50 ms behind; corrected, it is 5 ms late at 9 of 10 calls
    dumps = {0: dump(0, 0.0, [0.0] * 10), 1: dump(1, 0.010, [0.001] * 10),
             2: dump(2, -0.050, [0.006] * 9 + [0.0])}
    lines = lateness(dumps)
    assert lines[0].startswith("lateness over 10 collectives"), lines
    assert lines[1] == "  rank 2: last in 9 (90%), by a median of 5.00 ms  <- the straggler", lines
    assert lateness({0: dump(0, 0.0, [0.0]), 1: {"rank": 1, "records": []}})[0].startswith("no collective")


JOB = r"""
import os, sys, time
import numpy as np
import axonhpc as ax
from axonhpc.collectives import flight, stragglers
world = ax.init()
x = np.ones(512)
for _ in range(300):
    if world.rank == 1:
        time.sleep(0.004)
    ax.all_reduce(x)
facts = stragglers.summary(world.default_group)
if world.rank == 0:
    print("summary", facts["straggler"], facts["calls"], flush=True)
flight.dump("test")
"""


@pytest.mark.timeout(300)
def test_under_mpi_rank_0_warns_and_the_doctor_names_the_straggler(tmp_path):
    script = tmp_path / "job.py"
    script.write_text(JOB)
    env = dict(os.environ, OMP_NUM_THREADS="1", AXONHPC_STRAGGLER_EVERY="100", AXONHPC_FLIGHT_DIR=str(tmp_path / "f"))
    out = subprocess.run([sys.executable, "-m", "axonhpc", "launch", "-n", "3", "--", str(script)], capture_output=True,
                         text=True, timeout=240, cwd=tmp_path, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "summary 1 300" in out.stdout, out.stdout
    warnings = [line for line in out.stderr.splitlines() if "axonhpc.stragglers" in line]
    assert len(warnings) == 3 and all("[axonhpc rank 0/3]" in w for w in warnings), out.stderr[-3000:]
    assert "rank 1 was the last to arrive in" in warnings[0] and "of the last 100 collectives on group world" in warnings[0]
    dumps = [json.loads(path.read_text()) for r in range(3)
             for path in (tmp_path / "f").glob(f"flight-*-rank{r:05d}.json")]  # flight-<run>-rank<r>.json
    assert len(dumps) == 3 and len({d["run"] for d in dumps}) == 1, dumps
    assert dumps[0]["clock_offset"] == 0.0 and all(abs(d["clock_offset"]) < 0.01 for d in dumps)
    doctor = subprocess.run([sys.executable, "-m", "axonhpc", "doctor", str(tmp_path / "f")], capture_output=True,
                            text=True, timeout=60)
    assert doctor.returncode == 0, doctor.stderr
    assert "rank 1: last in" in doctor.stdout and "<- the straggler" in doctor.stdout, doctor.stdout
