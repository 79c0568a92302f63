"""scripts/gpu-check.sh where it can be checked without a GPU: its syntax, its refusals, its plan.

On a node without a GPU it must stop at once saying "no GPU found" (never
pass silently); ``--dry-run --gpus N --cuda X.Y`` prints what it would run
on such a node, which is how its choices (the extra for the driver, the
two-rank runs for one GPU and for several) are tested here.
"""
import ctypes
import importlib
import os
import shutil
import subprocess
import sys

import pytest

from support.paths import ROOT

SCRIPT = os.path.join(ROOT, "scripts", "gpu-check.sh")


def check(*args, python=None, timeout=120):
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHON", "AXONHPC_VENV", "AXONHPC_GPU_LOGS")}
    if python:
        env["PYTHON"] = python
    return subprocess.run(["bash", SCRIPT, *args], capture_output=True, text=True, timeout=timeout, cwd=ROOT,
                          env=env)


def _gpu_here():
    if shutil.which("nvidia-smi"):
        return True
    try:
        ctypes.CDLL("libcuda.so.1")
    except OSError:
        return False
    return True


def summary(out):
    """{part: (verdict, detail)} from the summary block."""
    lines = out.split("== gpu-check summary\n", 1)[1].splitlines()
    parts = {}
    for line in lines:
        words = line.split(None, 2)
        if len(words) >= 2 and words[0] in ("PASS", "FAIL", "SKIP", "PLAN"):
            parts[words[1]] = (words[0], words[2] if len(words) > 2 else "")
    return parts


def test_the_script_parses():
    out = subprocess.run(["bash", "-n", SCRIPT], capture_output=True, text=True, timeout=30)
    assert out.returncode == 0, out.stderr


def test_help_is_the_whole_header_comment():
    out = check("--help")
    header = open(SCRIPT).read().split("\nset -uo pipefail")[0].splitlines()[1:]
    assert out.returncode == 0 and out.stdout.splitlines() == [line[2:] for line in header], out.stdout
    assert out.stdout.rstrip().endswith("test-logs/gpu-check/ (AXONHPC_GPU_LOGS).") and "  gpt " in out.stdout


def test_without_a_gpu_it_says_so_and_fails():
    if _gpu_here():
        pytest.skip("this machine has a GPU driver: run scripts/gpu-check.sh itself")
    for python in (None, sys.executable):
        out = check(python=python)
        assert out.returncode == 2, out.stdout + out.stderr
        assert "gpu-check: no GPU found (nvidia-smi: not found; " in out.stderr
        assert "libcuda.so.1" in out.stderr and "run this on a GPU node" in out.stderr
        assert "== gpu-check summary" not in out.stdout  # nothing was set up or run


def test_bad_arguments_are_refused_with_the_value():
    cases = [
        (("--frobnicate",), "unknown argument '--frobnicate'"),
        (("--dry-run", "--gpus", "two"), "--gpus takes a number of GPUs, got 'two'"),
        (("--dry-run", "--cuda", "13"), "--cuda takes a CUDA version such as 13.0, got '13'"),
        (("--gpus", "2"), "--gpus and --cuda describe a node for --dry-run only"),
        (("--dry-run", "--parts", "train,tests"), "--parts: unknown part 'tests'; the parts are: info, gpu-1rank, "
                                                  "gpu-2shared, gpu-2nccl, train, bench, step, step-unfused, gpt"),
        (("--dry-run", "--parts", ","), "--parts takes a comma list of parts, got ','"),
    ]
    for args, message in cases:
        out = check(*args)
        assert out.returncode == 2 and message in out.stderr, (args, out.stderr)
    missing = check("--dry-run", "--gpus", "1", python="/no/such/python")
    assert missing.returncode == 2 and "PYTHON=/no/such/python is not an executable" in missing.stderr


