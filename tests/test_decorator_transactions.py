"""distributed_lock under faults: transactions, cancellation, streaming, responses.

Against the real redis-server nodes of the fixtures and, when DATABASE_URL names
one, a real PostgreSQL. The views are mounted by this module's ``urlpatterns``.
"""

from __future__ import annotations

import asyncio
import json
import logging
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
from asgiref.sync import sync_to_async
from django.core.exceptions import PermissionDenied
from django.core.signals import request_finished
from django.db import OperationalError, connection, connections, transaction
from django.http import (
    Http404,
    HttpRequest,
    HttpResponse,
    StreamingHttpResponse,
)
from django.test import AsyncClient, Client
from django.urls import path
from django.utils.decorators import method_decorator
from django.views import View
from django.views.decorators.csrf import csrf_exempt

from harness.held import held_on, lock_key
from redlock_django import Redlock
from redlock_django.decorators import distributed_lock
from tests._decorated import asgi_request, free_for_another_owner
from tests.models import Counter

pytestmark = pytest.mark.urls(__name__)

TTL = 2.0

postgres_only = pytest.mark.skipif(
    connection.vendor != "postgresql", reason="needs PostgreSQL"
)


def _keys(nodes: Any, resource: str) -> list[bool]:
    return [bool(node.client().exists(lock_key(resource))) for node in nodes]


def _free(nodes: Any, resource: str) -> bool:
    return _keys(nodes, resource) == [False] * len(nodes)


def _violate_deferred_foreign_key() -> None:
    with connection.cursor() as cursor:
        cursor.execute(
            "CREATE TEMPORARY TABLE IF NOT EXISTS orphan_rows ("
            "id integer PRIMARY KEY, parent integer REFERENCES orphan_rows (id) "
            "DEFERRABLE INITIALLY DEFERRED)"
        )
        cursor.execute("INSERT INTO orphan_rows (id, parent) VALUES (1, 2)")


def _bump(name: str) -> None:
    counter, _ = Counter.objects.get_or_create(name=name)
    counter.value += 1
    counter.save()


# Views.

SEEN: list[Any] = []


@csrf_exempt
@distributed_lock("rv:{name}", ttl=TTL, timeout=0.5)
def own_atomic_commit_fails(request: HttpRequest, name: str) -> HttpResponse:
    with transaction.atomic():
        _violate_deferred_foreign_key()
    return HttpResponse("never")


@csrf_exempt
@distributed_lock("rv:{name}", ttl=TTL, timeout=0.5)
def nested_savepoint(request: HttpRequest, name: str) -> HttpResponse:
    _bump(name)
    try:
        with transaction.atomic():
            _bump(name)
            raise ValueError("inner")
    except ValueError:
        pass
    with transaction.atomic():
        _bump(name)
    return HttpResponse("ok")


@csrf_exempt
@distributed_lock("rv:{name}", ttl=TTL, timeout=0.5)
def sets_rollback(request: HttpRequest, name: str) -> HttpResponse:
    _bump(name)
    transaction.set_rollback(True)
    return HttpResponse("rolled back")


@csrf_exempt
@distributed_lock("rv:{name}", ttl=TTL, timeout=0.5)
def raises_404(request: HttpRequest, name: str) -> HttpResponse:
    raise Http404("nope")


@csrf_exempt
@distributed_lock("rv:{name}", ttl=TTL, timeout=0.5)
def raises_403(request: HttpRequest, name: str) -> HttpResponse:
    raise PermissionDenied("no")


@csrf_exempt
@distributed_lock("rv:{name}", ttl=TTL, timeout=0.5)
def raises_plain(request: HttpRequest, name: str) -> HttpResponse:
    raise RuntimeError("boom")


@csrf_exempt
@distributed_lock("rv:{name}", ttl=TTL, timeout=0.5)
def streams(request: HttpRequest, name: str) -> StreamingHttpResponse:
    def chunks() -> Iterator[bytes]:
        SEEN.append(("streaming", free_for_another_owner(f"rv:{name}")))
        yield b"a"
        yield b"b"

    return StreamingHttpResponse(chunks())


class SerializationFailure(OperationalError):
    """Stands for a serialization failure raised by the view's write."""


