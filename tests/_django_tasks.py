"""Django 6 tasks run by the ``db_worker`` processes of ``tests/test_django_tasks.py``.

Imported only under Django 6.0+ (by the workers, which find each task by its
module path, and by the test that enqueues them). Every counting task does the same
read-modify-write on a Redis counter (``REDLOCK_TEST_COUNTER``: a GET, ``gap``
seconds, a SET), which loses updates unless something serialises it, and counts
how many runs are inside at once (``<name>:inside``; an ``<name>:overlaps`` INCR
whenever another run is already inside). ``held`` and ``held_plain`` sit on their
lock until told to stop (``<name>:stop``) or for ``seconds``.
"""

from __future__ import annotations

import asyncio
import functools
import os
import time
from typing import Any

import redis
from django.tasks import TaskContext, task

from redlock_django.contrib.tasks import locked_task


@functools.cache
def _counter() -> redis.Redis:
    return redis.Redis.from_url(os.environ["REDLOCK_TEST_COUNTER"])


def _enter(name: str) -> None:
    client = _counter()
    if client.incr(f"{name}:inside") > 1:
        client.incr(f"{name}:overlaps")
    client.rpush(f"{name}:pids", os.getpid())


def _leave(name: str) -> None:
    _counter().decr(f"{name}:inside")


def _increment(name: str, gap: float) -> int:
    _enter(name)
    try:
        client = _counter()
        value = int(client.get(f"{name}:counter") or 0)
        time.sleep(gap)
        client.set(f"{name}:counter", value + 1)
        return value + 1
    finally:
        _leave(name)


@task()
def unlocked_increment(name: str, gap: float) -> int:
    """The negative control: the same increment with no lock."""
    return _increment(name, gap)


@locked_task("counter:{name}")
def locked_increment(name: str, gap: float) -> int:
    """Increment under the lock, waiting for it (the default policy)."""
    return _increment(name, gap)


@locked_task("counter:{name}")
async def async_locked_increment(name: str, gap: float) -> int:
    """The async twin of ``locked_increment``, on the same lock."""
    _enter(name)
    try:
        client = _counter()
        value = int(client.get(f"{name}:counter") or 0)
        await asyncio.sleep(gap)
        client.set(f"{name}:counter", value + 1)
        return value + 1
    finally:
        _leave(name)


@locked_task("held:{name}", on_contention="skip")
def skip_increment(name: str, gap: float) -> int:
    """Increment unless someone holds ``held:<name>``: then return None."""
    return _increment(name, gap)


@locked_task("held:{name}", on_contention="raise")
def raise_increment(name: str, gap: float) -> int:
    """Increment, or fail at once with LockContentionError if held."""
    return _increment(name, gap)


def _sit(name: str, seconds: float, about: dict[str, Any]) -> dict[str, Any]:
    client = _counter()
    client.hset(f"{name}:started", mapping={"pid": os.getpid(), **about})
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline and not client.exists(f"{name}:stop"):
        time.sleep(0.02)
    return {"pid": os.getpid(), **about}


@locked_task("held:{name}", takes_context=True)
def held(context: TaskContext, name: str, seconds: float) -> dict[str, Any]:
    """Hold ``held:<name>`` for ``seconds`` (or until ``<name>:stop`` is set)."""
    return _sit(name, seconds, {"result_id": context.task_result.id})


@locked_task("held:{name}")
def held_plain(name: str, seconds: float) -> dict[str, Any]:
    """``held`` without the task context: its label gets the id from the worker."""
    return _sit(name, seconds, {})
