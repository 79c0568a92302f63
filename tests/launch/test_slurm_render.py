"""``axonhpc slurm render``: every template renders to valid bash, values are validated,
and no argument can inject shell code.

The rendered scripts are not only syntax-checked: they are run by bash with a
stand-in ``srun`` (drops its options, runs the rest) and a stand-in Python
(records its argv and environment), so the arguments the program would get are
compared with the ones given. Serial and fast: no MPI, no SLURM. Submitting the
templates to a real slurmctld is the job of tests/support/cluster/.
"""
import json
import os
import re
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import given, settings, strategies as st

from axonhpc import cli
from axonhpc.errors import ConfigurationError
from axonhpc.slurm import (MissingValueError, SlurmOptions, TemplateError, TemplateNotFoundError,
                           available_templates, find_template, parse_time, render, render_options, shell_quote,
                           template_dir, template_names)
from support.paths import ROOT

BASH = shutil.which("bash")
TEMPLATES = ["cpu-ddp", "fsdp-hybrid", "gpu", "multinode", "pytest-mpi"]
TRAINING = ["cpu-ddp", "fsdp-hybrid", "gpu", "multinode"]  # run a script; pytest-mpi runs the suite
LAUNCHED = os.path.join(ROOT, "axonhpc", "launched.py")
pytestmark = pytest.mark.skipif(BASH is None, reason="bash is needed to check the rendered scripts")

# Each of these must reach the program as exactly this one argument.
HOSTILE = [
    "'; rm -rf / #",
    "$(touch {pwned})",
    "`touch {pwned}`",
    "a\nb; touch {pwned}",
    "line one\n#SBATCH --nodes=99\ntouch {pwned}",
    '"; touch {pwned}; echo "',
    "it's",
    "back\\slash\\",
    "$HOME ${HOME} $((1+1)) $1 $@",
    "* ? [a-z] ~ ~root",
    "tab\there\rcarriage",
    "\x01\x7f control",
    "",
    " ",
    "--",
    "--nodes=99",
    "{{nodes}} {{?requeue}}",
    "héllo wörld ✓",
    "a & b | c > {pwned} < /dev/null; (d)",
    "!history !!",
]


def hostile_args(tmp_path):
    pwned = str(tmp_path / "PWNED")
    return [a.replace("{pwned}", pwned) for a in HOSTILE], pwned


def cli_render(capsys, *argv):
    """(exit code, stdout, stderr) of ``axonhpc slurm render ARGV`` run in this process."""
    try:
        code = cli.main(["slurm", "render", *argv])
    except SystemExit as exc:  # argparse's own errors
        code = exc.code
    out = capsys.readouterr()
    return code, out.out, out.err


def minimal_options(template):
    """The smallest valid option list for a template."""
    opts = ["--nodes", "1" if template == "cpu-ddp" else "2", "--tasks-per-node", "2"]
    if template == "gpu":
        opts += ["--gpus-per-node", "2"]
    return opts


