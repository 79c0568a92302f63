"""Mistakes users make and spellings they already type (issue 42, part 4): each gets what it asks for, or an
AxonError that says what was expected."""
import os
import re
import subprocess
import sys
import textwrap

import numpy as np
import pytest

import axonhpc as ax
from axonhpc import nn
from axonhpc.backends.base import ReduceOp
from axonhpc.bench.allreduce import format_table
from axonhpc.cli import build_parser
from axonhpc.data import DistributedSampler
from axonhpc.errors import ArgumentTypeError, ConfigurationError
from axonhpc.info import GPU_EXTRA_HINT, _concrete
from support.paths import ROOT

AXONHPC = os.path.join(os.path.dirname(sys.executable), "axonhpc")


def _python(code, **env):
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                          timeout=120, cwd=ROOT, env=dict(os.environ, **env))


def test_reduce_op_spellings_people_use():
    assert ReduceOp.parse("mean") is ReduceOp.AVG and ReduceOp.parse("Average") is ReduceOp.AVG
    assert ReduceOp.parse("prod") is ReduceOp.PRODUCT
    with pytest.raises(ax.errors.InvalidArgumentError, match="unknown reduce op 'median'"):
        ReduceOp.parse("median")

    def fn(world):
        x = np.full(3, world.rank + 1.0)
        ax.all_reduce(x, op="mean")
        return x.tolist()
    assert ax.run_local(fn, world_size=2) == [[1.5] * 3] * 2


def test_a_reduce_op_name_is_parsed_once(monkeypatch):
    # parse_choice walks the enum (about 10 us): on every all-reduce given "sum" or "avg", as the docs write them.
    from axonhpc.backends import base

    calls = []
    real = base.parse_choice
    monkeypatch.setattr(base, "parse_choice", lambda *a, **k: calls.append(a[1]) or real(*a, **k))
    monkeypatch.setattr(base, "REDUCE_OP_NAMES", {})
    for _ in range(3):
        assert ReduceOp.parse("Sum") is ReduceOp.SUM and ReduceOp.parse("mean") is ReduceOp.AVG
    assert calls == ["Sum", "mean"]
    with pytest.raises(ax.errors.UnknownChoiceError):
        ReduceOp.parse("median")
    assert "median" not in base.REDUCE_OP_NAMES


