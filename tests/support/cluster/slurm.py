"""Submit rendered templates to a real SLURM cluster started by the tests, and wait for the outcome.

``sbatch --wait`` polls every few seconds; ``Job.wait`` asks ``scontrol``
five times a second instead, so a test waits for the job, not for a poll.
"""
import os
import re
import subprocess
import sys
import time
from typing import Dict, List, Optional

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(os.path.dirname(HERE)))  # tests/support/cluster -> the checkout
DONE = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE",
        "PREEMPTED"}


def render(template: str, options: List[str], command: List[str], python: Optional[str] = None) -> str:
    """``axonhpc slurm render TEMPLATE OPTIONS -- COMMAND`` (exit 0 required)."""
    cmd = [python or sys.executable, "-m", "axonhpc", "slurm", "render", template, *options, "--", *command]
    out = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, timeout=120)
    assert out.returncode == 0, out.stderr
    return out.stdout


class Cluster:
    """Clients of one cluster: how to run sbatch/scontrol (a prefix such as nsenter, and SLURM_CONF)."""

    def __init__(self, prefix: Optional[List[str]] = None, env: Optional[Dict[str, str]] = None):
        self.prefix = prefix or []
        self.env = dict(os.environ, **(env or {}))

    def run(self, *argv: str, timeout: float = 60) -> subprocess.CompletedProcess:
        return subprocess.run([*self.prefix, *argv], capture_output=True, text=True, env=self.env, timeout=timeout)

    def submit(self, script: str, directory: str, env: Optional[Dict[str, str]] = None) -> "Job":
        """Write ``script`` into ``directory`` and sbatch it from there."""
        path = os.path.join(directory, "job.sbatch")
        with open(path, "w") as f:
            f.write(script)
        run_env = dict(self.env, **(env or {}))
        out = subprocess.run([*self.prefix, "sbatch", "--parsable", path], capture_output=True, text=True,
                             env=run_env, cwd=directory, timeout=60)
        assert out.returncode == 0, out.stderr
        return Job(self, out.stdout.strip().split(";")[0], directory)


class Job:
    """One submitted job."""

    def __init__(self, cluster: Cluster, job_id: str, directory: str):
        self.cluster, self.id, self.directory = cluster, job_id, directory

    def fields(self) -> Dict[str, str]:
        out = self.cluster.run("scontrol", "show", "job", "-o", self.id)
        return dict(re.findall(r"(\w+)=(\S*)", out.stdout))

    def wait(self, timeout: float = 240) -> Dict[str, str]:
        """Poll until the job is over; returns its scontrol fields (JobState, ExitCode, ...)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            fields = self.fields()
            if fields.get("JobState") in DONE:
                return fields
            time.sleep(0.2)
        self.cluster.run("scancel", self.id)
        raise AssertionError(f"job {self.id} did not end within {timeout} s: {self.fields()}")

    def logs(self) -> str:
        """Everything the job wrote into its directory's .out and .err files."""
        text = []
        for name in sorted(os.listdir(self.directory)):
            if name.endswith((".out", ".err")):
                with open(os.path.join(self.directory, name), errors="replace") as f:
                    text.append(f"--- {name} ---\n{f.read()}")
        return "\n".join(text)
