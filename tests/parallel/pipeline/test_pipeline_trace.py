"""Pipeline timeline export: Chrome-trace JSON, the measured bubble, the gather encoding.

The gather itself runs as ``case_gather_timelines`` in pipeline_cases.py (threads and MPI).
"""
import importlib
import json

import pytest

import axonhpc as ax
from axonhpc import nn
from axonhpc.parallel.pipeline import trace
from axonhpc.parallel.pipeline.schedules import Action, PipelineSchedule, pipeline_schedule
from axonhpc.parallel.pipeline.simulate import simulate_pipeline
from support.pipeline_cases import make_data, make_stages


def synthetic(p, m, schedule=PipelineSchedule.GPIPE):
    """Simulated timelines (unit-cost forwards and backwards), as per-rank (action, start, end) lists."""
    actions = pipeline_schedule(schedule, p, m)
    result = simulate_pipeline(actions, forward_cost=1.0, backward_cost=1.0)
    return [list(timeline) for timeline in result.timelines]


def test_array_round_trip_and_padding():
    timeline = [(Action(0, "F", 0), 0.0, 0.25), (Action(2, "B", 7), 0.5, 1.125)]
    rows = trace.timeline_to_array(timeline)
    assert rows.shape == (2, 5) and rows.dtype.name == "float64"
    assert rows[1].tolist() == [2, 1, 7, 0.5, 1.125]
    padded = [list(r) for r in rows] + [[float("nan")] * 5]
    assert trace.timeline_from_array(padded) == timeline


@pytest.mark.parametrize("p,m", [(2, 4), (4, 8), (3, 1)])
def test_bubble_of_equal_stages_matches_formula(p, m):
    for schedule in (PipelineSchedule.GPIPE, PipelineSchedule.ONE_F_ONE_B):
        assert trace.timeline_bubble(synthetic(p, m, schedule)) == pytest.approx((p - 1) / (m + p - 1))
    assert trace.timeline_bubble([]) == 0.0


def test_chrome_trace_json(tmp_path):
    timelines = synthetic(2, 3)
    path = tmp_path / "trace.json"
    doc = trace.write_chrome_trace({0: {"timeline": timelines[0]}, 1: timelines[1]}, str(path))
    assert json.loads(path.read_text()) == doc
    spans = [e for e in doc["traceEvents"] if e["ph"] == "X"]
    meta = [e for e in doc["traceEvents"] if e["ph"] == "M"]
    assert [(e["pid"], e["args"]["name"]) for e in meta] == [(0, "rank 0"), (1, "rank 1")]
    assert len(spans) == 12
    first = spans[0]
    assert first["name"] == "0F0" and first["pid"] == 0 and first["cat"] == "forward"
    assert first["ts"] == 0.0 and first["dur"] == pytest.approx(1e6)  # one time unit = 1 s -> microseconds
    for (action, start, end), e in zip(timelines[1], [e for e in spans if e["pid"] == 1]):
        assert e["name"] == str(action)
        assert e["ts"] == pytest.approx(start * 1e6) and e["dur"] == pytest.approx((end - start) * 1e6)
        assert e["args"] == {"stage": action.stage, "microbatch": action.microbatch}


def test_trace_of_a_real_pipeline_run(tmp_path):
    def run(world):
        pipe = ax.Pipeline.from_modules(make_stages(world.world_size), num_microbatches=4,
                                        schedule="1f1b", loss_fn=nn.CrossEntropyLoss())
        pipe.train_step(*make_data(0))
        gathered = trace.gather_timelines(pipe)
        if world.rank == 0:
            return trace.write_chrome_trace(gathered, str(tmp_path / "run.json"))
        return None

    doc = ax.run_local(run, world_size=3)[0]
    on_disk = json.loads((tmp_path / "run.json").read_text())
    assert on_disk == doc
    spans = [e for e in on_disk["traceEvents"] if e["ph"] == "X"]
    assert len(spans) == 3 * 4 * 2
    for pid in range(3):
        mine = [e for e in spans if e["pid"] == pid]
        assert [e["name"] for e in mine] == [str(a) for a in pipeline_schedule("1f1b", 3, 4)[pid]]
        assert all(e["dur"] >= 0 and e["ts"] >= 0 for e in mine)
        assert all(a["ts"] + a["dur"] <= b["ts"] + 1e-3 for a, b in zip(mine, mine[1:]))


def test_gantt_png(tmp_path):
    try:
        importlib.import_module("matplotlib")
    except ImportError:
        with pytest.raises(ImportError, match="pip install matplotlib"):
            trace.write_gantt_png(synthetic(2, 2), str(tmp_path / "gantt.png"))
        return
    path = tmp_path / "gantt.png"
    trace.write_gantt_png(synthetic(2, 2), str(path))
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_exported():
    for name in ("gather_timelines", "timeline_bubble", "chrome_trace", "write_chrome_trace", "write_gantt_png"):
        assert getattr(ax.parallel, name) is getattr(trace, name) and name in ax.parallel.__all__