# -- a stand-in cluster: srun, scontrol and python that only record ---------------------------
@pytest.fixture
def fake_cluster(tmp_path):
    """A bin/ directory with fake srun and scontrol, a fake python, and a runner for rendered scripts."""
    bindir = tmp_path / "bin"
    bindir.mkdir()
    log = tmp_path / "calls.jsonl"

    def write(path, text):
        path.write_text(text)
        path.chmod(path.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)

    # srun: record the options, drop them, run the rest (as srun runs the program on each task).
    write(bindir / "srun", "#!/bin/bash\n"
          'opts=(); while [ $# -gt 0 ] && [[ $1 == -* ]]; do opts+=("$1"); shift; done\n'
          'printf "%s\\n" "${opts[@]}" > "$FAKE_DIR/srun-options"\n'
          'exec "$@"\n')
    write(bindir / "scontrol", '#!/bin/bash\nprintf "%s\\n" "$@" > "$FAKE_DIR/scontrol-args"\n')
    # python: record argv and the environment the job set; optionally send the USR1 notice.
    fake_python = tmp_path / "fake python"  # a space in the interpreter's path, on purpose
    write(fake_python, f"#!{sys.executable}\n"
          "import json, os, signal, sys, time\n"
          "if sys.argv[1] == '-c':  # the template asks where launched.py is: answer as python would\n"
          "    exec(sys.argv[2])\n"
          "    sys.exit(0)\n"
          "keys = ('CUDA_VISIBLE_DEVICES', 'OMP_NUM_THREADS', 'PYTHONUNBUFFERED', 'AXONHPC_TIMEOUT',\n"
          "        'AXONHPC_ABORT_ON_EXCEPTION', 'OPENBLAS_NUM_THREADS')\n"
          f"launched = sys.argv[1] == {LAUNCHED!r}  # the script runs through axonhpc/launched.py\n"
          "argv = sys.argv[2:] if launched else sys.argv[1:]\n"
          f"with open({str(log)!r}, 'a') as f:\n"
          "    f.write(json.dumps({'argv': argv, 'launched': launched,\n"
          "                        'env': {k: os.environ.get(k) for k in keys}}) + '\\n')\n"
          "if os.environ.get('FAKE_NOTICE') == '1' and 'junit_total' not in ' '.join(sys.argv):\n"
          "    os.kill(os.getppid(), signal.SIGUSR1)\n"
          "    time.sleep(0.5)\n"
          "sys.exit(int(os.environ.get('FAKE_EXIT', '0')))\n")
    workdir = tmp_path / "work"
    (workdir / "scripts").mkdir(parents=True)
    (workdir / "scripts" / "mpi_pytest.py").write_text("# stand-in\n")

    class Cluster:
        python = str(fake_python)
        dir = tmp_path

        @staticmethod
        def run(script, **env):
            path = tmp_path / "job.sbatch"
            path.write_text(script)
            full_env = {"PATH": f"{bindir}:/usr/bin:/bin", "HOME": str(tmp_path), "FAKE_DIR": str(tmp_path),
                        "LC_ALL": "C.UTF-8"}
            full_env.update({k: str(v) for k, v in env.items()})
            return subprocess.run([BASH, str(path)], capture_output=True, text=True, cwd=workdir, env=full_env,
                                  timeout=60)

        @staticmethod
        def calls():
            if not log.exists():
                return []
            return [json.loads(line) for line in log.read_text().splitlines()]

        @staticmethod
        def srun_options():
            return (tmp_path / "srun-options").read_text().splitlines()

    return Cluster


# -- the templates ---------------------------------------------------------------------------
def test_the_templates_are_found_beside_the_package():
    assert template_dir() == Path(ROOT) / "slurm"
    assert available_templates() == TEMPLATES


@pytest.mark.parametrize("template", TEMPLATES)
@pytest.mark.parametrize("extra", [
    [],
    ["--requeue", "--time", "01:00:00", "--partition", "debug", "--account", "proj-1", "--cpus-per-task", "2",
     "--job-name", "my.job_1", "--signal-seconds", "300", "--mpi", "pmix", "--log-dir", "logs/x",
     "--chdir", "/tmp", "--collective-timeout", "90"],
], ids=["minimal", "every-option"])
def test_every_template_renders_to_valid_bash(template, extra, capsys, tmp_path):
    code, out, err = cli_render(capsys, template, *minimal_options(template), *extra, "--",
                                "train.py", "--epochs", "3")
    assert code == 0, err
    assert out.startswith("#!/bin/bash\n")
    assert "{{" not in out and "#@" not in out
    path = tmp_path / "job.sbatch"
    path.write_text(out)
    check = subprocess.run([BASH, "-n", str(path)], capture_output=True, text=True)
    assert check.returncode == 0, check.stderr + out
    # What every template promises.
    assert "--kill-on-bad-exit=1" in out
    assert re.search(r"^#SBATCH --output=\S+/%x-%j\.out$", out, re.M)
    assert re.search(r"^#SBATCH --error=\S+/%x-%j\.err$", out, re.M)
    assert re.search(r"^#SBATCH --signal=B:USR1@\d+$", out, re.M)
    assert "export PYTHONUNBUFFERED=1" in out
    assert "export OMP_NUM_THREADS=${SLURM_CPUS_PER_TASK:-1}" in out
    sbatch_lines = [line for line in out.splitlines() if line.startswith("#SBATCH")]
    first_command = next(i for i, line in enumerate(out.splitlines()) if line and not line.startswith("#"))
    assert all(out.splitlines().index(line) < first_command for line in sbatch_lines), "sbatch stops at a command"
    if extra:
        for line in ("--requeue", "--open-mode=append", "--time=01:00:00", "--partition=debug",
                     "--account=proj-1", "--cpus-per-task=2", "--job-name=my.job_1", "--signal=B:USR1@300",
                     "--output=logs/x/%x-%j.out", "--chdir=/tmp"):
            assert f"#SBATCH {line}\n" in out
        assert "--mpi=pmix" in out and "scontrol requeue" in out and "export AXONHPC_TIMEOUT=90\n" in out
    else:
        assert "#SBATCH --no-requeue\n" in out and "scontrol" not in out and "AXONHPC_TIMEOUT" not in out
        assert f"#SBATCH --job-name=axonhpc-{template}\n" in out
        assert "--mpi=pmi2" in out or "launch -n" in out


