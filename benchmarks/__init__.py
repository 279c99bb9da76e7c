"""Benchmarks of the lock itself, apart from the Locust scenarios in ``loadtests/``.

``python -m benchmarks.locks`` (the lock against its peers and the raw floor) and
``python -m benchmarks.metrics`` (what the signals cost); both start their Redis
nodes with :mod:`harness.nodes`. Commands and results: ``docs/benchmarks.md``.
"""
