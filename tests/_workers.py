"""Worker processes for the cross-process tests, run as ``python -m tests._workers``.

A worker configures Django itself (``settings.configure``: no test settings module,
nothing inherited from pytest), then increments a shared counter key ``iterations``
times with a separate GET and SET, a read-modify-write that loses updates unless
something serialises it. ``--mode`` picks what does:

- ``sync``: ``with Redlock(...)`` around each increment, in ``--concurrency`` threads;
- ``async``: ``async with Redlock(...)`` in ``--concurrency`` asyncio tasks;
- ``none``: nothing (the negative control), in ``--concurrency`` threads;
- ``locked``: an ``@locked("<resource>:{slot}")`` function around each increment,
  in ``--concurrency`` threads;
- ``alocked``: an ``@locked`` coroutine, in ``--concurrency`` asyncio tasks.

The code between GET and SET is the same in every mode. ``--gap`` seconds pass
between them, to widen the race window. Inside each increment the worker also
counts how many workers are inside at once (INCR/DECR of an ``inside`` key) and
appends its name to an ``order`` list, so the parent can prove the workers really
ran at the same time.

Workers start together: each one INCRs ``<prefix>:ready`` once set up, then waits
until the parent sets ``<prefix>:go``. On success the worker prints one JSON line
(``done``, ``overlaps``, ``elapsed``) and exits 0; on any error it prints the
traceback on stderr and exits 1. ``--deadline`` bounds the whole run.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import sys
import threading
import time
import traceback
from collections.abc import Sequence
from typing import Any

import redis
import redis.asyncio

#: The lock's settings in a worker: generous node timeouts (two cores shared by
#: every worker and five servers), short retries so waiting workers keep trying.
LOCK_SETTINGS: dict[str, Any] = {
    "TTL": 10.0,
    "NODE_TIMEOUT": 0.5,
    "RETRY_DELAY": 0.005,
    "RETRY_JITTER": 0.01,
}


class Keys:
    """The counter node's keys used by one run, all under one prefix."""

    def __init__(self, prefix: str) -> None:
        self.counter = f"{prefix}:counter"
        self.inside = f"{prefix}:inside"
        self.order = f"{prefix}:order"
        self.ready = f"{prefix}:ready"
        self.go = f"{prefix}:go"


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m tests._workers")
    parser.add_argument("--name", required=True, help="this worker's name")
    parser.add_argument(
        "--mode", choices=("sync", "async", "none", "locked", "alocked"), required=True
    )
    parser.add_argument("--nodes", required=True, help="comma-separated Redis URLs")
    parser.add_argument("--counter-url", required=True)
    parser.add_argument("--prefix", required=True)
    parser.add_argument("--resource", default="counter")
    parser.add_argument("--iterations", type=int, required=True)
    parser.add_argument("--concurrency", type=int, default=1)
    parser.add_argument("--gap", type=float, default=0.0)
    parser.add_argument("--deadline", type=float, default=60.0)
    return parser.parse_args(argv)


def setup_django(urls: list[str], deadline: float) -> None:
    import django
    from django.conf import settings

    settings.configure(
        INSTALLED_APPS=["redlock_django"],
        REDLOCK={**LOCK_SETTINGS, "NODES": urls, "WAIT_TIMEOUT": deadline},
    )
    django.setup()


def wait_for_go(client: redis.Redis, keys: Keys, deadline: float) -> None:
    client.incr(keys.ready)
    while not client.exists(keys.go):
        if time.monotonic() > deadline:
            raise TimeoutError("the parent never said go")
        time.sleep(0.001)


def increment(client: redis.Redis, keys: Keys, name: str, gap: float) -> int:
    """Add one to the counter by GET then SET; return 1 if another was inside."""
    overlapped = int(client.incr(keys.inside) != 1)
    value = int(client.get(keys.counter) or 0)
    time.sleep(gap)
    client.set(keys.counter, value + 1)
    client.rpush(keys.order, name)
    client.decr(keys.inside)
    return overlapped


async def aincrement(
    client: redis.asyncio.Redis, keys: Keys, name: str, gap: float
) -> int:
    """``increment()`` for asyncio tasks."""
    overlapped = int(await client.incr(keys.inside) != 1)
    value = int(await client.get(keys.counter) or 0)
    await asyncio.sleep(gap)
    await client.set(keys.counter, value + 1)
    await client.rpush(keys.order, name)
    await client.decr(keys.inside)
    return overlapped


def run_threads(args: argparse.Namespace, keys: Keys, deadline: float) -> int:
    from redlock_django import Redlock, locked

    lock = Redlock(args.resource)

    @locked(f"{args.resource}:{{slot}}")
    def locked_increment(client: redis.Redis, name: str, slot: int = 0) -> int:
        return increment(client, keys, name, args.gap)

    overlaps: list[int] = []
    errors: list[BaseException] = []

    def loop(name: str) -> None:
        try:
            with redis.Redis.from_url(args.counter_url) as client:
                for _ in range(args.iterations):
                    if time.monotonic() > deadline:
                        raise TimeoutError(f"{name}: deadline passed")
                    if args.mode == "locked":
                        overlaps.append(locked_increment(client, name))
                        continue
                    guard = lock if args.mode == "sync" else contextlib.nullcontext()
                    with guard:
                        overlaps.append(increment(client, keys, name, args.gap))
        except BaseException as exc:
            errors.append(exc)

    threads = [
        threading.Thread(target=loop, args=(f"{args.name}.{i}",))
        for i in range(args.concurrency)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(max(0.0, deadline - time.monotonic()) + 1.0)
        if thread.is_alive():
            raise TimeoutError(f"{thread.name} still running at the deadline")
    if errors:
        raise errors[0]
    return sum(overlaps)


async def run_tasks(args: argparse.Namespace, keys: Keys, deadline: float) -> int:
    from redlock_django import Redlock, locked

    lock = Redlock(args.resource)
    client = redis.asyncio.Redis.from_url(args.counter_url)

    @locked(f"{args.resource}:{{slot}}")
    async def locked_increment(name: str, slot: int = 0) -> int:
        return await aincrement(client, keys, name, args.gap)

    async def loop(name: str) -> int:
        overlaps = 0
        for _ in range(args.iterations):
            if args.mode == "alocked":
                overlaps += await locked_increment(name)
                continue
            async with lock:
                overlaps += await aincrement(client, keys, name, args.gap)
        return overlaps

    try:
        async with asyncio.timeout(max(0.0, deadline - time.monotonic())):
            counts = await asyncio.gather(
                *(loop(f"{args.name}.{i}") for i in range(args.concurrency))
            )
    finally:
        await client.aclose()
    return sum(counts)


def main(argv: Sequence[str]) -> int:
    args = parse_args(argv)
    deadline = time.monotonic() + args.deadline
    setup_django(args.nodes.split(","), args.deadline)
    keys = Keys(args.prefix)
    with redis.Redis.from_url(args.counter_url) as client:
        wait_for_go(client, keys, deadline)
    started = time.monotonic()
    if args.mode in ("async", "alocked"):
        overlaps = asyncio.run(run_tasks(args, keys, deadline))
    else:
        overlaps = run_threads(args, keys, deadline)
    result = {
        "name": args.name,
        "pid": os.getpid(),
        "done": args.iterations * args.concurrency,
        "overlaps": overlaps,
        "elapsed": time.monotonic() - started,
    }
    print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    try:
        code = main(sys.argv[1:])
    except BaseException:
        traceback.print_exc()
        sys.stderr.flush()
        # Leave at once, even if a stuck thread is still running.
        os._exit(1)
    sys.exit(code)
