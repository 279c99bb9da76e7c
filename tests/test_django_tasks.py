"""``redlock_django.contrib.tasks``: Django 6 tasks run once at a time, by real workers.

The workers are django-tasks-db's ``db_worker`` processes (``python -m django
db_worker``) on the test database (PostgreSQL), racing for tasks from
``tests/_django_tasks.py``; the test enqueues with ``Task.enqueue`` and reads the
results back from the database. The race is a GET+SET on a Redis counter: with the
lock no update is lost and no two runs are ever inside at once, without it (the
negative control) updates are lost. ``skip`` and ``raise`` are observed against a
lock held by a task on another worker, and a worker killed with SIGKILL while
holding the lock frees it within the TTL.

Django 6.0 needs Python >= 3.12: these tests run in the second venv that
``make test-django6`` builds (``--ds=tests.settings_django6``); in the main venv
they are skipped, saying so, and the import test checks the clear ImportError.
"""

from __future__ import annotations

import importlib
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import django
import pytest
from django.conf import settings

from harness.held import held_on
from harness.nodes import NodeSet
from harness.processes import REPO, Children, log_tail

DJANGO6 = django.VERSION >= (6, 0)
_HAS_QUEUE = "django_tasks_db" in settings.INSTALLED_APPS
needs_django6 = pytest.mark.skipif(
    not (DJANGO6 and _HAS_QUEUE),
    reason=(
        "needs Django 6.0: run make test-django6"
        if not DJANGO6
        else "needs django-tasks-db and --ds=tests.settings_django6: "
        "run make test-django6"
    ),
)

#: How long a worker may take to start polling (two cores, several workers).
START_TIMEOUT = 30.0
#: How long a batch of tasks may take to finish.
RUN_TIMEOUT = 45.0


def test_import_needs_django_6_and_says_so() -> None:
    """Below Django 6.0 the import fails with the reason; from 6.0 on it works."""
    if DJANGO6:
        module = importlib.import_module("redlock_django.contrib.tasks")
        assert callable(module.locked_task)
        return
    with pytest.raises(ImportError) as caught:
        importlib.import_module("redlock_django.contrib.tasks")
    assert str(caught.value) == (
        "redlock_django.contrib.tasks: django.tasks needs Django 6.0 or later; "
        f"this is Django {django.get_version()}"
    )


def _worker_database_url() -> str:
    """Return a DATABASE_URL naming the test database this test runs on."""
    from django.db import connection

    if connection.vendor != "postgresql":
        pytest.skip("the db_worker tests need PostgreSQL: set DATABASE_URL")
    base = urlsplit(os.environ["DATABASE_URL"])
    return urlunsplit(base._replace(path="/" + connection.settings_dict["NAME"]))


class Workers:
    """``db_worker`` processes on the test database, stopped at the test's end."""

    def __init__(self, env: dict[str, str], logs: Path) -> None:
        self.env = env
        self.logs = logs
        self.children = Children()
        self.processes: dict[str, subprocess.Popen[bytes]] = {}

    def start(self, count: int, *, ttl: float = 10.0) -> list[str]:
        """Start ``count`` workers with the lock's ``ttl``; return once all poll."""
        names = [f"w{len(self.processes) + i}" for i in range(count)]
        env = {**self.env, "REDLOCK_TEST_TTL": str(ttl)}
        for name in names:
            command = [
                sys.executable, "-m", "django", "db_worker",
                "--settings=tests.settings_django6",
                "--interval=0.02", "--no-startup-delay", "--no-reload",
                f"--worker-id={name}",
            ]  # fmt: skip
            self.processes[name] = self.children.start(
                name, command, env, self.log(name)
            )
        deadline = time.monotonic() + START_TIMEOUT
        for name in names:
            while f"worker_id={name}" not in self.output(name):
                if self.processes[name].poll() is not None or (
                    time.monotonic() > deadline
                ):
                    pytest.fail(f"worker {name} did not start:\n{self.tail(name)}")
                time.sleep(0.05)
        return names

    def log(self, name: str) -> Path:
        return self.logs / f"{name}.log"

    def output(self, name: str) -> str:
        try:
            return self.log(name).read_text(errors="replace")
        except FileNotFoundError:
            return ""

    def tail(self, name: str) -> str:
        return log_tail(self.log(name), 30)

    def tails(self) -> str:
        return "\n".join(f"--- {name}\n{self.tail(name)}" for name in self.processes)

    def kill(self, name: str) -> None:
        """SIGKILL one worker, as the OOM killer or a hard time limit would."""
        process = self.processes[name]
        os.kill(process.pid, signal.SIGKILL)
        process.wait(10)