def test_node_and_task_counts_reach_sbatch_and_srun(capsys):
    code, out, err = cli_render(capsys, "multinode", "--nodes", "3", "--tasks-per-node", "4", "--", "t.py")
    assert code == 0, err
    assert "#SBATCH --nodes=3\n" in out and "#SBATCH --ntasks-per-node=4\n" in out
    assert "srun --kill-on-bad-exit=1 --mpi=pmi2 --nodes=3 --ntasks=12 \\\n" in out
    code, out, err = cli_render(capsys, "gpu", "--nodes", "2", "--tasks-per-node", "4", "--gpus-per-node", "4",
                                "--", "t.py")
    assert code == 0, err
    assert "#SBATCH --gpus-per-node=4\n" in out and "--ntasks=8" in out
    assert "untested" in out.lower()


# -- arguments reach the program unchanged ------------------------------------------------------
@pytest.mark.parametrize("template", TRAINING)
def test_hostile_arguments_arrive_as_single_literal_arguments(template, capsys, tmp_path, fake_cluster):
    args, pwned = hostile_args(tmp_path)
    code, out, err = cli_render(capsys, template, *minimal_options(template), "--python", fake_cluster.python,
                                "--", "my script.py", *args)
    assert code == 0, err
    result = fake_cluster.run(out, SLURM_LOCALID=0)
    assert result.returncode == 0, result.stderr
    calls = fake_cluster.calls()
    assert len(calls) == 1
    assert calls[0]["argv"] == ["my script.py", *args]
    assert calls[0]["launched"], "under srun the script runs through axonhpc/launched.py"
    assert not os.path.exists(pwned), "an argument ran a command"
    assert "--kill-on-bad-exit=1" in fake_cluster.srun_options()
    env = calls[0]["env"]
    assert env["PYTHONUNBUFFERED"] == "1" and env["OMP_NUM_THREADS"] == "1"
    assert env["AXONHPC_ABORT_ON_EXCEPTION"] == "1"


def test_mpiexec_launcher_passes_the_arguments_to_axonhpc_launch(capsys, tmp_path, fake_cluster):
    args, pwned = hostile_args(tmp_path)
    code, out, err = cli_render(capsys, "cpu-ddp", "--nodes", "1", "--tasks-per-node", "3", "--launcher", "mpiexec",
                                "--python", fake_cluster.python, "--", "train.py", *args)
    assert code == 0, err
    assert "srun" not in out.split("set -euo pipefail")[1]
    result = fake_cluster.run(out)
    assert result.returncode == 0, result.stderr
    (call,) = fake_cluster.calls()
    assert call["argv"] == ["-m", "axonhpc", "launch", "-n", "3", "--", "train.py", *args]
    assert not os.path.exists(pwned)


def test_fault_tolerant_launches_with_axonhpc_launch_fault_tolerant(capsys, tmp_path, fake_cluster):
    code, out, err = cli_render(capsys, "cpu-ddp", "--nodes", "1", "--tasks-per-node", "3", "--launcher", "mpiexec",
                                "--fault-tolerant", "--python", fake_cluster.python, "--", "train.py", "--elastic")
    assert code == 0, err
    assert "keeps the others running" in out
    result = fake_cluster.run(out)
    assert result.returncode == 0, result.stderr
    (call,) = fake_cluster.calls()
    assert call["argv"] == ["-m", "axonhpc", "launch", "--fault-tolerant", "-n", "3", "--", "train.py", "--elastic"]


