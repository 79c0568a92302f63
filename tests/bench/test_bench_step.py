"""``axonhpc bench step``: options checked, each candidate does its work, the table adds up (no time asserted)."""
import sys

import numpy as np
import pytest

from axonhpc.bench import step as bench_step
from axonhpc.errors import InvalidArgumentError
from axonhpc.settings import settings

TINY = "12-16-5x8"


def test_parse_models():
    specs = bench_step.parse_models("784-256-10x128, 1024-4096-4096-10x2048")
    assert [(s.widths, s.batch) for s in specs] == [((784, 256, 10), 128), ((1024, 4096, 4096, 10), 2048)]
    assert specs[0].label == "784-256-10 x128"
    # forward and weight gradient of both layers; the input gradient of the second only (the first's input is data)
    assert specs[0].gemm_flops() == 2 * 128 * (2 * 784 * 256 + 3 * 256 * 10)
    for bad in ("784x128", "784-256", "784-0-10x8", "784-256-10x0", "a-bx2", ","):
        with pytest.raises(InvalidArgumentError, match="--models"):
            bench_step.parse_models(bad)


def test_parse_precisions_refuses_what_cannot_run_here_with_the_reason():
    assert bench_step.parse_precisions("fp32,TF32", "cuda") == ["fp32", "tf32"]
    with pytest.raises(InvalidArgumentError, match="tf32 .* needs --device cuda"):
        bench_step.parse_precisions("tf32", "cpu")
    with pytest.raises(InvalidArgumentError, match="bf16 needs --device cuda: numpy has no bfloat16 GEMM"):
        bench_step.parse_precisions("fp32,bf16", "cpu")
    with pytest.raises(InvalidArgumentError, match="fp16 needs --device cuda: numpy multiplies float16 in its own"):
        bench_step.parse_precisions("fp16", "cpu")
    assert bench_step.parse_precisions("fp16,fp32", "cuda") == ["fp16", "fp32"]
    assert bench_step.DEFAULT_PRECISIONS["cuda"] == "fp32,tf32,bf16,fp16"
    with pytest.raises(InvalidArgumentError, match="unknown 'fp8'"):
        bench_step.parse_precisions("fp8", "cpu")


def test_our_step_trains_and_the_torch_step_trains_the_same_model():
    spec = bench_step.parse_models(TINY)[0]
    device = bench_step.Device("cpu")
    ours = bench_step.axon_step(spec, device)
    losses = [ours() for _ in range(30)]
    assert losses[-1] < 0.5 * losses[0]  # a step that did nothing would be fast and wrong
    theirs, note = bench_step.torch_step(spec, device, "fp32")
    if theirs is None:
        assert note == "torch not installed"
    else:
        torch_losses = [theirs().item() for _ in range(30)]
        assert torch_losses[-1] < 0.5 * torch_losses[0]


def test_gemm_floor_computes_the_products_a_step_needs(monkeypatch):
    spec = bench_step.parse_models(TINY)[0]
    calls = []
    real = np.matmul
    monkeypatch.setattr(np, "matmul",
                        lambda a, b, out: calls.append((a.shape, b.shape, out.shape)) or real(a, b, out=out))
    bench_step.gemm_floor(spec, bench_step.Device("cpu"))()
    # no (8, 16) @ (16, 12) for the first layer's input gradient: the step skips it, as torch's does
    assert calls == [((8, 12), (12, 16), (8, 16)), ((16, 8), (8, 12), (16, 12)),
                     ((8, 16), (16, 5), (8, 5)), ((5, 8), (8, 16), (5, 16)), ((8, 5), (5, 16), (8, 16))]


