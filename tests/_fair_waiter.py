"""One waiter of a fair lock, in its own process: ``python -m tests._fair_waiter``.

It configures Django itself with the node URLs it is given, acquires ``--resource``
with ``fair=True`` (or, with ``--barging``, not fair; waiting up to
``--timeout``), prints one JSON line when it got the lock (``at``:
CLOCK_MONOTONIC, system-wide on Linux; ``attempts``, ``wakeups`` and ``handed``
from the ``lock_acquired`` signal), holds it ``--hold`` seconds, releases it and
exits. A wait that runs out prints ``{"event": "gave up"}``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests._fair_waiter")
    parser.add_argument("--nodes", required=True, help="comma-separated Redis URLs")
    parser.add_argument("--resource", required=True)
    parser.add_argument("--name", required=True)
    parser.add_argument("--timeout", type=float, default=20.0)
    parser.add_argument("--hold", type=float, default=0.05)
    parser.add_argument("--retry-delay", type=float, default=0.05)
    parser.add_argument("--node-timeout", type=float, default=0.2)
    parser.add_argument("--queue-life", type=float, default=None)
    parser.add_argument("--no-handoff", action="store_true")
    parser.add_argument(
        "--barging", action="store_true", help="a lock that is not fair (FAIR False)"
    )
    parser.add_argument(
        "--loop", type=float, default=0.0, help="acquire and release for so long"
    )
    args = parser.parse_args(argv)

    import django
    from django.conf import settings

    settings.configure(
        INSTALLED_APPS=["redlock_django"],
        REDLOCK={
            "NODES": args.nodes.split(","),
            "TTL": 10.0,
            "NODE_TIMEOUT": args.node_timeout,
            "RETRY_DELAY": args.retry_delay,
            "RETRY_JITTER": 0,
            "FAIR": not args.barging,
            **({} if args.queue_life is None else {"QUEUE_LIFE": args.queue_life}),
            **({"HANDOFF": False} if args.no_handoff else {}),
        },
    )
    django.setup()
    from redlock_django import Redlock, signals

    got: dict[str, Any] = {}

    def on_acquired(**kwargs: Any) -> None:
        got.update(
            attempts=kwargs["attempts"],
            wakeups=kwargs["wakeups"],
            handed=kwargs["handed"],
        )

    signals.lock_acquired.connect(on_acquired, weak=False)
    lock = Redlock(args.resource)
    if args.loop:
        return _loop(lock, args.name, args.loop, args.timeout, got)
    if not lock.acquire(timeout=args.timeout):
        print(json.dumps({"event": "gave up", "name": args.name}), flush=True)
        return 0
    at = time.monotonic()
    print(
        json.dumps({"event": "acquired", "name": args.name, "at": at, **got}),
        flush=True,
    )
    time.sleep(args.hold)
    lock.release()
    return 0


def _loop(lock: Any, name: str, seconds: float, timeout: float, got: Any) -> int:
    """Acquire and release in a loop; print the count, the longest wait and how
    many acquisitions were handed over."""
    waits: list[float] = []
    handed = 0
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        began = time.monotonic()
        if not lock.acquire(timeout=timeout):
            print(json.dumps({"event": "gave up", "name": name}), flush=True)
            return 0
        waits.append(time.monotonic() - began)
        handed += bool(got.get("handed"))
        lock.release()
    print(
        json.dumps(
            {
                "event": "looped",
                "name": name,
                "acquired": len(waits),
                "handed": handed,
                "longest": max(waits),
            }
        ),
        flush=True,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
