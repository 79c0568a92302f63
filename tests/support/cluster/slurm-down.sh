#!/usr/bin/env bash
# slurm-down.sh -- stop what slurm-up.sh started (by its recorded pids only) and remove its state.
set -uo pipefail
STATE=${AXONHPC_SLURM_STATE:-/tmp/axonhpc-slurm/one}
if [ -f "$STATE/run/slurmctld.bg.pid" ]; then
  jobs=$(squeue -h -o %i 2>/dev/null || true)
  [ -n "$jobs" ] && scancel $jobs 2>/dev/null && sleep 1
fi
stop() {
  [ -f "$1" ] || return 0
  local pid; pid=$(cat "$1")
  kill -TERM "$pid" 2>/dev/null || return 0
  for _ in $(seq 50); do kill -0 "$pid" 2>/dev/null || return 0; sleep 0.1; done
  kill -KILL "$pid" 2>/dev/null || true
}
stop "$STATE/run/slurmd.bg.pid"
stop "$STATE/run/slurmctld.bg.pid"
stop "$STATE/run/munged.pid"
rm -rf "$STATE"
rm -f /etc/slurm/slurm.conf
echo "[slurm-down] done"