def test_pytest_job_passes_extra_pytest_arguments(capsys, tmp_path, fake_cluster):
    args, pwned = hostile_args(tmp_path)
    code, out, err = cli_render(capsys, "pytest-mpi", "--nodes", "2", "--tasks-per-node", "2",
                                "--python", fake_cluster.python, "--", *args)
    assert code == 0, err
    result = fake_cluster.run(out, SLURM_JOB_ID=77)
    assert result.returncode == 0, result.stderr
    run, total = fake_cluster.calls()
    assert run["argv"] == ["scripts/mpi_pytest.py", "test-logs/slurm-77/mpi-slurm-n4", "-q", "-m", "mpi",
                           "--color=no", "--timeout=300", "--timeout-method=thread", *args]
    assert total["argv"] == ["scripts/junit_total.py", "test-logs/slurm-77"]
    assert not os.path.exists(pwned)
    # No extra arguments at all is fine too.
    code, out, err = cli_render(capsys, "pytest-mpi", "--nodes", "1", "--tasks-per-node", "2")
    assert code == 0, err


def test_pytest_job_fails_when_a_rank_fails_and_shows_its_log(capsys, fake_cluster):
    code, out, err = cli_render(capsys, "pytest-mpi", "--nodes", "1", "--tasks-per-node", "2",
                                "--python", fake_cluster.python)
    logdir = fake_cluster.dir / "work" / "test-logs" / "slurm-5" / "mpi-slurm-n2"
    logdir.mkdir(parents=True)
    (logdir / "rank1.log").write_text("E   assert 1 == 2\n")
    result = fake_cluster.run(out, SLURM_JOB_ID=5, FAKE_EXIT=3)
    assert result.returncode == 3
    assert "rank1.log" in result.stdout and "assert 1 == 2" in result.stdout


def test_exit_status_of_the_step_is_the_job_status(capsys, fake_cluster):
    code, out, err = cli_render(capsys, "multinode", "--nodes", "2", "--tasks-per-node", "1",
                                "--python", fake_cluster.python, "--", "t.py")
    result = fake_cluster.run(out, FAKE_EXIT=7)
    assert result.returncode == 7
    assert "step ended with status 7" in result.stderr


@pytest.mark.parametrize("visible,local_id,expected", [(None, 1, "1"), ("4,5", 1, "5"), ("7", 0, "7")])
def test_gpu_template_binds_one_gpu_per_rank_from_slurm_localid(visible, local_id, expected, capsys, fake_cluster):
    code, out, err = cli_render(capsys, "gpu", "--nodes", "1", "--tasks-per-node", "2", "--gpus-per-node", "2",
                                "--python", fake_cluster.python, "--", "t.py", "--x")
    env = {"SLURM_LOCALID": local_id}
    if visible is not None:
        env["CUDA_VISIBLE_DEVICES"] = visible
    result = fake_cluster.run(out, **env)
    assert result.returncode == 0, result.stderr
    (call,) = fake_cluster.calls()
    assert call["env"]["CUDA_VISIBLE_DEVICES"] == expected
    assert call["argv"] == ["t.py", "--x"]


def test_gpu_template_refuses_a_local_id_beyond_the_visible_gpus(capsys, fake_cluster):
    code, out, err = cli_render(capsys, "gpu", "--nodes", "1", "--tasks-per-node", "2", "--gpus-per-node", "2",
                                "--python", fake_cluster.python, "--", "t.py")
    result = fake_cluster.run(out, SLURM_LOCALID=2, CUDA_VISIBLE_DEVICES="0,1")
    assert result.returncode == 1
    assert "local id 2 but only 2 GPU(s)" in result.stderr
    assert fake_cluster.calls() == []


# -- preemption, requeue and resume --------------------------------------------------------------
@pytest.mark.parametrize("template", TRAINING)
def test_requeue_passes_resume_and_requeues_on_the_usr1_notice(template, capsys, fake_cluster):
    code, out, err = cli_render(capsys, template, *minimal_options(template), "--requeue", "--time", "00:10:00",
                                "--python", fake_cluster.python, "--", "train.py", "--epochs", "5")
    assert code == 0, err
    assert "#SBATCH --requeue\n" in out and "#SBATCH --signal=B:USR1@120\n" in out
    result = fake_cluster.run(out, SLURM_JOB_ID=4242, SLURM_LOCALID=0, FAKE_NOTICE=1)
    assert result.returncode == 0, result.stderr
    (call,) = fake_cluster.calls()
    assert call["argv"] == ["train.py", "--epochs", "5", "--resume"]
    assert "got SIGUSR1" in result.stderr
    assert (fake_cluster.dir / "scontrol-args").read_text().split() == ["requeue", "4242"]