def test_launch_and_slurm_take_mpiexecs_and_slurms_spellings():
    args = build_parser().parse_args(["launch", "-np", "3", "--", "train.py", "--lr", "0.1"])
    assert args.n == 3 and args.command == ["--", "train.py", "--lr", "0.1"]
    args = build_parser().parse_args(["slurm", "render", "cpu-ddp", "--nodes", "1", "--ntasks-per-node", "4"])
    assert args.tasks_per_node == "4"
    out = subprocess.run([AXONHPC, "launch", "train.py", "-n", "2"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 2
    assert "the script and its arguments go after the options and a --: axonhpc launch -n 2 -- train.py" in out.stderr


def test_the_sampler_takes_rank_and_size_from_the_world():
    got = ax.run_local(lambda world: (DistributedSampler(10).rank, DistributedSampler(10).num_replicas,
                                      DistributedSampler(10, num_replicas=1, rank=0).num_replicas), world_size=3)
    assert got == [(0, 3, 1), (1, 3, 1), (2, 3, 1)]
    out = _python("""
        from axonhpc.data import DistributedSampler
        try:
            DistributedSampler(10)
        except Exception as exc:
            print(type(exc).__name__, exc)
    """)
    assert "ConfigurationError DistributedSampler needs num_replicas and rank" in out.stdout, out.stderr


def test_float64_data_into_a_float32_model_computes_in_float32():
    layer = nn.Linear(4, 3, seed=0)
    x = np.random.default_rng(0).standard_normal((5, 4))  # float64, as numpy makes it
    y = layer(x)
    assert y.dtype == np.float32
    np.testing.assert_array_equal(y, nn.Linear(4, 3, seed=0)(x.astype(np.float32)))
    dx = layer.backward(np.ones_like(y))
    assert dx.dtype == np.float64 and layer.weight.grad.dtype == np.float32  # a cast's backward
    assert nn.Linear(4, 3, seed=0)(np.ones((2, 4), dtype=np.int64)).dtype == np.float32


@pytest.mark.parametrize("layer", [nn.Linear(4, 2), nn.GELU(), nn.ReLU(), nn.LayerNorm(4), nn.CrossEntropyLoss(),
                                   nn.Sequential(nn.Linear(4, 2))])
def test_a_layer_given_a_list_says_to_pass_an_array(layer):
    with pytest.raises(ArgumentTypeError, match=r"takes a numpy or cupy array, got builtins\.list; pass np\.asarray"):
        layer([[1.0, 2.0, 3.0, 4.0]], *([np.array([0])] if isinstance(layer, nn.CrossEntropyLoss) else []))


def test_memory_mapped_arrays_are_arrays(tmp_path):
    m = np.memmap(tmp_path / "x.bin", dtype=np.float32, mode="w+", shape=(3, 4))
    m[:] = 1.0
    assert nn.Linear(4, 2, seed=0)(m).shape == (3, 2)


def test_wrappers_refuse_what_is_not_a_module_on_every_rank():
    def fn(world):
        with pytest.raises(ArgumentTypeError, match=r"DDP wraps an axonhpc\.nn\.Module, got numpy\.ndarray"):
            ax.DDP(np.ones(3))
        with pytest.raises(ArgumentTypeError, match=r"FSDP wraps an axonhpc\.nn\.Module, got builtins\.list"):
            ax.FSDP([1, 2])
        return True
    assert ax.run_local(fn, world_size=2) == [True, True]


@pytest.mark.parametrize("timeout, error, match", [
    ("60", ArgumentTypeError, r"init\(timeout='60'\): the timeout is a number of seconds"),
    (-5, ConfigurationError, r"init\(timeout=-5\) must be a positive number of seconds, or 0"),
    (float("nan"), ConfigurationError, "must be a positive number"),
])
def test_init_checks_its_timeout(timeout, error, match):
    before = ax.settings.timeout
    with pytest.raises(error, match=match):
        ax.init(timeout=timeout)
    assert ax.settings.timeout == before  # nothing changed


def test_sigusr1_says_where_the_flight_recorder_went(tmp_path):
    out = _python("""
        import os, signal
        import numpy as np
        import axonhpc as ax
        ax.init(backend="local")
        ax.all_reduce(np.ones(2))
        os.kill(os.getpid(), signal.SIGUSR1)
    """, AXONHPC_FLIGHT_DIR=str(tmp_path / "flight"))
    assert out.returncode == 0, out.stderr
    assert f"SIGUSR1: wrote the flight recorder to {tmp_path / 'flight'}" in out.stderr, out.stderr
    assert f"axonhpc doctor {tmp_path / 'flight'}" in out.stderr
    written = re.search(r"wrote the flight recorder to (\S+) .*axonhpc doctor \S+ --run ([0-9a-f]{16})\)", out.stderr)
    assert written and written.group(1) == str(tmp_path / "flight" / f"flight-{written.group(2)}-rank00000.json"), \
        out.stderr
    assert os.path.exists(written.group(1))


def test_bandwidth_is_printed_as_a_rate():
    row = dict(bytes=4096, ours_us=10.0, raw_us=12.0, mpi_path_us=11.0, ours_algbw=0.41, raw_algbw=0.34,
               ours_busbw=0.41, raw_busbw=0.34, ratio=1.2, copy_gbs=5.0, of_bound=0.5)
    line = format_table([row], 2).splitlines()[-1]
    assert line.count("GB/s") == 4 and "GB " not in line.replace("GB/s", "")


def test_info_gpu_hints_say_what_to_do_here():
    text = f"cupy is not installed ({GPU_EXTRA_HINT})"
    assert "axonhpc info says which" not in _concrete(text, None)
    assert "no CUDA driver on this machine" in _concrete(text, None)
    assert "pip install axonhpc[gpu-cuda12] for this machine's CUDA driver" in _concrete(text, "gpu-cuda12")


def test_progress_in_a_file_is_a_plain_line_every_tenth_of_the_epoch():
    import io

    from axonhpc.trainer.progress import Progress, parse_every

    out = io.StringIO()  # not a terminal, as an sbatch .out file
    bar = Progress(40, 0, "epoch 1/3", parse_every(True), stream=out)
    for k in range(40):
        bar.update(1.0 / (k + 1))
    bar.close()
    lines = out.getvalue().splitlines()
    assert "\r" not in out.getvalue() and len(lines) == 10, lines  # every 10%: 4 steps of 40
    assert lines[-1].startswith("epoch 1/3: 100%") and "40/40" in lines[-1] and "loss=0.0250" in lines[-1]
    assert parse_every("5%") == (5.0, float("inf")) and parse_every("30s") == (float("inf"), 30.0)
    out = io.StringIO()
    bar = Progress(1000, 0, "e", parse_every("25%"), stream=out)
    for _ in range(1000):
        bar.update()
    assert len(out.getvalue().splitlines()) == 4
    for bad in ("often", "0%", "-3s", "10"):
        with pytest.raises(ConfigurationError, match="progress="):
            parse_every(bad)


WRONG_TYPES = {
    "SGD(model)": (lambda: ax.optim.SGD(nn.Linear(2, 2), lr=0.1), "SGD takes the parameters, got the Linear itself"),
    "SGD(lr='0.1')": (lambda: ax.optim.SGD([nn.Parameter(np.ones(2))], lr="0.1"), "SGD: lr must be a number"),
    "Adam(lr=None)": (lambda: ax.optim.Adam([nn.Parameter(np.ones(2))], lr=None), "Adam: lr must be a number"),
    "SGD(5)": (lambda: ax.optim.SGD(5, lr=0.1), "SGD takes an iterable of Parameters, got int"),
    "Linear('4', 2)": (lambda: nn.Linear("4", 2), "Linear in_features must be an int, got str '4'"),
    "Embedding(3.0, 2)": (lambda: nn.Embedding(3.0, 2), "Embedding num_embeddings must be an int, got float"),
    "GPT(heads='4')": (lambda: nn.GPT(256, 8, 16, "4", 1), "GPT heads must be an int"),
    "GradScaler('x')": (lambda: ax.GradScaler(init_scale="x"), "GradScaler init_scale must be a number"),
    "save(None)": (lambda: ax.checkpoint.save(None, {"a": np.ones(2)}), "checkpoint path must be a str or os.PathLike"),
    "Trainer(array)": (lambda: ax.DistributedTrainer(np.ones(3), None, None), "DistributedTrainer wraps an axonhpc.nn"),
    "Trainer(optimizer=None)": (lambda: ax.DistributedTrainer(nn.Linear(2, 2), None, nn.MSELoss()),
                                "optimizer must be an optimizer"),
    "Trainer(loss_fn=len)": (lambda: ax.DistributedTrainer(nn.Linear(2, 2), ax.optim.SGD(nn.Linear(2, 2).parameters(),
                                                                                          lr=0.1), len),
                             "loss_fn must be a loss module"),
}


@pytest.mark.parametrize("case", sorted(WRONG_TYPES))
def test_public_entry_points_say_what_type_they_expected(case):
    call, match = WRONG_TYPES[case]
    with pytest.raises(ArgumentTypeError, match=re.escape(match)):
        call()
