"""What the tests share: the cupy stand-ins, the cases every strategy runs, the shared runner, jobs and clusters.

``tests/`` is on ``sys.path`` (``conftest.py``), so a test imports these as
``support.<module>``: ``from support.ddp_cases import CASES``.
"""
