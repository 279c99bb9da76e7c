"""``RedlockTask`` with real Celery workers, a real broker and the five lock nodes.

The workers are ``celery -A tests._celery_app worker --pool=prefork`` processes,
started the way a user starts them, against a ``redis-server`` broker this module
starts. Every task counts its runs on that broker's server (``tests/_celery_app.py``),
so a test reads what happened from outside the workers. Lock state is read from
the nodes themselves (``harness.held``), never from the lock's own view.
"""

from __future__ import annotations

import contextlib
import gc
import json
import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import redis
from celery import Celery
from celery.exceptions import Retry
from django.core.exceptions import ImproperlyConfigured
from kombu.transport import redis as kombu_redis

from harness.held import held_on
from harness.nodes import NodeSet, RedisNode
from harness.processes import REPO, Children, log_tail
from harness.proxy import FaultProxy
from redlock_django import LockContentionError, Redlock, signals
from redlock_django.contrib.celery import RedlockTask, task_label
from redlock_django.functions import MAX_LABEL_LENGTH, current_lock
from redlock_django.keys import lock_key
from redlock_django.listing import describe
from redlock_django.scripts import RELEASE_SCRIPT
from tests import _celery_app as tasks
from tests.test_faults import PREFIX, start_holder

pytestmark = pytest.mark.timeout(90)

WORKER_START_TIMEOUT = 30.0
#: The quorum of the five test nodes.
QUORUM = 3


def unique(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:10]}"


class Worker:
    """One ``celery worker`` process (and its pool children), with its log."""

    def __init__(self, process: subprocess.Popen[bytes], name: str, log: Path):
        self.process = process
        self.name = name
        self.log = log

    @property
    def pid(self) -> int:
        return self.process.pid

    def text(self) -> str:
        return self.log.read_text(errors="replace") if self.log.exists() else ""

    def wait_ready(self) -> None:
        deadline = time.monotonic() + WORKER_START_TIMEOUT
        while " ready." not in self.text():
            if self.process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(
                    f"worker {self.name} did not start:\n{log_tail(self.log, 40)}"
                )
            time.sleep(0.05)


def start_workers(
    children: Children,
    directory: Path,
    broker: RedisNode,
    lock_nodes: NodeSet,
    names: list[str],
    *,
    queue: str,
    concurrency: int = 2,
    extra_env: dict[str, str] | None = None,
) -> list[Worker]:
    """Start one worker per name on ``queue``; return them once all are ready."""
    env = {
        **os.environ,
        "PYTHONPATH": str(REPO),
        "REDLOCK_TEST_NODES": ",".join(lock_nodes.urls),
        "CELERY_TEST_BROKER": broker.url,
        "CELERY_TEST_BACKEND": f"redis://127.0.0.1:{broker.port}/1",
        "CELERY_TEST_COUNTER": f"redis://127.0.0.1:{broker.port}/2",
        **(extra_env or {}),
    }
    # The workers configure Django themselves, as tests/_workers.py does.
    env.pop("DJANGO_SETTINGS_MODULE", None)
    workers = []
    for name in names:
        log = directory / f"{name}.log"
        command = [
            sys.executable, "-m", "celery", "-A", "tests._celery_app", "worker",
            "--pool=prefork", f"--concurrency={concurrency}", "-n", f"{name}@%h",
            "-Q", queue, "--loglevel=INFO",
            "--without-heartbeat", "--without-gossip", "--without-mingle",
        ]  # fmt: skip
        process = children.start(name, command, env, log)
        workers.append(Worker(process, name, log))
    for worker in workers:
        worker.wait_ready()
    return workers


@pytest.fixture(scope="module")
def broker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisNode]:
    """A redis-server of this module's own: the broker, results and counters."""
    node = RedisNode(tmp_path_factory.mktemp("broker"))
    node.start()
    try:
        yield node
    finally:
        # A result caught in a reference cycle (an exception's traceback) is
        # finalized whenever the collector runs; its __del__ unsubscribes from
        # the result store, so finalize them while that store still answers.
        gc.collect()
        node.stop()