@distributed_lock("rv:{name}", ttl=TTL, timeout=0.5)
def fails_first_time(request: HttpRequest, name: str) -> HttpResponse:
    _bump(name)
    if not SEEN:
        SEEN.append("failed once")
        raise SerializationFailure("could not serialize access")
    return HttpResponse("written")


@csrf_exempt
@transaction.non_atomic_requests
def retries(request: HttpRequest, name: str) -> HttpResponse:
    """The usual retry loop around a transaction that may fail to serialize."""
    for _attempt in range(3):
        try:
            with transaction.atomic():
                return fails_first_time(request, name=name)
        except SerializationFailure:
            continue
    return HttpResponse("gave up", status=500)


@csrf_exempt
@distributed_lock("rv:{name}", ttl=TTL, timeout=0.3)
def calls_itself(request: HttpRequest, name: str) -> HttpResponse:
    inner = raises_404_free(request, name=name)
    SEEN.append(inner.status_code)
    return HttpResponse("outer")


@distributed_lock("rv:{name}", ttl=TTL, timeout=0.3)
def raises_404_free(request: HttpRequest, name: str) -> HttpResponse:
    return HttpResponse("inner")


def _bad_resolver(request: HttpRequest, **kwargs: Any) -> str:
    raise LookupError("resolver failed")


def _int_resolver(request: HttpRequest, **kwargs: Any) -> Any:
    return 42


def _huge_resolver(request: HttpRequest, **kwargs: Any) -> str:
    return "h" * 10_000


def _glob_resolver(request: HttpRequest, **kwargs: Any) -> str:
    return "rv:*"


@distributed_lock(_bad_resolver, ttl=TTL)
def bad_resolver(request: HttpRequest) -> HttpResponse:
    return HttpResponse("ran")


@distributed_lock(_int_resolver, ttl=TTL)
def int_resolver(request: HttpRequest) -> HttpResponse:
    return HttpResponse("ran")


@distributed_lock(_huge_resolver, ttl=TTL)
def huge_resolver(request: HttpRequest) -> HttpResponse:
    return HttpResponse("ran")


@distributed_lock(_glob_resolver, ttl=TTL)
def glob_resolver(request: HttpRequest) -> HttpResponse:
    return HttpResponse("ran")


@distributed_lock("rv:{name}", ttl=0.3, timeout=0.2)
def short_ttl(request: HttpRequest, name: str) -> HttpResponse:
    return HttpResponse("ran")


@distributed_lock("rv:{name}", ttl=TTL, timeout=0.2)
def plain_locked(request: HttpRequest, name: str) -> HttpResponse:
    return HttpResponse("ran")


@method_decorator(csrf_exempt, name="dispatch")
@method_decorator(distributed_lock("rv:{name}", ttl=TTL, timeout=0.5), name="dispatch")
class CommitFailsView(View):
    def post(self, request: HttpRequest, name: str) -> HttpResponse:
        _violate_deferred_foreign_key()
        return HttpResponse("written")


ENTERED: list[asyncio.Event] = []


@distributed_lock("rv:{name}", ttl=TTL, auto_extend=True, timeout=5)
async def async_sleeps(request: HttpRequest, name: str) -> HttpResponse:
    ENTERED[0].set()
    await asyncio.sleep(30)
    return HttpResponse("woke")


@distributed_lock("rv:{name}", ttl=TTL, auto_extend=True, timeout=5)
async def async_quick(request: HttpRequest, name: str) -> HttpResponse:
    ENTERED[0].set()
    return HttpResponse("quick")


@distributed_lock("rv:{name}", ttl=TTL, timeout=0.5)
async def async_streams(request: HttpRequest, name: str) -> StreamingHttpResponse:
    async def chunks() -> Any:
        yield b"a"

    return StreamingHttpResponse(chunks())


GATE: list[asyncio.Event] = []


@distributed_lock("rv:{name}", ttl=TTL, auto_extend=True, timeout=5)
async def async_gated(request: HttpRequest, name: str) -> HttpResponse:
    ENTERED[0].set()
    await GATE[0].wait()
    return HttpResponse("gated")


@csrf_exempt
@distributed_lock("rv:{name}", ttl=TTL, timeout=20)
def increments(request: HttpRequest, name: str) -> HttpResponse:
    counter, _ = Counter.objects.get_or_create(name=name)
    value = counter.value
    time.sleep(0.01)
    Counter.objects.filter(pk=counter.pk).update(value=value + 1)
    return HttpResponse("ok")


