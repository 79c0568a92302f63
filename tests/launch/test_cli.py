"""The axonhpc command: info, launch (its argument list and its clear errors)."""
import json
import os
import subprocess
import sys

import pytest

from axonhpc.mpiexec import LAUNCHED, launch_command
from support.openmpi import OPENMPI_PYTHON, job_env, needs_openmpi
from support.paths import ROOT

AXONHPC = [sys.executable, "-m", "axonhpc"]


def run(*args, timeout=120):
    return subprocess.run([*AXONHPC, *args], capture_output=True, text=True, timeout=timeout, cwd=ROOT)


def test_info_reports_mpi_and_world():
    out = run("info", "--json")
    assert out.returncode == 0, out.stderr
    facts = json.loads(out.stdout)
    assert facts["mpi_vendor"].split()[0] in ("MPICH", "Open")
    assert facts["thread_level"] in ("single", "funneled", "serialized", "multiple")
    assert facts["world_size"] == 1 and facts["num_nodes"] == 1
    assert "cuda_aware_mpi" in facts and "nccl" in facts


@needs_openmpi
@pytest.mark.timeout(300)
def test_info_under_open_mpi_prints_no_nul_byte(tmp_path):
    """Open MPI's library version string ends in a NUL byte: neither the table nor the JSON may carry it."""
    env = job_env(tmp_path)
    table = subprocess.run([OPENMPI_PYTHON, "-m", "axonhpc", "info"], capture_output=True, timeout=240, env=env,
                           cwd=ROOT)
    assert table.returncode == 0, table.stderr
    line = next(row for row in table.stdout.splitlines() if row.startswith(b"mpi_library"))
    assert b"Open MPI" in line and b"\x00" not in table.stdout, line
    as_json = subprocess.run([OPENMPI_PYTHON, "-m", "axonhpc", "info", "--json"], capture_output=True, text=True,
                             timeout=240, env=env, cwd=ROOT)
    assert as_json.returncode == 0, as_json.stderr
    assert "\\u0000" not in as_json.stdout and "\x00" not in json.loads(as_json.stdout)["mpi_library"]


def test_launch_runs_a_script_on_several_ranks():
    out = run("launch", "-n", "3", "--", "examples/collectives_demo.py", timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "world: 3 ranks" in out.stdout and "all checks passed on every rank" in out.stdout


def _stale_session_folders(base, count=3000):
    """Session folders under ``base`` as a job killed with SIGKILL leaves them, for the next ``count`` process ids
    (made without starting a process, so none of those ids is used up here)."""
    pid_max = int(open("/proc/sys/kernel/pid_max").read())
    last = int(open("/proc/loadavg").read().split()[-1])  # the process id Linux handed out last, to anyone
    for k in range(1, count + 1):
        pid = last + k
        pid = pid if pid < pid_max else 300 + pid - pid_max  # Linux wraps past pid_max to 300
        folder = base / f"ompi.{pid}"
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "pmix.vm.tool").touch()


@needs_openmpi
@pytest.mark.timeout(300)
def test_launch_gives_an_open_mpi_job_a_session_folder_of_its_own(tmp_path):
    """Open MPI keeps a job's session folder at <tmp>/ompi.<pid of mpiexec>; one a killed job left behind makes a
    later mpiexec with that pid fail. With such folders for every next pid, a plain mpiexec fails and a job of
    axonhpc launch runs (in a folder it makes and removes)."""
    env = job_env(tmp_path, TMPDIR=str(tmp_path / "tmp"))  # Open MPI's default place and mkdtemp's
    del env["PRTE_MCA_prte_tmpdir_base"]
    _stale_session_folders(tmp_path / "tmp")
    mpiexec = os.path.join(os.path.dirname(OPENMPI_PYTHON), "mpiexec")
    plain = subprocess.run([mpiexec, "-n", "2", "true"], capture_output=True, text=True, timeout=120, env=env)
    assert plain.returncode != 0 and "listener thread failed to start" in plain.stdout + plain.stderr, plain
    script = tmp_path / "hello.py"
    script.write_text("import axonhpc as ax\nax.init()\nprint('rank', ax.current_world().rank, 'of',"
                      " ax.current_world().world_size)\n")
    out = subprocess.run([OPENMPI_PYTHON, "-m", "axonhpc", "launch", "-n", "2", "--", str(script)],
                         capture_output=True, text=True, timeout=240, env=env, cwd=ROOT)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "rank 0 of 2" in out.stdout and "rank 1 of 2" in out.stdout, out.stdout
    assert [p.name for p in (tmp_path / "tmp").iterdir() if not p.name.startswith("ompi.")] == []  # removed


