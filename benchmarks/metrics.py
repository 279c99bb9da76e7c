"""Measure what the lock signals, Prometheus metrics and tracing spans cost.

Starts its own redis-server nodes (as the tests do) and runs uncontended acquire +
release cycles on fresh keys, interleaved, one configuration after the other in
every rep, with these instruments attached (``signals.attach``):

- ``none``: no instrument at all (neither extra installed);
- ``metrics``: the Prometheus instruments only. Without ``opentelemetry-api`` this
  is exactly what runs: ``tracing.install()`` attaches nothing;
- ``metrics (again)``: the same once more, the noise control: its ratio to
  ``metrics`` would be 1.000 on a quiet machine, and its distance from 1 is how
  far this run's ratios can be trusted;
- ``metrics+tracing (api)``: plus the span instruments with the API's no-op
  provider (``opentelemetry-api`` installed, no SDK configured);
- ``metrics+tracing (sdk)``: plus spans recorded by an SDK ``TracerProvider``
  (sampled, no exporter: an exporter adds its own cost).

Short blocks, many reps: other processes' load comes in bursts, so each rep's
rates are compared with each other (paired) and the median of those ratios to
``metrics`` is printed, with the median rates. Then the instruments' own CPU
time: one ``lock_acquired`` and one ``lock_released`` sent as the lock sends them
(``signals.send``), no network (best of five). Usage: python -m benchmarks.metrics
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from collections.abc import Callable
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


def instruments_us(count: int = 20000) -> float:
    """Microseconds to send one acquired and one released signal (no network)."""
    from redlock_django import Redlock, signals

    lock = Redlock("bench:signals")
    send, acquired_signal = signals.send, signals.lock_acquired
    released_signal = signals.lock_released
    acquired = {"waited": 0.001, "fencing_token": None, "attempts": 1, "wakeups": 0}
    acquired.update(granted=5, quorum=3, nodes=5)
    released = {"held": 0.001, "elapsed": 0.0005, "released": 5, "lost": None}
    best = float("inf")
    for _ in range(5):
        started = time.perf_counter()
        for _ in range(count):
            send(acquired_signal, Redlock, lock=lock, resource="r", **acquired)
            send(released_signal, Redlock, lock=lock, resource="r", **released)
        best = min(best, time.perf_counter() - started)
    return best / count * 1e6


def configurations() -> dict[str, Callable[[], None]]:
    """Return, by name, a function attaching that configuration's instruments."""
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.trace import NoOpTracerProvider

    from redlock_django import metrics, signals, tracing

    assert metrics.installed(), "pip install prometheus_client"
    tracing.uninstall()
    all_signals = [getattr(signals, name) for name in signals.__all__]
    # The metrics instruments, as the app config attached them.
    saved = {signal: signals.instruments(signal) for signal in all_signals}

    def connect(metrics_on: bool, provider: object = None) -> Callable[[], None]:
        def apply() -> None:
            tracing.uninstall()
            for signal in all_signals:
                for instrument in saved[signal]:
                    signals.detach(signal, instrument)
                    if metrics_on:
                        signals.attach(signal, instrument)
            if provider is not None:
                assert tracing.install(tracer_provider=provider)

        return apply

    return {
        "none": connect(False),
        "metrics": connect(True),
        "metrics (again)": connect(True),
        "metrics+tracing (api)": connect(True, NoOpTracerProvider()),
        "metrics+tracing (sdk)": connect(True, TracerProvider()),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--nodes", type=int, default=5)
    parser.add_argument("--cycles", type=int, default=300)
    parser.add_argument("--reps", type=int, default=30)
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
            setups = configurations()
            runs: dict[str, list[float]] = {name: [] for name in setups}
            for apply in setups.values():
                apply()
                cycles_per_second(200)  # warm up connections, scripts, instruments
            for rep in range(args.reps):
                # Rotate the order each rep, so no configuration always runs first.
                names = list(setups)
                names = names[rep % len(names) :] + names[: rep % len(names)]
                for name in names:
                    setups[name]()
                    runs[name].append(cycles_per_second(args.cycles))
            sends = {}
            for name, apply in setups.items():
                apply()
                sends[name] = instruments_us()
        finally:
            nodes.stop_all()
    medians = {name: statistics.median(values) for name, values in runs.items()}
    base = runs["metrics"]
    print(f"{args.nodes} nodes, {args.cycles} cycles x {args.reps} reps, interleaved")
    for name, rates in runs.items():
        ratio = statistics.median(r / b for r, b in zip(rates, base, strict=True))
        print(
            f"{name:22} {medians[name]:6.0f} cycles/s (median)   "
            f"ratio to metrics {ratio:.3f} (median of paired reps)"
        )
    print("instruments alone (signals sent for one acquire + release, no network):")
    for name, us in sends.items():
        print(f"{name:22} {us:6.1f} us  ({us - sends['none']:+5.1f} us to none)")


if __name__ == "__main__":
    main()