@pytest.fixture(scope="module")
def workers(
    broker: RedisNode,
    redis_nodes: NodeSet,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[list[Worker]]:
    """Two prefork workers of two processes each, on the ``race`` queue."""
    children = Children()
    try:
        yield start_workers(
            children,
            tmp_path_factory.mktemp("workers"),
            broker,
            redis_nodes,
            ["w1", "w2"],
            queue="race",
        )
    finally:
        children.stop_all()


def point_app_at(broker: RedisNode) -> None:
    """Point the test app (in this process) at ``broker``, for sending and results.

    Always the module's broker: the app caches its connections and backend.
    """
    tasks.app.conf.update(
        broker_url=broker.url,
        result_backend=f"redis://127.0.0.1:{broker.port}/1",
    )
    tasks.use_counter(f"redis://127.0.0.1:{broker.port}/2")


@pytest.fixture
def app(
    broker: RedisNode, workers: list[Worker], redlock_settings: dict[str, Any]
) -> Celery:
    """The test app, sending to the running workers; REDLOCK pointed at the nodes."""
    point_app_at(broker)
    return tasks.app


@pytest.fixture
def counts(broker: RedisNode) -> Iterator[redis.Redis]:
    client = broker.client(db=2)
    yield client
    client.close()


def runs(client: redis.Redis, name: str) -> list[dict[str, Any]]:
    return [json.loads(raw) for raw in client.lrange(f"{name}:runs", 0, -1)]


def wait_for(
    condition: Callable[[], Any], timeout: float, what: str, poll: float = 0.02
) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(poll)


def freed_after(nodes: NodeSet, resource: str, timeout: float) -> float:
    """Return how many seconds pass until no node holds ``resource``'s lock."""
    start = time.monotonic()
    wait_for(lambda: held_on(nodes, resource) == 0, timeout, f"{resource} freed")
    return time.monotonic() - start


# Two workers racing one task key.


def test_two_workers_never_run_the_locked_task_at_once(
    app: Celery, workers: list[Worker], nodes: NodeSet, counts: redis.Redis
) -> None:
    """Eight increments (GET, pause, SET) on four processes lose nothing."""
    name = unique("race")
    results = [
        tasks.locked_increment.apply_async((name, 0.05), queue="race") for _ in range(8)
    ]
    for result in results:
        result.get(timeout=60)
    assert int(counts.get(f"{name}:counter") or 0) == 8
    assert int(counts.get(f"{name}:overlaps") or 0) == 0
    # Both workers really took part: the lock, not the queue, kept them apart.
    parents = {entry["ppid"] for entry in runs(counts, name)}
    assert parents == {worker.pid for worker in workers}
    assert held_on(nodes, f"counter:{name}") == 0


def test_negative_control_without_the_lock_loses_updates(
    app: Celery, workers: list[Worker], counts: redis.Redis
) -> None:
    """The same eight increments without the lock overlap and lose updates."""
    name = unique("unsafe")
    results = [
        tasks.unlocked_increment.apply_async((name, 0.2), queue="race")
        for _ in range(8)
    ]
    for result in results:
        result.get(timeout=60)
    counter = int(counts.get(f"{name}:counter") or 0)
    overlaps = int(counts.get(f"{name}:overlaps") or 0)
    print(f"negative control: counter {counter}/8, overlaps {overlaps}")
    assert overlaps > 0
    assert counter < 8


# The contention policies, with the lock held by this test process.


def test_skip_returns_none_without_running(
    app: Celery, counts: redis.Redis, hold: Callable[..., Redlock]
) -> None:
    name = unique("skip")
    hold(f"held:{name}", ttl=30)
    result = tasks.skip_when_held.apply_async((name,), queue="race")
    assert result.get(timeout=30) is None
    assert result.state == "SUCCESS"
    assert runs(counts, name) == []


def test_raise_fails_the_task_at_once(
    app: Celery, counts: redis.Redis, hold: Callable[..., Redlock]
) -> None:
    name = unique("raise")
    hold(f"held:{name}", ttl=30)
    started = time.monotonic()
    result = tasks.raise_when_held.apply_async((name,), queue="race")
    result.get(timeout=30, propagate=False)
    assert result.state == "FAILURE"
    assert "LockContentionError" in (result.traceback or "")
    assert time.monotonic() - started < 5  # not the 30 s wait of "wait"
    assert runs(counts, name) == []


def test_retry_retries_until_the_lock_is_free(
    app: Celery, nodes: NodeSet, counts: redis.Redis, hold: Callable[..., Redlock]
) -> None:
    name = unique("retry")
    lock = hold(f"held:{name}", ttl=30)
    result = tasks.retry_when_held.apply_async((name,), queue="race")
    wait_for(lambda: result.state == "RETRY", 15, "the RETRY state")
    time.sleep(0.5)  # a retry or two more while held
    assert runs(counts, name) == []
    lock.release()
    outcome = result.get(timeout=30)
    assert outcome["retries"] >= 1
    assert len(runs(counts, name)) == 1
    assert held_on(nodes, f"held:{name}") == 0


# The body's process dies: killed, revoked, out of time.


def test_killed_child_frees_the_lock_within_ttl(
    app: Celery, nodes: NodeSet, counts: redis.Redis
) -> None:
    """SIGKILL of the pool child inside the task: the lock is free within TTL + 1 s."""
    name = unique("kill")
    resource = f"short:{name}"
    result = tasks.short_lease.apply_async((name, 30), queue="race")
    entry = wait_for(lambda: runs(counts, name), 15, "the task to start")[0]
    assert held_on(nodes, resource) >= QUORUM
    time.sleep(2.5)  # past the 2 s TTL: the watchdog was extending it
    assert held_on(nodes, resource) >= QUORUM
    os.kill(entry["pid"], signal.SIGKILL)
    elapsed = freed_after(nodes, resource, 2.0 + 1.0)
    print(f"killed child: lock free after {elapsed:.3f}s (TTL 2 s)")
    result.get(timeout=15, propagate=False)
    assert result.state == "FAILURE"
    assert "WorkerLostError" in type(result.result).__name__


@pytest.mark.parametrize("signum", ["SIGTERM", "SIGKILL"])
def test_revoke_terminate_releases_at_once(
    app: Celery, nodes: NodeSet, counts: redis.Redis, signum: str
) -> None:
    """revoke(terminate=True) frees the lock well inside its 10 s lease.

    SIGTERM ends the body with an exception (its own release runs); SIGKILL
    leaves no chance to the body: the worker's main process releases.
    """
    name = unique("revoke")
    resource = f"slow:{name}"
    result = tasks.slow.apply_async((name, 30), queue="race")
    wait_for(lambda: runs(counts, name), 15, "the task to start")
    listed = describe([resource])
    assert [held.label for held in listed] == [
        task_label("tests._celery_app.slow", result.id)
    ]
    result.revoke(terminate=True, signal=signum)
    elapsed = freed_after(nodes, resource, 5.0)
    print(f"revoke(terminate=True, {signum}): lock free after {elapsed:.3f}s (TTL 10)")
    assert elapsed < 3.0
    wait_for(lambda: result.state == "REVOKED", 10, "the REVOKED state")
    if signum == "SIGKILL":
        assert counts.lrange(f"{name}:ended", 0, -1) == []  # no clean-up ran


def test_revoke_with_an_ignored_signal_leaves_the_running_body_its_lock(
    app: Celery, nodes: NodeSet, counts: redis.Redis
) -> None:
    """A revoke whose signal the child ignores (SIGINT) must not free a live holder.

    The main process sees the lock's process still alive and leaves it; the body
    releases it itself when it ends.
    """
    name = unique("alive")
    resource = f"slow:{name}"
    result = tasks.slow.apply_async((name, 4), queue="race")
    wait_for(lambda: runs(counts, name), 15, "the task to start")
    result.revoke(terminate=True, signal="SIGINT")
    time.sleep(2.5)  # longer than the main process waits for the child
    assert counts.lrange(f"{name}:ended", 0, -1) == []
    assert held_on(nodes, resource) >= QUORUM
    wait_for(lambda: counts.lrange(f"{name}:ended", 0, -1), 10, "the body's end")
    freed_after(nodes, resource, 1.0)


def test_soft_time_limit_releases_at_once(
    app: Celery, nodes: NodeSet, counts: redis.Redis
) -> None:
    """SoftTimeLimitExceeded ends the body after 1 s: the 10 s lease goes with it."""
    name = unique("soft")
    resource = f"soft:{name}"
    result = tasks.soft_limited.apply_async((name,), queue="race")
    wait_for(lambda: runs(counts, name), 15, "the task to start")
    started = time.monotonic()
    assert held_on(nodes, resource) >= QUORUM
    freed_after(nodes, resource, 5.0)
    elapsed = time.monotonic() - started
    print(f"soft time limit 1 s: lock free {elapsed:.3f}s after the start (TTL 10 s)")
    assert elapsed < 3.0
    result.get(timeout=10, propagate=False)
    assert result.state == "FAILURE"
    assert "SoftTimeLimitExceeded" in (result.traceback or "")


def test_hard_time_limit_releases_at_once(
    app: Celery, nodes: NodeSet, counts: redis.Redis
) -> None:
    """The pool kills the child after 1 s; the 10 s lease goes with it.

    The pool sends SIGTERM (SIGKILL if that fails): the body's own release or the
    main process's, whichever comes first.
    """
    name = unique("hard")
    resource = f"hard:{name}"
    result = tasks.hard_limited.apply_async((name,), queue="race")
    wait_for(lambda: runs(counts, name), 15, "the task to start")
    started = time.monotonic()
    assert held_on(nodes, resource) >= QUORUM
    freed_after(nodes, resource, 5.0)
    elapsed = time.monotonic() - started
    print(f"hard time limit 1 s: lock free {elapsed:.3f}s after the start (TTL 10 s)")
    assert elapsed < 3.0
    result.get(timeout=10, propagate=False)
    assert result.state == "FAILURE"
    assert "TimeLimitExceeded" in type(result.result).__name__


def test_killed_worker_frees_the_lock_within_ttl(
    broker: RedisNode,
    redis_nodes: NodeSet,
    nodes: NodeSet,
    redlock_settings: dict[str, Any],
    counts: redis.Redis,
    tmp_path: Path,
) -> None:
    """SIGKILL of a whole worker (main process and child): the TTL frees the lock.

    Nobody is left to release it, so it stays held until its lease ends: within
    TTL + 1 s of the kill, and not at once.
    """
    point_app_at(broker)
    children = Children()
    try:
        [worker] = start_workers(
            children, tmp_path, broker, redis_nodes, ["doomed"], queue="doomed",
            concurrency=1,
        )  # fmt: skip
        name = unique("doomed")
        resource = f"short:{name}"
        tasks.short_lease.apply_async((name, 30), queue="doomed")
        wait_for(lambda: runs(counts, name), 15, "the task to start")
        assert held_on(nodes, resource) >= QUORUM
        os.killpg(worker.pid, signal.SIGKILL)
        elapsed = freed_after(nodes, resource, 2.0 + 1.0)
    finally:
        children.stop_all()
    print(f"killed worker: lock free after {elapsed:.3f}s (TTL 2 s)")
    assert elapsed > 0.2


# acks_late: a message delivered again while its first delivery still runs.


@pytest.fixture
def late_workers(
    broker: RedisNode, redis_nodes: NodeSet, tmp_path: Path
) -> Iterator[list[Worker]]:
    """Two one-process workers on the ``late`` queue whose broker transport
    delivers an unacknowledged message again after one second (visibility)."""
    point_app_at(broker)
    children = Children()
    try:
        yield start_workers(
            children, tmp_path, broker, redis_nodes, ["late1", "late2"],
            queue="late", concurrency=1, extra_env={"CELERY_TEST_VISIBILITY": "1"},
        )  # fmt: skip
    finally:
        children.stop_all()
        # The copies still bouncing between the two workers.
        with broker.client() as client:
            client.delete("late", "unacked", "unacked_index")


def deliveries(workers: list[Worker], task_id: str) -> int:
    """Return how many times the workers' logs say they received ``task_id``."""
    return sum(worker.text().count(f"[{task_id}] received") for worker in workers)


# kombu 5.7 reads ``unacked_restore_interval`` (the app sets 0.2 s); before it an
# unacknowledged message is restored every 10 s at most, after the first run ended.
# (Celery 5.5, the one that works with redis-py < 5.3, needs kombu < 5.6.)
_QUICK_RESTORE = hasattr(kombu_redis.Channel, "unacked_restore_interval")


@pytest.mark.skipif(
    not _QUICK_RESTORE,
    reason="this kombu restores unacknowledged messages every 10 s at most (no "
    "unacked_restore_interval, kombu < 5.7): no redelivery while the first run goes on",
)
@pytest.mark.parametrize("locked", [True, False], ids=["locked", "unlocked"])
def test_acks_late_redelivery_never_runs_beside_the_first_delivery(
    late_workers: list[Worker],
    nodes: NodeSet,
    redlock_settings: dict[str, Any],
    counts: redis.Redis,
    locked: bool,
) -> None:
    """The redelivered copy runs only once the first run has ended; without the
    lock it starts while the first one still runs."""
    name = unique("late")
    task = tasks.late_locked if locked else tasks.late_unlocked
    # The copy is due about 1.2 s in (visibility 1 s, restores every 0.2 s); a
    # busy CI host has delivered it after 2 s, so the first run lasts 5 s.
    result = task.apply_async((name, 5.0), queue="late")
    wait_for(lambda: len(runs(counts, name)) >= 2, 30, "the copy to start")
    overlaps = int(counts.get(f"{name}:overlaps") or 0)
    print(
        f"acks_late {'locked' if locked else 'unlocked'}: "
        f"{deliveries(late_workers, result.id)} deliveries, "
        f"{len(runs(counts, name))} runs started, {overlaps} overlaps"
    )
    assert deliveries(late_workers, result.id) >= 2
    if locked:
        assert overlaps == 0
        assert len(counts.lrange(f"{name}:ended", 0, -1)) >= 1
    else:
        assert overlaps >= 1


def test_a_requeued_task_whose_first_run_died_is_retried_not_dropped(
    broker: RedisNode, nodes: NodeSet, redlock_settings: dict[str, Any]
) -> None:
    """A message requeued after its run's process died (``acks_late`` with
    ``reject_on_worker_lost``, an OOM kill) finds the lock still labelled with its
    own task id until the TTL frees it: with "retry" the copy retries. (A check
    that took any holder with its own id for a live first run and ignored the copy
    dropped this task: reverted, see docs/reliability.md.)"""
    app = Celery("requeued", broker=broker.url)

    @app.task(
        bind=True,
        base=RedlockTask,
        lock="requeued:{name}",
        lock_on_contention="retry",
        lock_retry_countdown=60,
        acks_late=True,
        reject_on_worker_lost=True,
        shared=False,
    )
    def job(self: RedlockTask, name: str) -> str:
        return "ran"

    name, task_id = unique("requeued"), str(uuid.uuid4())
    taken: list[bool] = []

    def die_holding() -> None:  # what a killed run leaves until its TTL
        lock = Redlock(f"requeued:{name}", ttl=30, label=task_label(job.name, task_id))
        taken.append(lock.acquire(blocking=False))

    thread = threading.Thread(target=die_holding)
    thread.start()
    thread.join(10)
    assert taken == [True]
    job.push_request(
        id=task_id, args=[name], kwargs={}, retries=0, called_directly=False
    )
    try:
        with pytest.raises(Retry):
            job(name)
    finally:
        job.pop_request()


@pytest.fixture
def lost_worker(
    broker: RedisNode, redis_nodes: NodeSet, tmp_path: Path
) -> Iterator[Worker]:
    """A one-process worker on the ``lost`` queue."""
    point_app_at(broker)
    children = Children()
    try:
        [worker] = start_workers(
            children, tmp_path, broker, redis_nodes, ["lost"], queue="lost",
            concurrency=1,
        )  # fmt: skip
        yield worker
    finally:
        children.stop_all()


@pytest.mark.parametrize("policy", ["skip", "wait"])
def test_a_task_requeued_after_its_process_was_killed_runs_again_at_once(
    lost_worker: Worker,
    nodes: NodeSet,
    redlock_settings: dict[str, Any],
    counts: redis.Redis,
    policy: str,
) -> None:
    """``acks_late`` + ``reject_on_worker_lost``: the pool child running the task is
    SIGKILLed (the OOM killer) and Celery requeues the message, reporting no
    failure. The copy finds the lock its dead first run took, labelled with its
    own task id, on this host, its process gone: it frees that lock and runs,
    instead of skipping the job for good ("skip") or waiting out the 30 s lease."""
    name = unique(f"lost-{policy}")
    task = tasks.lost_skip if policy == "skip" else tasks.lost_wait
    result = task.apply_async((name,), queue="lost")
    first = wait_for(lambda: runs(counts, name), 15, "the first run")[0]
    assert held_on(nodes, f"lost:{name}") >= QUORUM
    killed = time.monotonic()
    os.kill(first["pid"], signal.SIGKILL)
    wait_for(
        lambda: counts.lrange(f"{name}:ended", 0, -1),
        15,
        "the requeued copy to run (the lease is 30 s)",
    )
    print(f"{policy}: the copy ran {time.monotonic() - killed:.2f}s after the kill")
    assert result.get(timeout=10) == "done"
    assert int(counts.get(f"{name}:deliveries") or 0) == 2
    pids = [entry["pid"] for entry in runs(counts, name)]
    assert len(pids) == 2 and pids[0] == first["pid"] != pids[1]
    freed_after(nodes, f"lost:{name}", 5.0)


def _skipping_job(app: Celery) -> Any:
    """A task of ``app`` locked on ``reclaim:{name}`` that skips when it is held."""

    @app.task(
        base=RedlockTask, lock="reclaim:{name}", lock_on_contention="skip", shared=False
    )
    def job(name: str) -> str:
        return "ran"

    return job


@pytest.mark.parametrize(
    "holder", ["dead", "alive", "dead-in-another-namespace", "another-task-dead"]
)
def test_a_task_frees_only_a_dead_run_of_its_own_in_its_own_pid_namespace(
    broker: RedisNode, nodes: NodeSet, redlock_settings: dict[str, Any], holder: str
) -> None:
    """A task that finds its lock held frees it only if a run of this same task id
    took it in this host's pid namespace and that run's process is gone. A live
    run keeps it (a copy delivered again past the broker's visibility timeout); so
    does a dead run that wrote another pid namespace (a container sharing the host
    name, whose pids this process cannot see), and another task's dead run: they
    are left to their TTL and the copy skips."""
    job = _skipping_job(Celery("reclaim", broker=broker.url))
    name, task_id = unique("reclaim"), str(uuid.uuid4())
    resource = f"reclaim:{name}"
    owner = str(uuid.uuid4()) if holder == "another-task-dead" else task_id
    process, _ = start_holder(
        nodes.urls, "--resource", resource, "--ttl", "30",
        "--label", task_label(job.name, owner),
    )  # fmt: skip
    try:
        if holder != "alive":
            process.kill()
            process.wait(10)
        if holder == "dead-in-another-namespace":
            key = lock_key(resource, PREFIX)
            for node in nodes:
                with node.client() as client:
                    held = json.loads(client.hget(key, "meta") or b"{}")
                    client.hset(key, "meta", json.dumps({**held, "ns": "0" * 16}))
        contended: list[str] = []

        def count(sender: Any, **kwargs: Any) -> None:
            contended.append(kwargs["resource"])

        signals.lock_contended.connect(count, weak=False)
        job.push_request(
            id=task_id, args=[name], kwargs={}, retries=0, called_directly=False
        )
        try:
            outcome = job(name)
        finally:
            job.pop_request()
            signals.lock_contended.disconnect(count)
    finally:
        process.kill()
        process.wait(10)
    # The look at the holder costs no second try: one contention, as without it.
    assert contended == [resource]
    if holder == "dead":
        assert outcome == "ran"
        assert held_on(nodes, resource) == 0
    else:
        assert outcome is None  # skipped
        assert held_on(nodes, resource) == len(nodes)


class _Interrupted(Exception):
    """What the test's SIGALRM handler raises, as Celery's soft time limit raises
    SoftTimeLimitExceeded (an ``Exception``) from its SIGUSR1 handler."""


def test_a_soft_time_limit_while_looking_for_a_dead_holder_ends_the_task(
    settings: Any, redlock_settings: dict[str, Any], nodes: NodeSet
) -> None:
    """A task finding its lock held looks at the holder (a dead run of its own is
    freed); a soft time limit landing during that look must end the task, not be
    taken for a failed look and swallowed (the task then went on to its policy:
    it waited for the lock past its limit, or here skipped as if on time)."""
    job = _skipping_job(Celery("reclaim-interrupted", set_as_current=False))
    name, task_id = unique("reclaim-interrupted"), str(uuid.uuid4())
    resource = f"reclaim:{name}"
    main = threading.main_thread().ident
    assert main is not None

    def raise_interrupted(signum: int, frame: Any) -> None:
        raise _Interrupted("soft time limit")

    with proxies_for(nodes) as proxies, Redlock(resource, nodes=nodes.urls, ttl=30):
        settings.REDLOCK = {
            **redlock_settings,
            "NODES": [proxy.url for proxy in proxies],
            "WAKE_UPS": False,
        }
        for proxy in proxies:
            proxy.hold_reply_to(b"HGETALL")  # the look at the holder

        def limit() -> None:
            # The soft time limit, once every node's look is under way.
            if all(proxy.wait_for_held_replies(1, timeout=10) for proxy in proxies):
                signal.pthread_kill(main, signal.SIGALRM)
            for proxy in proxies:
                proxy.release_held_replies()

        previous = signal.signal(signal.SIGALRM, raise_interrupted)
        timer = threading.Thread(target=limit)
        job.push_request(
            id=task_id, args=[name], kwargs={}, retries=0, called_directly=False
        )
        outcome: object
        try:
            timer.start()
            try:
                outcome = job(name)
            except _Interrupted:
                outcome = "interrupted"
        finally:
            job.pop_request()
            timer.join(15)
            signal.signal(signal.SIGALRM, previous)
    assert outcome == "interrupted", f"the task ended with {outcome!r}"
    assert held_on(nodes, resource) == 0


# Eager mode: the task runs in this process, under the same lock.


@pytest.fixture
def eager(broker: RedisNode, redlock_settings: dict[str, Any]) -> Iterator[Celery]:
    point_app_at(broker)
    tasks.app.conf.task_always_eager = True
    try:
        yield tasks.app
    finally:
        tasks.app.conf.task_always_eager = False


def test_eager_runs_under_the_lock_in_process(
    eager: Celery, nodes: NodeSet, counts: redis.Redis
) -> None:
    name = unique("eager")
    assert tasks.locked_increment.delay(name, 0).get() == 1
    assert tasks.locked_increment.apply((name, 0)).get() == 2
    assert held_on(nodes, f"counter:{name}") == 0
    [entry, _] = runs(counts, name)
    assert entry["pid"] == os.getpid()


@contextlib.contextmanager
def held_by_another_thread(resource: str) -> Iterator[None]:
    """Hold ``resource`` from another thread (owner) for the ``with`` block.

    An eager task runs in this thread, which would re-enter a lock it held.
    """
    lock = Redlock(resource, ttl=30)
    acquired, done = threading.Event(), threading.Event()

    def holder() -> None:
        with lock:
            acquired.set()
            done.wait(30)

    thread = threading.Thread(target=holder)
    thread.start()
    try:
        assert acquired.wait(10)
        yield
    finally:
        done.set()
        thread.join(10)


def test_eager_policies(eager: Celery, counts: redis.Redis) -> None:
    name = unique("eager-held")
    with held_by_another_thread(f"held:{name}"):
        assert tasks.skip_when_held.delay(name).get() is None
        with pytest.raises(LockContentionError):
            tasks.raise_when_held.delay(name).get()
    assert runs(counts, name) == []


def test_eager_holds_the_lock_while_the_body_runs(
    eager: Celery, nodes: NodeSet
) -> None:
    """The body sees its own lock on the nodes, labelled with its task id."""
    seen: list[list[str]] = []

    @eager.task(base=RedlockTask, lock="probe:{key}", shared=False)
    def probe(key: str) -> str | None:
        seen.append([held.label for held in describe([f"probe:{key}"])])
        lock = current_lock()
        return None if lock is None else lock.resource

    result = probe.apply(("k1",))
    assert result.get() == "probe:k1"  # current_lock() inside the body
    assert seen == [[task_label(probe.name, result.id)]]
    assert held_on(nodes, "probe:k1") == 0


def test_a_long_task_name_is_cut_in_the_label_but_never_the_id() -> None:
    label = task_label("x" * 500, "0f1e2d3c-aaaa-bbbb-cccc-1234567890ab")
    assert len(label) == MAX_LABEL_LENGTH
    assert label.endswith(" [0f1e2d3c-aaaa-bbbb-cccc-1234567890ab]")


# Bad input: clear errors, nothing sent to the nodes.


def fresh_app() -> Celery:
    app = Celery("bad_input", set_as_current=False)
    app.finalize()  # tasks are created when decorated, not on first use
    return app


def test_invalid_policy_fails_when_the_task_is_created() -> None:
    with pytest.raises(ImproperlyConfigured, match="lock_on_contention must be one of"):

        @fresh_app().task(
            base=RedlockTask, lock="x:{a}", lock_on_contention="hope", shared=False
        )
        def task(a: int) -> None: ...


def test_invalid_retry_countdown_fails_when_the_task_is_created() -> None:
    with pytest.raises(ImproperlyConfigured, match="lock_retry_countdown must be >= 0"):

        @fresh_app().task(
            base=RedlockTask, lock="x:{a}", lock_retry_countdown=-1, shared=False
        )
        def task(a: int) -> None: ...


def test_unknown_template_field_fails_when_the_task_is_created() -> None:
    with pytest.raises(ImproperlyConfigured, match="user_id"):

        @fresh_app().task(base=RedlockTask, lock="report:{user_id}", shared=False)
        def task(account: int) -> None: ...


def test_bind_self_is_not_a_template_field(nodes: NodeSet, eager: Celery) -> None:
    """A bound task's template names its arguments, not ``self``."""

    @eager.task(bind=True, base=RedlockTask, lock="bound:{key}", shared=False)
    def bound(self: RedlockTask, key: str) -> str:
        return str(self.request.id)

    result = bound.apply(("k",))
    assert result.get() == result.id


def test_bad_value_at_call_time_raises_before_any_lock(
    eager: Celery, nodes: NodeSet, counts: redis.Redis
) -> None:
    """A resource value that cannot name a lock fails the task; no node is touched."""
    with pytest.raises(ValueError):
        tasks.skip_when_held.apply(("a:b",)).get()
    for node in nodes:
        with node.client() as client:
            assert client.dbsize() == 0
    assert runs(counts, "a:b") == []


def test_importing_without_celery_says_how_to_install_it() -> None:
    code = (
        "import sys; sys.modules['celery'] = None\n"
        "import redlock_django.contrib.celery\n"
    )
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env
    )
    assert done.returncode == 1
    assert "ImportError: redlock_django.contrib.celery needs Celery" in done.stderr
    assert "pip install 'redlock-django[celery]'" in done.stderr


