"""Several hosts on one machine: network namespaces, real MPI traffic over veth, mpiexec across them.

Serial tests (each starts its own mpiexec from inside host1); they need root
and iproute2 and are skipped, with the reason, where namespaces cannot be made.
"""
import json
import os
import re
import subprocess
import sys
import time

import pytest

from support.cluster import netns
from support.openmpi import NO_FABRIC_BTL
from support.paths import CLUSTER, ROOT, TESTS

REASON = netns.unavailable_reason()
pytestmark = pytest.mark.skipif(REASON is not None, reason=f"simulated hosts unavailable: {REASON}")
FLAVOURS = ["mpich"] + (["openmpi"] if os.path.exists(netns.venv_python("openmpi")) else [])


@pytest.fixture(scope="module")
def hosts():
    with netns.Hosts(3) as h:
        yield h


def _facts(result):
    assert result.returncode == 0, result.stdout + result.stderr
    return [json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("flavour", FLAVOURS)
def test_node_facts_groups_and_collectives_span_hosts(hosts, flavour):
    before = hosts.rx_bytes("host2")
    rows = _facts(hosts.run(flavour, [2, 2], [os.path.join(CLUSTER, "node_facts.py")]))
    assert [row["rank"] for row in rows] == [0, 1, 2, 3]
    assert [row["host"] for row in rows] == ["host1", "host1", "host2", "host2"]
    assert [row["node_rank"] for row in rows] == [0, 0, 1, 1]
    assert [row["local_rank"] for row in rows] == [0, 1, 0, 1]
    assert all(row["num_nodes"] == 2 and row["local_size"] == 2 for row in rows)
    assert [row["node_group"] for row in rows] == [[0, 1], [0, 1], [2, 3], [2, 3]]
    assert all(row["flat"] == 10.0 and row["equal"] for row in rows)
    assert all(row["node_of"] == [0, 0, 1, 1] for row in rows)
    # shared memory inside each host only: the world's calls go over the link, the node group's do not
    assert all(row["one_node"] == [False, True] and row["engines"] == [False, True] for row in rows)
    assert [row["on_node"] for row in rows] == [3.0, 3.0, 7.0, 7.0]
    assert hosts.rx_bytes("host2") - before > 3 * 8000  # the arrays really crossed the veth link


@pytest.mark.timeout(300)
def test_uneven_hosts_use_the_leader_fallback(hosts):
    rows = _facts(hosts.run("mpich", [2, 1, 1], [os.path.join(CLUSTER, "node_facts.py")]))
    assert [row["node_rank"] for row in rows] == [0, 0, 1, 2]
    assert [row["local_size"] for row in rows] == [2, 2, 1, 1]
    assert all(row["flat"] == 10.0 and row["equal"] for row in rows)


@pytest.mark.timeout(300)
def test_fsdp_hybrid_shard_over_real_nodes(hosts):
    result = hosts.run("mpich", [2, 2], [os.path.join(CLUSTER, "fsdp_hybrid.py"), TESTS])
    assert result.returncode == 0, result.stdout + result.stderr
    assert "hybrid ok: 2 nodes x 2 ranks" in result.stdout


@pytest.mark.timeout(300)
@pytest.mark.parametrize("flavour", FLAVOURS)
def test_a_killed_rank_on_one_host_ends_the_job_on_all_hosts(hosts, flavour):
    start = time.monotonic()
    result = hosts.run(flavour, [2, 2], [os.path.join(CLUSTER, "kill_rank.py")], timeout=60)
    elapsed = time.monotonic() - start
    # non-zero, and long before the outer timeout (60 s) could have ended it
    assert result.returncode != 0 and elapsed < 30, (result.returncode, elapsed, result.stderr[-2000:])
    deadline = time.monotonic() + 10  # the launchers on the other hosts may take a moment to exit
    while any(netns.pids_in(h) for h in ("host1", "host2")) and time.monotonic() < deadline:
        time.sleep(0.2)
    for host in ("host1", "host2"):
        assert not netns.pids_in(host), f"processes left in {host}: {netns.pids_in(host)}"


@pytest.mark.timeout(300)
def test_a_partitioned_host_is_named_by_the_collective_timeout(hosts):
    """host2's link goes down mid-job: host1's ranks time out naming ranks 2 and 3 instead of hanging.

    The abort that follows cannot reach host2 through the cut link, so mpiexec itself hangs (and
    ignores SIGTERM, as MPICH's does): the outer ``timeout -k`` ends it and the test kills what is left.
    """
    job = hosts.popen("mpich", [2, 2], [os.path.join(CLUSTER, "partition_job.py")], timeout=15)
    try:
        assert job.stdout.readline().strip() == "ready"
        subprocess.run(["ip", "-n", "host2", "link", "set", "eth0", "down"], check=True)
        out, err = job.communicate(timeout=90)
    finally:
        subprocess.run(["ip", "-n", "host2", "link", "set", "eth0", "up"], capture_output=True)
        if job.poll() is None:
            job.kill()
        hosts.kill_all()
    text = out + err
    assert "timed out after 3 s" in text and "missing ranks: [2, 3]" in text, text[-3000:]
    assert "rank 0 finished" not in text


@pytest.mark.timeout(300)
@pytest.mark.skipif("openmpi" not in FLAVOURS, reason="needs the Open MPI environment (.venv-openmpi): ULFM")
def test_a_rank_killed_on_one_host_leaves_the_survivors_on_both_hosts_training(hosts):
    """Issue 39 across hosts: Open MPI with ULFM over the veth links, a real SIGKILL on host2; the survivors on
    host1 and host2 shrink, gather the state over the link and finish with the uninterrupted run's loss."""
    example = os.path.join(ROOT, "examples", "train_gpt.py")
    run = ["--max-bytes", "200000", "--steps", "8", "--dtype", "float64", "--eval-batches", "1", "--batch", "12"]
    alone = subprocess.run([sys.executable, example, *run], capture_output=True, text=True, timeout=150,
                           env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert alone.returncode == 0, alone.stderr
    want = float(re.search(r"^final loss (\S+)$", alone.stdout, re.M).group(1))
    before = hosts.rx_bytes("host1")
    result = hosts.run("openmpi", [2, 2], [example, "--elastic", *run, "--simulate-failure", "3:3"], timeout=150,
                       fault_tolerant=True)
    out = result.stdout + result.stderr
    assert result.returncode == 0, out[-4000:]
    # the log line of rank 0 (stderr): the step that was interrupted, redone on 3 ranks
    assert re.search(r"recovered: lost rank 3 at step 4, continuing on 3 ranks \(dp=3\) in \d+\.\d\d s", out), out
    got = [float(v) for v in re.findall(r"^final loss (\S+)$", result.stdout, re.M)]
    assert len(got) == 1 and abs(got[0] - want) <= 1e-10, (got, want)
    assert hosts.rx_bytes("host1") - before > 100_000  # the state and gradients crossed the link


@pytest.mark.timeout(300)
@pytest.mark.skipif("openmpi" not in FLAVOURS, reason="needs the Open MPI environment (.venv-openmpi): ULFM")
def test_a_fault_tolerant_launch_across_hosts_judges_only_the_ranks_on_its_own_host(hosts, tmp_path):
    """``axonhpc launch --fault-tolerant`` across two hosts, each with a /tmp of its own, as inside a batch system's
    allocation (here a default hostfile; no --hosts): the ranks on host2 cannot see the launcher's records folder.
    Before, they counted as killed: a job that finished exited 1, and each of them printed that it could not record
    its status. (And Open MPI, told to oversubscribe, put every rank on host1.)"""
    python = netns.venv_python("openmpi")
    script = os.path.join(CLUSTER, "node_facts.py")  # not under /tmp: host2 has a /tmp of its own
    hostfile = tmp_path / "hostfile"  # read by mpiexec, on host1
    hostfile.write_text("host1 slots=2\nhost2 slots=2\n")
    inner = " ".join([python, "-m", "axonhpc", "launch", "--fault-tolerant", "-n", "4", "--", script])
    env = dict(hosts.env, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1", OMP_NUM_THREADS="1",
               PRTE_MCA_plm_ssh_agent=os.path.join(CLUSTER, "netns-launch"), AXONHPC_NETNS_PRIVATE_TMP="1",
               OMPI_MCA_btl=NO_FABRIC_BTL, UCX_TLS="tcp,self", UCX_NET_DEVICES="eth0",
               PRTE_MCA_prte_default_hostfile=str(hostfile))
    env.pop("PRTE_MCA_rmaps_default_mapping_policy", None)  # the host slots decide where the ranks go
    env.pop("PRTE_MCA_prte_tmpdir_base", None)  # a folder of host1's /tmp: not on host2
    result = subprocess.run(["timeout", "-k", "5", "120", "ip", "netns", "exec", "host1", "unshare", "--uts", "sh",
                             "-c", f"hostname host1; exec {inner}"], env=env, capture_output=True, text=True,
                            timeout=150)
    out = result.stdout + result.stderr
    assert [row["host"] for row in _facts(result)] == ["host1", "host1", "host2", "host2"], out[-4000:]
    assert "could not record" not in out and "ended without exiting" not in out, out[-4000:]