@pytest.mark.parametrize("torch_present", [True, False])
def test_measure_row_is_consistent(monkeypatch, torch_present):
    if not torch_present:
        monkeypatch.setitem(sys.modules, "torch", None)  # import torch raises ImportError
    monkeypatch.setattr(bench_step, "TARGET_SECONDS", 0.002)
    spec = bench_step.parse_models(TINY)[0]
    row = bench_step.measure(spec, "fp32", bench_step.Device("cpu"), rounds=2, warmup=1)
    assert row["model"] == spec.label and row["precision"] == "fp32"
    assert row["axonhpc_s"] > 0 and row["floor_s"] > 0
    assert row["ours_over_floor"] == pytest.approx(row["axonhpc_s"] / row["floor_s"])
    assert row["floor_tflops"] == pytest.approx(spec.gemm_flops() / row["floor_s"] / 1e12)
    if row["torch_s"] is None:
        assert row["torch"] == "torch not installed" and row["ours_over_torch"] is None
    else:
        assert row["ours_over_torch"] == pytest.approx(row["axonhpc_s"] / row["torch_s"])
    assert settings.allow_tf32 is False
    lines = bench_step.format_table([row]).splitlines()
    assert "ours/floor" in lines[0] and len(lines) == 2
    assert row["graphed_s"] is None and row["graphed_over_torch"] is None  # no CUDA graphs on the CPU
    assert row["deferred_s"] is None and row["deferred_over_torch"] is None  # nothing to defer on the CPU
    cells = lines[1].split()
    assert cells[5] == cells[6] == "n/a" and (cells[7] == "n/a") == (row["torch_s"] is None)


