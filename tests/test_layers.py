"""The layer picture of docs/architecture.md, enforced by import-linter, and public docstrings."""
import inspect
import os
import shutil
import subprocess
import sys

import pytest

import axonhpc as ax

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_import_layers_hold():
    lint = os.path.join(os.path.dirname(sys.executable), "lint-imports")
    if not os.path.exists(lint):
        lint = shutil.which("lint-imports")
    assert lint, "import-linter is part of the test extra"
    out = subprocess.run([lint, "--no-cache"], capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "broken" not in out.stdout.lower() or "0 broken" in out.stdout.lower()


def test_layer_contract_catches_an_upward_import(tmp_path):
    """The checker is live: a backend importing the collectives must fail it."""
    src = os.path.join(ROOT, "axonhpc")
    dst = tmp_path / "axonhpc"
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("*.so", "__pycache__"))
    with open(dst / "backends" / "local.py", "a") as f:
        f.write("\nfrom ..collectives import all_reduce  # upward on purpose\n")
    shutil.copy(os.path.join(ROOT, "pyproject.toml"), tmp_path / "pyproject.toml")
    lint = os.path.join(os.path.dirname(sys.executable), "lint-imports")
    env = dict(os.environ, PYTHONPATH=str(tmp_path))
    out = subprocess.run([lint, "--no-cache"], capture_output=True, text=True, cwd=tmp_path, env=env, timeout=300)
    assert out.returncode != 0, out.stdout
    assert "axonhpc.backends.local -> axonhpc.collectives" in out.stdout


@pytest.mark.parametrize("name", sorted(ax.__all__))
def test_public_names_have_docstrings(name):
    obj = getattr(ax, name)
    if inspect.isfunction(obj) or inspect.isclass(obj) or inspect.ismodule(obj):
        assert inspect.getdoc(obj), f"axonhpc.{name} has no docstring"
    if inspect.isclass(obj):
        for attr, member in vars(obj).items():
            if not attr.startswith("_") and inspect.isfunction(member):
                assert inspect.getdoc(member), f"axonhpc.{name}.{attr} has no docstring"
