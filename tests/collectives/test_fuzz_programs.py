"""Seeded random programs of collectives over several groups, mixed ways, checked value by value.

The generator (``support.fuzz_program_cases``) makes valid MPI programs only (its note says how); each runs on
thread ranks at 2, 3 and 4 ranks and on the MPI world with shared memory "auto" and "off". A few fixed seeds run
by default; ``AXONHPC_FUZZ_SEEDS`` runs others instead (``"40"``: seeds 0-39, ``"100-200"``, ``"3,17"``), e.g.::

    AXONHPC_FUZZ_SEEDS=0-100 pytest tests/collectives/test_fuzz_programs.py

A program that works takes well under a second; on threads one that hangs is aborted after ``HANG_SECONDS``
and fails with every rank's stack (on MPI ranks the test's timeout ends the job).

Found so far (2026-11-28): eight hangs, seven fixed (tests/support/async_order_cases.py and mixed_way_cases.py
hold their reduced programs; the last fixed: a rank waiting inside the node's engine did not advance its MPI
requests in flight, [Note: MPI requests in flight while the node's engine waits] in backends/mpi_work.py). One is
known and not fixed, so its seeds are expected failures here and the MPI runs are opt-in (``AXONHPC_FUZZ_MPI=1``),
since a hang there ends the whole multi-rank job:

- ``KNOWN_HANGS``: an asynchronous call on a group whose earlier asynchronous call still waits for its check
  issues that call first, waiting for its check, while the other rank is in a blocking call of another group
  it reaches before the first call (valid MPI: nonblocking calls return at once). The check and the data share
  the group's communicator, so the later call's check cannot simply go first. Queueing the later call behind
  the earlier, its check started once they are issued, fixes these programs, but a call refused on one rank
  then left the others' later calls out of step (DDP's and FSDP's failures that reach every rank), and with
  the node's engine DDP hung in a bucket: tried 2026-11-28, not shipped.
"""
import os
import sys
import threading
import traceback

import pytest

import axonhpc as ax
from support.fuzz_program_cases import generate, run_program, seeds_from
from support.runner import mpi_test

SEEDS = seeds_from(os.environ.get("AXONHPC_FUZZ_SEEDS", "")) or [0, 1, 2, 3, 4, 5]
HANG_SECONDS = float(os.environ.get("AXONHPC_FUZZ_HANG_SECONDS", "15"))
# (seed, world size) -> the known, unfixed hang it shows on threads (see the module docstring)
KNOWN_HANGS = {(4, 2): "an asynchronous call waits for the check of its group's earlier asynchronous call",
               (5, 2): "an asynchronous call waits for the check of its group's earlier asynchronous call"}
RUN_ON_MPI = os.environ.get("AXONHPC_FUZZ_MPI") == "1"


def _case(seed):
    return lambda world: run_program(world, seed)


CASES = {f"seed{seed}": _case(seed) for seed in SEEDS}


def _stacks(names):
    frames = sys._current_frames()
    out = []
    for thread in threading.enumerate():
        if thread.name in names and thread.ident in frames:
            out.append(f"--- {thread.name} ---\n" + "".join(traceback.format_stack(frames[thread.ident])[-12:]))
    return "\n".join(out)


@pytest.mark.timeout(HANG_SECONDS + 60)
@pytest.mark.parametrize("world_size", (2, 3, 4))
@pytest.mark.parametrize("seed", SEEDS)
def test_fuzz_program_on_threads(seed, world_size, request):
    known = KNOWN_HANGS.get((seed, world_size))
    if known is not None:
        request.applymarker(pytest.mark.xfail(reason=f"known, not fixed: {known}", strict=True))
    worlds, outcome = [], {}

    def fn(world):
        worlds.append(world)
        run_program(world, seed)

    def runner():
        try:
            ax.run_local(fn, world_size=world_size)
        except BaseException as exc:  # noqa: BLE001 - raised in the test's thread
            outcome["error"] = exc

    thread = threading.Thread(target=runner, name="fuzz-run-local", daemon=True)
    thread.start()
    thread.join(3.0 if known is not None else HANG_SECONDS)  # a known hang is told apart in 3 s
    if thread.is_alive():
        stacks = _stacks({f"axonhpc-rank{r}" for r in range(world_size)})
        for world in list(worlds):  # wake the ranks (LocalAbort), so nothing keeps spinning after the test
            world.backend.abort_quietly(f"fuzz program seed {seed} hung")
        thread.join(10)
        pytest.fail(f"seed {seed} at {world_size} ranks hung (a valid MPI program); "
                    f"stacks:\n{stacks}\n\nprogram:\n{generate(seed, world_size).describe()}")
    if "error" in outcome:
        raise outcome["error"]


test_fuzz_program_on_mpi_ranks = mpi_test(
    CASES, min_size=2, shm=["auto", "off"],
    marks=(pytest.mark.timeout(120), pytest.mark.skipif(not RUN_ON_MPI, reason="known hangs on MPI ranks (see the module "
                                                          "docstring): AXONHPC_FUZZ_MPI=1 runs them")))


@pytest.mark.parametrize("world_size", (2, 3, 4))
def test_programs_are_the_same_every_time_and_deadlock_free(world_size):
    from support.fuzz_program_cases import deadlock_free

    for seed in range(50):
        a, b = generate(seed, world_size), generate(seed, world_size)
        assert a.describe() == b.describe()
        assert deadlock_free(a, a.events)