def test_without_requeue_the_notice_is_only_logged(capsys, fake_cluster):
    code, out, err = cli_render(capsys, "multinode", "--nodes", "2", "--tasks-per-node", "1",
                                "--python", fake_cluster.python, "--", "train.py")
    result = fake_cluster.run(out, FAKE_NOTICE=1)
    assert result.returncode == 0, result.stderr
    assert "got SIGUSR1" in result.stderr
    assert not (fake_cluster.dir / "scontrol-args").exists()
    (call,) = fake_cluster.calls()
    assert call["argv"] == ["train.py"]


@pytest.mark.parametrize("flags,resume", [(["--requeue"], True), (["--requeue", "--no-resume"], False),
                                          (["--resume"], True), ([], False)])
def test_resume_follows_requeue_unless_told(flags, resume, capsys, fake_cluster):
    code, out, err = cli_render(capsys, "multinode", "--nodes", "2", "--tasks-per-node", "1", *flags,
                                "--python", fake_cluster.python, "--", "train.py")
    assert code == 0, err
    result = fake_cluster.run(out)
    assert result.returncode == 0, result.stderr
    (call,) = fake_cluster.calls()
    assert call["argv"] == ["train.py"] + (["--resume"] if resume else [])


def test_train_digits_supports_the_resume_convention():
    with open(os.path.join(ROOT, "examples", "train_digits.py")) as f:
        assert 'add_argument("--resume"' in f.read()


def test_default_notice_is_at_most_half_the_time_limit(capsys):
    code, out, err = cli_render(capsys, "multinode", "--nodes", "1", "--tasks-per-node", "1", "--time", "00:01:00",
                                "--", "t.py")
    assert code == 0, err
    assert "#SBATCH --signal=B:USR1@30\n" in out


def test_collective_timeout_and_cpus_reach_the_job(capsys, fake_cluster):
    code, out, err = cli_render(capsys, "multinode", "--nodes", "1", "--tasks-per-node", "1", "--cpus-per-task",
                                "4", "--collective-timeout", "2.5", "--python", fake_cluster.python, "--", "t.py")
    result = fake_cluster.run(out, SLURM_CPUS_PER_TASK=4)
    assert result.returncode == 0, result.stderr
    (call,) = fake_cluster.calls()
    assert call["env"]["AXONHPC_TIMEOUT"] == "2.5" and call["env"]["OMP_NUM_THREADS"] == "4"
    assert "--cpus-per-task=4" in fake_cluster.srun_options()


# -- refusing bad values ---------------------------------------------------------------------------
BAD = [
    (["--nodes", "0"], "--nodes must be a positive integer, got '0'"),
    (["--nodes", "-2"], "'-2'"),
    (["--nodes", "two"], "'two'"),
    (["--nodes", "\u00b2"], "'\u00b2'"),
    (["--nodes", " 2"], "' 2'"),
    (["--tasks-per-node", "0"], "--tasks-per-node must be a positive integer, got '0'"),
    (["--tasks-per-node", "1.5"], "'1.5'"),
    (["--time", "abc"], "--time 'abc' is not a SLURM time limit"),
    (["--time", "01:61:00"], "'01:61:00'"),
    (["--time", "00:00:00"], "'00:00:00'"),
    (["--time", "1:00:00; touch x"], "'1:00:00; touch x'"),
    (["--job-name", "my job"], "--job-name 'my job' is refused"),
    (["--job-name", "it's"], "\"it's\""),
    (["--job-name", "a\nb"], "'a\\nb'"),
    (["--job-name", "$(touch x)"], "'$(touch x)'"),
    (["--job-name", "`id`"], "'`id`'"),
    (["--job-name", ""], "--job-name ''"),
    (["--partition", "debug batch"], "--partition 'debug batch' is refused"),
    (["--partition", "a,"], "'a,'"),
    (["--account", "x\"y"], "--account 'x\"y' is refused"),
    (["--signal-seconds", "0"], "--signal-seconds must be a positive integer"),
    (["--signal-seconds", "70000"], "from 1 to 65535, got '70000'"),
    (["--signal-seconds", "600", "--time", "00:05:00"], "--signal-seconds 600 must be shorter than the time limit"),
    (["--mpi", "none"], "--mpi 'none' is not one of pmi2, pmix"),
    (["--log-dir", "my logs"], "--log-dir 'my logs' is refused"),
    (["--chdir", "$HOME"], "--chdir '$HOME' is refused"),
    (["--collective-timeout", "-1"], "--collective-timeout must be a positive number of seconds, got '-1'"),
    (["--collective-timeout", "nan"], "got 'nan'"),
    (["--gpus-per-node", "0"], "--gpus-per-node must be a positive integer, got '0'"),
]