def test_plan_for_one_gpu_shares_it_and_skips_nccl_between_ranks():
    out = check("--dry-run", "--gpus", "1", "--cuda", "13.0")
    assert out.returncode == 0, out.stdout + out.stderr
    parts = summary(out.stdout)
    assert list(parts) == ["setup", "build", "info", "gpu-1rank", "gpu-2shared", "gpu-2nccl", "train", "bench",
                           "step", "step-unfused", "gpt"]
    assert parts["gpu-2nccl"] == ("SKIP", "one GPU: NCCL refuses two ranks on one GPU, so NCCL between ranks "
                                          "needs a node with 2+ GPUs")
    plan = out.stdout
    if "cupy already imports" not in parts["setup"][1]:
        assert "AXONHPC_EXTRAS=test,bf16,bench,examples,gpu-cuda13 bash scripts/setup-env.sh" in plan
    assert "-m pytest -q -m gpu --with-mpi" in plan
    assert "env CUDA_VISIBLE_DEVICES=0 timeout -k 10 900 " in plan and "-m 'gpu and mpi'" in plan
    assert "examples/train_digits.py --device cuda --epochs 20 --min-accuracy 0.95" in plan
    assert "-m axonhpc bench allreduce --device gpu" in plan
    assert "timeout -k 10 900 " in plan and "-m axonhpc bench step --device cuda" in plan
    assert "bench step --device cuda --precisions fp32,tf32 --no-fused" in plan
    every_mpiexec = [line for line in plan.splitlines() if "mpiexec" in line]
    assert len(every_mpiexec) == 3 and all("timeout -k 10 900 " in line for line in every_mpiexec)


def test_parts_runs_only_the_parts_named_after_setup_and_build():
    out = check("--dry-run", "--gpus", "2", "--cuda", "13.0", "--parts", "step,gpu-2nccl")
    assert out.returncode == 0, out.stdout + out.stderr
    assert list(summary(out.stdout)) == ["setup", "build", "gpu-2nccl", "step"]  # in the script's order
    assert "bench step --device cuda" in out.stdout and "--no-fused" not in out.stdout
    assert "train_digits" not in out.stdout and "-m pytest -q -m gpu" not in out.stdout


def test_plan_for_two_gpus_adds_the_nccl_run_and_a_cuda_12_driver_gets_the_cuda_12_extra():
    out = check("--dry-run", "--gpus", "2", "--cuda", "12.4")
    assert out.returncode == 0, out.stdout + out.stderr
    parts = summary(out.stdout)
    assert parts["gpu-2nccl"][0] == "PLAN"
    assert "scripts/mpi_pytest.py test-logs/gpu-check/gpu-2nccl" in out.stdout
    if "cupy already imports" not in parts["setup"][1]:
        assert "gpu-cuda12 bash scripts/setup-env.sh" in out.stdout


def test_a_driver_older_than_cuda_12_and_a_python_without_cupy_fail_the_set_up():
    old = check("--dry-run", "--gpus", "1", "--cuda", "11.8")
    assert old.returncode == 1
    assert summary(old.stdout)["setup"] == ("FAIL", "the driver supports CUDA 11.8; the GPU extras need a CUDA 12 "
                                                    "or 13 driver (update the driver)")
    given = check("--dry-run", "--gpus", "1", "--cuda", "13.0", python=sys.executable)
    verdict, detail = summary(given.stdout)["setup"]
    try:
        importlib.import_module("cupy")
    except ImportError:
        assert given.returncode == 1 and verdict == "FAIL"
        assert detail.startswith(f"{sys.executable} lacks: cupy") and "axonhpc[gpu-cuda13,test]" in detail
    else:
        assert verdict == "PASS" and "nothing installed" in detail
    assert f"{sys.executable} setup.py -q build_ext --inplace" in given.stdout  # a given python builds in place


def _functions(*names):
    """The script's own bash functions of these names (from the name to the first '}' line, or one line)."""
    with open(SCRIPT) as f:
        lines = f.read().splitlines()
    out = []
    for name in names:
        start = next(i for i, line in enumerate(lines) if line.startswith(f"{name}() {{"))
        end = start if lines[start].endswith("; }") else next(i for i in range(start, len(lines)) if lines[i] == "}")
        out += lines[start:end + 1]
    return "\n".join(out)


