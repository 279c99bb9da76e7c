"""Prometheus metrics for locks, fed where the signals are sent, when prometheus_client
is there (instruments attached in ``signals.py``, not Django receivers).

``install()`` (called by the app config) registers the metrics in the default
registry, which a scrape endpoint or django-prometheus exposes. No metric has a
resource label: resource names are unbounded, metric label sets must not be.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

from django.dispatch import Signal

from . import holds, signals

__all__ = ["install", "installed"]

_installed = False

# Latency buckets for a lock: a loopback round trip to ~a second of waiting.
_BUCKETS = (
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1,
    2.5,
    5,
    10,
)


def installed() -> bool:
    """Return whether the metrics are being recorded."""
    return _installed


def install() -> bool:
    """Create the metrics and attach them to the signals; False without prometheus."""
    global _installed
    if _installed:
        return True
    try:
        from prometheus_client import Counter, Gauge, Histogram, values
    except ImportError:
        return False

    acquire_seconds = Histogram(
        "redlock_acquire_seconds",
        "Time spent acquiring a lock, by outcome.",
        ["outcome"],
        buckets=_BUCKETS,
    )
    hold_seconds = Histogram(
        "redlock_hold_seconds",
        "Time a lock was held, from grant to release.",
        buckets=_BUCKETS,
    )
    contended = Counter(
        "redlock_contended", "Acquisitions given up because others held the lock."
    )
    unavailable = Counter(
        "redlock_quorum_failures", "Acquisitions failed for want of a node quorum."
    )
    lost = Counter("redlock_lost", "Leases lost (ran out or not extended) while held.")
    extended = Counter("redlock_extended", "Successful lease extensions.")
    current = Gauge("redlock_held", "Locks currently held by this process.")
    # Read from the holds at each scrape, so a thread or task that ended holding a
    # lock (no lock_released ever comes) stops counting. Prometheus's multiprocess
    # mode cannot read a function: there the signals count up and down.
    counted = values.ValueClass is not values.MutexValue
    if not counted:
        current.set_function(holds.held_count)

    acquired_seconds = acquire_seconds.labels("acquired")
    contended_seconds = acquire_seconds.labels("contended")
    unavailable_seconds = acquire_seconds.labels("unavailable")

    def on_acquired(named: dict[str, Any]) -> None:
        acquired_seconds.observe(named["waited"])
        if counted:
            current.inc()

    def on_contended(named: dict[str, Any]) -> None:
        contended_seconds.observe(named["waited"])
        contended.inc()

    def on_unavailable(named: dict[str, Any]) -> None:
        unavailable_seconds.observe(named["waited"])
        unavailable.inc()

    def on_released(named: dict[str, Any]) -> None:
        hold_seconds.observe(named["held"])
        if counted:
            current.dec()

    def on_lost(named: dict[str, Any]) -> None:
        lost.inc()

    def on_extended(named: dict[str, Any]) -> None:
        extended.inc()

    instruments: dict[Signal, Callable[[dict[str, Any]], None]] = {
        signals.lock_acquired: on_acquired,
        signals.lock_contended: on_contended,
        signals.lock_unavailable: on_unavailable,
        signals.lock_released: on_released,
        signals.lock_lost: on_lost,
        signals.lock_extended: on_extended,
    }
    for signal, instrument in instruments.items():
        signals.attach(signal, instrument)
    # A forked child holds none of its parent's locks (holds.py): it starts at 0,
    # or its gauge would count holds whose release it never sees.
    if counted:
        os.register_at_fork(after_in_child=lambda: current.set(0))
    _installed = True
    return True
