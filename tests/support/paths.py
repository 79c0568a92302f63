"""Where things are: the checkout, the tests, and the scripts the tests start (jobs, clusters)."""
import os

SUPPORT = os.path.dirname(os.path.abspath(__file__))
TESTS = os.path.dirname(SUPPORT)
ROOT = os.path.dirname(TESTS)  # the checkout
JOBS = os.path.join(SUPPORT, "jobs")
CLUSTER = os.path.join(SUPPORT, "cluster")
