"""``distributed_lock`` frees its lock on every way a request can end.

The views below are mounted by this module's own ``urlpatterns``. A COMMIT that
fails after the view returned (here: a deferred foreign key that points nowhere)
makes Django answer 500 and drop the view's response, so neither the on-commit
callback nor the response's closer runs; the request's ``request_finished`` still
comes, on the view's thread. An ASGI client that disconnects cancels an async
view's task; the lock must be free right after, not after its lease.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from asgiref.sync import sync_to_async
from django.db import connection, connections, transaction
from django.http import HttpRequest, HttpResponse
from django.test import Client
from django.urls import path
from django.views.decorators.csrf import csrf_exempt

from harness.held import lock_key
from harness.nodes import free_port
from harness.processes import REPO, Children
from redlock_django.decorators import distributed_lock
from tests._decorated import asgi_request, free_for_another_owner

pytestmark = pytest.mark.urls(__name__)

#: Short enough that a lock left to its lease would show within a test, and the
#: watchdog extends it every fraction of it.
TTL = 1.0


def _violate_deferred_foreign_key() -> None:
    """Write a row whose deferred foreign key points nowhere: COMMIT will fail.

    A temporary table, so the test database needs no model for it; PostgreSQL and
    SQLite both check a ``DEFERRABLE INITIALLY DEFERRED`` key only at COMMIT.
    """
    with connection.cursor() as cursor:
        cursor.execute(
            "CREATE TEMPORARY TABLE IF NOT EXISTS redlock_orphan ("
            "id integer PRIMARY KEY, parent integer REFERENCES redlock_orphan (id) "
            "DEFERRABLE INITIALLY DEFERRED)"
        )
        cursor.execute("INSERT INTO redlock_orphan (id, parent) VALUES (1, 2)")


@csrf_exempt
@distributed_lock("release:{name}", ttl=TTL, auto_extend=True, timeout=0.5)
def commit_fails(request: HttpRequest, name: str) -> HttpResponse:
    _violate_deferred_foreign_key()
    return HttpResponse("written")


#: ``commit_fails_late`` sets ENTERED_SYNC once it holds its lock, then waits
#: for the test to open GATE.
ENTERED_SYNC = threading.Event()
GATE = threading.Event()


@csrf_exempt
@distributed_lock("release:{name}", ttl=TTL, auto_extend=True, timeout=0.5)
def commit_fails_late(request: HttpRequest, name: str) -> HttpResponse:
    ENTERED_SYNC.set()
    GATE.wait(10)
    _violate_deferred_foreign_key()
    return HttpResponse("written")


def _replaced(view: Callable[..., HttpResponse]) -> Callable[..., HttpResponse]:
    """Roll back and answer with a new response, as some middleware does."""

    def wrapper(request: HttpRequest, *args: Any, **kwargs: Any) -> HttpResponse:
        view(request, *args, **kwargs)
        transaction.set_rollback(True)
        return HttpResponse("replaced")

    return wrapper


@csrf_exempt
@_replaced
@distributed_lock("release:{name}", ttl=TTL, auto_extend=True, timeout=0.5)
def rolled_back_and_replaced(request: HttpRequest, name: str) -> HttpResponse:
    return HttpResponse("dropped")


#: Set by ``sleeps_holding`` once it holds its lock.
ENTERED: list[asyncio.Event] = []


@distributed_lock("release:{name}", ttl=TTL, auto_extend=True, timeout=0.5)
async def sleeps_holding(request: HttpRequest, name: str) -> HttpResponse:
    ENTERED[0].set()
    await asyncio.sleep(30)
    return HttpResponse("woke")


def plain(request: HttpRequest) -> HttpResponse:
    return HttpResponse("plain")


def _done(request: HttpRequest, name: str) -> HttpResponse:
    return HttpResponse("done")


urlpatterns = [
    path("commit-fails/<str:name>/", commit_fails),
    path("commit-fails-late/<str:name>/", commit_fails_late),
    path("replaced/<str:name>/", rolled_back_and_replaced),
    path("sleeps/<str:name>/", sleeps_holding),
    path("plain/", plain),
]


@pytest.fixture
def atomic_requests(monkeypatch: pytest.MonkeyPatch) -> None:
    """Turn on ATOMIC_REQUESTS for the default database during the test."""
    monkeypatch.setitem(connections.settings["default"], "ATOMIC_REQUESTS", True)


def _keys(nodes: Any, resource: str) -> list[bool]:
    return [bool(node.client().exists(lock_key(resource))) for node in nodes]


def _watchdogs(resource: str) -> list[threading.Thread]:
    name = f"redlock-watchdog:{resource}"
    return [t for t in threading.enumerate() if t.name == name]


# A COMMIT that fails after the view returned.


@pytest.mark.django_db(transaction=True)
def test_failed_commit_frees_the_lock_when_the_500_is_served(
    nodes: Any, redlock_settings: dict[str, Any], atomic_requests: None
) -> None:
    """The deferred key fails the COMMIT: 500, and the lock is free at once.

    Its watchdog is stopped too, instead of extending the lease until MAX_HOLD.
    """
    client = Client(raise_request_exception=False)
    response = client.post("/commit-fails/a/")
    assert response.status_code == 500
    assert _keys(nodes, "release:a") == [False] * len(nodes)
    assert _watchdogs("release:a") == []
    assert free_for_another_owner("release:a")


@pytest.mark.django_db(transaction=True)
def test_rolled_back_request_with_a_replaced_response_frees_the_lock(
    nodes: Any, redlock_settings: dict[str, Any], atomic_requests: None
) -> None:
    """The view's response (and its closer) is dropped after a rollback.

    ``request_finished`` of the request frees the lock.
    """
    response = Client().post("/replaced/a/")
    assert response.content == b"replaced"
    assert _keys(nodes, "release:a") == [False] * len(nodes)
    assert _watchdogs("release:a") == []


@pytest.mark.django_db(transaction=True)
def test_a_later_request_finished_frees_a_rolled_back_hold_never_closed(
    rf: Any, nodes: Any, redlock_settings: dict[str, Any]
) -> None:
    """A view called in a transaction that rolls back, its response never closed.

    Once that transaction is over, the next ``request_finished`` on the thread
    means the request is over too: the lock is freed.
    """
    view = distributed_lock("release:{name}", ttl=TTL, auto_extend=True)(_done)
    with transaction.atomic():
        view(rf.post("/"), name="b")
        transaction.set_rollback(True)
    assert _keys(nodes, "release:b") == [True] * len(nodes)
    assert Client().get("/plain/").status_code == 200
    assert _keys(nodes, "release:b") == [False] * len(nodes)
    assert _watchdogs("release:b") == []


@pytest.mark.django_db(transaction=True)
def test_another_request_finishing_inside_the_transaction_does_not_free_the_lock(
    rf: Any, nodes: Any, redlock_settings: dict[str, Any]
) -> None:
    """``request_finished`` of another request, sent while the transaction the
    lock waits for is still open, leaves the lock held; the commit frees it."""
    view = distributed_lock("release:{name}", ttl=TTL)(_done)
    with transaction.atomic():
        view(rf.post("/"), name="c")
        assert Client().get("/plain/").status_code == 200
        assert _keys(nodes, "release:c") == [True] * len(nodes)
    assert _keys(nodes, "release:c") == [False] * len(nodes)


# The same through a real WSGI server.

SERVER_SETTINGS = """
from tests.settings import *  # noqa: F403

