"""The Celery app of ``tests/test_celery.py``, run as ``celery -A tests._celery_app``.

A worker started by the tests configures Django itself (``settings.configure``,
as ``tests/_workers.py`` does) from its environment: ``REDLOCK_TEST_NODES`` (the
lock nodes, comma-separated), ``CELERY_TEST_BROKER`` (a redis-server the test
started), ``CELERY_TEST_BACKEND`` (results) and ``CELERY_TEST_COUNTER`` (where the
tasks count). ``CELERY_TEST_VISIBILITY`` shortens the broker's visibility timeout,
so an unacknowledged ``acks_late`` message is delivered again while its first run
still goes on. The pytest process imports the module too, with Django already set
up; its fixture points ``app.conf`` at the same broker.

Every task writes to the counter node under the ``name`` it is given, so tests
never share keys: ``<name>:runs`` (one entry per run that entered the body),
``<name>:inside`` (how many bodies run right now) and ``<name>:overlaps`` (how
many runs found another one inside).
"""

from __future__ import annotations

import json
import os
import socket
import time
from typing import Any

import redis
from celery import Celery

from redlock_django.contrib.celery import RedlockTask

# The lock settings of a worker: generous node timeouts (two cores shared by the
# workers, the test and five servers), short retries so waiting tasks keep trying.
LOCK_SETTINGS: dict[str, Any] = {
    "TTL": 10.0,
    "NODE_TIMEOUT": 0.5,
    "RETRY_DELAY": 0.01,
    "RETRY_JITTER": 0.01,
    "WAIT_TIMEOUT": 30.0,
}


def _setup_django() -> None:
    from django.conf import settings

    if settings.configured:  # the pytest process: tests.settings
        return
    import django

    nodes = os.environ.get("REDLOCK_TEST_NODES", "redis://127.0.0.1:1/0")
    settings.configure(
        INSTALLED_APPS=["redlock_django"],
        REDLOCK={**LOCK_SETTINGS, "NODES": nodes.split(",")},
    )
    django.setup()


_setup_django()

app = Celery("redlock_tests")
_visibility = os.environ.get("CELERY_TEST_VISIBILITY")
app.conf.update(
    broker_url=os.environ.get("CELERY_TEST_BROKER", "redis://127.0.0.1:1/0"),
    result_backend=os.environ.get("CELERY_TEST_BACKEND", "redis://127.0.0.1:1/1"),
    broker_connection_retry_on_startup=True,
    task_serializer="json",
    result_serializer="json",
    accept_content=["json"],
    # One message reserved per free process: a message waits in the queue, not
    # in a busy worker's buffer, so both workers get a share.
    worker_prefetch_multiplier=1,
    worker_hijack_root_logger=False,
    # A result store that is gone stays gone (the module's broker is stopped):
    # fail at once instead of retrying for 20 s inside whatever runs next.
    result_backend_transport_options={"retry_policy": {"max_retries": 0}},
    broker_transport_options=(
        {
            "visibility_timeout": float(_visibility),
            "unacked_restore_interval": 0.2,
            "unacked_restore_throttle": 1,
        }
        if _visibility
        else {}
    ),
)


_counter: redis.Redis | None = None


def counter() -> redis.Redis:
    """Return a client of the counter node (one per process, made on first use)."""
    global _counter
    if _counter is None:
        use_counter(os.environ.get("CELERY_TEST_COUNTER", "redis://127.0.0.1:1/2"))
    assert _counter is not None
    return _counter


def use_counter(url: str) -> None:
    """Count on ``url`` from now on (the pytest process, for eager runs)."""
    global _counter
    _counter = redis.Redis.from_url(url)


