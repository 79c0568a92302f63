"""``axonhpc bench gpt``: the step beside PyTorch's (where installed) and the table of layouts. No time is asserted."""
import importlib
import os
import re
import subprocess
import sys

import pytest

from axonhpc.bench import gpt
from support.paths import ROOT

TINY = ["--width", "16", "--layers", "2", "--heads", "2", "--context", "8", "--batch", "4", "--vocab", "32"]
MPIEXEC = os.path.join(os.path.dirname(sys.executable), "mpiexec")


def _run(*args, timeout=280):
    return subprocess.run([sys.executable, "-m", "axonhpc", "bench", "gpt", *args], capture_output=True, text=True,
                          timeout=timeout, cwd=ROOT)


def test_the_step_is_timed_beside_torch_with_our_profile():
    out = _run(*TINY, "--rounds", "2", "--steps", "1", "--profile-steps", "2", "--no-scaling", "--unfused")
    assert out.returncode == 0, out.stderr
    assert re.search(r"same model: first-step loss ours \d+\.\d+", out.stdout), out.stdout
    assert re.search(r"axonhpc +\d+\.\d+ ms/step +\d+ tokens/s", out.stdout), out.stdout
    assert re.search(r"unfused +\d+\.\d+ ms/step +\d+ tokens/s", out.stdout), out.stdout  # fused kernels off
    assert re.search(r"fused +\d+\.\d+ \(axonhpc / unfused", out.stdout), out.stdout
    try:
        importlib.import_module("torch")
        assert re.search(r"torch +\d+\.\d+ ms/step", out.stdout) and "ratio" in out.stdout, out.stdout
        assert "|difference| 0" in out.stdout or "e-0" in out.stdout  # the same model: the same first loss
    except ImportError:
        assert "torch           n/a" in out.stdout, out.stdout
    profile = out.stdout.split("top 10 functions")[1].strip().splitlines()[1:]
    assert 5 <= len(profile) <= 10 and all(re.match(r"\s+\d+\.\d+ ms\s+\d+\.\d+%", line) for line in profile)


@pytest.mark.skipif(not os.path.exists(MPIEXEC), reason="no mpiexec in this environment")
@pytest.mark.timeout(600)
def test_the_layouts_train_under_default_thread_settings():
    out = _run(*TINY, "--rounds", "1", "--steps", "1", "--profile-steps", "0", "--no-torch", "--repeats", "1",
               "--scaling-steps", "2", "--warmup", "1", timeout=580)
    assert out.returncode == 0, out.stdout + out.stderr
    table = out.stdout.split("tokens/s on this machine")[1]
    for label in ("1 process", "1 process, OMP_NUM_THREADS=1", "dp=2", "dp=2 fsdp", "tp=2", "pp=2"):
        assert re.search(rf"\n  {re.escape(label)} +[12] +\d+ +\d+\.\d+x", table), (label, table)
    # the jobs ran without thread variables: axonhpc sized the pools (but where the row sets them itself)
    rows = [line for line in table.splitlines() if re.match(r"  (dp|tp|pp|1 process )", line)]
    assert rows and all("(axonhpc)" in line for line in rows if "OMP_NUM_THREADS=1" not in line), table
    assert "1 (the environment)" in next(line for line in table.splitlines() if "OMP_NUM_THREADS=1" in line)


def test_bad_arguments_are_refused_with_the_option():
    assert _run("--heads", "3", "--width", "16").returncode == 2
    out = _run("--layouts", "dp,zigzag")
    assert out.returncode == 2 and "unknown zigzag" in out.stderr
    out = _run("--rounds", "0")
    assert out.returncode == 2 and "--rounds must be at least 1" in out.stderr


