#!/usr/bin/env bash
# slurm-netns-down.sh -- stop what slurm-netns-up.sh started (recorded pids), then remove the namespaces.
set -uo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
D=${AXONHPC_SLURM_MULTI:-/tmp/axonhpc-slurm/multi}; ST=$D/state
export SLURM_CONF=$D/slurm.conf
if [ -f "$ST/run/slurmctld.bg.pid" ] && [ -e /run/netns/host1 ]; then
  jobs=$(nsenter --net=/run/netns/host1 squeue -h -o %i 2>/dev/null || true)
  [ -n "$jobs" ] && nsenter --net=/run/netns/host1 scancel $jobs && sleep 1
fi
for f in "$ST"/run/slurmd-*.bg.pid "$ST/run/slurmctld.bg.pid" "$ST/run/munged.pid"; do
  [ -f "$f" ] || continue
  p=$(cat "$f"); kill -TERM "$p" 2>/dev/null || continue
  for _ in $(seq 50); do kill -0 "$p" 2>/dev/null || break; sleep 0.1; done
  kill -KILL "$p" 2>/dev/null || true
done
"$HERE/netns-down.sh" >/dev/null
rm -rf "$ST" "$D/slurm.conf"
echo "[slurm-netns-down] done"