DATABASES["default"]["ATOMIC_REQUESTS"] = True  # noqa: F405
ROOT_URLCONF = "tests.test_decorator_release"
REDLOCK = {redlock!r}
"""


@pytest.fixture
def wsgi_server(
    tmp_path: Path, nodes: Any, redlock_settings: dict[str, Any]
) -> Iterator[str]:
    """Serve this module's views from gunicorn (one gthread worker, 2 threads).

    ATOMIC_REQUESTS on, on a database of its own: a SQLite file, or the
    PostgreSQL database ``DATABASE_URL`` names (only a temporary table is
    written). Yield the base URL.
    """
    (tmp_path / "release_settings.py").write_text(
        SERVER_SETTINGS.format(redlock=redlock_settings)
    )
    base = os.environ.get("DATABASE_URL", "")
    env = dict(os.environ)
    env.update(
        DJANGO_SETTINGS_MODULE="release_settings",
        DATABASE_URL=(
            base if base.startswith("postgres") else f"sqlite:///{tmp_path}/db.sqlite3"
        ),
        PYTHONPATH=os.pathsep.join([str(tmp_path), str(REPO)]),
        PYTHONUNBUFFERED="1",
    )
    port = free_port()
    log = tmp_path / "gunicorn.log"
    command = [
        sys.executable, "-m", "gunicorn",
        "django.core.wsgi:get_wsgi_application()",
        "--bind", f"127.0.0.1:{port}",
        "--workers", "1",
        "--worker-class", "gthread",
        "--threads", "2",
        "--graceful-timeout", "2",
        "--log-level", "warning",
    ]  # fmt: skip
    children = Children()
    process = children.start("gunicorn", command, env, log)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 20.0
        while True:
            assert process.poll() is None, log.read_text()
            with (
                contextlib.suppress(OSError),
                urllib.request.urlopen(f"{url}/plain/", timeout=1.0) as reply,
            ):
                if reply.status == 200:
                    break
            assert time.monotonic() < deadline, log.read_text()
            time.sleep(0.1)
        yield url
    finally:
        children.stop_all()


def _post_status(url: str) -> int:
    request = urllib.request.Request(url, data=b"", method="POST")
    try:
        with urllib.request.urlopen(request, timeout=10.0) as reply:
            return int(reply.status)
    except urllib.error.HTTPError as error:
        return int(error.code)


def test_failed_commit_under_gunicorn_frees_the_lock(
    wsgi_server: str, nodes: Any
) -> None:
    """A real WSGI server: after the 500, the lock is free within moments.

    The server writes the 500 before it closes it (and sends request_finished),
    so the lock is polled for; held on, the watchdog would keep it past 3 TTLs.
    """
    assert _post_status(f"{wsgi_server}/commit-fails/g/") == 500
    answered = time.monotonic()
    while any(_keys(nodes, "release:g")):
        assert time.monotonic() - answered < 3 * TTL, "the lock is still held"
        time.sleep(0.005)
    assert free_for_another_owner("release:g")


# ASGI.


@pytest.mark.django_db(transaction=True)
async def test_failed_commit_under_asgi_frees_the_lock(
    nodes: Any, redlock_settings: dict[str, Any], atomic_requests: None
) -> None:
    """Django's ASGIHandler closes the 500 on the sync view's thread: freed."""
    try:
        sent = await asgi_request("POST", "/commit-fails/a/")
        assert sent[0]["status"] == 500
        assert _keys(nodes, "release:a") == [False] * len(nodes)
        assert _watchdogs("release:a") == []
    finally:
        await sync_to_async(connections.close_all)()


async def test_client_disconnect_frees_the_async_views_lock_at_once(
    nodes: Any, redlock_settings: dict[str, Any]
) -> None:
    """The disconnect cancels the view's task; the lock is free right after."""
    ENTERED[:] = [asyncio.Event()]
    disconnect = asyncio.Event()
    request = asyncio.ensure_future(asgi_request("GET", "/sleeps/a/", disconnect))
    await asyncio.wait_for(ENTERED[0].wait(), 5)
    assert _keys(nodes, "release:a") == [True] * len(nodes)
    started = time.monotonic()
    disconnect.set()
    sent = await asyncio.wait_for(request, 5)
    elapsed = time.monotonic() - started
    assert sent == []
    assert _keys(nodes, "release:a") == [False] * len(nodes), elapsed


