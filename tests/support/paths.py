"""Where things are: the checkout, the tests, and the scripts the tests start (jobs, clusters)."""
import os

SUPPORT = os.path.dirname(os.path.abspath(__file__))
TESTS = os.path.dirname(SUPPORT)
ROOT = os.path.dirname(TESTS)  # the checkout
JOBS = os.path.join(SUPPORT, "jobs")
CLUSTER = os.path.join(SUPPORT, "cluster")


def timed_verdicts(folder, ranks):
    """rank -> (seconds, verdict) from the ``verdict-rank<r>.txt`` files a job's ranks left in ``folder`` (the
    seconds on the first line); a rank that left none is missing."""
    verdicts = {}
    for rank in range(ranks):
        path = os.path.join(str(folder), f"verdict-rank{rank}.txt")
        if os.path.exists(path):
            with open(path) as f:
                seconds, text = f.read().split("\n", 1)
            verdicts[rank] = (float(seconds), text)
    return verdicts
