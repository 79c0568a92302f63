"""Simulated hosts for multi-node tests and benchmarks: network namespaces with real MPI traffic over veth.

``Hosts(n)`` runs ``netns-up.sh`` (host1..hostN on one bridge), ``run`` starts an
mpiexec from inside host1 that reaches the other hosts through
``netns-launch`` (the stand-in for ssh), and ``close`` removes everything.
MPICH's UCX would move data between namespaces through shared memory (they
share one kernel), so ``UCX_TLS=tcp,self`` forces it onto the veth links.
"""
import os
import shlex
import shutil
import subprocess
from typing import Dict, List, Optional, Sequence

from axonhpc.mpiexec import FAULT_TOLERANT_ARGS
from support.openmpi import NO_FABRIC_BTL

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(os.path.dirname(HERE)))  # tests/support/cluster -> the checkout


def unavailable_reason() -> Optional[str]:
    """Why simulated hosts cannot be made here, or None."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    if shutil.which("ip") is None or shutil.which("unshare") is None:
        return "iproute2 (ip) and util-linux (unshare) are needed"
    probe = subprocess.run(["ip", "netns", "add", "axonhpc-probe"], capture_output=True, text=True)
    if probe.returncode != 0:
        return f"cannot create a network namespace: {probe.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", "axonhpc-probe"], capture_output=True)
    return None


def pids_in(host: str) -> List[int]:
    """Processes still running in the namespace ``host``."""
    out = subprocess.run(["ip", "netns", "pids", host], capture_output=True, text=True)
    return [int(p) for p in out.stdout.split()]


def venv_python(flavour: str) -> str:
    """The Python of the venv whose MPI is ``flavour`` ("mpich": .venv, "openmpi": .venv-openmpi)."""
    return os.path.join(REPO, ".venv" if flavour == "mpich" else ".venv-openmpi", "bin", "python")


class Hosts:
    """host1..hostN in network namespaces; a context manager that removes them on exit."""

    def __init__(self, n: int, directory: str = "/tmp/axonhpc-netns"):
        self.n = n
        self.env = dict(os.environ, AXONHPC_NETNS_DIR=directory)
        subprocess.run(["bash", os.path.join(HERE, "netns-down.sh")], env=self.env, capture_output=True)
        subprocess.run(["bash", os.path.join(HERE, "netns-up.sh"), str(n)], env=self.env, check=True,
                       capture_output=True, text=True)

    def __enter__(self) -> "Hosts":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        """Kill what still runs in the namespaces and remove them."""
        subprocess.run(["bash", os.path.join(HERE, "netns-down.sh")], env=self.env, capture_output=True)

    def rx_bytes(self, host: str) -> int:
        """Bytes received so far on ``host``'s eth0 (proof that traffic crossed the veth)."""
        out = subprocess.run(["ip", "netns", "exec", host, "cat", "/sys/class/net/eth0/statistics/rx_bytes"],
                             capture_output=True, text=True, check=True)
        return int(out.stdout)

    def shape(self, rate: str) -> None:
        """Limit every host's outgoing eth0 to ``rate`` (tc tbf, e.g. "100mbit").

        The queue is deep (2 s of traffic), so the shaper delays bursts
        instead of dropping them: drops would add TCP retransmission timeouts
        to the measurement.
        """
        for i in range(1, self.n + 1):
            subprocess.run(["ip", "netns", "exec", f"host{i}", "tc", "qdisc", "replace", "dev", "eth0", "root", "tbf",
                            "rate", rate, "burst", "32kb", "latency", "2s"], check=True, capture_output=True)

    def command(self, flavour: str, slots: Sequence[int], argv: List[str], fault_tolerant: bool = False) -> List[str]:
        """The mpiexec command line (run from host1) for ``slots[i]`` ranks on host i+1.

        ``fault_tolerant``: Open MPI with ULFM, as ``axonhpc launch --fault-tolerant`` starts it.
        """
        python = venv_python(flavour)
        mpiexec = os.path.join(os.path.dirname(python), "mpiexec")
        launcher = os.path.join(HERE, "netns-launch")
        hosts = [f"host{i + 1}:{k}" for i, k in enumerate(slots) if k]
        n = sum(slots)
        if flavour == "mpich":
            return [mpiexec, "-launcher", "ssh", "-launcher-exec", launcher, "-hosts", ",".join(hosts), "-n", str(n),
                    python, *argv]
        ft = list(FAULT_TOLERANT_ARGS) if fault_tolerant else []
        return [mpiexec, "--prtemca", "plm_ssh_agent", launcher, *ft, "--host", ",".join(hosts), "-n", str(n), python,
                *argv]

    def _launch(self, flavour: str, slots: Sequence[int], argv: List[str], timeout: float,
                env: Optional[Dict[str, str]], fault_tolerant: bool = False) -> tuple:
        full_env = dict(self.env, UCX_TLS="tcp,self", UCX_NET_DEVICES="eth0", OMPI_ALLOW_RUN_AS_ROOT="1",
                        OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1", OMP_NUM_THREADS="1", PYTHONPATH=REPO)
        full_env.setdefault("OMPI_MCA_btl", NO_FABRIC_BTL)  # TCP over the veths; no libfabric probe at each start
        full_env.update(env or {})
        # A mapping policy inherited from the caller (scripts/test.sh sets ":oversubscribe" for one-host runs)
        # would let Open MPI pack every rank onto host1; the host slots given here decide instead.
        full_env.pop("PRTE_MCA_rmaps_default_mapping_policy", None)
        if fault_tolerant:
            full_env["AXONHPC_FAULT_TOLERANT"] = "1"  # what axonhpc launch --fault-tolerant sets
        inner = " ".join(shlex.quote(a) for a in self.command(flavour, slots, argv, fault_tolerant))
        cmd = ["timeout", "-k", "5", str(timeout), "ip", "netns", "exec", "host1", "unshare", "--uts", "sh", "-c",
               f"hostname host1; exec {inner}"]
        return cmd, full_env

    def run(self, flavour: str, slots: Sequence[int], argv: List[str], timeout: float = 120,
            env: Optional[Dict[str, str]] = None, fault_tolerant: bool = False) -> subprocess.CompletedProcess:
        """Run ``python argv`` on the hosts under mpiexec (outer ``timeout -k``); returns the finished process."""
        cmd, full_env = self._launch(flavour, slots, argv, timeout, env, fault_tolerant)
        return subprocess.run(cmd, env=full_env, capture_output=True, text=True, timeout=timeout + 30)

    def popen(self, flavour: str, slots: Sequence[int], argv: List[str], timeout: float = 120,
              env: Optional[Dict[str, str]] = None) -> subprocess.Popen:
        """Start the job like ``run`` and return it running (stdout and stderr as text pipes)."""
        cmd, full_env = self._launch(flavour, slots, argv, timeout, env)
        return subprocess.Popen(cmd, env=full_env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

    def kill_all(self) -> None:
        """Kill every process left in the hosts' namespaces (a partitioned job's mpiexec ignores SIGTERM)."""
        for i in range(1, self.n + 1):
            for pid in pids_in(f"host{i}"):
                try:
                    os.kill(pid, 9)
                except ProcessLookupError:
                    pass
