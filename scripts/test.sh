#!/usr/bin/env bash
# The whole test suite, from a fresh machine: set-up, then the serial suite
# (plain pytest: the in-process backend, compiled buffers, layers, ...), then
# the multi-rank suite under mpiexec -n 2, 3 and 4, each wrapped in an outer
# timeout. Per-rank logs land in test-logs/. Ends with one line:
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
TIMEOUT_ARGS=(--timeout=300 --timeout-method=thread)
status=0

echo "== serial suite (plain pytest)"
timeout -k 10 1500 "$PY" -m pytest -q -p no:cacheprovider --color=no "${TIMEOUT_ARGS[@]}" \
    --basetemp="$LOGS/tmp-serial" --junitxml="$LOGS/serial/junit.xml" "$@"
code=$?
[ $code -ne 0 ] && { echo "serial suite failed (exit $code)"; status=1; }

for n in 2 3 4; do
    echo "== multi-rank suite: mpiexec -n $n"
    timeout -k 10 900 "$MPIEXEC" -n "$n" "$PY" scripts/mpi_pytest.py "$LOGS/mpi-n$n" \
        -q -m mpi "${TIMEOUT_ARGS[@]}" "$@"
    code=$?
    if [ $code -ne 0 ]; then
        echo "multi-rank suite at n=$n failed (exit $code); per-rank logs:"
        for f in "$LOGS/mpi-n$n"/rank*.log; do
            [ -f "$f" ] && { echo "----- $f -----"; tail -n 80 "$f"; }
        done
        status=1
    fi
done

"$PY" scripts/junit_total.py "$LOGS" || status=1
exit $status