def test_main_prints_the_table(monkeypatch, capsys):
    monkeypatch.setattr(bench_step, "TARGET_SECONDS", 0.002)
    assert bench_step.main(["--models", TINY + ",6-3x4", "--rounds", "1"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("device: cpu") and "ours/floor" in out[1]
    assert [line.split()[0] for line in out[2:]] == ["12-16-5", "6-3"]


def test_main_refuses_bad_options_and_a_missing_gpu_with_status_2(monkeypatch, capsys):
    assert bench_step.main(["--precisions", "bf16"]) == 2
    assert "bf16 needs --device cuda" in capsys.readouterr().err
    monkeypatch.setitem(sys.modules, "cupy", None)
    assert bench_step.main(["--device", "cuda", "--models", TINY]) == 2
    assert "--device cuda: no CUDA device" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        bench_step.main(["--rounds", "0"])


def test_bf16_needs_ml_dtypes(monkeypatch):
    monkeypatch.setattr(bench_step, "bfloat16_dtype", lambda: None)
    with pytest.raises(InvalidArgumentError, match="bf16 needs ml_dtypes"):
        bench_step.parse_precisions("bf16", "cuda")
    assert bench_step.parse_precisions("fp32", "cuda") == ["fp32"]


def _candidates_compute_in(monkeypatch, precision, dtype):
    """The host cannot time a 16-bit row, but its candidates are built for it: the floor's products in ``dtype``,
    our step and torch's (where installed) train."""
    spec = bench_step.parse_models(TINY)[0]
    device = bench_step.Device("cpu")
    calls = []
    real = np.matmul
    with monkeypatch.context() as patched:
        patched.setattr(np, "matmul", lambda a, b, out: calls.append(out.dtype) or real(a, b, out=out))
        bench_step.gemm_floor(spec, device, precision)()
    assert calls and set(calls) == {np.dtype(dtype)}
    ours = bench_step.axon_step(spec, device, precision)
    losses = [ours() for _ in range(30)]
    assert losses[-1] < 0.5 * losses[0]
    theirs, _ = bench_step.torch_step(spec, device, precision)
    if theirs is not None:
        torch_losses = [theirs().item() for _ in range(30)]
        assert torch_losses[-1] < 0.5 * torch_losses[0]


def test_bf16_candidates_compute_in_bfloat16(monkeypatch):
    """autocast, torch.autocast, bf16 GEMMs."""
    ml_dtypes = pytest.importorskip("ml_dtypes")
    assert bench_step.Device("cpu").bf16_problem() is None  # ml_dtypes multiplies on the host
    _candidates_compute_in(monkeypatch, "bf16", ml_dtypes.bfloat16)


def test_fp16_candidates_compute_in_float16_with_a_loss_scaler(monkeypatch):
    """autocast and the scaler, torch's amp, fp16 GEMMs; the scaler's step and update run after every step."""
    from axonhpc.parallel import GradScaler

    scales = []
    monkeypatch.setattr(GradScaler, "update", lambda self, real=GradScaler.update: (real(self),
                                                                                    scales.append(self.scale_value)))
    _candidates_compute_in(monkeypatch, "fp16", np.float16)
    assert len(scales) == 30 and scales[0] == 2.0 ** 16


def test_bf16_rows_are_skipped_with_the_reason_where_the_device_cannot(monkeypatch, capsys):
    monkeypatch.setattr(bench_step, "TARGET_SECONDS", 0.002)
    monkeypatch.setattr(bench_step, "parse_precisions", lambda text, device: text.split(","))
    monkeypatch.setattr(bench_step.Device, "bf16_problem", lambda self: "cupy 0 cannot multiply bfloat16 arrays")
    assert bench_step.main(["--models", TINY, "--rounds", "1", "--precisions", "fp32,bf16"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert [line.split()[2] for line in out[2:-1]] == ["fp32"]  # "12-16-5 x8 fp32 ..."
    assert out[-1] == "bf16 rows skipped: cupy 0 cannot multiply bfloat16 arrays"


def test_the_graphed_step_trains_as_the_eager_step_does(monkeypatch):
    """On the strict stand-in's stream capture: the graphed and deferred candidates are the eager step bit for bit."""
    from support.fake_cuda import FakeCupy

    fake = FakeCupy()
    monkeypatch.setitem(sys.modules, "cupy", fake)
    monkeypatch.setitem(sys.modules, "cupy.cuda", fake.cuda)
    spec = bench_step.parse_models(TINY)[0]
    device = bench_step.Device("cpu")
    device.xp = fake  # the stand-in plays the GPU's array library
    for precision in ("fp32", "fp16"):  # fp16: the forward and backward graphed, the scaler's step after
        eager = bench_step.axon_step(spec, device, precision)
        graphed = bench_step.graphed_step(spec, device, precision)
        deferred = bench_step.axon_step(spec, device, precision, deferred=True)
        eager_losses = [eager() for _ in range(30)]
        graphed_losses = [float(graphed()) for _ in range(30)]
        assert graphed_losses == eager_losses
        assert [float(deferred()) for _ in range(30)] == eager_losses
        assert eager_losses[-1] < 0.5 * eager_losses[0]
    row = dict(model="m", precision="fp32", axonhpc_s=2e-3, floor_s=1e-3, deferred_s=1.5e-3, graphed_s=1e-3,
               torch_s=2e-3, torch="torch 0", floor_tflops=1.0, ours_over_floor=2.0, ours_over_torch=1.0,
               deferred_over_torch=0.75, graphed_over_torch=0.5)
    assert "deferred/torch graphed/torch" in bench_step.format_table([row]).splitlines()[0]
    assert bench_step.format_table([row]).splitlines()[1].split()[-3:-1] == ["0.75", "0.50"]


def test_a_step_that_cannot_be_graphed_leaves_the_other_columns(monkeypatch, capsys):
    """The first GPU run lost the whole table to the graphed column's GraphCaptureError."""
    from support.fake_cuda import FakeCupy, bench_device

    from axonhpc.errors import GraphCaptureError

    fake = FakeCupy()
    monkeypatch.setitem(sys.modules, "cupy", fake)
    monkeypatch.setitem(sys.modules, "cupy.cuda", fake.cuda)
    monkeypatch.setattr(bench_step, "TARGET_SECONDS", 0.002)

    def refused(spec, device, precision="fp32"):
        def step():
            raise GraphCaptureError("the step did work a CUDA graph cannot hold (a read)")
        return step

    monkeypatch.setattr(bench_step, "graphed_step", refused)
    monkeypatch.setattr(bench_step, "torch_step", lambda spec, device, precision: (None, "torch n/a"))
    monkeypatch.setattr(bench_step, "Device", bench_device(fake))
    assert bench_step.main(["--device", "cuda", "--models", TINY, "--rounds", "1", "--precisions", "fp32"]) == 0
    out = capsys.readouterr().out.splitlines()
    row = out[2].split()
    assert row[0] == "12-16-5" and row[6] == "n/a" and float(row[3]) > 0 and float(row[5]) > 0  # graphed n/a
    assert out[-1] == "graphed n/a: the step did work a CUDA graph cannot hold (a read)"
