"""The collective suite on the in-process backend: threads as ranks, world sizes 1-4."""
from support.collective_cases import CASES
from support.runner import threads_test

LOCAL_ONLY_SKIPS = set()


test_collective_case = threads_test(CASES)