def test_each_tests_line_counts_from_the_junit_report_with_the_skip_reasons(tmp_path):
    report = tmp_path / "junit.xml"
    share = "NCCL needs one GPU per rank: ranks [0, 1] share cuda:0"
    report.write_text(
        '<?xml version="1.0" encoding="utf-8"?><testsuites>'
        '<testsuite name="pytest" errors="1" failures="1" skipped="3" tests="8">'
        '<testcase classname="t" name="a"/><testcase classname="t" name="b"/><testcase classname="t" name="c"/>'
        f'<testcase classname="t" name="d"><skipped type="pytest.skip" message="{share}">x</skipped></testcase>'
        f'<testcase classname="t" name="e"><skipped type="pytest.skip" message="{share}">x</skipped></testcase>'
        '<testcase classname="t" name="f"><skipped type="pytest.skip" message="needs 3 ranks">x</skipped></testcase>'
        '<testcase classname="t" name="g"><failure message="boom">x</failure></testcase>'
        '<testcase classname="t" name="h"><error message="fixture">x</error></testcase>'
        '</testsuite></testsuites>')
    empty = tmp_path / "empty.xml"
    empty.write_text('<testsuites><testsuite tests="2" skipped="2" failures="0" errors="0"/></testsuites>')
    script = (f"PY={sys.executable} DRY=0 status=0 SUMMARY=()\n{_functions('record', 'counts', 'verdict')}\n"
              f"verdict gpu-1rank 0 {report}\nverdict gpu-2shared 1 {report}\nverdict gpu-2nccl 0 {empty}\n"
              f"verdict train 0 {tmp_path}/missing.xml\n"
              'printf "%s\\n" "${SUMMARY[@]}"; echo "status=$status"\n')
    out = subprocess.run(["bash", "-c", script], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    counted = f"3 passed, 2 failed, 3 skipped; skipped: 2 x {share}; 1 x needs 3 ranks"
    assert lines[0] == f"PASS gpu-1rank    {counted}"
    assert lines[1] == f"FAIL gpu-2shared  exit 1: {counted} (log: {tmp_path})"
    assert lines[2] == "FAIL gpu-2nccl    no test passed: 0 passed, 0 failed, 2 skipped"
    assert lines[3].startswith("FAIL train        no test passed: no test report (")
    assert lines[4] == "status=1"


def test_each_benchmark_part_reads_its_summary_from_the_benchmarks_real_output(tmp_path):
    """The PASS lines of the GPU-only parts, read from what the same benchmarks print here on the CPU.

    The GPU session has one try at these parts, so their summary lines are checked on real output (the step
    and GPT benchmarks on the CPU, at a tiny size) and a failing command's last error line reaches FAIL.
    """
    py = sys.executable
    bench_log = tmp_path / "gpu-bench.txt"
    bench_log.write_text("# nccl: NCCL 2.21.5, 2 ranks, one communicator\n"
                         "      size  nccl us\n   4 KiB  10.0  0.51\n 256 MiB  900.0  0.93\n")
    calls = "\n".join([
        f"part step step_line {py} -m axonhpc bench step --models 64-32-10x16 --rounds 1",
        f"part gpt gpt_line {py} -m axonhpc bench gpt --width 32 --heads 2 --layers 1 --context 16 --batch 2 "
        "--rounds 1 --steps 1 --profile-steps 1 --no-scaling --unfused",
        f"part bench bench_line cat {bench_log}",
        f"part step-unfused unfused_line {py} -c 'raise ValueError(\"the model 1-2 is too small\")'",
    ])
    script = (f"PY={py} DRY=0 status=0 SUMMARY=() LOGS={tmp_path}/logs\n"
              f"{_functions('record', 'shown', 'run', 'part', 'step_line', 'unfused_line', 'gpt_line', 'bench_line')}"
              f"\n{calls}\n" 'printf "%s\\n" "${SUMMARY[@]}"; echo "status=$status"\n')
    env = dict(os.environ, OMP_NUM_THREADS="1")
    out = subprocess.run(["bash", "-c", script], capture_output=True, text=True, timeout=120, cwd=ROOT, env=env)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()[-5:]
    assert lines[0] == f"PASS step         1 rows; ours/floor, ours/torch and graphed/torch in {tmp_path}/logs/step.log"
    gpt = lines[1].split(None, 2)[2].split(";")
    assert [row.split()[0] for row in gpt] == ["axonhpc", "unfused", "fused", "torch"], lines[1]
    assert "ms/step" in gpt[0] and "ms/step" in gpt[1] and "(axonhpc / unfused" in gpt[2]
    assert lines[2] == "PASS bench        2 sizes timed; 256 MiB bound/pipelined 0.93; # nccl: NCCL 2.21.5, 2 ranks, one communicator"
    assert lines[3] == (f"FAIL step-unfused exit 1: ValueError: the model 1-2 is too small "
                        f"(log: {tmp_path}/logs/step-unfused.log)")
    assert lines[4] == "status=1"
