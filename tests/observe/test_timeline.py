"""ax.timeline: merged Chrome traces across ranks; whole-run recording by setting; merging files."""
import json
import os
import subprocess
import sys

import pytest

from axonhpc.errors import ConfigurationError
from axonhpc.observe import tracing
from axonhpc.observe.timeline import merge_files
from support.runner import case_tests
from support.timeline_cases import CASES


test_timeline_case_local, test_timeline_case_mpi = case_tests(CASES, sizes=(1, 2, 3))


def test_nothing_records_by_default():
    assert tracing.active() is None
    with tracing.span("ignored"):
        pass


def test_recorder_rejects_unknown_lanes():
    with pytest.raises(ValueError, match="unknown timeline lane 'gpu'"):
        tracing.Recorder(0).add("x", "gpu", 0.0, 1.0)


def test_merge_refuses_bad_inputs(tmp_path):
    with pytest.raises(ConfigurationError, match="no timeline rank files"):
        merge_files([])
    bad = tmp_path / "timeline-rank00000.json"
    bad.write_text(json.dumps({"traceEvents": []}))
    with pytest.raises(ConfigurationError, match="not an axonhpc per-rank timeline"):
        merge_files([str(bad)])
    rec = tracing.Recorder(3)
    tracing.write_rank_file(str(tmp_path / "a.json"), rec)
    tracing.write_rank_file(str(tmp_path / "b.json"), rec)
    with pytest.raises(ConfigurationError, match="rank 3 appears twice"):
        merge_files([str(tmp_path / "a.json"), str(tmp_path / "b.json")])


@pytest.mark.timeout(300)
def test_whole_run_recording_by_setting_then_cli_merge(tmp_path):
    script = tmp_path / "job.py"
    script.write_text(
        "import numpy as np\nimport axonhpc as ax\n"
        "ax.init()\n"
        "for _ in range(5):\n    ax.all_reduce(np.ones(1000))\n"
        "ax.barrier()\n")
    directory = tmp_path / "tl"
    env = dict(os.environ, AXONHPC_TIMELINE_DIR=str(directory))
    mpiexec = os.path.join(os.path.dirname(sys.executable), "mpiexec")
    out = subprocess.run([mpiexec, "-n", "2", sys.executable, str(script)], capture_output=True, text=True,
                         timeout=120, env=env)
    assert out.returncode == 0, out.stderr
    assert sorted(os.listdir(directory)) == ["timeline-rank00000.json", "timeline-rank00001.json"]
    merged = subprocess.run([sys.executable, "-m", "axonhpc", "timeline", "merge", str(directory)],
                            capture_output=True, text=True, timeout=120)
    assert merged.returncode == 0, merged.stderr
    assert "merged the timelines of 2 rank(s)" in merged.stdout
    with open(directory / "timeline.json") as f:
        trace = json.load(f)
    spans = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    for rank in (0, 1):
        names = [e["name"] for e in spans if e["pid"] == rank]
        assert names.count("all_reduce") == 5 and names.count("barrier") == 1, names
    missing = subprocess.run([sys.executable, "-m", "axonhpc", "timeline", "merge", str(tmp_path / "none")],
                             capture_output=True, text=True, timeout=120)
    assert missing.returncode == 1 and f"timeline folder {str(tmp_path / 'none')!r} does not exist" in missing.stderr
    (tmp_path / "empty").mkdir()
    empty = subprocess.run([sys.executable, "-m", "axonhpc", "timeline", "merge", str(tmp_path / "empty")],
                           capture_output=True, text=True, timeout=120)
    assert empty.returncode == 1 and f"no timeline-rank*.json in {str(tmp_path / 'empty')!r}" in empty.stderr
