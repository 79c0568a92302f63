"""Add up the JUnit reports of one test run and print 'total: N passed, N failed, N skipped'.

Serial reports count once; for each mpiexec run only rank 0's report counts
(every rank runs the same tests and the assertions are collective). Exits 1
when anything failed or when no test ran at all.
"""
import glob
import os
import sys
import xml.etree.ElementTree as ET


def main(logdir: str) -> int:
    reports = sorted(glob.glob(os.path.join(logdir, "serial", "junit.xml")))
    reports += sorted(glob.glob(os.path.join(logdir, "mpi-*", "junit-rank0.xml")))
    tests = failed = skipped = 0
    for path in reports:
        for suite in ET.parse(path).getroot().iter("testsuite"):
            tests += int(suite.get("tests", 0))
            failed += int(suite.get("failures", 0)) + int(suite.get("errors", 0))
            skipped += int(suite.get("skipped", 0))
    passed = tests - failed - skipped
    print(f"total: {passed} passed, {failed} failed, {skipped} skipped")
    if passed == 0:
        print("no tests ran: treating that as a failure")
        return 1
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1] if len(sys.argv) > 1 else "test-logs"))