@csrf_exempt
@distributed_lock("rv:{name}", ttl=1.0, auto_extend=True, timeout=0.5)
def extends_and_rolls_back(request: HttpRequest, name: str) -> HttpResponse:
    transaction.set_rollback(True)
    return HttpResponse("rolled back")


@distributed_lock("report:{org}:{user}:{month}", ttl=TTL, timeout=0.2)
def report(request: HttpRequest, org: str, user: str, month: str) -> HttpResponse:
    return HttpResponse("ran")


HASHED_LOOKING = "x" * 160 + "~" + "0123456789abcdef" * 2


def _hashed_resolver(request: HttpRequest, **kwargs: Any) -> str:
    return HASHED_LOOKING


@distributed_lock(_hashed_resolver, ttl=TTL)
def hashed_resolver(request: HttpRequest) -> HttpResponse:
    return HttpResponse("ran")


#: (the lock's key count on the nodes when the write finished, the resource)
WRITES: list[int] = []
WRITE_STARTED = threading.Event()


def _slow_write(name: str) -> None:
    WRITE_STARTED.set()
    time.sleep(1.0)  # a slow query
    _bump(name)
    WRITES.append(held_on(SEEN_NODES[0], f"rv:{name}"))


SEEN_NODES: list[Any] = []


@distributed_lock("rv:{name}", ttl=TTL, auto_extend=True, timeout=5)
async def async_writes(request: HttpRequest, name: str) -> HttpResponse:
    await sync_to_async(_slow_write)(name)
    return HttpResponse("written")


@distributed_lock("rv:{name}", ttl=TTL, auto_extend=True, timeout=5)
async def async_write_timed_out(request: HttpRequest, name: str) -> HttpResponse:
    # Gives up on the write after 0.2 s: wait_for cancels the await, not the
    # thread, and the TimeoutError propagates.
    await asyncio.wait_for(sync_to_async(_slow_write)(name), 0.2)
    return HttpResponse("written")


@csrf_exempt
@transaction.non_atomic_requests
@distributed_lock("rv:{name}", ttl=TTL, timeout=0.5)
def not_atomic_inner(request: HttpRequest, name: str) -> HttpResponse:
    SEEN.append(connection.in_atomic_block)
    return HttpResponse("ok")


@csrf_exempt
@distributed_lock("rv:{name}", ttl=TTL, timeout=0.5)
@transaction.non_atomic_requests
def not_atomic_outer(request: HttpRequest, name: str) -> HttpResponse:
    SEEN.append(connection.in_atomic_block)
    return HttpResponse("ok")


@distributed_lock("rv:{name}", ttl=0.3, auto_extend=False, timeout=0.5)
def outlives_lease(request: HttpRequest, name: str) -> HttpResponse:
    time.sleep(0.8)
    return HttpResponse("done late")


@distributed_lock("rv:{name}", ttl=TTL, timeout=0.5)
def pauses_all_nodes(request: HttpRequest, name: str) -> HttpResponse:
    for node in SEEN_NODES[0]:
        node.pause()
    return HttpResponse("paused")


@csrf_exempt
@distributed_lock("rv:{name}", ttl=1.0, auto_extend=True, timeout=0.5)
def extends_and_raises(request: HttpRequest, name: str) -> HttpResponse:
    _bump(name)
    raise RuntimeError("boom")


def plain(request: HttpRequest) -> HttpResponse:
    return HttpResponse("plain")


