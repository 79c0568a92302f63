"""examples/train_fsdp.py (the script the fsdp-hybrid SLURM template runs) trains and resumes under mpiexec."""
import os
import subprocess
import sys

import pytest

from support.paths import ROOT

pytest.importorskip("sklearn")

SCRIPT = os.path.join(ROOT, "examples", "train_fsdp.py")
MPIEXEC = os.path.join(os.path.dirname(sys.executable), "mpiexec")


def _run(n, args, cwd):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    return subprocess.run([MPIEXEC, "-n", str(n), sys.executable, SCRIPT, *args], capture_output=True, text=True,
                          timeout=600, cwd=cwd, env=env)


def test_hybrid_shard_over_two_blocks_of_two_ranks_learns_and_resumes(tmp_path):
    ckpt = str(tmp_path / "ckpt")
    first = _run(4, ["--ranks-per-node", "2", "--epochs", "6", "--checkpoint-dir", ckpt, "--min-accuracy", "0.85"],
                 tmp_path)
    assert first.returncode == 0, first.stdout + first.stderr
    assert "FSDP hybrid_shard on 4 rank(s): each parameter sharded over 2 rank(s), 2 replica(s)" in first.stdout
    assert "epoch   6" in first.stdout
    resumed = _run(4, ["--ranks-per-node", "2", "--epochs", "8", "--checkpoint-dir", ckpt, "--resume"], tmp_path)
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    assert "epoch   7" in resumed.stdout and "epoch   1 " not in resumed.stdout  # continued, not restarted


def test_hybrid_shard_on_one_node_shards_over_every_rank(tmp_path):
    out = _run(2, ["--epochs", "1", "--checkpoint-dir", str(tmp_path / "ckpt")], tmp_path)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "each parameter sharded over 2 rank(s), 1 replica(s)" in out.stdout