@pytest.mark.parametrize("bad,message", BAD, ids=[" ".join(b).replace("\n", "\\n") for b, _ in BAD])
def test_bad_values_are_refused_with_exit_2_naming_the_value(bad, message, capsys):
    opts = dict(zip(["--nodes", "--tasks-per-node"], ["2", "2"]))
    extra = []
    for flag, value in zip(bad[::2], bad[1::2]):
        if flag in opts:
            opts[flag] = value
        else:
            extra += [flag, value]
    argv = [x for kv in opts.items() for x in kv] + extra
    code, out, err = cli_render(capsys, "multinode", *argv, "--", "t.py")
    assert code == 2
    assert out == ""
    assert message in err, err
    assert err.startswith("axonhpc slurm render: ")


def test_exit_code_and_message_from_the_real_command():
    cmd = [sys.executable, "-m", "axonhpc", "slurm", "render", "cpu-ddp", "--nodes", "1", "--tasks-per-node", "2",
           "--job-name", "x'; touch /tmp/pwned #", "--", "t.py"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert out.returncode == 2 and out.stdout == ""
    assert "--job-name \"x'; touch /tmp/pwned #\" is refused" in out.stderr
    ok = subprocess.run(cmd[:-4] + ["--", "t.py", "$(id)"], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert ok.returncode == 0, ok.stderr
    assert "t.py '$(id)'" in ok.stdout


@pytest.mark.parametrize("template,argv,message", [
    ("gpu", ["--nodes", "1", "--tasks-per-node", "2", "--", "t.py"], "template 'gpu' needs --gpus-per-node"),
    ("gpu", ["--nodes", "1", "--tasks-per-node", "2", "--gpus-per-node", "4", "--", "t.py"],
     "requires --tasks-per-node == --gpus-per-node (one rank per GPU); got --tasks-per-node 2, --gpus-per-node 4"),
    ("cpu-ddp", ["--nodes", "2", "--tasks-per-node", "2", "--", "t.py"], "requires --nodes == 1"),
    ("cpu-ddp", ["--nodes", "1", "--tasks-per-node", "2", "--gpus-per-node", "2", "--", "t.py"],
     "template 'cpu-ddp' does not use --gpus-per-node"),
    ("multinode", ["--nodes", "1", "--tasks-per-node", "2", "--launcher", "mpiexec", "--", "t.py"],
     "template 'multinode' does not use --launcher"),
    ("pytest-mpi", ["--nodes", "1", "--tasks-per-node", "2", "--resume"],
     "template 'pytest-mpi' does not use --resume"),
    ("multinode", ["--nodes", "1", "--tasks-per-node", "2"], "template 'multinode' runs a program: give it after --"),
    ("cpu-ddp", ["--nodes", "1", "--tasks-per-node", "2", "--launcher", "ssh", "--", "t.py"],
     "--launcher 'ssh' is not one of srun, mpiexec"),
    ("cpu-ddp", ["--nodes", "1", "--tasks-per-node", "2", "--fault-tolerant", "--", "t.py"],
     "--fault-tolerant needs --launcher mpiexec (got srun): srun ends the whole step when a task dies"),
    ("cpu-ddp", ["--nodes", "1", "--tasks-per-node", "2", "--launcher", "mpiexec", "--mpi", "pmix", "--", "t.py"],
     "--mpi pmix chooses srun's MPI plugin, and --launcher mpiexec starts the ranks without srun: drop --mpi"),
])
def test_options_that_do_not_fit_the_template_are_refused(template, argv, message, capsys):
    code, out, err = cli_render(capsys, template, *argv)
    assert code == 2 and out == ""
    assert message in err, err


def test_required_options_and_stray_words_are_argparse_errors(capsys):
    code, out, err = cli_render(capsys, "multinode", "--tasks-per-node", "2", "--", "t.py")
    assert code == 2 and "--nodes" in err
    code, out, err = cli_render(capsys, "multinode", "--nodes", "1", "--tasks-per-node", "2", "t.py")
    assert code == 2 and "unrecognized arguments: t.py" in err


def test_words_after_the_first_double_dash_are_all_the_programs(capsys, fake_cluster):
    code, out, err = cli_render(capsys, "multinode", "--nodes", "1", "--tasks-per-node", "1",
                                "--python", fake_cluster.python, "--", "t.py", "--", "--nodes", "9", "--requeue")
    assert code == 0, err
    assert "#SBATCH --nodes=1\n" in out and "--no-requeue" in out
    result = fake_cluster.run(out)
    assert result.returncode == 0, result.stderr
    assert fake_cluster.calls()[0]["argv"] == ["t.py", "--", "--nodes", "9", "--requeue"]


# -- finding templates -------------------------------------------------------------------------------
def test_unknown_template_lists_the_available_ones(capsys):
    code, out, err = cli_render(capsys, "nope", "--nodes", "1", "--tasks-per-node", "1", "--", "t.py")
    assert code == 2 and out == ""
    assert "no SLURM template 'nope'; available: cpu-ddp, fsdp-hybrid, gpu, multinode, pytest-mpi" in err
    code, out, err = cli_render(capsys, "no/such/file.sbatch", "--nodes", "1", "--tasks-per-node", "1", "--", "t")
    assert code == 2 and "available: cpu-ddp" in err


def test_templates_by_name_with_suffix_and_by_path(capsys, tmp_path):
    assert find_template("gpu") == find_template("gpu.sbatch") == template_dir() / "gpu.sbatch"
    with pytest.raises(TemplateNotFoundError, match="available: cpu-ddp"):
        find_template("../slurm")
    custom = tmp_path / "mine.sbatch"
    custom.write_text("#!/bin/bash\n#SBATCH --job-name={{job_name}}\n#SBATCH --nodes={{nodes}}\n"
                      "#SBATCH --ntasks-per-node={{tasks_per_node}}\nsrun {{python}} {{command}}\n")
    code, out, err = cli_render(capsys, str(custom), "--nodes", "2", "--tasks-per-node", "3", "--python", "py",
                                "--", "a b")
    assert code == 0, err
    assert out == ("#!/bin/bash\n#SBATCH --job-name=axonhpc-mine\n#SBATCH --nodes=2\n"
                   "#SBATCH --ntasks-per-node=3\nsrun py 'a b'\n")
    custom.write_text("#!/bin/bash\necho {{nodse}}\n")
    code, out, err = cli_render(capsys, str(custom), "--nodes", "2", "--tasks-per-node", "3")
    assert code == 2 and "unknown option(s) nodse" in err


def test_help_lists_the_templates(capsys):
    with pytest.raises(SystemExit) as exc:
        cli.main(["slurm", "render", "--help"])
    assert exc.value.code == 0
    assert "templates: cpu-ddp, fsdp-hybrid, gpu, multinode, pytest-mpi" in capsys.readouterr().out


# -- the pure rendering functions ---------------------------------------------------------------------
def test_render_fills_placeholders_guards_and_checks():
    text = ("a={{a}}\n{{?flag}}flag on\n{{!flag}}flag off\n{{?mode=x}}mode x\n{{!mode=x}}mode not x\n"
            "{{?a}}{{!flag}}chained {{a}}\n#@ a note mentioning {{anything}}\n#@ require a >= 2: big enough\nend")
    assert render(text, a="3", flag=True, mode="x") == "a=3\nflag on\nmode x\nend"
    assert render(text, a=2, flag=False, mode="y") == "a=2\nflag off\nmode not x\nchained 2\nend"
    with pytest.raises(TemplateError, match=r"requires \{\{a\}\} >= 2 \(big enough\); got \{\{a\}\} 1"):
        render(text, a=1, flag=False, mode="y")
    assert template_names(text) == {"a", "flag", "mode"}


def test_render_is_single_pass_and_refuses_what_could_break_lines():
    assert render("x {{a}} {{b}}", a="{{b}}", b="B") == "x {{b}} B"
    with pytest.raises(TemplateError, match="line break"):
        render("# {{a}}", a="x\ntouch pwned")
    with pytest.raises(MissingValueError) as exc:
        render("{{a}}", a=None)
    assert exc.value.name == "a"
    with pytest.raises(TemplateError, match="is a flag"):
        render("{{a}}", a=True)
    with pytest.raises(TemplateError, match="unknown option"):
        render("{{a}}")
    with pytest.raises(TemplateError, match="line 2: '{{ a}}' is not a placeholder"):
        render("ok\n{{ a}}", a="1")
    with pytest.raises(TemplateError, match=re.escape("line 1: '{{?a}}' is not a placeholder")):
        render("x {{?a}}", a="1")
    with pytest.raises(TemplateError, match="cannot read"):
        template_names("#@ require a ~ 2")


def test_options_record_validates_and_quotes():
    options = SlurmOptions(nodes="2", tasks_per_node=4, time="1-02:03:04", command=("t.py", "a b", "x\ny"),
                           python="/opt/my python/bin/python3")
    assert options.nodes == 2 and options.ntasks == 8
    values = options.placeholders("multinode")
    assert values["command"] == "t.py 'a b' $'x\\ny'"
    assert values["python"] == "'/opt/my python/bin/python3'"
    assert values["job_name"] == "axonhpc-multinode" and values["mpi"] == "pmi2" and values["resume"] is False
    assert options.given() == {"time", "command", "python"}
    with pytest.raises(ConfigurationError, match="--nodes must be a positive integer, got True"):
        SlurmOptions(nodes=True, tasks_per_node=1)
    with pytest.raises(ConfigurationError, match="NUL byte"):
        SlurmOptions(nodes=1, tasks_per_node=1, command=("a\x00b",))
    with pytest.raises(TemplateError, match="does not use --account"):
        render_options("{{nodes}} {{tasks_per_node}}", SlurmOptions(nodes=1, tasks_per_node=1, account="a"))


@pytest.mark.parametrize("text,seconds", [("90", 5400), ("10:30", 630), ("01:00:00", 3600), ("2-0", 172800),
                                          ("1-01:01", 90060), ("0-00:00:01", 1), ("100:00:00", 360000)])
def test_parse_time_reads_slurm_time_limits(text, seconds):
    assert parse_time(text) == seconds


@pytest.mark.parametrize("text", ["", "abc", "1:2:3:4", "00:60", "1-24:00:00", "0", "-1", "1h", " 10", "１０"])
def test_parse_time_refuses_other_forms(text):
    with pytest.raises(ConfigurationError, match="not a SLURM time limit"):
        parse_time(text)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.text(alphabet=st.characters(blacklist_characters="\x00", blacklist_categories=("Cs",))),
                max_size=4))