def test_launch_refuses_bad_input_clearly():
    zero = run("launch", "-n", "0", "--", "examples/collectives_demo.py")
    assert zero.returncode == 2 and "-n must be at least 1, got 0" in zero.stderr
    missing = run("launch", "-n", "2", "--", "no/such/script.py")
    assert missing.returncode == 2 and "script 'no/such/script.py' does not exist" in missing.stderr
    empty = run("launch", "-n", "2")
    assert empty.returncode == 2 and "no script given" in empty.stderr
    bare = run("launch", "-n", "2", "--", "-m")
    assert bare.returncode == 2 and "-m needs a module name" in bare.stderr
    unknown = run("launch", "-n", "2", "--", "-m", "no_such_module_here")
    assert unknown.returncode == 2 and "no module named 'no_such_module_here'" in unknown.stderr


def test_launch_runs_a_module_as_python_m_does():
    out = run("launch", "-n", "2", "--", "-m", "axonhpc", "info", "--json", timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    assert [json.loads(line)["rank"] for line in out.stdout.strip().splitlines()] == [0, 1]


def test_launch_command_is_an_argument_list_with_open_mpi_settings():
    hostile = "$(touch /tmp/pwned); echo 'x'"
    cmd = launch_command("/opt/mpi/bin/mpiexec", "openmpi", 4, "train.py", ["--name", hostile], is_root=True)
    assert cmd[:3] == ["/opt/mpi/bin/mpiexec", "--allow-run-as-root", "--oversubscribe"]
    assert cmd[-2:] == ["--name", hostile]  # passed through untouched, never through a shell
    mpich = launch_command("/x/mpiexec", "mpich", 2, "t.py", [], hosts="a,b")
    assert mpich == ["/x/mpiexec", "-hosts", "a,b", "-n", "2", sys.executable, LAUNCHED, "t.py"]


def test_open_mpi_is_not_told_to_oversubscribe_across_hosts(tmp_path):
    # With --oversubscribe, Open MPI put every rank of `--host host1:2,host2:2 -n 4` on host1 (simulated hosts,
    # tests/launch/test_multinode.py runs the job): across hosts the slots decide.
    from axonhpc.mpiexec import several_hosts

    across = launch_command("mpiexec", "openmpi", 4, "t.py", [], hosts="host1:2,host2:2", environ={})
    assert "--oversubscribe" not in across and across[1:3] == ["--host", "host1:2,host2:2"]
    assert "--oversubscribe" in launch_command("mpiexec", "openmpi", 4, "t.py", [], environ={"SLURM_NNODES": "1"})
    nodefile = tmp_path / "nodes"
    nodefile.write_text("n1\nn1\nn2\nn2\n")
    for env, said in (({"SLURM_JOB_NUM_NODES": "2"}, "a SLURM allocation of 2 nodes"),
                      ({"PBS_NODEFILE": str(nodefile)}, "a PBS allocation of 2 nodes"),
                      ({"LSB_MCPU_HOSTS": "n1 4 n2 4"}, "an LSF allocation of 2 hosts"),
                      ({"PRTE_MCA_prte_default_hostfile": "/etc/hosts.mpi"}, "a default hostfile")):
        assert several_hosts(env).startswith(said), env
        assert "--oversubscribe" not in launch_command("mpiexec", "openmpi", 4, "t.py", [], environ=env)
    assert several_hosts({"LSB_MCPU_HOSTS": "n1 8", "PBS_NODEFILE": str(tmp_path / "absent")}) is None


MPIEXEC = os.path.join(os.path.dirname(sys.executable), "mpiexec")


def test_info_json_under_mpiexec_is_one_object_per_rank_per_line():
    """Every rank runs the command; rank 0 alone prints, one JSON object per line, in rank order."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    out = subprocess.run([MPIEXEC, "-n", "2", sys.executable, "-m", "axonhpc", "info", "--json"],
                         capture_output=True, text=True, timeout=300, cwd=ROOT, env=env)
    assert out.returncode == 0, out.stdout + out.stderr
    lines = out.stdout.strip().splitlines()
    assert len(lines) == 2, out.stdout
    facts = [json.loads(line) for line in lines]
    assert [f["rank"] for f in facts] == [0, 1] and all(f["world_size"] == 2 for f in facts)


def test_launch_with_python_before_the_script_says_to_drop_it():
    for word in ("python", "python3", "/usr/bin/python3.11", sys.executable):
        out = run("launch", "-n", "2", "--", word, "examples/collectives_demo.py")
        assert out.returncode == 2, out.stderr
        assert f"{word!r} is a Python interpreter, not a script" in out.stderr
        assert f"drop {word!r}" in out.stderr and "axonhpc launch -n 2 -- examples/collectives_demo.py" in out.stderr
        assert sys.executable in out.stderr  # the Python the launcher runs


def test_bench_pack_runs_from_the_command_line():
    out = run("bench", "pack", "--help")
    assert out.returncode == 0 and "usage: axonhpc bench pack" in out.stdout, out.stderr
    assert run("bench", "pack", "--bogus").returncode == 2


def test_bench_without_a_name_lists_the_benchmarks_and_the_help_names_them_all():
    import axonhpc.cli as cli

    out = run("bench")
    assert out.returncode == 2 and out.stdout == "", out.stderr
    assert "the following arguments are required: NAME\n" in out.stderr and "rest" not in out.stderr, out.stderr
    assert f"NAME is the benchmark to run, one of {', '.join(sorted(cli.BENCHMARKS))}" in out.stderr, out.stderr
    listed = cli.__doc__.split("axonhpc bench NAME [args]")[1].splitlines()[0]
    assert all(name in listed for name in cli.BENCHMARKS), listed  # the module docstring's list is complete


def _dump(rank, records, reason="collective mismatch"):
    return {"rank": rank, "pid": 1, "reason": reason, "time": 0.0, "records": records}


def _record(seq, op, done=True, t=1.0):
    return {"t": t, "group": "world", "ranks": [0, 1, 2], "seq": seq, "op": op, "dtype": "float64", "shape": [4],
            "reduce": "SUM" if op == "all_reduce" else None, "root": None, "where": None, "done": done}


def test_doctor_names_a_truncated_dump_and_uses_the_others(tmp_path):
    for rank in (0, 1):
        (tmp_path / f"flight-rank{rank:05d}.json").write_text(
            json.dumps(_dump(rank, [_record(0, "all_reduce"), _record(1, "all_reduce", done=False)])))
    whole = json.dumps(_dump(2, [_record(0, "all_reduce"), _record(1, "barrier", done=False)]))
    (tmp_path / "flight-rank00002.json").write_text(whole[:len(whole) // 2])  # cut off mid-write
    out = run("doctor", str(tmp_path))
    assert out.returncode == 0, out.stderr
    broken = str(tmp_path / "flight-rank00002.json")
    assert f"skipped flight dump {broken!r}" in out.stderr and "may be truncated" in out.stderr, out.stderr
    assert "JSONDecodeError" not in out.stderr + out.stdout and "Traceback" not in out.stderr
    assert "flight records of ranks [0, 1]" in out.stdout
    assert "no dump from ranks [2]" in out.stdout, out.stdout
    (tmp_path / "flight-rank00000.json").write_text("{")
    (tmp_path / "flight-rank00001.json").write_text("[]")
    none = run("doctor", str(tmp_path))
    assert none.returncode == 2 and "none of its 3 flight dumps can be used" in none.stderr, none.stderr
    assert "is not an axonhpc flight-recorder dump" in none.stderr
    gone = run("doctor", str(tmp_path / "nowhere"))
    assert gone.returncode == 2 and "does not exist" in gone.stderr and "nowhere" in gone.stderr


def test_doctor_skips_malformed_records_renamed_files_and_a_stale_run(tmp_path):
    # Each crashed the doctor with a traceback (KeyError, TypeError) or was read as this run's: a stale
    # flight-rank00003.json of a 4-rank run was a "divergence" of the 2-rank run beside it (now it is named as
    # another run), a second file claiming rank 0 hid behind it, and a dump's rank outside its own groups ended
    # in "max() arg is empty". These are the names of versions before dumps carried their run's id in the name.
    import time

    def write(name, data):
        (tmp_path / name).write_text(json.dumps(data))

    now = [_record(0, "all_reduce"), _record(1, "barrier", done=False)]
    for rank in (0, 1):
        write(f"flight-rank{rank:05d}.json", dict(_dump(rank, [dict(e, ranks=[0, 1]) for e in now]), run="b" * 16,
                                                  world_size=2, time=20.0))
    write("flight-rank00003.json", dict(_dump(3, [dict(_record(0, "broadcast", t=0.5), ranks=[0, 1, 2, 3])]),
                                        run="a" * 16, world_size=4, time=10.0))
    write("flight-rank00004.json", _dump(4, [{"t": 1.0}]))
    write("flight-rank00005.json", _dump(5, [dict(_record(0, "barrier"), seq="0", ranks=[5])]))
    write("flight-rank00006.json", _dump(0, []))
    write("flight-rank00007.json", _dump(7, [_record(0, "barrier")]))
    out = run("doctor", str(tmp_path))
    assert out.returncode == 0 and "Traceback" not in out.stderr, out.stderr
    assert f"flight records of ranks [0, 1] of run {'b' * 16} in" in out.stdout and "diverged" not in out.stdout, \
        out.stdout
    assert "never reached" not in out.stdout and "no dump from" not in out.stdout, out.stdout
    when = time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(10.0))  # the time the dump records
    assert (f"(the newest of 2 runs in {tmp_path}; the other: run {'a' * 16} (ranks [3] of 4, last written {when}); "
            "read another with --run ID)") in out.stdout, out.stdout
    path = lambda rank: repr(str(tmp_path / f"flight-rank{rank:05d}.json"))  # noqa: E731
    assert path(3) not in out.stderr, out.stderr
    stale = run("doctor", str(tmp_path), "--run", "a" * 16)
    assert stale.returncode == 0 and f"flight records of ranks [3] of run {'a' * 16} in" in stale.stdout, stale.stdout
    assert f"(one of 2 runs in {tmp_path}; the other: run {'b' * 16} (ranks [0, 1] of 2," in stale.stdout, stale.stdout
    assert "no dump from ranks [0, 1, 2]" in stale.stdout, stale.stdout
    for text in (f"skipped flight dump {path(4)}: record 0 has no 'group' field",
                 f"skipped flight dump {path(5)}: record 0 has seq='0', not an integer >= 0",
                 f"skipped flight dump {path(6)} says it is rank 0's; its name says rank 6",
                 f"skipped flight dump {path(7)}: record 0 is a call of group world [0, 1, 2], which rank 7 is not in"):
        assert text in out.stderr, (text, out.stderr)


def test_doctor_reads_old_and_new_names_and_skips_a_dump_filed_under_another_run(tmp_path):
    # A folder after an upgrade: an earlier version's flight-rank<r>.json (its run is the id inside) beside two runs
    # named flight-<run>-rank<r>.json. A file whose name and contents name different runs, or that repeats a rank of
    # its run, is skipped; an id's start that fits two runs is refused, naming both.
    old, new, newer = "0" * 16, "ab" + "1" * 14, "ab" + "2" * 14

    def write(name, rank, run, when, records):
        data = dict(_dump(rank, [dict(e, ranks=[0, 1]) for e in records]), run=run, world_size=2, time=when)
        (tmp_path / name).write_text(json.dumps(data))

    for rank in (0, 1):
        write(f"flight-rank{rank:05d}.json", rank, old, 30.0, [_record(0, "all_reduce", done=rank == 1)])
        write(f"flight-{new}-rank{rank:05d}.json", rank, new, 10.0, [_record(0, "broadcast")])
        write(f"flight-{newer}-rank{rank:05d}.json", rank, newer, 20.0,
              [_record(0, "barrier"), _record(1, "all_reduce", done=False)][:2 - rank])
    write(f"flight-{new}-rank00002.json", 0, newer, 20.0, [_record(0, "barrier")])  # rank 0 of newer, misnamed
    write(f"flight-{newer}-rank1.json", 1, newer, 20.0, [])  # a second dump of newer's rank 1
    out = run("doctor", str(tmp_path))
    assert out.returncode == 0, out.stderr
    assert f"flight records of ranks [0, 1] of run {old} in {tmp_path}:" in out.stdout, out.stdout
    assert f"the newest of 3 runs in {tmp_path}; the others: run {newer} (ranks [0, 1] of 2, " in out.stdout
    assert f"run {new} (ranks [0, 1] of 2, " in out.stdout, out.stdout
    assert "rank 0 was waiting in group world #0: all_reduce" in out.stdout, out.stdout
    misnamed = repr(str(tmp_path / f"flight-{new}-rank00002.json"))
    assert (f"skipped flight dump {misnamed} says it is rank 0's; its name says rank 2") in out.stderr, out.stderr
    second = repr(str(tmp_path / f"flight-{newer}-rank1.json"))
    first = repr(str(tmp_path / f"flight-{newer}-rank00001.json"))
    assert f"skipped flight dump {second} is a second dump of rank 1 of run {newer} (beside {first})" in out.stderr, \
        out.stderr
    chosen = run("doctor", str(tmp_path), "--run", newer)
    assert chosen.returncode == 0 and f"flight records of ranks [0, 1] of run {newer} in" in chosen.stdout
    assert "ranks [1] never reached group world #1, where ranks [0] called all_reduce" in chosen.stdout, chosen.stdout
    both = run("doctor", str(tmp_path), "--run", "ab")
    assert both.returncode == 2 and both.stdout == "", both.stdout
    assert f"run 'ab' is the start of 2 runs' ids in {str(tmp_path)!r}: run {newer} (" in both.stderr, both.stderr
    assert f"; run {new} (" in both.stderr and "(give more of the id)" in both.stderr, both.stderr
    (tmp_path / f"flight-{new}-rank00002.json").write_text(
        json.dumps(dict(_dump(2, [dict(_record(0, "barrier"), ranks=[0, 1, 2])]), run=newer)))
    renamed = run("doctor", str(tmp_path), "--run", new)
    misnamed = repr(str(tmp_path / f"flight-{new}-rank00002.json"))
    assert (f"skipped flight dump {misnamed} says it is run {newer!r}'s; its name says run {new!r} (a renamed or "
            f"copied file?)") in renamed.stderr, renamed.stderr
    assert renamed.returncode == 0 and f"flight records of ranks [0, 1] of run {new} in" in renamed.stdout


SLEEPER = """
import os, time
rank = os.environ.get("PMI_RANK", os.environ.get("OMPI_COMM_WORLD_RANK"))
with open(f"pid-{rank}.txt", "w") as f:
    f.write(str(os.getpid()))
time.sleep(120)
"""


@pytest.mark.timeout(120)
@pytest.mark.parametrize("how", ["SIGTERM", "SIGKILL"])
def test_ending_the_launcher_ends_the_ranks(tmp_path, how):
    import signal
    import time

    script = tmp_path / "sleeper.py"
    script.write_text(SLEEPER)
    launcher = subprocess.Popen([sys.executable, "-m", "axonhpc", "launch", "-n", "2", "--", str(script)],
                                cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                env=dict(os.environ, OMP_NUM_THREADS="1"))
    deadline = time.monotonic() + 60
    while len(list(tmp_path.glob("pid-*.txt"))) < 2 and time.monotonic() < deadline:
        time.sleep(0.1)
    time.sleep(0.2)
    pids = [int(p.read_text()) for p in tmp_path.glob("pid-*.txt")]
    assert len(pids) == 2
    launcher.send_signal(getattr(signal, how))
    launcher.wait(timeout=30)

    def alive(pid):
        try:
            os.kill(pid, 0)
            with open(f"/proc/{pid}/stat") as stat:  # the process may end between the two
                return stat.read().rsplit(")", 1)[1].split()[0] not in "ZX"
        except (ProcessLookupError, FileNotFoundError):
            return False

    deadline = time.monotonic() + 20
    while any(alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    left = [p for p in pids if alive(p)]
    for p in left:
        os.kill(p, signal.SIGKILL)
    assert not left, f"ranks {left} outlived the launcher ({how})"