def test_lock_nodes_given_as_one_url_string_is_refused_when_the_task_is_made(
    nodes: NodeSet,
) -> None:
    """``locked(nodes="redis://...")`` is refused at decoration; the task option is
    too (it was split into characters, and every run failed on "cache alias 'r'")."""
    app = Celery("nodes-string", set_as_current=False)
    app.conf.task_always_eager = True
    app.finalize()
    with pytest.raises(ImproperlyConfigured, match="nodes must be a non-empty list"):

        @app.task(
            base=RedlockTask, lock="x:{a}", lock_nodes=nodes.urls[0], shared=False
        )
        def job(a: int) -> None: ...


# Interruptions. Found by an adversarial review (each test failed on the code
# before its fix): a soft time limit firing while the body's lock was being
# released left the pool child trusting its old hold, so its next task on that
# resource re-entered it without asking the nodes and ran beside another owner;
# a task id too long for the 200-character label kept a SIGKILLed task's lock
# for its whole lease; a "retry" task given lock_timeout was refused naming the
# "raise" policy.


#: A request chunk carrying the plain release (the sync driver's EVALSHA; the
#: source, written behind it when no reply came, would hold only that).
RELEASE_MATCH = RELEASE_SCRIPT.sha.encode()


@contextlib.contextmanager
def proxies_for(nodes: NodeSet) -> Iterator[list[FaultProxy]]:
    started = [FaultProxy(node.port).start() for node in nodes]
    try:
        yield started
    finally:
        for proxy in started:
            proxy.close()