@pytest.fixture
def workers(
    transactional_db: None,
    redlock_settings: dict[str, Any],
    nodes: NodeSet,
    tmp_path: Path,
) -> Iterator[Workers]:
    """Yield a ``Workers`` on the committed test database; stop them at the end.

    Workers are stopped before ``transactional_db`` empties the tables under them.
    """
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(
            [str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])]
        ),
        "DATABASE_URL": _worker_database_url(),
        "DJANGO_SETTINGS_MODULE": "tests.settings_django6",
        "REDLOCK_TEST_NODES": ",".join(nodes.urls),
        "REDLOCK_TEST_COUNTER": nodes[0].url,
    }
    os.environ["REDLOCK_TEST_COUNTER"] = nodes[0].url
    pool = Workers(env, tmp_path)
    try:
        yield pool
    finally:
        pool.children.stop_all()
        os.environ.pop("REDLOCK_TEST_COUNTER", None)


def _wait_finished(results: list[Any], workers: Workers, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while True:
        for result in results:
            if not result.is_finished:
                result.refresh()
        if all(result.is_finished for result in results):
            return
        if time.monotonic() > deadline:
            pending = [r.id for r in results if not r.is_finished]
            pytest.fail(f"tasks {pending} did not finish:\n{workers.tails()}")
        time.sleep(0.05)


def _wait_for(check: Callable[[], Any], timeout: float, what: str) -> Any:
    deadline = time.monotonic() + timeout
    while not (value := check()):
        if time.monotonic() > deadline:
            pytest.fail(f"timed out waiting for {what}")
        time.sleep(0.02)
    return value


def _wait_started(counter: Counter, holder: Any, workers: Workers) -> dict[str, str]:
    """Wait until the ``held`` task ``holder`` sits on its lock; return its notes."""
    deadline = time.monotonic() + START_TIMEOUT
    while not (started := counter.started()):
        holder.refresh()
        if holder.is_finished or time.monotonic() > deadline:
            errors = [error.traceback for error in holder.errors]
            pytest.fail(
                f"the holder did not start ({holder.status}): {errors}\n"
                f"{workers.tails()}"
            )
        time.sleep(0.02)
    return started


class Counter:
    """The keys the counting tasks write on the counter node, read back."""

    def __init__(self, nodes: NodeSet) -> None:
        self.name = f"c{uuid.uuid4().hex[:8]}"
        self.client = nodes[0].client()

    def value(self) -> int:
        return int(self.client.get(f"{self.name}:counter") or 0)

    def overlaps(self) -> int:
        return int(self.client.get(f"{self.name}:overlaps") or 0)

    def pids(self) -> set[int]:
        return {int(pid) for pid in self.client.lrange(f"{self.name}:pids", 0, -1)}

    def started(self) -> dict[str, str]:
        raw = self.client.hgetall(f"{self.name}:started")
        return {k.decode(): v.decode() for k, v in raw.items()}

    def stop(self) -> None:
        self.client.set(f"{self.name}:stop", 1)


RACE_TASKS = 12
RACE_GAP = 0.1


@needs_django6
def test_workers_racing_a_locked_task_never_run_it_twice_at_once(
    workers: Workers, nodes: NodeSet
) -> None:
    """Three workers, 12 increments (sync and async tasks, one lock): none lost."""
    from tests import _django_tasks as tasks

    workers.start(3)
    counter = Counter(nodes)
    results = [
        (tasks.async_locked_increment if i % 2 else tasks.locked_increment).enqueue(
            counter.name, RACE_GAP
        )
        for i in range(RACE_TASKS)
    ]
    _wait_finished(results, workers, RUN_TIMEOUT)

    assert [r.status for r in results] == ["SUCCESSFUL"] * RACE_TASKS, workers.tails()
    assert counter.value() == RACE_TASKS
    assert counter.overlaps() == 0
    # The workers really competed for the tasks: more than one of them ran some.
    assert len(counter.pids()) >= 2
    assert held_on(nodes, f"counter:{counter.name}") == 0


@needs_django6
def test_negative_control_workers_without_the_lock_lose_updates(
    workers: Workers, nodes: NodeSet
) -> None:
    """The same race with a plain ``@task``: runs overlap and updates are lost."""
    from tests import _django_tasks as tasks

    workers.start(3)
    counter = Counter(nodes)
    results = [
        tasks.unlocked_increment.enqueue(counter.name, RACE_GAP)
        for _ in range(RACE_TASKS)
    ]
    _wait_finished(results, workers, RUN_TIMEOUT)

    assert [r.status for r in results] == ["SUCCESSFUL"] * RACE_TASKS, workers.tails()
    print(
        f"negative control: {counter.value()}/{RACE_TASKS} increments kept, "
        f"{counter.overlaps()} overlapping runs"
    )
    assert counter.overlaps() > 0
    assert counter.value() < RACE_TASKS


@needs_django6
def test_skip_and_raise_against_a_task_holding_the_lock_on_another_worker(
    workers: Workers, nodes: NodeSet
) -> None:
    """``skip`` succeeds with None without running, ``raise`` fails at once.

    The lock is held by a ``held_plain`` task on one worker; its label names the
    task and its result id (from the worker's ``task_started``). The other worker
    runs the ``skip`` and ``raise`` tasks; once the holder ends, the lock is free
    at once and ``skip`` runs.
    """
    from redlock_django.listing import describe
    from tests import _django_tasks as tasks

    workers.start(2)
    counter = Counter(nodes)
    resource = f"held:{counter.name}"
    holder = tasks.held_plain.enqueue(counter.name, 30.0)
    _wait_started(counter, holder, workers)
    (listed,) = describe([resource])
    assert listed.label == f"task tests._django_tasks.held_plain [{holder.id}]"

    skipped = tasks.skip_increment.enqueue(counter.name, 0.0)
    refused = tasks.raise_increment.enqueue(counter.name, 0.0)
    started = time.monotonic()
    _wait_finished([skipped, refused], workers, RUN_TIMEOUT)
    assert time.monotonic() - started < 5  # neither waited for the holder

    assert skipped.status == "SUCCESSFUL", workers.tails()
    assert skipped.return_value is None
    assert refused.status == "FAILED"
    assert refused.errors[0].exception_class_path == (
        "redlock_django.exceptions.LockContentionError"
    )
    assert counter.value() == 0  # neither ran its body
    assert any(resource in workers.output(name) for name in workers.processes)

    holder.refresh()
    assert not holder.is_finished
    counter.stop()
    _wait_finished([holder], workers, RUN_TIMEOUT)
    assert held_on(nodes, resource) == 0  # released when the task returned

    again = tasks.skip_increment.enqueue(counter.name, 0.0)
    _wait_finished([again], workers, RUN_TIMEOUT)
    assert again.status == "SUCCESSFUL"
    assert again.return_value == 1


@needs_django6
def test_a_worker_killed_inside_the_task_frees_the_lock_within_the_ttl(
    workers: Workers, nodes: NodeSet
) -> None:
    """SIGKILL the worker running ``held``: the lock expires within TTL + 1 s.

    Before the kill the lease outlives several TTLs (the watchdog extends it), so
    the expiry after it is the kill's doing; then the other worker gets the lock.
    The label carries the result id from the task context (``takes_context``).
    """
    from redlock_django.listing import describe
    from tests import _django_tasks as tasks

    ttl = 2.0
    workers.start(2, ttl=ttl)
    counter = Counter(nodes)
    resource = f"held:{counter.name}"
    holder = tasks.held.enqueue(counter.name, 60.0)
    started = _wait_started(counter, holder, workers)
    assert started["result_id"] == holder.id
    (listed,) = describe([resource])
    assert listed.label == f"task tests._django_tasks.held [{holder.id}]"
    pid = int(started["pid"])
    (victim,) = [n for n, p in workers.processes.items() if p.pid == pid]

    time.sleep(1.5 * ttl)
    assert held_on(nodes, resource) == len(nodes)  # extended past its TTL

    workers.kill(victim)
    killed = time.monotonic()
    _wait_for(lambda: held_on(nodes, resource) == 0, ttl + 5, "the lock to expire")
    freed_after = time.monotonic() - killed
    print(f"lock freed {freed_after:.2f} s after SIGKILL (TTL {ttl} s)")
    assert freed_after <= ttl + 1.0

    after = tasks.held.enqueue(counter.name, 0.0)
    _wait_finished([after], workers, RUN_TIMEOUT)
    assert after.status == "SUCCESSFUL", workers.tails()
    assert after.return_value["pid"] != pid


def _report(user_id: int) -> None:
    """A plain function for the decoration-time checks (never made a task)."""


def _report_with_context(context: Any, user_id: int) -> None:
    """The same, taking the task context first."""


@needs_django6
@pytest.mark.parametrize(
    ("resource", "options", "function", "message"),
    [
        ("report:{user}", {}, _report, "user"),
        ("report:{user_id", {}, _report, "report:{user_id"),
        ("report:{context}", {"takes_context": True}, _report_with_context, "context"),
        ("report:{user_id}", {"on_contention": "retry"}, _report, "retry"),
        ("report:{user_id}", {"ttl": -1}, _report, "ttl"),
        ("report:{user_id}", {"on_contention": "skip", "timeout": 1}, _report, "time"),
    ],
)
def test_bad_templates_and_options_fail_when_the_task_is_defined(
    resource: str, options: dict[str, Any], function: Any, message: str
) -> None:
    """Mistakes in code raise ImproperlyConfigured at import, naming the mistake.

    With ``takes_context`` the template ranges over the arguments after
    ``context``: the context is not part of a resource name.
    """
    from django.core.exceptions import ImproperlyConfigured

    from redlock_django.contrib.tasks import locked_task

    with pytest.raises(ImproperlyConfigured, match=message):
        locked_task(resource, **options)(function)


@needs_django6
def test_locked_task_goes_in_place_of_task_not_on_top_of_it() -> None:
    """A task (or anything but a function) is refused with the reason."""
    from redlock_django.contrib.tasks import locked_task
    from tests import _django_tasks as tasks

    with pytest.raises(TypeError, match="in place of @task"):
        locked_task("counter:{name}")(tasks.unlocked_increment)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="needs a function"):
        locked_task("counter:{name}")(len)


@needs_django6
def test_a_value_that_cannot_name_a_lock_fails_before_anything_is_sent(
    redlock_settings: dict[str, Any], nodes: NodeSet
) -> None:
    """``"a:b"`` as ``name``: a ValueError naming the placeholder; nodes stay empty."""
    from tests import _django_tasks as tasks

    with pytest.raises(ValueError, match="name"):
        tasks.locked_increment.call("a:b", 0.0)
    assert [node.client().dbsize() for node in nodes] == [0] * len(nodes)