async def _request_task_cancelled() -> None:
    """Wait until ASGIHandler's task running the request is done (cancelled)."""
    deadline = time.monotonic() + 5.0
    while True:
        running = [
            task
            for task in asyncio.all_tasks()
            if getattr(task.get_coro(), "__qualname__", "").endswith("process_request")
        ]
        if not running:
            return
        assert time.monotonic() < deadline, running
        await asyncio.sleep(0.001)


@pytest.mark.django_db(transaction=True)
async def test_client_gone_while_a_sync_view_runs_frees_the_lock_after_it_ends(
    nodes: Any, redlock_settings: dict[str, Any], atomic_requests: None
) -> None:
    """The disconnect cancels the handler's task, not the sync view's thread.

    The view goes on and its COMMIT fails; Django then sends request_finished
    through the request's thread-sensitive executor, on the view's thread, once
    the view is done: the lock is free when the handler returns.
    """
    ENTERED_SYNC.clear()
    GATE.clear()
    disconnect = asyncio.Event()
    request = asyncio.ensure_future(
        asgi_request("POST", "/commit-fails-late/d/", disconnect)
    )
    try:
        assert await asyncio.to_thread(ENTERED_SYNC.wait, 5)
        disconnect.set()
        await _request_task_cancelled()
        assert not request.done()  # waiting for the view's thread
    finally:
        GATE.set()
    try:
        sent = await asyncio.wait_for(request, 10)
        assert sent == []
        assert _keys(nodes, "release:d") == [False] * len(nodes)
        assert _watchdogs("release:d") == []
    finally:
        await sync_to_async(connections.close_all)()