urlpatterns = [
    path("own-atomic-fails/<str:name>/", own_atomic_commit_fails),
    path("nested/<str:name>/", nested_savepoint),
    path("set-rollback/<str:name>/", sets_rollback),
    path("404/<str:name>/", raises_404),
    path("403/<str:name>/", raises_403),
    path("500/<str:name>/", raises_plain),
    path("stream/<str:name>/", streams),
    path("retries/<str:name>/", retries),
    path("calls-itself/<str:name>/", calls_itself),
    path("bad-resolver/", bad_resolver),
    path("int-resolver/", int_resolver),
    path("huge-resolver/", huge_resolver),
    path("glob-resolver/", glob_resolver),
    path("short-ttl/<str:name>/", short_ttl),
    path("plain-locked/<str:name>/", plain_locked),
    path("cbv-commit-fails/<str:name>/", CommitFailsView.as_view()),
    path("async-sleeps/<str:name>/", async_sleeps),
    path("async-quick/<str:name>/", async_quick),
    path("async-stream/<str:name>/", async_streams),
    path("plain/", plain),
    path("extends-raises/<str:name>/", extends_and_raises),
    path("pauses/<str:name>/", pauses_all_nodes),
    path("outlives/<str:name>/", outlives_lease),
    path("async-writes/<str:name>/", async_writes),
    path("async-write-timed-out/<str:name>/", async_write_timed_out),
    path("na-inner/<str:name>/", not_atomic_inner),
    path("na-outer/<str:name>/", not_atomic_outer),
    path("report/<str:org>/<str:user>/<str:month>/", report),
    path("hashed-resolver/", hashed_resolver),
    path("extends-rb/<str:name>/", extends_and_rolls_back),
    path("async-gated/<str:name>/", async_gated),
    path("incr/<str:name>/", increments),
]


