#!/usr/bin/env bash
# The main job, from a fresh machine: set up, then train an MLP on the
# handwritten digits with DDP on 2 ranks (MPI from PyPI). It checkpoints each
# epoch under checkpoints/digits/ and fails if the held-out accuracy ends
# below 95%. Extra arguments go to examples/train_digits.py (e.g. --resume).
# AXONHPC_DEVICE=cuda trains on the GPU(s) (the model and data as cupy arrays;
# the venv needs cupy: scripts/gpu-check.sh installs the right one).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup-env.sh
N=${AXONHPC_RANKS:-2}
DEVICE=${AXONHPC_DEVICE:-cpu}
case "$DEVICE" in
    cpu|cuda) ;;
    *) echo "demo: AXONHPC_DEVICE must be cpu or cuda, got '$DEVICE'" >&2; exit 2 ;;
esac
export OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1 AXONHPC_ABORT_ON_EXCEPTION=1
# A run without --resume starts afresh: the trainer refuses to write a new run's checkpoints among an
# earlier run's (pruning could delete the new ones), so the demo's own directory is emptied first.
case " $* " in
    *" --resume "*) ;;
    *) rm -rf checkpoints/digits ;;
esac
exec timeout -k 10 900 "${AXONHPC_VENV:-.venv}/bin/axonhpc" launch -n "$N" -- examples/train_digits.py \
    --epochs 20 --min-accuracy 0.95 --checkpoint-dir checkpoints/digits --device "$DEVICE" "$@"
