#!/usr/bin/env bash
# slurm-netns-up.sh N -- an N-node SLURM cluster: hosts host1..hostN in network namespaces (netns-up.sh),
# one slurmd in each, slurmctld in host1. Needs the packages slurm-up.sh installs. Clients run in host1:
#   SLURM_CONF=/tmp/axonhpc-slurm/multi/slurm.conf nsenter --net=/run/netns/host1 sbatch -N 2 ...
set -euo pipefail
N=${1:-2}
HERE=$(cd "$(dirname "$0")" && pwd)
D=${AXONHPC_SLURM_MULTI:-/tmp/axonhpc-slurm/multi}; ST=$D/state
mkdir -p "$ST"/ctld "$ST"/log "$ST"/run
"$HERE/netns-up.sh" "$N" >/dev/null
install -d -o munge -g munge -m 0755 /run/munge   # its socket is reachable from every namespace
if ! munge -n 2>/dev/null | unmunge >/dev/null 2>&1; then
  runuser -u munge -- /usr/sbin/munged
  for _ in $(seq 50); do munge -n 2>/dev/null | unmunge >/dev/null 2>&1 && break; sleep 0.1; done
  cp /run/munge/munged.pid "$ST/run/munged.pid"
fi
{
cat <<CONF
ClusterName=axonhpc-netns
SlurmctldHost=host1(10.77.0.11)
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
StateSaveLocation=$ST/ctld
SlurmdSpoolDir=$ST/spool-%n
TmpFS=$ST/tmp-%n
SlurmctldPidFile=$ST/run/slurmctld.pid
SlurmdPidFile=$ST/run/slurmd-%n.pid
SlurmctldLogFile=$ST/log/slurmctld.log
SlurmdLogFile=$ST/log/slurmd-%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SlurmdParameters=config_overrides
MpiDefault=none
ReturnToService=2
MailProg=/bin/true
FirstJobId=$(( ($(date +%s) % 600000) * 100 + 1 ))
CONF
for i in $(seq 1 "$N"); do echo "NodeName=host$i NodeAddr=10.77.0.$((10 + i)) CPUs=4"; done
echo "PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP OverSubscribe=FORCE:4"
} > "$D/slurm.conf"
export SLURM_CONF=$D/slurm.conf
# nsenter --net, not `ip netns exec`: the latter remounts /sys and slurmd then finds no cgroup filesystem.
nsenter --net=/run/netns/host1 unshare --uts sh -c 'hostname host1; exec setsid slurmctld -D -i' \
  >"$ST/log/slurmctld.out" 2>&1 </dev/null &
echo $! > "$ST/run/slurmctld.bg.pid"
for i in $(seq 1 "$N"); do
  h=host$i; mkdir -p "$ST/spool-$h" "$ST/tmp-$h"
  nsenter --net=/run/netns/$h unshare --uts sh -c "hostname $h; exec setsid slurmd -D -N $h" \
    >"$ST/log/slurmd-$h.out" 2>&1 </dev/null &
  echo $! > "$ST/run/slurmd-$h.bg.pid"
done
idle=0
for _ in $(seq 150); do
  idle=$(nsenter --net=/run/netns/host1 sinfo -h -N -o %T 2>/dev/null | grep -c idle || true)
  [ "$idle" = "$N" ] && break; sleep 0.2
done
[ "$idle" = "$N" ] || { echo "[slurm-netns-up] only $idle of $N nodes idle; logs in $ST/log"; exit 1; }
echo "[slurm-netns-up] $N nodes"