def test_layouts_the_model_cannot_take_are_refused_before_any_job():
    """One block cannot make the two stages of the default layouts' pp=2: refused up front, naming the values,
    with nothing timed first (without the check the other layouts ran, then pp's worker failed)."""
    quick = ["--width", "16", "--heads", "2", "--context", "8", "--vocab", "32", "--rounds", "1", "--steps", "1",
             "--profile-steps", "0", "--no-torch", "--repeats", "1", "--scaling-steps", "1", "--warmup", "0"]
    out = _run(*quick, "--layers", "1")
    assert out.returncode == 2, out.stdout + out.stderr
    assert "--layers 1 cannot be split into 2 pipeline stages (layout pp on --ranks 2)" in out.stderr, out.stderr
    assert out.stdout == "" and "Traceback" not in out.stderr
    out = _run(*quick, "--layers", "2", "--batch", "6")  # pp=2 runs 4 micro-batches
    assert out.returncode == 2 and "--batch 6 does not split into 4 micro-batches" in out.stderr, out.stderr
    out = _run(*quick, "--layers", "2", "--batch", "4", "--heads", "1", "--layouts", "tp")
    assert out.returncode == 2 and "--heads 1 does not split over tp=2" in out.stderr, out.stderr
    assert gpt.layout_problem(gpt.parse_args([*quick, "--layers", "1", "--layouts", "dp,tp"])) is None


def test_the_default_environment_drops_the_thread_variables(monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.setenv("AXONHPC_THREADS_SET_BY", "axonhpc launch")
    env = gpt.default_environment()
    assert "OMP_NUM_THREADS" not in env and "AXONHPC_THREADS_SET_BY" not in env and "PATH" in env


def test_the_device_step_trains_the_host_steps_model(monkeypatch):
    """``--device cuda``'s candidates on the strict stand-in: our step on device arrays gives the host step's losses,
    and torch's model loads the device model's weights (read back through the host)."""
    from support.fake_cuda import FakeCupy

    fake = FakeCupy()
    monkeypatch.setitem(sys.modules, "cupy", fake)
    monkeypatch.setitem(sys.modules, "cupy.cuda", fake.cuda)
    args = gpt.parse_args(TINY + ["--device", "cuda", "--no-scaling"])
    on_device, model = gpt.our_step(args, fake)
    assert all(type(p.data).__module__ != "numpy" for p in model.parameters())
    on_host, _ = gpt.our_step(args)
    device_losses = [on_device() for _ in range(4)]
    host_losses = [on_host() for _ in range(4)]
    assert device_losses == pytest.approx(host_losses, rel=1e-5) and device_losses[-1] < device_losses[0]
    _, fresh = gpt.our_step(args, fake)
    theirs = gpt.torch_step(args, fresh)  # torch's on the CPU: where this machine can run it
    if theirs is not None:
        assert theirs() == pytest.approx(host_losses[0], rel=1e-5)


def test_the_device_comparison_runs_and_leaves_the_layouts_out(monkeypatch, capsys):
    """The whole ``--device cuda`` run on the stand-in device: the table, and the layouts skipped with the reason."""
    from support.fake_cuda import FakeCupy, bench_device

    fake = FakeCupy()
    monkeypatch.setitem(sys.modules, "cupy", fake)
    monkeypatch.setitem(sys.modules, "cupy.cuda", fake.cuda)
    monkeypatch.setattr(gpt, "Device", bench_device(fake))
    monkeypatch.setitem(sys.modules, "torch", None)  # torch's CUDA step cannot run here
    assert gpt.main(TINY + ["--device", "cuda", "--rounds", "1", "--steps", "1", "--profile-steps", "2"]) == 0
    out = capsys.readouterr().out
    assert "device: cuda: the strict stand-in" in out and "one GPU, each step reading its loss" in out
    assert re.search(r"axonhpc +\d+\.\d+ ms/step", out) and "top 10 functions" in out
    assert "table of layouts: skipped with --device cuda" in out and "tokens/s on this machine" not in out


def test_a_missing_gpu_is_refused(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "cupy", None)
    assert gpt.main(TINY + ["--device", "cuda", "--rounds", "1", "--no-scaling"]) == 1
    assert "--device cuda: no CUDA device" in capsys.readouterr().err