class Inside:
    """Count the bodies running under ``name``, and the runs that saw another."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.client = counter()

    def __enter__(self) -> Inside:
        entry = {"pid": os.getpid(), "ppid": os.getppid(), "host": socket.gethostname()}
        self.client.rpush(f"{self.name}:runs", json.dumps(entry))
        if self.client.incr(f"{self.name}:inside") != 1:
            self.client.incr(f"{self.name}:overlaps")
        return self

    def __exit__(self, *exc: object) -> None:
        self.client.decr(f"{self.name}:inside")
        self.client.rpush(f"{self.name}:ended", str(os.getpid()))


def increment(name: str, gap: float) -> int:
    """Add one to ``<name>:counter`` by GET, a pause of ``gap`` seconds, then SET."""
    with Inside(name) as inside:
        value = int(inside.client.get(f"{name}:counter") or 0)
        time.sleep(gap)
        inside.client.set(f"{name}:counter", value + 1)
    return value + 1


def sleep_inside(name: str, seconds: float) -> str:
    """Run for ``seconds`` inside ``name``; return "done"."""
    with Inside(name):
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            time.sleep(0.02)
    return "done"


@app.task(base=RedlockTask, lock="counter:{name}", lock_timeout=60)
def locked_increment(name: str, gap: float) -> int:
    return increment(name, gap)


@app.task
def unlocked_increment(name: str, gap: float) -> int:
    """The negative control: the same body without the lock."""
    return increment(name, gap)


@app.task(base=RedlockTask, lock="held:{name}", lock_on_contention="skip")
def skip_when_held(name: str) -> str:
    return sleep_inside(name, 0)


@app.task(base=RedlockTask, lock="held:{name}", lock_on_contention="raise")
def raise_when_held(name: str) -> str:
    return sleep_inside(name, 0)


@app.task(
    bind=True,
    base=RedlockTask,
    lock="held:{name}",
    lock_on_contention="retry",
    lock_retry_countdown=0.3,
    max_retries=50,
)
def retry_when_held(self: RedlockTask, name: str) -> dict[str, Any]:
    sleep_inside(name, 0)
    return {"retries": self.request.retries}


# A long lease (and auto-extension): a lock freed within a second of a revoke or
# a soft time limit was released, not left to expire.
@app.task(base=RedlockTask, lock="slow:{name}", lock_ttl=10.0)
def slow(name: str, seconds: float) -> str:
    return sleep_inside(name, seconds)


# A short lease, auto-extended while the body runs: a killed worker child frees it
# within TTL.
@app.task(base=RedlockTask, lock="short:{name}", lock_ttl=2.0)
def short_lease(name: str, seconds: float) -> str:
    return sleep_inside(name, seconds)


@app.task(base=RedlockTask, lock="soft:{name}", lock_ttl=10.0, soft_time_limit=1.0)
def soft_limited(name: str) -> str:
    return sleep_inside(name, 30)


@app.task(base=RedlockTask, lock="hard:{name}", lock_ttl=10.0, time_limit=1.0)
def hard_limited(name: str) -> str:
    return sleep_inside(name, 30)


@app.task(base=RedlockTask, lock="late:{name}", lock_timeout=60, acks_late=True)
def late_locked(name: str, seconds: float) -> str:
    return sleep_inside(name, seconds)


@app.task(acks_late=True)
def late_unlocked(name: str, seconds: float) -> str:
    """The negative control of ``late_locked``: redelivered, runs twice at once."""
    return sleep_inside(name, seconds)


def first_delivery_hangs(name: str) -> str:
    """The first delivery of ``name`` runs until killed; later ones end at once."""
    first = counter().incr(f"{name}:deliveries") == 1
    return sleep_inside(name, 120 if first else 0)


# Requeued when their process dies (an OOM kill): the copy finds the lock its
# killed first run took, labelled with its own task id, for up to lock_ttl.
@app.task(
    base=RedlockTask,
    lock="lost:{name}",
    lock_on_contention="skip",
    lock_ttl=30.0,
    acks_late=True,
    reject_on_worker_lost=True,
)
def lost_skip(name: str) -> str:
    return first_delivery_hangs(name)


@app.task(
    base=RedlockTask,
    lock="lost:{name}",
    lock_timeout=60,
    lock_ttl=30.0,
    acks_late=True,
    reject_on_worker_lost=True,
)
def lost_wait(name: str) -> str:
    return first_delivery_hangs(name)
