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
    from axonhpc.observe.doctor import find_runs

    def body(world):
        for _ in range(2):
            ax.all_reduce(np.ones(2))
        ax.broadcast(np.ones(3), src=0)
        ax.barrier()  # every thread has recorded all three before any reads: a shared buffer would interleave
        mine = flight.records(world.rank)[-4:-1]
        return [e["op"] for e in mine], mine[-1]["root"], world.run_id

    before = ax.settings.flight_dir
    ax.settings.flight_dir = str(tmp_path)
    try:
        earlier = ax.run_local(body, world_size=5)[0][2]
        results = ax.run_local(body, world_size=3)
        run = results[0][2]
        assert results == [(["all_reduce", "all_reduce", "broadcast"], 0, run)] * 3
        flight.dump("test")
    finally:
        ax.settings.flight_dir = before
    # Ranks 3 and 4, which only the earlier 5-rank world had, dump that world's records under its run id
    # (ranks of worlds before it, in other tests of this process, theirs): the doctor reads this world's
    # three, the newest run, though all were written at once.
    broken = []
    assert set(load_dumps(str(tmp_path), broken)) == {0, 1, 2} and broken == [], broken
    runs = find_runs(str(tmp_path))
    assert runs[0].id == run and sorted(runs[0].dumps) == [0, 1, 2], [r.describe() for r in runs]
    stale = {r.id: sorted(r.dumps) for r in runs[1:]}
    assert {3, 4} <= set(stale[earlier]) and not {0, 1, 2} & {k for ks in stale.values() for k in ks}, stale
    assert sorted(load_dumps(str(tmp_path), run=earlier)) == stale[earlier]


# Both ranks time out (rank 0 waits in an all-reduce of the world, rank 1 in one of another group), dump and say
# so; each leaves once the other has too (mpiexec ends a job's other ranks when one exits with an error), without
# MPI's finalize (where it could wait for the other's unmatched call). argv[1] good all-reduces come first, so the
# two jobs' dumps differ in where the ranks parted.
TWO_TIMEOUTS = """
import os, sys, time
import numpy as np
import axonhpc as ax
from axonhpc.errors import CollectiveTimeoutError

world = ax.init(timeout=1.5)
sub = world.new_group([0, 1], name="sub")
x = np.ones(4)
for _ in range(int(sys.argv[1])):
    ax.all_reduce(x)
try:
    if world.rank == 1:
        ax.all_reduce(np.ones(3), group=sub)
    else:
        ax.all_reduce(x)
except CollectiveTimeoutError:
    print(f"run {world.run_id} rank {world.rank} timed out", flush=True)
    open(f"timed-out-{world.rank}", "w").close()
    deadline = time.monotonic() + 30
    while not os.path.exists(f"timed-out-{1 - world.rank}") and time.monotonic() < deadline:
        time.sleep(0.05)
    os._exit(3)
print(f"rank {world.rank} did not time out", flush=True)
"""


def _two_timeouts(folder, flight_dir, good_calls):
    """Run the job above on 2 ranks from ``folder``, dumping to ``flight_dir``; its run id."""
    folder.mkdir()
    script = folder / "job.py"
    script.write_text(TWO_TIMEOUTS)
    env = dict(_env(flight_dir), AXONHPC_ABORT_ON_EXCEPTION="0")
    out = subprocess.run(["timeout", "-k", "5", "60", MPIEXEC, "-n", "2", sys.executable, str(script), str(good_calls)],
                         capture_output=True, text=True, cwd=folder, env=env)
    text = out.stdout + out.stderr
    runs = set(re.findall(r"^run ([0-9a-f]{16}) rank \d timed out$", out.stdout, re.M))
    assert out.returncode not in (0, 124) and len(runs) == 1, text[-3000:]
    assert sorted(re.findall(r"rank (\d) timed out", out.stdout)) == ["0", "1"], text[-3000:]
    return runs.pop()


def _doctor(flight_dir, *args):
    return subprocess.run(["timeout", "-k", "5", "60", sys.executable, "-m", "axonhpc", "doctor", str(flight_dir),
                           *args], capture_output=True, text=True)


@pytest.mark.timeout(240)
def test_two_jobs_sharing_a_flight_folder_keep_their_dumps_and_the_doctor_tells_them_apart(tmp_path):
    # The dumps were flight-rank<r>.json: the second job's replaced the first's, and the doctor could only
    # read the second.
    flight_dir = tmp_path / "flight"
    first = _two_timeouts(tmp_path / "a", flight_dir, 1)
    second = _two_timeouts(tmp_path / "b", flight_dir, 3)
    assert first != second
    names = sorted(p.name for p in flight_dir.iterdir())
    assert names == sorted(f"flight-{run}-rank{r:05d}.json" for run in (first, second) for r in (0, 1)), names
    for run, good in ((first, 1), (second, 3)):
        dumps = load_dumps(str(flight_dir), run=run)
        assert sorted(dumps) == [0, 1] and {d["run"] for d in dumps.values()} == {run}, dumps
        last = [(e["group"], e["seq"], e["done"]) for e in (dumps[r]["records"][-1] for r in (0, 1))]
        assert last == [("world", good, False), ("sub", 0, False)], last
        assert [e["seq"] for e in dumps[1]["records"] if e["group"] == "world"] == list(range(good)), dumps[1]
        assert all(d["reason"].startswith("timeout in") for d in dumps.values()), dumps

    newest = _doctor(flight_dir)
    assert newest.returncode == 0, newest.stderr
    header, note = newest.stdout.splitlines()[:2]
    assert header == f"flight records of ranks [0, 1] of run {second} in {flight_dir}:", newest.stdout
    assert f"the newest of 2 runs in {flight_dir}" in note and f"run {first} (ranks [0, 1] of 2" in note, note
    assert "--run ID" in note, note
    for run, good in ((first, 1), (second, 3)):
        out = newest if run == second else _doctor(flight_dir, "--run", run)
        assert out.returncode == 0 and out.stderr == "", out.stderr
        assert f"of run {run} in" in out.stdout, out.stdout
        assert (f"ranks [1] never reached group world #{good}, where ranks [0] called all_reduce float64 (4,) "
                "op=SUM") in out.stdout, out.stdout
        assert f"rank 0 was waiting in group world #{good}: all_reduce float64 (4,) op=SUM" in out.stdout, out.stdout
        assert "rank 1 was waiting in group sub #0: all_reduce float64 (3,) op=SUM" in out.stdout, out.stdout
        assert "no dump from" not in out.stdout, out.stdout
    by_prefix = _doctor(flight_dir, "--run", first[:6])
    assert by_prefix.returncode == 0 and f"of run {first} in" in by_prefix.stdout, by_prefix.stdout + by_prefix.stderr

    unknown = _doctor(flight_dir, "--run", "feedface")
    assert unknown.returncode == 2 and unknown.stdout == "", unknown.stdout
    assert f"no run 'feedface' in {str(flight_dir)!r}; its runs:" in unknown.stderr, unknown.stderr
    assert first in unknown.stderr and second in unknown.stderr, unknown.stderr
