"""``Work.wait``'s timeout: a number of seconds, 0 or more; ``math.inf`` waits forever, None the group's timeout."""
import math

import numpy as np
import pytest

import axonhpc as ax
from axonhpc.backends.base import Work
from axonhpc.errors import ArgumentTypeError, InvalidArgumentError


class _Pending(Work):
    """A Work that completes once it has been tested ``polls`` times."""

    def __init__(self, polls=3):
        super().__init__("done")
        self.polls = polls

    def _test(self):
        self.polls -= 1
        return self.polls < 0


@pytest.mark.parametrize("timeout", [float("nan"), -1, -0.5, -math.inf, np.float64("nan")])
def test_a_negative_or_nan_timeout_is_refused_naming_it(timeout):
    # NaN waited for ever (no deadline is ever reached); -1 "timed out after -1 s"
    for work in (_Pending(), _Pending(polls=-1)):  # still running, or done already: the same answer
        with pytest.raises(InvalidArgumentError, match=r"wait\(timeout=(-?nan|-1|-0\.5|-inf)\)") as info:
            work.wait(timeout=timeout)
        assert "0 or more seconds" in str(info.value) and "math.inf" in str(info.value)


@pytest.mark.parametrize("timeout", ["3", True, [1]])
def test_a_timeout_that_is_not_a_number_is_refused(timeout):
    with pytest.raises(ArgumentTypeError, match="the timeout is a number of seconds"):
        _Pending().wait(timeout=timeout)


@pytest.mark.parametrize("timeout", [None, 0.5, 5, math.inf, np.float32(2.0)])
def test_valid_timeouts_wait(timeout):
    assert _Pending().wait(timeout=timeout) == "done"
    assert _Pending(polls=0).wait(timeout=0) == "done"  # 0: done at the first look, else a timeout at once


def test_an_irecv_timeout_of_nan_is_refused_before_it_waits():
    def body(world):
        if world.rank == 0:
            work = ax.irecv(np.zeros(1), src=1, tag=9)
            with pytest.raises(InvalidArgumentError, match=r"timeout=nan"):
                work.wait(timeout=float("nan"))
            ax.barrier()
            work.wait(timeout=30)
        else:
            ax.barrier()
            ax.send(np.ones(1), dst=0, tag=9)

    ax.run_local(body, 2)
