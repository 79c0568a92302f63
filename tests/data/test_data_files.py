"""Your own corpus (``FileCorpus``, ``train_gpt.py --data``) and memory-mapped arrays in the ``DataLoader``."""
import os
import re
import subprocess
import sys

import numpy as np
import pytest

from axonhpc.data import DataLoader, DistributedSampler, FileCorpus, TextWindows
from axonhpc.errors import ConfigurationError, NotFoundError, ShapeError
from support.paths import ROOT

BIN = os.path.dirname(sys.executable)


def test_a_text_file_is_its_bytes_memory_mapped_with_its_tail_held_out(tmp_path):
    text = b"hello, corpus\n" * 100
    (tmp_path / "a.txt").write_bytes(text)
    corpus = FileCorpus(str(tmp_path / "a.txt"), held_out=0.1)
    assert corpus.kind == "bytes" and corpus.vocab_size == 256
    assert isinstance(corpus.train, np.memmap) and corpus.train.dtype == np.uint8
    assert len(corpus.val) == 140 and bytes(corpus.train) + bytes(corpus.val) == text


def test_a_folder_of_text_is_split_by_file_the_same_way_every_time(tmp_path):
    for k in range(10):
        (tmp_path / f"part{k:02d}.txt").write_bytes(bytes([65 + k]) * (10 + k))
    (tmp_path / ".hidden").write_bytes(b"skipped")
    a, b = FileCorpus(str(tmp_path), held_out=0.2, seed=3), FileCorpus(str(tmp_path), held_out=0.2, seed=3)
    np.testing.assert_array_equal(a.train, b.train)
    letters = set(bytes(a.val)) | set(bytes(a.train))
    assert len(set(bytes(a.val))) == 2 and not set(bytes(a.val)) & set(bytes(a.train))  # whole files held out
    assert letters == set(range(65, 75)) and b"skipped"[0] not in letters - set(range(65, 75))


def test_nanogpt_token_files_are_uint16_memory_mapped(tmp_path):
    rng = np.random.default_rng(0)
    train, val = rng.integers(0, 1000, 5000).astype(np.uint16), rng.integers(0, 900, 700).astype(np.uint16)
    train.tofile(tmp_path / "train.bin")
    val.tofile(tmp_path / "val.bin")
    corpus = FileCorpus(str(tmp_path))
    assert corpus.kind == "tokens" and isinstance(corpus.train, np.memmap) and corpus.train.dtype == np.uint16
    np.testing.assert_array_equal(corpus.train, train)
    np.testing.assert_array_equal(corpus.val, val)
    assert corpus.vocab_size == int(max(train.max(), val.max())) + 1
    assert FileCorpus(str(tmp_path), vocab_size=50257).vocab_size == 50257
    single = FileCorpus(str(tmp_path / "train.bin"), held_out=0.2)  # one file: its tail held out
    assert len(single.val) == 1000 and len(single.train) == 4000


def test_bad_corpora_are_refused_with_the_path(tmp_path):
    with pytest.raises(NotFoundError, match="does not exist"):
        FileCorpus(str(tmp_path / "missing"))
    (tmp_path / "odd.bin").write_bytes(b"abc")
    with pytest.raises(ShapeError, match="3 bytes is not a whole number of uint16 tokens"):
        FileCorpus(str(tmp_path / "odd.bin"))
    (tmp_path / "only").mkdir()
    np.zeros(10, np.uint16).tofile(tmp_path / "only" / "train.bin")
    with pytest.raises(ConfigurationError, match="holds train.bin but not val.bin"):
        FileCorpus(str(tmp_path / "only"))
    np.full(100, 7, np.uint16).tofile(tmp_path / "tok.bin")
    with pytest.raises(ConfigurationError, match="token 7 is beyond vocab_size=5"):
        FileCorpus(str(tmp_path / "tok.bin"), vocab_size=5)


def test_windows_of_a_mapped_corpus_are_the_same_on_any_number_of_ranks(tmp_path):
    np.random.default_rng(1).integers(0, 300, 4000).astype(np.uint16).tofile(tmp_path / "t.bin")
    tokens = FileCorpus(str(tmp_path / "t.bin")).train
    one = TextWindows(tokens, 16, 8, 1, 0, seed=2).batch(5)[0]
    two = np.concatenate([TextWindows(tokens, 16, 8, 2, r, seed=2).batch(5)[0] for r in range(2)])
    assert sorted(map(tuple, one)) == sorted(map(tuple, two))


def test_the_data_loader_batches_memory_mapped_arrays(tmp_path):
    x = np.memmap(tmp_path / "x.bin", dtype=np.float32, mode="w+", shape=(50, 3))
    x[:] = np.arange(150, dtype=np.float32).reshape(50, 3)
    y = np.arange(50)
    mapped = list(DataLoader((x, y), batch_size=8, sampler=DistributedSampler(50, 2, 1, seed=4)))
    in_memory = list(DataLoader((np.array(x), y), batch_size=8, sampler=DistributedSampler(50, 2, 1, seed=4)))
    assert len(mapped) == len(in_memory) == 4
    for (a, b), (c, d) in zip(mapped, in_memory):
        np.testing.assert_array_equal(a, c)
        np.testing.assert_array_equal(b, d)


@pytest.mark.timeout(300)
def test_train_gpt_on_your_own_data_gives_one_loss_on_any_layout(tmp_path):
    np.random.default_rng(2).integers(0, 97, 30000).astype(np.uint16).tofile(tmp_path / "train.bin")
    np.random.default_rng(3).integers(0, 97, 5000).astype(np.uint16).tofile(tmp_path / "val.bin")
    args = [os.path.join(ROOT, "examples", "train_gpt.py"), "--data", str(tmp_path), "--steps", "3", "--width", "16",
            "--layers", "1", "--heads", "2", "--context", "16", "--batch", "4", "--dtype", "float64"]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    losses = []
    for cmd in ([sys.executable] + args, [os.path.join(BIN, "mpiexec"), "-n", "2", sys.executable] + args + ["--dp", "2"]):
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=240, cwd=tmp_path, env=env)
        assert out.returncode == 0, out.stdout + out.stderr
        assert "vocabulary 97" in out.stdout, out.stdout
        losses.append(float(re.search(r"final loss (\S+)", out.stdout).group(1)))
    assert abs(losses[0] - losses[1]) <= 1e-10 * abs(losses[0]), losses
