"""Every runnable example in docs/ runs and exits 0.

A fenced python block whose first line is ``# run with: mpiexec -n N`` runs on
N ranks; ``# run with: python`` runs in one process. A fenced bash block whose
first line is ``# run with: bash`` runs as a shell script (``set -eu``) in a
scratch folder that links the repository's ``examples/``, with this
environment's ``bin/`` (``axonhpc``, ``mpiexec``) first on the PATH.
"""
import glob
import os
import re
import subprocess
import sys

import pytest

from support.paths import ROOT

BLOCK = re.compile(r"```python\n(# run with: (?P<how>[^\n]+)\n.*?)```", re.S)
SHELL_BLOCK = re.compile(r"```bash\n(# run with: bash\n.*?)```", re.S)


def _examples():
    for path in sorted(glob.glob(os.path.join(ROOT, "docs", "*.md"))):
        with open(path) as f:
            text = f.read()
        for i, m in enumerate(BLOCK.finditer(text)):
            yield pytest.param(m.group(1), m.group("how").strip(), id=f"{os.path.basename(path)}-{i}")


@pytest.mark.parametrize("code,how", list(_examples()))
def test_doc_example_runs(code, how, tmp_path):
    script = tmp_path / "example.py"
    script.write_text(code)
    if how == "python":
        cmd = [sys.executable, str(script)]
    else:
        m = re.fullmatch(r"mpiexec -n (\d+)", how)
        assert m, f"unknown run line {how!r}"
        cmd = [os.path.join(os.path.dirname(sys.executable), "mpiexec"), "-n", m.group(1), sys.executable, str(script)]
    env = dict(os.environ, AXONHPC_ABORT_ON_EXCEPTION="1")
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=180, cwd=tmp_path, env=env)
    assert out.returncode == 0, f"exit {out.returncode}\nstdout:\n{out.stdout}\nstderr:\n{out.stderr}"


def _shell_examples():
    for path in sorted(glob.glob(os.path.join(ROOT, "docs", "*.md"))):
        with open(path) as f:
            text = f.read()
        for i, m in enumerate(SHELL_BLOCK.finditer(text)):
            yield pytest.param(m.group(1), id=f"{os.path.basename(path)}-sh{i}")


@pytest.mark.parametrize("code", list(_shell_examples()))
def test_doc_shell_example_runs(code, tmp_path):
    (tmp_path / "examples").symlink_to(os.path.join(ROOT, "examples"))
    script = tmp_path / "example.sh"
    script.write_text("set -eu\n" + code)
    bindir = os.path.dirname(sys.executable)
    env = dict(os.environ, PATH=bindir + os.pathsep + os.environ.get("PATH", ""), OMP_NUM_THREADS="1")
    out = subprocess.run(["bash", str(script)], capture_output=True, text=True, timeout=300, cwd=tmp_path, env=env)
    assert out.returncode == 0, f"exit {out.returncode}\nstdout:\n{out.stdout}\nstderr:\n{out.stderr}"


def test_there_are_runnable_examples():
    assert len(list(_examples())) >= 5
    shell = [p.values[0] for p in _shell_examples()]
    assert any("axonhpc timeline merge" in code for code in shell)  # docs/observability.md's launch line