@pytest.fixture
def proxied_worker(
    broker: RedisNode,
    nodes: NodeSet,
    redlock_settings: dict[str, Any],
    tmp_path: Path,
) -> Iterator[tuple[Worker, list[FaultProxy], str]]:
    """One single-process worker whose lock nodes are reached through proxies."""
    point_app_at(broker)
    queue = unique("proxied")
    children = Children()
    with proxies_for(nodes) as proxies:
        try:
            [worker] = start_workers(
                children,
                tmp_path,
                broker,
                SimpleNamespace(urls=[p.url for p in proxies]),  # type: ignore[arg-type]
                ["proxied"],
                queue=queue,
                concurrency=1,
            )
            yield worker, proxies, queue
        finally:
            children.stop_all()


def test_soft_time_limit_during_release_never_lets_the_next_task_skip_the_lock(
    proxied_worker: tuple[Worker, list[FaultProxy], str],
    nodes: NodeSet,
    counts: redis.Redis,
    hold: Callable[..., Redlock],
) -> None:
    """A soft time limit that fires while the body's lock is being released (slow
    replies from the nodes) must not leave the pool child believing it still holds
    the lock: its next task on the same resource must wait for the holder.

    The release commands reach the nodes, so the lock is free there; another
    owner takes it. The next run of the task in the same child must then wait
    (policy "wait"), not run beside that owner.
    """
    _worker, proxies, queue = proxied_worker
    name = unique("softrel")
    resource = f"slow:{name}"
    for proxy in proxies:
        proxy.hold_reply_to(RELEASE_MATCH)
    # Body 0.7 s, soft limit 1.0 s: the limit fires while the release waits
    # NODE_TIMEOUT (0.5 s) for the held replies.
    first = tasks.slow.apply_async((name, 0.7), queue=queue, soft_time_limit=1.0)
    first.get(timeout=30, propagate=False)
    for proxy in proxies:
        proxy.release_held_replies()
    assert first.state == "FAILURE", first.state
    assert "SoftTimeLimitExceeded" in (first.traceback or "")
    # The release did run on the nodes: the lock is free there.
    assert held_on(nodes, resource) == 0
    # Another owner (this test) takes it, for 30 s.
    hold(resource, ttl=30)
    before = len(runs(counts, name))
    second = tasks.slow.apply_async((name, 0.2), queue=queue)
    time.sleep(3.0)
    started = len(runs(counts, name)) - before
    second.revoke(terminate=True, signal="SIGKILL")
    assert started == 0, (
        f"the task body ran {started}x while another owner held {resource!r} "
        f"on {held_on(nodes, resource)}/5 nodes"
    )


