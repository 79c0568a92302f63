"""examples/pipeline_timeline.py writes a Chrome trace and a Gantt chart of a real 2-rank step."""
import importlib
import json
import os
import subprocess
import sys

import pytest

from support.paths import ROOT


@pytest.mark.timeout(300)
@pytest.mark.parametrize("schedule", ["gpipe", "interleaved"])
def test_timeline_files(tmp_path, schedule):
    cmd = [os.path.join(os.path.dirname(sys.executable), "mpiexec"), "-n", "2", sys.executable,
           os.path.join(ROOT, "examples", "pipeline_timeline.py"), "--schedule", schedule, "--microbatches", "4",
           "--width", "16", "--batch", "16", "--steps", "2", "--out", str(tmp_path / "tl")]
    env = dict(os.environ, OMP_NUM_THREADS="1", AXONHPC_ABORT_ON_EXCEPTION="1")
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=240, env=env)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "measured bubble" in out.stdout
    trace = json.loads((tmp_path / "tl.json").read_text())
    events = [e for e in trace["traceEvents"] if e.get("ph") == "X"]
    v = 2 if schedule == "interleaved" else 1
    assert len(events) == 2 * 2 * 4 * v  # ranks x (F, B) x micro-batches x chunks per rank
    assert {e["pid"] for e in events} == {0, 1}
    try:
        importlib.import_module("matplotlib")
    except ImportError:
        assert "no PNG" in out.stdout
    else:
        assert (tmp_path / "tl.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