def test_shell_quote_round_trips_through_bash(words):
    quoted = [shell_quote(w) for w in words]
    assert all("\n" not in q and "\r" not in q for q in quoted)
    script = "printf '%s\\0' " + " ".join(quoted) if words else "true"
    out = subprocess.run([BASH, "-c", script], capture_output=True, env={"LC_ALL": "C.UTF-8", "PATH": "/usr/bin:/bin"},
                         timeout=10)
    assert out.returncode == 0, out.stderr
    got = out.stdout.split(b"\0")[:-1] if words else []
    assert got == [w.encode("utf-8", "surrogateescape") for w in words]


def test_every_script_a_template_tells_you_to_render_with_exists():
    """The "Render it" lines of slurm/*.sbatch name real scripts of this repository (issue 18)."""
    named = []
    for path in sorted(Path(ROOT, "slurm").glob("*.sbatch")):
        for line in path.read_text().splitlines():
            if line.startswith("#@") and " -- " in line:
                script = line.split(" -- ", 1)[1].split()[0]
                if script.endswith(".py"):
                    named.append((path.name, script))
    assert ("fsdp-hybrid.sbatch", "examples/train_fsdp.py") in named, named
    missing = [(template, script) for template, script in named if not os.path.isfile(os.path.join(ROOT, script))]
    assert not missing, f"templates name scripts that do not exist: {missing}"
