"""Start a child process that saves a checkpoint, and SIGKILL it once a file of the save holds enough bytes.

The crash tests of every checkpoint kind (``test_checkpoint_crash``,
``test_checkpoint_async``, ``test_checkpoint_sliced``) share this: the
child runs with this checkout on its path and a lower priority (the writer
yields the core to the watcher on a busy machine), and the watcher polls the
size of the first file matching a pattern.
"""
import glob
import os
import signal
import subprocess
import sys
import time

from support.paths import ROOT as REPO


def start_child(code, *args):
    """``python -c code args...`` from the checkout, at a lower priority, with pipes for its output."""
    return subprocess.Popen(
        [sys.executable, "-c", code, *args], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        env=dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", "")),
        preexec_fn=lambda: os.nice(5),
    )


def expect_line(child, line):
    """Read one line of the child's output and check it (its stderr in the message otherwise)."""
    got = child.stdout.readline()
    assert got == line, got + child.stderr.read()


def kill_when_written(child, pattern, threshold, settled_for=None, timeout=60, strict=True):
    """SIGKILL ``child`` once the first file matching ``pattern`` holds ``threshold`` bytes.

    Args:
        child: the process from ``start_child``.
        pattern: a glob of the file being written.
        threshold: bytes the file must hold first.
        settled_for: also wait until the size has not changed for this many seconds (aims the kill at the
            moment between the last byte and the rename); None: kill at once.
        timeout: seconds before giving up.
        strict: raise if the child ends with an error or the time runs out before the file grew enough
            (False: just stop watching).

    Returns:
        ``(returncode, last size seen)``; returncode 0 means the save won the race and completed.
    """
    deadline = time.monotonic() + timeout
    size, last_size, last_change = -1, -1, time.monotonic()
    try:
        while True:
            found = glob.glob(pattern)
            try:
                size = os.path.getsize(found[0]) if found else -1
            except FileNotFoundError:  # renamed between glob and stat
                size = -1
            if size != last_size:
                last_size, last_change = size, time.monotonic()
            settled = settled_for is None or time.monotonic() - last_change > settled_for
            if size >= threshold and settled:
                child.send_signal(signal.SIGKILL)
                break
            if child.poll() == 0:
                break  # the save won the race (a slow watcher on a busy machine): it completed
            if child.poll() is not None or time.monotonic() > deadline:
                if strict:
                    raise AssertionError(f"the child ended (code {child.returncode}) before {pattern} held "
                                         f"{threshold} bytes: {child.stderr.read().decode()[-2000:]}")
                break
            time.sleep(0.0005)
        child.wait(30)
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
        child.stdout.close()
        child.stderr.close()
    return child.returncode, size
