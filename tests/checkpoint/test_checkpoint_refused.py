"""Refused checkpoint loads: the cases of support/checkpoint_load_cases.py on thread ranks and on MPI (every rank
refuses, none changes anything), and the save tokens of directory checkpoints in one process."""
import os

import numpy as np
import pytest

from axonhpc.checkpoint import load_per_rank, save, save_per_rank
from axonhpc.checkpoint.directory import INDEX, PER_RANK_FORMAT, rank_file
from axonhpc.checkpoint.format import encode
from axonhpc.checkpoint.io import read_saved, write_atomic
from axonhpc.errors import CheckpointError
from axonhpc.groups import ProcessGroup
from support.checkpoint_load_cases import CASES
from support.runner import case_tests

test_refused_case_local, test_refused_case_mpi = case_tests(CASES)

ONE = ProcessGroup.mock()


def test_every_file_of_a_directory_save_carries_the_index_token(tmp_path):
    path = str(tmp_path / "ckpt")
    save_per_rank(path, {"w": np.ones(2)}, group=ONE, extra={"step": 1})
    index, _, token = read_saved(os.path.join(path, INDEX))
    assert index["format"] == PER_RANK_FORMAT == "axonhpc.per-rank/2"
    assert isinstance(token, str) and len(token) == 32 and int(token, 16) >= 0
    assert read_saved(os.path.join(path, rank_file(0, 1)))[2] == token
    save_per_rank(path, {"w": np.ones(2)}, group=ONE, extra={"step": 1})  # the next save draws another
    assert read_saved(os.path.join(path, INDEX))[2] != token


def test_a_directory_saved_before_tokens_still_loads(tmp_path):
    """Format /1, written by hand as axonhpc wrote it then: no tokens anywhere, so nothing to check."""
    path = str(tmp_path / "ckpt")
    os.mkdir(path)
    save(os.path.join(path, rank_file(0, 1)), {"w": np.full(2, 3.0)}, group=ONE)
    save(os.path.join(path, INDEX), {"format": "axonhpc.per-rank/1", "world_size": 1, "extra": {"step": 3}},
         group=ONE)
    state, extra = load_per_rank(path, group=ONE)
    assert extra == {"step": 3} and np.all(state["w"] == 3.0)


def test_an_index_without_its_token_or_with_a_malformed_one_is_refused(tmp_path):
    path = str(tmp_path / "ckpt")
    save_per_rank(path, {"w": np.ones(2)}, group=ONE, extra=None)
    token = read_saved(os.path.join(path, rank_file(0, 1)))[2]
    index = {"format": PER_RANK_FORMAT, "world_size": 1, "extra": None}
    save(os.path.join(path, INDEX), index, group=ONE)  # rewritten by hand: a current format, no token
    with pytest.raises(CheckpointError, match=f"'{rank_file(0, 1)}' was written by save '{token}', but the index "
                                              f"was written with no save token"):
        load_per_rank(path, group=ONE)
    for bad in ("xyz", 12, "A" * 32):
        write_atomic(os.path.join(path, INDEX), encode(index, save=bad))
        with pytest.raises(CheckpointError, match="records the save token .*; expected 32 hex digits"):
            load_per_rank(path, group=ONE)


def test_a_file_without_a_token_in_a_tokened_directory_is_refused(tmp_path):
    path = str(tmp_path / "ckpt")
    save_per_rank(path, {"w": np.ones(2)}, group=ONE, extra=None)
    save(os.path.join(path, rank_file(0, 1)), {"w": np.zeros(2)}, group=ONE)  # a plain file put in its place
    with pytest.raises(CheckpointError, match="records no save token"):
        load_per_rank(path, group=ONE)
