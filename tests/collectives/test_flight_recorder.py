"""The flight recorder and ``axonhpc doctor``: who diverged first, and where."""
import os
import signal
import subprocess
import re
import sys

import pytest

from axonhpc.observe.doctor import diagnose, load_dumps
from support.paths import JOBS

JOB = os.path.join(JOBS, "timeout_job.py")
MPIEXEC = os.path.join(os.path.dirname(sys.executable), "mpiexec")


def _entry(seq, op, shape=(4,), done=True, where="train.py:42", t=0.0):
    return {"t": t + seq, "group": "world", "ranks": [0, 1, 2], "seq": seq, "op": op, "dtype": "float64",
            "shape": list(shape), "reduce": "SUM" if op == "all_reduce" else None, "root": None, "where": where,
            "done": done}


def test_diagnose_names_the_odd_rank_and_both_calls():
    same = [_entry(0, "barrier"), _entry(1, "all_reduce")]
    dumps = {0: {"rank": 0, "reason": "timeout", "records": same + [_entry(2, "all_reduce", done=False)]},
             1: {"rank": 1, "reason": "timeout", "records": same + [_entry(2, "all_reduce", done=False)]},
             2: {"rank": 2, "reason": "timeout", "records": same + [_entry(2, "all_reduce", (18, 18), done=False,
                                                                            where="train.py:43")]}}
    lines = diagnose(dumps)
    assert lines[0].startswith("rank 2 diverged first, at group world #2:"), lines
    assert "ranks [0, 1] called all_reduce float64 (4,) op=SUM at train.py:42" in lines[0]
    assert "ranks [2] called all_reduce float64 (18, 18) op=SUM at train.py:43" in lines[0]
    assert any(line.startswith("rank 2 was waiting in group world #2") for line in lines)


def test_diagnose_a_rank_that_never_arrived():
    dumps = {0: {"rank": 0, "reason": "timeout", "records": [_entry(0, "barrier"), _entry(1, "all_reduce", done=False)]},
             1: {"rank": 1, "reason": "signal", "records": [_entry(0, "barrier")]}}
    lines = diagnose(dumps)
    assert lines[0] == ("ranks [1] never reached group world #1, where ranks [0] called all_reduce float64 (4,) "
                        "op=SUM at train.py:42"), lines
    assert "no dump from ranks [2]" in lines[-1]


def _env(tmp_path):
    return dict(os.environ, AXONHPC_ABORT_ON_EXCEPTION="1", OMP_NUM_THREADS="1", AXONHPC_FLIGHT_DIR=str(tmp_path))


@pytest.mark.timeout(120)
def test_a_mismatch_is_dumped_by_every_rank_and_the_doctor_names_the_culprit(tmp_path):
    out = subprocess.run(["timeout", "-k", "5", "60", MPIEXEC, "-n", "3", sys.executable, JOB, "mismatch"],
                         capture_output=True, text=True, env=_env(tmp_path))
    assert out.returncode != 0, out.stdout + out.stderr
    dumps = load_dumps(str(tmp_path))
    assert sorted(dumps) == [0, 1, 2]
    assert len({d["run"] for d in dumps.values()}) == 1 and {d["world_size"] for d in dumps.values()} == {3}, dumps
    report = subprocess.run([sys.executable, "-m", "axonhpc", "doctor", str(tmp_path)], capture_output=True,
                            text=True, timeout=60)
    assert report.returncode == 0, report.stderr
    assert ("rank 2 diverged first, at group world #1: ranks [0, 1] called all_reduce float64 (4,) op=SUM at "
            "timeout_job.py:") in report.stdout, report.stdout
    assert "ranks [2] called barrier at timeout_job.py:" in report.stdout, report.stdout


@pytest.mark.timeout(120)
def test_sigusr1_dumps_every_rank_and_the_job_goes_on(tmp_path):
    job = subprocess.Popen(["timeout", "-k", "5", "60", MPIEXEC, "-n", "2", sys.executable, JOB, "usr1"],
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_env(tmp_path))
    seen = ""
    while len(re.findall(r"ready \d", seen)) < 2:
        line = job.stdout.readline()
        assert line, f"the job ended before both ranks were ready: {seen!r}"
        seen += line
    assert sorted(re.findall(r"ready \d", seen)) == ["ready 0", "ready 1"], seen
    pids = subprocess.run(["pgrep", "-f", f"{JOB} usr1"], capture_output=True, text=True).stdout.split()
    ranks = [int(p) for p in pids if open(f"/proc/{p}/cmdline", "rb").read().split(b"\0")[0].endswith(b"python")]
    assert len(ranks) == 2, pids
    for pid in ranks:
        os.kill(pid, signal.SIGUSR1)
    out, err = job.communicate(timeout=60)
    assert job.returncode == 0, out + err
    dumps = load_dumps(str(tmp_path))
    assert sorted(dumps) == [0, 1]
    for data in dumps.values():
        assert data["reason"] == "signal SIGUSR1"
        ops = [e["op"] for e in data["records"]]
        assert ops[-4:] == ["all_reduce", "all_reduce", "all_reduce", "barrier"], ops
        assert all(e["done"] for e in data["records"])


def test_thread_ranks_keep_their_own_records(tmp_path):
    import numpy as np

    import axonhpc as ax
    from axonhpc.collectives import flight

    def body(world):
        for _ in range(2):
            ax.all_reduce(np.ones(2))
        ax.broadcast(np.ones(3), src=0)
        ax.barrier()  # every thread has recorded all three before any reads: a shared buffer would interleave
        mine = flight.records(world.rank)[-4:-1]
        return [e["op"] for e in mine], mine[-1]["root"]

    before = ax.settings.flight_dir
    ax.settings.flight_dir = str(tmp_path)
    try:
        results = ax.run_local(body, world_size=3)
        assert results == [(["all_reduce", "all_reduce", "broadcast"], 0)] * 3
        flight.dump("test")
    finally:
        ax.settings.flight_dir = before
    # Ranks that only an earlier run_local world of this process had (3, 4, ...) dump that world's records:
    # the doctor leaves them out as another run's, and keeps this world's three.
    broken = []
    assert set(load_dumps(str(tmp_path), broken)) == {0, 1, 2}, broken
    assert all("comes from another run" in line for line in broken), broken
