"""TextCorpus: byte-level standard-library text, split by file, sampled deterministically."""
import os
import subprocess
import sys
import sysconfig

import numpy as np
import pytest

from axonhpc.data import TextCorpus, sample_windows, stdlib_source_files
from axonhpc.errors import ConfigurationError


@pytest.fixture
def tree(tmp_path):
    """Ten small .py files in two folders, plus files that must be skipped."""
    (tmp_path / "pkg").mkdir()
    (tmp_path / "site-packages").mkdir()
    (tmp_path / "__pycache__").mkdir()
    for i in range(6):
        (tmp_path / f"m{i}.py").write_bytes(f"# module {i}\nx = {i}\n".encode() * 3)
    for i in range(4):
        (tmp_path / "pkg" / f"p{i}.py").write_bytes(f"def f{i}(): return {i}\n".encode())
    (tmp_path / "site-packages" / "other.py").write_bytes(b"nope\n")
    (tmp_path / "__pycache__" / "m0.py").write_bytes(b"nope\n")
    (tmp_path / "notes.txt").write_bytes(b"nope\n")
    return tmp_path


def test_files_sorted_and_skipped(tree):
    files = stdlib_source_files(str(tree))
    assert files == sorted(files) and len(files) == 10
    assert "pkg/p0.py" in files and not any("site-packages" in f or "pycache" in f for f in files)


def test_split_is_by_file_and_covers_everything(tree):
    corpus = TextCorpus(held_out=0.3, seed=1, root=str(tree))
    assert len(corpus.val_files) == 3 and len(corpus.train_files) == 7
    assert set(corpus.val_files).isdisjoint(corpus.train_files)
    assert sorted(corpus.train_files + corpus.val_files) == stdlib_source_files(str(tree))
    expected_val = b"".join((tree / f).read_bytes() for f in corpus.val_files)
    assert corpus.val.tobytes() == expected_val and corpus.val.dtype == np.uint8
    assert corpus.train.tobytes() == b"".join((tree / f).read_bytes() for f in corpus.train_files)
    other = TextCorpus(held_out=0.3, seed=2, root=str(tree))
    again = TextCorpus(held_out=0.3, seed=1, root=str(tree))
    assert again.val_files == corpus.val_files and np.array_equal(again.train, corpus.train)
    assert other.val_files != corpus.val_files  # the seed chooses the held-out files


def test_max_bytes_caps_the_read(tree):
    files = stdlib_source_files(str(tree))
    first = len((tree / files[0]).read_bytes())
    corpus = TextCorpus(max_bytes=first + 5, held_out=0.5, root=str(tree))
    assert len(corpus.train) + len(corpus.val) == first + 5
    assert sorted(corpus.train_files + corpus.val_files) == files[:2]


def test_windows_are_next_token_pairs_and_seeded():
    tokens = np.arange(100, dtype=np.uint8)
    x, y = sample_windows(tokens, 6, 9, np.random.default_rng(0))
    assert x.shape == y.shape == (6, 9) and x.dtype == y.dtype == np.int64
    np.testing.assert_array_equal(y, x + 1)  # consecutive tokens: targets are the inputs shifted by one
    x2, _ = sample_windows(tokens, 6, 9, np.random.default_rng(0))
    np.testing.assert_array_equal(x, x2)
    # Every start is reachable, the last one included.
    starts = sample_windows(tokens[:12], 500, 10, np.random.default_rng(1))[0][:, 0]
    assert set(starts.tolist()) == {0, 1}
    with pytest.raises(ConfigurationError):
        sample_windows(tokens[:5], 1, 5, np.random.default_rng(0))


def test_stdlib_corpus_is_deterministic_and_capped():
    corpus = TextCorpus(max_bytes=300_000, held_out=0.1, seed=0)
    assert corpus.vocab_size == 256
    assert len(corpus.train) + len(corpus.val) == 300_000
    assert len(corpus.val_files) >= 1 and len(corpus.train) > len(corpus.val)
    root = sysconfig.get_paths()["stdlib"]
    assert corpus.train_files[0] == sorted(corpus.train_files)[0]
    assert os.path.isfile(os.path.join(root, corpus.val_files[0]))
    a = [next(corpus.batches("train", 4, 32, seed=7)) for _ in range(2)]
    batches = corpus.batches("train", 4, 32, seed=7)
    b = [next(batches), next(batches)]
    np.testing.assert_array_equal(a[0][0], b[0][0])  # same seed, same first batch
    assert not np.array_equal(b[0][0], b[1][0])      # the stream moves on
    xv, yv = next(corpus.batches("val", 2, 8, seed=0))
    assert xv.max() < 256 and yv.shape == (2, 8)
    with pytest.raises(ConfigurationError):
        corpus.split("test")


def test_same_corpus_in_a_fresh_process():
    code = ("from axonhpc.data import TextCorpus; import hashlib; c = TextCorpus(max_bytes=200_000, seed=3); "
            "x, y = next(c.batches('train', 4, 16, seed=5)); "
            "print(hashlib.sha256(c.train.tobytes() + c.val.tobytes() + x.tobytes()).hexdigest(), c.val_files)")
    runs = [subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
            for _ in range(2)]
    assert runs[0] == runs[1] and runs[0].strip()


@pytest.mark.parametrize("kw", [dict(max_bytes=0), dict(held_out=0.0), dict(held_out=1.0)])
def test_bad_arguments(tree, kw):
    with pytest.raises(ConfigurationError):
        TextCorpus(root=str(tree), **kw)


def test_too_few_files(tmp_path):
    (tmp_path / "only.py").write_bytes(b"x = 1\n")
    with pytest.raises(ConfigurationError, match="at least 2"):
        TextCorpus(root=str(tmp_path))
