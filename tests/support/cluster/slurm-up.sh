#!/usr/bin/env bash
# slurm-up.sh -- a real one-node SLURM cluster on this machine, for the test suite.
# Debian's slurm-wlm (22.05) and munge, started without systemd. Run as root.
#   AXONHPC_SLURM_STATE  state, logs and pid files (default /tmp/axonhpc-slurm/one)
#   AXONHPC_SLURM_CPUS   CPUs the node advertises (default 8: more than the cores, so jobs oversubscribe)
#   AXONHPC_SLURM_PMIX=1 also make `srun --mpi=pmix` work (Open MPI)
# Exit 0 with the node idle, 3 when the packages cannot be installed, 1 on any other failure.
set -euo pipefail
STATE=${AXONHPC_SLURM_STATE:-/tmp/axonhpc-slurm/one}
CPUS=${AXONHPC_SLURM_CPUS:-8}
HOST=$(hostname -s)
say() { echo "[slurm-up] $*"; }

if ! command -v slurmctld >/dev/null || ! command -v slurmd >/dev/null || ! command -v sbatch >/dev/null \
   || ! command -v munged >/dev/null; then
  if ! { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
          slurmctld slurmd slurm-client munge; } >"${TMPDIR:-/tmp}/axonhpc-slurm-apt.log" 2>&1; then
    say "cannot install slurmctld slurmd slurm-client munge (see ${TMPDIR:-/tmp}/axonhpc-slurm-apt.log)"
    exit 3
  fi
fi
if [ "${AXONHPC_SLURM_PMIX:-0}" = 1 ]; then
  # slurm's mpi_pmix plugin loads the unversioned libpmix.so, which only libpmix-dev would provide
  dpkg -s libpmix2 >/dev/null 2>&1 || DEBIAN_FRONTEND=noninteractive apt-get install -y -qq \
      --no-install-recommends libpmix2 >/dev/null 2>&1 || { say "cannot install libpmix2"; exit 3; }
  ln -sf libpmix.so.2 /usr/lib/x86_64-linux-gnu/pmix2/lib/libpmix.so
fi

getent hosts "$HOST" >/dev/null || echo "127.0.0.1 $HOST" >> /etc/hosts   # slurmd looks its name up

# munge: a key, and the daemon (as user munge; without systemd nobody creates /run/munge)
install -d -o munge -g munge -m 0700 /etc/munge /var/log/munge
install -d -o munge -g munge -m 0711 /var/lib/munge
install -d -o munge -g munge -m 0755 /run/munge
[ -s /etc/munge/munge.key ] || runuser -u munge -- mungekey --create --keyfile=/etc/munge/munge.key
mkdir -p "$STATE"/ctld "$STATE"/spool "$STATE"/log "$STATE"/run
if ! munge -n 2>/dev/null | unmunge >/dev/null 2>&1; then
  runuser -u munge -- /usr/sbin/munged
  for _ in $(seq 50); do munge -n 2>/dev/null | unmunge >/dev/null 2>&1 && break; sleep 0.1; done
  cp /run/munge/munged.pid "$STATE/run/munged.pid"   # ours to stop later
fi
munge -n | unmunge >/dev/null || { say "munge does not work"; exit 1; }

# Job ids start somewhere new on every start-up: MPICH names its shared-memory segments after the PMI
# job id, and a segment a killed job left in /dev/shm must never be picked up by a new job with its id.
FIRST_JOB_ID=$(( ($(date +%s) % 600000) * 100 + 1 ))

# The cgroup plugins need cgroup controllers this container lacks: linuxproc and task/none.
cat > /etc/slurm/slurm.conf <<CONF
ClusterName=axonhpc
SlurmctldHost=$HOST
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
StateSaveLocation=$STATE/ctld
SlurmdSpoolDir=$STATE/spool
SlurmctldPidFile=$STATE/run/slurmctld.pid
SlurmdPidFile=$STATE/run/slurmd.pid
SlurmctldLogFile=$STATE/log/slurmctld.log
SlurmdLogFile=$STATE/log/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SlurmdParameters=config_overrides
MpiDefault=none
ReturnToService=2
SlurmctldTimeout=30
SlurmdTimeout=30
MailProg=/bin/true
FirstJobId=$FIRST_JOB_ID
NodeName=$HOST CPUs=$CPUS State=UNKNOWN
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP OverSubscribe=FORCE:4
CONF

setsid slurmctld -D -i >"$STATE/log/slurmctld.out" 2>&1 </dev/null &
echo $! > "$STATE/run/slurmctld.bg.pid"
setsid slurmd -D >"$STATE/log/slurmd.out" 2>&1 </dev/null &
echo $! > "$STATE/run/slurmd.bg.pid"

state=""
for _ in $(seq 150); do
  state=$(sinfo -h -n "$HOST" -o %T 2>/dev/null || true)
  case "$state" in
    idle*|mixed*|allocated*) break ;;
    down*|drain*) scontrol update nodename="$HOST" state=resume 2>/dev/null || true ;;
  esac
  sleep 0.2
done
case "$state" in idle*|mixed*|allocated*) ;; *)
  say "node $HOST not ready (state '$state'); logs in $STATE/log"; tail -5 "$STATE"/log/*.out; exit 1 ;;
esac
say "node $HOST $state"