@pytest.mark.parametrize("long_id", [False, True], ids=["uuid-id", "long-id"])
def test_revoke_terminate_frees_the_lock_of_a_task_with_a_long_id(
    proxied_worker: tuple[Worker, list[FaultProxy], str],
    nodes: NodeSet,
    counts: redis.Redis,
    long_id: bool,
) -> None:
    """``task_label`` promises to cut the name, never the id, because the main
    process finds a killed task's lock by that label. A task id is any string
    the sender picks (``apply_async(task_id=...)``); with a long one the lock's
    label is cut to 200 characters anyway, the labels never match, and a
    SIGKILLed body's lock stays held for its whole lease instead of being
    released at once (as it is for a uuid id)."""
    _worker, _proxies, queue = proxied_worker
    name = unique("longid")
    resource = f"slow:{name}"
    task_id = "nightly-export-" + "x" * 220 if long_id else str(uuid.uuid4())
    result = tasks.slow.apply_async((name, 30), queue=queue, task_id=task_id)
    wait_for(lambda: runs(counts, name), 15, "the task to start")
    assert held_on(nodes, resource) >= 3
    result.revoke(terminate=True, signal="SIGKILL")
    wait_for(lambda: result.state == "REVOKED", 10, "the REVOKED state")
    start = time.monotonic()
    deadline = start + 4.0
    while held_on(nodes, resource) and time.monotonic() < deadline:
        time.sleep(0.05)
    elapsed = time.monotonic() - start
    assert held_on(nodes, resource) == 0, (
        f"lock of the SIGKILLed task still held on {held_on(nodes, resource)}/5 "
        f"nodes {elapsed:.1f}s after the revoke (lease 10 s)"
    )


