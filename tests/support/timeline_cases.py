"""ax.timeline cases, written once, run on threads (plain pytest) and on MPI ranks."""
import json
import os

import numpy as np
import pytest

import axonhpc as ax
from axonhpc import nn, optim
from axonhpc.observe import tracing
from axonhpc.observe.timeline import merge_files
from support.ddp_cases import make_data, make_model, shard
from support.pipeline_cases import make_data as pipeline_data, make_stages


def _shared_path(world, name):
    """A path every rank agrees on (rank 0's temporary directory, broadcast)."""
    import tempfile

    text = tempfile.mkdtemp(prefix="axtl-") if world.rank == 0 else ""
    data = np.zeros(256, dtype=np.uint8)
    data[:len(text)] = np.frombuffer(text.encode(), dtype=np.uint8)
    ax.broadcast(data, 0)
    return os.path.join(bytes(data).rstrip(b"\0").decode(), name)


def _events(path):
    with open(path) as f:
        trace = json.load(f)
    return [e for e in trace["traceEvents"] if e["ph"] == "X"], trace


def case_ddp_steps_are_recorded_on_every_rank(world):
    n, r = world.world_size, world.rank
    path = _shared_path(world, "ddp.json")
    ddp = ax.DDP(make_model(), bucket_size_mb=300 / 2**20)
    opt = optim.SGD(ddp.parameters(), lr=0.1)
    loss_fn = nn.CrossEntropyLoss()
    with ax.timeline(path) as recorder:
        for step in range(3):
            x, y = make_data(step)
            opt.zero_grad()
            loss_fn(ddp(shard(x, r, n)), shard(y, r, n))
            ddp.backward(loss_fn.backward())
            opt.step()
    assert tracing.active() is None
    names = [s[0] for s in recorder.spans]
    buckets = len(ddp.bucket_plan)
    assert names.count("forward") == 3 and names.count("backward") == 3 and names.count("SGD.step") == 3
    assert sum(name.startswith("bucket ") for name in names) == 3 * buckets
    assert names.count("all_reduce") == 3 * buckets
    ax.barrier()
    if r == 0:
        events, trace = _events(path)
        assert sorted({e["pid"] for e in events}) == list(range(n))
        for rank in range(n):
            mine = [e for e in events if e["pid"] == rank]
            assert sum(e["name"] == "backward" for e in mine) == 3
            assert {e["cat"] for e in mine} == {"compute", "comm", "buckets"}
            assert all(e["ts"] >= 0 and e["dur"] >= 0 for e in mine)
        names_of_processes = {e["pid"]: e["args"]["name"] for e in trace["traceEvents"] if e["name"] == "process_name"}
        assert names_of_processes == {k: f"rank {k}" for k in range(n)}


def case_blocking_buckets_are_recorded_too(world):
    # One Reducer under DDP's SYNCHRONOUS pass and the GradientSynchronizer: a blocking all-reduce is a
    # span of its own as well (it once passed None where the span wanted a Work).
    n, r = world.world_size, world.rank
    ddp = ax.DDP(make_model(), bucket_size_mb=300 / 2**20, strategy="synchronous")
    sync = ax.GradientSynchronizer("synchronous", bucket_size=64)
    grads = [np.full(8, r + 1.0) for _ in range(3)]
    loss_fn = nn.CrossEntropyLoss()
    with ax.timeline(_shared_path(world, "blocking.json")) as recorder:
        x, y = make_data(0)
        loss_fn(ddp(shard(x, r, n)), shard(y, r, n))
        ddp.backward(loss_fn.backward())
        sync.synchronize(grads)
    buckets = [s for s in recorder.spans if s[1] == "buckets"]
    assert len(buckets) == len(ddp.bucket_plan) + len(sync.last_layout)
    assert all(np.all(g == (n + 1) / 2) for g in grads)


def case_pipeline_actions_are_recorded(world):
    p = world.world_size
    path = _shared_path(world, "pipe.json")
    pipe = ax.Pipeline.from_modules(make_stages(p), num_microbatches=4, loss_fn=nn.CrossEntropyLoss())
    with ax.timeline(path) as recorder:
        x, y = pipeline_data(0)
        pipe.train_step(x, y)
    mine = [s[0] for s in recorder.spans if s[1] == "compute"]
    assert sorted(m for m in mine if m.startswith("forward stage")) == sorted(
        f"forward stage {world.rank} mb {i}" for i in range(4))
    assert sum(m.startswith("backward stage") for m in mine) == 4
    if p > 1:
        assert any(s[1] == "comm" and s[0] in ("send", "recv", "isend", "irecv") for s in recorder.spans)


def case_nested_timeline_is_refused(world):
    path = _shared_path(world, "outer.json")
    with ax.timeline(path):
        with pytest.raises(ax.errors.ConfigurationError, match="cannot be nested"):
            with ax.timeline(path + ".inner"):
                pass


def case_an_error_inside_writes_per_rank_files(world):
    path = _shared_path(world, "failed.json")
    with pytest.raises(ZeroDivisionError):
        with ax.timeline(path):
            ax.all_reduce(np.ones(3))
            1 / 0
    assert tracing.active() is None
    own = f"{path}.rank{world.rank:05d}.json"
    with open(own) as f:
        data = json.load(f)
    assert data["rank"] == world.rank and [s[0] for s in data["spans"]] == ["all_reduce"]
    ax.barrier()
    if world.rank == 0:
        assert not os.path.exists(path)  # no merged file: nobody communicated on the way out
        merged = merge_files([f"{path}.rank{k:05d}.json" for k in range(world.world_size)])
        assert sorted({e["pid"] for e in merged["traceEvents"] if e["ph"] == "X"}) == list(range(world.world_size))


CASES = {name[len("case_"):]: fn for name, fn in sorted(globals().items()) if name.startswith("case_")}
