"""What the tests, the load tests and the benchmarks share to run real processes.

Real ``redis-server`` nodes (:mod:`harness.nodes`), a fault-injecting TCP proxy
(:mod:`harness.proxy`), the commands a node runs (:mod:`harness.monitor`), child
processes that die with their parent (:mod:`harness.processes`), the Locust command
line (:mod:`harness.locust`) and the look at what the nodes hold
(:mod:`harness.held`). Not shipped in the wheel;
``python -m pytest`` and ``python -m loadtests.demo`` run from the repository
root, so it imports without any ``sys.path`` edit.
"""