def test_soft_time_limit_while_waiting_for_the_lock_leaves_nothing_behind(
    proxied_worker: tuple[Worker, list[FaultProxy], str],
    nodes: NodeSet,
    counts: redis.Redis,
    hold: Callable[..., Redlock],
) -> None:
    """Pins: a soft time limit that interrupts the wait ("wait" policy) ends the
    task without running it, and the child's next run takes the lock normally."""
    _worker, _proxies, queue = proxied_worker
    name = unique("softwait")
    resource = f"slow:{name}"
    ours = hold(resource, ttl=30)
    first = tasks.slow.apply_async((name, 0.1), queue=queue, soft_time_limit=1.0)
    first.get(timeout=30, propagate=False)
    assert "SoftTimeLimitExceeded" in (first.traceback or "")
    assert runs(counts, name) == []
    ours.release()
    assert held_on(nodes, resource) == 0
    second = tasks.slow.apply_async((name, 0.1), queue=queue)
    assert second.get(timeout=30) == "done"
    assert len(runs(counts, name)) == 1
    assert held_on(nodes, resource) == 0


def test_a_retry_task_given_lock_timeout_is_refused_naming_its_own_policy() -> None:
    """``lock_timeout`` with ``lock_on_contention="retry"`` is refused when the task
    is made (fine), but the message names a policy the user never wrote."""
    from celery import Celery
    from django.core.exceptions import ImproperlyConfigured

    from redlock_django.contrib.celery import RedlockTask

    app = Celery("review-retry-timeout", set_as_current=False)
    app.finalize()
    with pytest.raises(ImproperlyConfigured) as info:

        @app.task(
            base=RedlockTask,
            lock="x:{a}",
            lock_on_contention="retry",
            lock_timeout=5,
            shared=False,
        )
        def job(a: int) -> None: ...

    assert "'raise'" not in str(info.value), str(info.value)
    assert "retry" in str(info.value)
