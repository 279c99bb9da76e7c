"""Measure what the lock signals and Prometheus metrics cost per acquire + release.

Starts its own redis-server nodes (as the tests do), runs uncontended cycles on
fresh keys with the metrics receivers connected and disconnected, interleaved, and
prints the medians and their ratio. Usage: python -m benchmarks.metrics
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import django
from django.conf import settings


def cycles_per_second(count: int) -> float:
    from redlock_django import Redlock

    started = time.monotonic()
    for i in range(count):
        lock = Redlock(f"bench:{i}")
        lock.acquire()
        lock.release()
    return count / (time.monotonic() - started)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--nodes", type=int, default=5)
    parser.add_argument("--cycles", type=int, default=2000)
    parser.add_argument("--reps", type=int, default=5)
    args = parser.parse_args()

    from harness.nodes import NodeSet

    with tempfile.TemporaryDirectory() as tmp:
        nodes = NodeSet.create(args.nodes, Path(tmp))
        nodes.start_all()
        try:
            settings.configure(
                INSTALLED_APPS=["redlock_django"],
                REDLOCK={"NODES": nodes.urls},
            )
            django.setup()
            from redlock_django import metrics, signals

            assert metrics.installed(), "pip install prometheus_client"
            receivers = {
                s: list(s.receivers) for s in map(signals.__dict__.get, signals.__all__)
            }
            cycles_per_second(200)  # warm up connections and script caches
            on, off = [], []
            for _ in range(args.reps):
                for signal, saved in receivers.items():
                    signal.receivers = list(saved)
                    signal.sender_receivers_cache.clear()
                on.append(cycles_per_second(args.cycles))
                for signal in receivers:
                    signal.receivers = []
                    signal.sender_receivers_cache.clear()
                off.append(cycles_per_second(args.cycles))
        finally:
            nodes.stop_all()
    with_metrics, without = statistics.median(on), statistics.median(off)
    print(f"{args.nodes} nodes, {args.cycles} cycles x {args.reps} reps")
    print(f"metrics on : {with_metrics:8.0f} cycles/s (median)")
    print(f"metrics off: {without:8.0f} cycles/s (median)")
    print(f"ratio on/off: {with_metrics / without:.3f}")
    per_cycle_us = (1 / with_metrics - 1 / without) * 1e6
    print(f"cost per acquire+release: {per_cycle_us:.1f} us")


if __name__ == "__main__":
    main()
