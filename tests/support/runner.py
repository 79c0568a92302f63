"""The one runner of the ``*_cases`` modules: every case on in-process threads, and on the real MPI world.

A ``*_cases`` module holds ``CASES``, a name -> function of a ``World``. A test
file turns them into its two parametrized tests, named as it likes::

    test_ddp_case_local, test_ddp_case_mpi = case_tests(CASES)

- the threads test runs each case with ``ax.run_local`` at every world size of
  ``sizes`` (plain pytest);
- the MPI test is marked ``mpi(min_size=...)`` and runs each case on every rank
  of the mpiexec job (``scripts/mpi_pytest.py``), collectively
  (``support.mpi_assert``): a failure on one rank fails every rank.

``threads_test`` and ``mpi_test`` make one of the two, for a file that wants
only that one. pytest collects a test by the module-level name it is bound to.
"""
import inspect

import pytest

import axonhpc as ax
from support.mpi_assert import collectively
from support.settings_override import override

WORLD_SIZES = (1, 2, 3, 4)


def _taking(test, names):
    """``test`` as pytest sees it: a function of exactly these arguments (parameters, then fixtures)."""
    kind = inspect.Parameter.POSITIONAL_OR_KEYWORD
    test.__signature__ = inspect.Signature([inspect.Parameter(name, kind) for name in names])
    return test


def _marked(test, marks):
    """``test`` under these marks, listed as decorators are (the last applied first)."""
    for mark in reversed(marks):
        test = mark(test)
    return test


def threads_test(cases, *, sizes=WORLD_SIZES, fixtures=(), marks=()):
    """A test running ``cases[case](world, *fixtures)`` on thread ranks for each case and world size.

    Args:
        cases: name -> function of a ``World`` (a ``*_cases`` module's ``CASES``).
        sizes: the world sizes; or a function of a case's name giving that case's
            sizes, parametrized as ``case,world_size`` pairs.
        fixtures: names of fixtures whose values each case takes after the world.
        marks: pytest marks for the test (a timeout, say).
    """
    if callable(sizes):
        pairs = [(case, n) for case in sorted(cases) for n in sizes(case)]
        parametrize = [pytest.mark.parametrize("case,world_size", pairs, ids=[f"{c}-{n}" for c, n in pairs])]
    else:
        parametrize = [pytest.mark.parametrize("world_size", list(sizes)),
                       pytest.mark.parametrize("case", sorted(cases))]

    def test(case, world_size, **values):
        fn, extra = cases[case], [values[name] for name in fixtures]
        ax.run_local((lambda world: fn(world, *extra)) if extra else fn, world_size=world_size)

    return _marked(_taking(test, ["case", "world_size", *fixtures]), [*marks, *parametrize])


def mpi_test(cases, *, min_size=1, shm=None, sizes=None, fixtures=(), marks=()):
    """A test running ``cases[case](mpi_world, *fixtures)`` on every rank of the MPI world, collectively.

    Args:
        cases: name -> function of a ``World``.
        min_size: the smallest world the test runs in (``pytest.mark.mpi(min_size=...)``).
        shm: ``None`` leaves ``ax.settings.shm_collectives`` alone; a value runs
            every case with that setting; a list of values parametrizes the test
            over them (as ``shm``).
        sizes: ``None``, or a function of a case's name giving the world sizes
            it runs at: it is skipped at the others.
        fixtures: names of fixtures whose values each case takes after the world.
        marks: pytest marks for the test, besides ``mpi``.
    """
    varied = isinstance(shm, (list, tuple))

    def test(case, mpi_world, **values):
        if sizes is not None and mpi_world.world_size not in sizes(case):
            pytest.skip(f"{case} runs at world sizes {sizes(case)}")
        extra = [values[name] for name in fixtures]

        def check():
            cases[case](mpi_world, *extra)

        setting = values["shm"] if varied else shm
        if setting is None:
            collectively(mpi_world, check)
        else:
            with override(shm_collectives=setting):
                collectively(mpi_world, check)

    parametrize = [pytest.mark.parametrize("case", sorted(cases))]
    if varied:
        parametrize.insert(0, pytest.mark.parametrize("shm", list(shm)))
    names = ["case", *(["shm"] if varied else []), "mpi_world", *fixtures]
    return _marked(_taking(test, names), [*marks, pytest.mark.mpi(min_size=min_size), *parametrize])


def case_tests(cases, *, sizes=WORLD_SIZES, min_size=1, shm=None, fixtures=(), threads_marks=(), mpi_marks=()):
    """``(threads_test, mpi_test)`` for the same cases; the arguments as theirs.

    ``sizes`` is the threads test's; given as a function, the MPI test also
    skips each case at the world sizes it does not list.
    """
    return (threads_test(cases, sizes=sizes, fixtures=fixtures, marks=threads_marks),
            mpi_test(cases, min_size=min_size, shm=shm, sizes=sizes if callable(sizes) else None, fixtures=fixtures,
                     marks=mpi_marks))