@pytest.fixture
def atomic_requests(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(connections.settings["default"], "ATOMIC_REQUESTS", True)


@pytest.fixture(autouse=True)
def _clean() -> Iterator[None]:
    SEEN.clear()
    yield
    SEEN.clear()


# Transactions.


@postgres_only
@pytest.mark.django_db(transaction=True)
def test_view_own_atomic_commit_failure_frees_lock_and_answers_500(
    nodes: Any, redlock_settings: dict[str, Any]
) -> None:
    response = Client(raise_request_exception=False).post("/own-atomic-fails/a/")
    assert response.status_code == 500
    assert _free(nodes, "rv:a")


@postgres_only
@pytest.mark.django_db(transaction=True)
def test_cbv_method_decorator_commit_failure_under_atomic_requests_frees_lock(
    nodes: Any, redlock_settings: dict[str, Any], atomic_requests: None
) -> None:
    response = Client(raise_request_exception=False).post("/cbv-commit-fails/b/")
    assert response.status_code == 500
    assert _free(nodes, "rv:b")
    assert free_for_another_owner("rv:b")


@pytest.mark.django_db(transaction=True)
def test_nested_savepoints_under_atomic_requests_release_after_commit(
    nodes: Any, redlock_settings: dict[str, Any], atomic_requests: None
) -> None:
    response = Client().post("/nested/c/")
    assert response.status_code == 200
    assert Counter.objects.get(name="c").value == 2
    assert _free(nodes, "rv:c")


@pytest.mark.django_db(transaction=True)
def test_set_rollback_under_atomic_requests_frees_lock(
    nodes: Any, redlock_settings: dict[str, Any], atomic_requests: None
) -> None:
    response = Client().post("/set-rollback/d/")
    assert response.status_code == 200
    assert not Counter.objects.filter(name="d").exists()
    assert _free(nodes, "rv:d")


@pytest.mark.django_db(transaction=True)
def test_retrying_a_rolled_back_transaction_in_the_same_request_gets_the_lock(
    nodes: Any, redlock_settings: dict[str, Any]
) -> None:
    """The usual serialization-failure retry loop: the first transaction rolled
    back (README: the lock is released after the commit, or the rollback), so
    the second attempt must get the lock, not wait for the request's own hold
    and answer 423."""
    response = Client().post("/retries/e/")
    assert SEEN == ["failed once"]
    assert response.status_code == 200, (response.status_code, response.content)
    assert Counter.objects.get(name="e").value == 1
    assert _free(nodes, "rv:e")


@pytest.mark.parametrize(
    ("url", "status"), [("/404/g/", 404), ("/403/g/", 403), ("/500/g/", 500)]
)
@pytest.mark.parametrize("atomic", [False, True])
@pytest.mark.django_db(transaction=True)
def test_view_exceptions_free_the_lock_with_djangos_response(
    url: str,
    status: int,
    atomic: bool,
    nodes: Any,
    redlock_settings: dict[str, Any],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    if atomic:
        monkeypatch.setitem(connections.settings["default"], "ATOMIC_REQUESTS", True)
    response = Client(raise_request_exception=False).post(url)
    assert response.status_code == status
    assert _free(nodes, "rv:g")
    assert free_for_another_owner("rv:g")


# Streaming.


@pytest.mark.parametrize("atomic", [False, True])
@pytest.mark.django_db(transaction=True)
def test_streaming_response_lock_released_before_streaming_even_if_never_consumed(
    atomic: bool,
    nodes: Any,
    redlock_settings: dict[str, Any],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    if atomic:
        monkeypatch.setitem(connections.settings["default"], "ATOMIC_REQUESTS", True)
    response = Client().post("/stream/h/")
    assert response.status_code == 200
    # Not consumed yet: the lock covers only the view call (release.py docstring).
    assert _free(nodes, "rv:h")
    assert b"".join(response.streaming_content) == b"ab"
    assert SEEN == [("streaming", True)]


# Re-entrancy.


@pytest.mark.django_db(transaction=True)
def test_view_calling_a_view_on_the_same_resource_waits_and_gets_423(
    nodes: Any, redlock_settings: dict[str, Any]
) -> None:
    response = Client().post("/calls-itself/i/")
    assert response.status_code == 200
    assert SEEN == [423]
    assert _free(nodes, "rv:i")
    assert free_for_another_owner("rv:i")


# Resource callables.


@pytest.mark.parametrize(
    ("url", "status"),
    [
        ("/bad-resolver/", 500),
        ("/int-resolver/", 500),
        ("/huge-resolver/", 400),
        ("/glob-resolver/", 400),
    ],
)
@pytest.mark.django_db(transaction=True)
def test_bad_resource_callables_answer_and_hold_nothing(
    url: str, status: int, nodes: Any, redlock_settings: dict[str, Any]
) -> None:
    response = Client(raise_request_exception=False).get(url)
    assert response.status_code == status
    assert b"ran" not in response.content
    keys = set()
    for node in nodes:
        keys.update(node.client().scan_iter(match="redlock:lock:*"))
    assert keys == set()


# 423 / 503 answers.


@pytest.mark.django_db(transaction=True)
def test_423_json_and_html_and_retry_after(
    nodes: Any, redlock_settings: dict[str, Any], hold: Any
) -> None:
    hold("rv:j")
    client = Client()
    as_json = client.get("/short-ttl/j/")
    assert as_json.status_code == 423
    assert as_json["Retry-After"] == "1"
    assert json.loads(as_json.content)["error"] == "locked"
    as_html = client.get("/short-ttl/j/", HTTP_ACCEPT="text/html")
    assert as_html.status_code == 423
    assert as_html["Content-Type"].startswith("text/html")
    assert "Accept" in as_html["Vary"]
    refuses_json = client.get(
        "/short-ttl/j/", HTTP_ACCEPT="application/json;q=0, text/html"
    )
    assert refuses_json["Content-Type"].startswith("text/html")


@pytest.mark.django_db(transaction=True)
def test_503_names_no_credentials_in_body_or_log(
    nodes: Any,
    redlock_settings: dict[str, Any],
    settings: Any,
    caplog: pytest.LogCaptureFixture,
) -> None:
    secret = "s3cr3t-pass"
    urls = [url.replace("redis://", f"redis://user:{secret}@") for url in nodes.urls]
    settings.REDLOCK = {**redlock_settings, "NODES": urls}
    with caplog.at_level(logging.DEBUG):
        response = Client().get("/plain-locked/k/")
    assert response.status_code == 503
    assert response["Retry-After"] == "5"
    assert secret.encode() not in response.content
    assert secret not in caplog.text
    for record in caplog.records:
        assert secret not in str(record.args) and secret not in str(record.exc_info)


# Commit order under contention (PostgreSQL, READ COMMITTED).


@postgres_only
@pytest.mark.django_db(transaction=True)
def test_read_modify_write_under_atomic_requests_loses_no_update(
    nodes: Any, redlock_settings: dict[str, Any], atomic_requests: None
) -> None:
    """Released before the COMMIT, the next holder would read the old value."""
    Counter.objects.create(name="m", value=0)
    errors: list[Any] = []

    def worker() -> None:
        try:
            client = Client()
            for _ in range(5):
                response = client.post("/incr/m/")
                if response.status_code != 200:
                    errors.append(response.status_code)
        except Exception as exc:  # pragma: no cover
            errors.append(exc)
        finally:
            connection.close()

    threads = [threading.Thread(target=worker) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert errors == []
    assert Counter.objects.get(name="m").value == 20
    assert _free(nodes, "rv:m")


# ASGI: async views cancelled.


def _lock_keys(nodes: Any) -> set[bytes]:
    keys: set[bytes] = set()
    for node in nodes:
        keys.update(node.client().scan_iter(match="redlock:*"))
    return keys


async def test_async_view_cancelled_while_waiting_for_the_lock_leaves_nothing(
    nodes: Any, redlock_settings: dict[str, Any]
) -> None:
    other = Redlock("rv:n")
    assert await other.aacquire(blocking=False)
    ENTERED[:] = [asyncio.Event()]
    disconnect = asyncio.Event()
    request = asyncio.ensure_future(asgi_request("GET", "/async-sleeps/n/", disconnect))
    await asyncio.sleep(0.5)
    assert not ENTERED[0].is_set()
    started = time.monotonic()
    disconnect.set()
    sent = await asyncio.wait_for(request, 5)
    assert sent == []
    assert time.monotonic() - started < 2.0
    await other.arelease()
    await asyncio.sleep(0.5)
    assert not ENTERED[0].is_set()
    assert await sync_to_async(_free)(nodes, "rv:n")
    assert await sync_to_async(free_for_another_owner)("rv:n")


async def test_async_view_cancelled_during_release_still_frees_the_lock(
    nodes: Any, redlock_settings: dict[str, Any], settings: Any
) -> None:
    """Two nodes paused: the release waits on them; the client goes away then.

    The release runs to its end (shielded): a quorum is free at once, and with
    auto_extend nothing extends the lease afterwards."""
    settings.REDLOCK = {**redlock_settings, "NODE_TIMEOUT": 1.0}
    ENTERED[:] = [asyncio.Event()]
    GATE[:] = [asyncio.Event()]
    disconnect = asyncio.Event()
    request = asyncio.ensure_future(asgi_request("GET", "/async-gated/o/", disconnect))
    await asyncio.wait_for(ENTERED[0].wait(), 5)
    paused = [nodes[3], nodes[4]]
    for node in paused:
        await sync_to_async(node.pause)()
    try:
        GATE[0].set()
        await asyncio.sleep(0.3)  # the release is waiting on the paused nodes
        disconnect.set()
        await asyncio.wait_for(request, 10)
        free = [
            await sync_to_async(nodes[i].client().exists)(lock_key("rv:o"))
            for i in range(3)
        ]
        assert free == [0, 0, 0]
    finally:
        for node in paused:
            await sync_to_async(node.resume)()
    await asyncio.sleep(TTL + 1.0)
    assert await sync_to_async(_free)(nodes, "rv:o")


async def test_async_streaming_view_released_when_view_returns(
    nodes: Any, redlock_settings: dict[str, Any]
) -> None:
    sent = await asgi_request("GET", "/async-stream/p/")
    assert sent[0]["status"] == 200
    assert await sync_to_async(_free)(nodes, "rv:p")


@pytest.mark.django_db(transaction=True)
async def test_closer_on_other_thread_with_auto_extend_leaves_lock_to_its_lease(
    nodes: Any,
    redlock_settings: dict[str, Any],
    atomic_requests: None,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """release.py: a response closed on another thread (Django's AsyncClient)
    cannot release, "and a WARNING says the lock is left to its lease" ("left to
    expire within <ttl>s"). With auto_extend the watchdog must not keep the
    lease alive after that: the lock has to be gone a few TTLs later."""
    try:
        response = await AsyncClient().post("/extends-rb/q/")
        assert response.status_code == 200
        assert "left to expire" in caplog.text
        deadline = time.monotonic() + 4.0  # 4 TTLs
        while not await sync_to_async(_free)(nodes, "rv:q"):
            assert time.monotonic() < deadline, "still held: the watchdog extends it"
            await asyncio.sleep(0.1)
    finally:
        # Nothing in the library can release it any more: delete the keys, so
        # the watchdog finds the lease lost and stops.
        for node in nodes:
            await sync_to_async(node.client().delete)(lock_key("rv:q"))
        await sync_to_async(connections.close_all)()


@pytest.mark.django_db(transaction=True)
def test_request_values_forming_a_hashed_key_name_get_a_400_not_a_500(
    nodes: Any, redlock_settings: dict[str, Any]
) -> None:
    """Every value is within the limits (<= 64 printable characters, no
    separator), yet together they spell the form a hashed long name takes in
    keys (160 characters, '~', 32 hex digits), which Redlock() refuses with
    ValueError. resources.py: values from the request that cannot name a
    resource get a 400 before any lock is taken; here the client gets a 500."""
    org, user = "o" * 64, "u" * 64
    month = "m" * 23 + "~" + "0123456789abcdef" * 2
    resource = f"report:{org}:{user}:{month}"
    assert len(resource[: resource.index("~")]) == 160 and len(month) <= 64
    response = Client(raise_request_exception=False).get(
        f"/report/{org}/{user}/{month}/"
    )
    assert b"ran" not in response.content
    assert _lock_keys(nodes) == set()
    assert response.status_code == 400, response.status_code


@pytest.mark.django_db(transaction=True)
def test_resource_callable_returning_a_hashed_looking_name_gets_a_clear_400(
    nodes: Any, redlock_settings: dict[str, Any]
) -> None:
    """The callable's other bad names (too long, glob characters) are refused by
    check_name with a 400; the hashed-looking one escapes it as a 500."""
    response = Client(raise_request_exception=False).get("/hashed-resolver/")
    assert b"ran" not in response.content
    assert _lock_keys(nodes) == set()
    assert response.status_code == 400, response.status_code


@pytest.mark.django_db(transaction=True)
async def test_async_view_cancelled_during_a_thread_write_keeps_the_lock_until_it_ends(
    nodes: Any, redlock_settings: dict[str, Any]
) -> None:
    """An async view awaiting ORM work in a thread (sync_to_async, as Django's
    async ORM does) is cancelled by a client disconnect. Cancelling the await
    does not stop the thread: the write goes on. The lock must still be held
    when that write ends; otherwise the next request runs concurrently with it.
    """
    SEEN_NODES[:] = [nodes]
    WRITES.clear()
    WRITE_STARTED.clear()
    disconnect = asyncio.Event()
    try:
        request = asyncio.ensure_future(
            asgi_request("GET", "/async-writes/s/", disconnect)
        )
        assert await asyncio.to_thread(WRITE_STARTED.wait, 5)
        disconnect.set()
        await asyncio.wait_for(request, 10)
        deadline = time.monotonic() + 5
        while not WRITES:
            assert time.monotonic() < deadline
            await asyncio.sleep(0.05)
        assert WRITES[0] >= 3, f"the write ended with the lock on {WRITES[0]} nodes"
    finally:
        await asyncio.sleep(1.5)
        await sync_to_async(connections.close_all)()


@pytest.mark.django_db(transaction=True)
async def test_async_view_raising_while_its_thread_still_writes_keeps_the_lock(
    nodes: Any, redlock_settings: dict[str, Any]
) -> None:
    """The same write abandoned by the view itself (``asyncio.wait_for`` timed
    out): the view raises TimeoutError while the thread still writes. The lock
    must still be held when the write ends."""
    SEEN_NODES[:] = [nodes]
    WRITES.clear()
    WRITE_STARTED.clear()
    try:
        with pytest.raises(TimeoutError):
            await AsyncClient().get("/async-write-timed-out/w/")
        deadline = time.monotonic() + 5
        while not WRITES:
            assert time.monotonic() < deadline
            await asyncio.sleep(0.05)
        assert WRITES[0] >= 3, f"the write ended with the lock on {WRITES[0]} nodes"
    finally:
        await asyncio.sleep(1.5)
        await sync_to_async(connections.close_all)()


@pytest.mark.parametrize("url", ["/na-inner/t/", "/na-outer/t/"])
@pytest.mark.django_db(transaction=True)
def test_non_atomic_requests_in_either_order_runs_outside_atomic(
    url: str, nodes: Any, redlock_settings: dict[str, Any], atomic_requests: None
) -> None:
    response = Client().post(url)
    assert response.status_code == 200
    assert SEEN == [False]
    assert _free(nodes, "rv:t")


@pytest.mark.django_db(transaction=True)
async def test_asgi_sync_view_rolled_back_under_atomic_requests_frees_the_lock(
    nodes: Any, redlock_settings: dict[str, Any], atomic_requests: None
) -> None:
    try:
        sent = await asgi_request("POST", "/set-rollback/u/")
        assert sent[0]["status"] == 200
        assert await sync_to_async(_free)(nodes, "rv:u")
    finally:
        await sync_to_async(connections.close_all)()


@pytest.mark.django_db(transaction=True)
def test_lease_lost_during_the_view_is_logged_and_the_response_returned(
    nodes: Any, redlock_settings: dict[str, Any], caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING, logger="redlock_django"):
        response = Client().get("/outlives/v/")
    assert response.status_code == 200
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert errors and "rv:v" in errors[0].getMessage()
    assert _free(nodes, "rv:v")


async def test_async_view_cancelled_around_the_grant_never_leaves_the_lock_held(
    nodes: Any, redlock_settings: dict[str, Any]
) -> None:
    """The holder lets go and the client disconnects at nearly the same moment,
    many times over: whichever wins, the lock is free once the request is over."""
    import random

    rng = random.Random(7)
    for round_ in range(25):
        other = Redlock("rv:x")
        assert await other.aacquire(blocking=False)
        ENTERED[:] = [asyncio.Event()]
        disconnect = asyncio.Event()
        request = asyncio.ensure_future(
            asgi_request("GET", "/async-sleeps/x/", disconnect)
        )
        await asyncio.sleep(0.05)
        release_at, cancel_at = rng.uniform(0, 0.03), rng.uniform(0, 0.03)

        async def go_away(delay: float, event: asyncio.Event = disconnect) -> None:
            await asyncio.sleep(delay)
            event.set()

        leaving = asyncio.ensure_future(go_away(cancel_at))
        await asyncio.sleep(release_at)
        await other.arelease()  # the owner is this task
        await leaving
        await asyncio.wait_for(request, 10)
        await asyncio.sleep(0.05)
        assert await sync_to_async(_free)(nodes, "rv:x"), round_


@pytest.mark.django_db(transaction=True)
def test_failed_release_and_wrong_password_logs_name_no_password(
    nodes: Any,
    redlock_settings: dict[str, Any],
    settings: Any,
    caplog: pytest.LogCaptureFixture,
    capsys: pytest.CaptureFixture[str],
) -> None:
    secret = "pw-7f3a9c1e"
    urls = nodes.require_password(secret)
    try:
        settings.REDLOCK = {**redlock_settings, "NODES": urls}
        SEEN_NODES[:] = [nodes]
        with caplog.at_level(logging.DEBUG):
            try:
                response = Client().get("/pauses/y/")
            finally:
                for node in nodes:
                    node.resume()
            assert response.status_code == 200
            wrong = [u.replace(secret, secret + "-wrong") for u in urls]
            settings.REDLOCK = {**redlock_settings, "NODES": wrong}
            unavailable = Client().get("/plain-locked/y/", HTTP_ACCEPT="text/html")
        assert unavailable.status_code == 503
        assert secret.encode() not in unavailable.content
        text = caplog.text
        for record in caplog.records:
            text += str(record.args) + str(record.exc_info) + record.getMessage()
            if record.exc_info:
                import traceback

                text += "".join(traceback.format_exception(*record.exc_info))
        out = capsys.readouterr()
        assert caplog.records  # something was logged
        assert secret not in text + out.out + out.err
    finally:
        for node in nodes:
            with node.client(password=secret) as client:
                client.config_set("requirepass", "")


@pytest.mark.django_db(transaction=True)
def test_view_raising_under_atomic_requests_with_propagated_exceptions_frees_lock(
    nodes: Any,
    redlock_settings: dict[str, Any],
    atomic_requests: None,
    settings: Any,
) -> None:
    """DEBUG_PROPAGATE_EXCEPTIONS (a documented Django setting): the handler
    re-raises instead of serving a 500, so no response is closed and no
    request_finished is sent. The view raised, and its transaction rolled back:
    README, the lock is released when the view raises (after the rollback).
    With auto_extend it must not stay held, extended until MAX_HOLD."""
    settings.DEBUG_PROPAGATE_EXCEPTIONS = True
    try:
        with pytest.raises(RuntimeError):
            Client().post("/extends-raises/z/")
        assert not Counter.objects.filter(name="z").exists()  # rolled back
        deadline = time.monotonic() + 4.0  # 4 TTLs
        while not _free(nodes, "rv:z"):
            assert time.monotonic() < deadline, "still held after the rollback"
            time.sleep(0.1)
    finally:
        # The request_finished the handler never sent: frees the hold and
        # balances this thread's request count for the tests after this one.
        request_finished.send(sender=None)
