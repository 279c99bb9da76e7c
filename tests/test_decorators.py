"""``distributed_lock`` on real views, against five real redis-server nodes.

The views live in tests/views.py (mounted under /views/); a few views that are
misconfigured on purpose live here, with this module's own ``urlpatterns`` for
the tests marked ``@pytest.mark.urls(__name__)``.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
import threading
import time
from collections.abc import Iterator
from typing import Any
from urllib.parse import quote

import pytest
from asgiref.sync import sync_to_async
from django.core.exceptions import ImproperlyConfigured
from django.core.handlers.asgi import ASGIHandler
from django.db import connection, connections, transaction
from django.http import HttpRequest, HttpResponse, JsonResponse
from django.test import Client
from django.urls import include, path, re_path
from django.utils.decorators import method_decorator
from django.views import View

from harness.held import lock_key, tokens
from redlock_django import Redlock
from redlock_django.checks import E020, check_url_placeholders
from redlock_django.decorators import DistributedLockMixin, distributed_lock
from tests import views
from tests.models import Counter

BROWSER_ACCEPT = "text/html,application/xhtml+xml,application/xml;q=0.9,*/*;q=0.8"

SYNC_URLS = [
    "/views/sync/{}/",
    "/views/cbv/method/{}/",
    "/views/cbv/mixin/{}/",
    "/views/cbv/class/{}/",
]
ASYNC_URLS = [
    "/views/async/{}/",
    "/views/cbv/amethod/{}/",
    "/views/cbv/amixin/{}/",
    "/views/cbv/aclass/{}/",
]


@pytest.fixture(autouse=True)
def _clean_views() -> Iterator[None]:
    views.CALLS.clear()
    views.PROBES.clear()
    views.AFTER_VIEW.clear()
    yield
    views.PROBES.clear()
    views.AFTER_VIEW.clear()


def lock_keys(nodes: Any) -> set[bytes]:
    keys: set[bytes] = set()
    for node in nodes:
        keys.update(node.client().scan_iter(match="redlock:lock:*"))
    return keys


def record_holders(nodes: Any, resource: str) -> list[list[bytes | None]]:
    """Add a probe recording the resource's token on every node, from the view."""
    seen: list[list[bytes | None]] = []
    views.PROBES.append(lambda request: seen.append(tokens(nodes, resource)))
    return seen


# Misconfigured on purpose: the routes below never supply {other}.


@distributed_lock("x:{other}")
def needs_other(request: HttpRequest, **kwargs: Any) -> HttpResponse:
    return HttpResponse("ran")


@method_decorator(distributed_lock("x:{other}"), name="dispatch")
class NeedsOtherView(View):
    def get(self, request: HttpRequest, **kwargs: Any) -> HttpResponse:
        return HttpResponse("ran")


class NeedsOtherMixinView(DistributedLockMixin, View):
    lock_resource = "x:{other}"

    def get(self, request: HttpRequest, **kwargs: Any) -> HttpResponse:
        return HttpResponse("ran")


urlpatterns = [
    path("missing/<str:item>/", needs_other),
    path("cbv/<str:item>/", NeedsOtherView.as_view()),
    path("mixin/<str:item>/", NeedsOtherMixinView.as_view()),
    # Each of these supplies {other}: captured, as a pattern kwarg, by an
    # including pattern, or as a regex group.
    path("given/<str:other>/", needs_other),
    path("default/", needs_other, {"other": "fixed"}),
    path("outer/<int:other>/", include([path("inner/", NeedsOtherView.as_view())])),
    re_path(r"^re/(?P<other>\w+)/$", NeedsOtherMixinView.as_view()),
]


# Templates and options: checked when the decorator is applied.


@pytest.mark.parametrize(
    ("template", "placeholder"),
    [
        ("x:{}", "{}"),
        ("x:{0}", "{0}"),
        ("x:{item[0]}", "{item[0]}"),
        ("x:{item!r}", "{item}"),
        ("x:{item:>9}", "{item}"),
        ("x:{item.pk}", "{item.pk}"),
        ("x:{request}", "{request}"),
        ("x:{request.user._wrapped}", "{request.user._wrapped}"),
        ("x:{request.__class__}", "{request.__class__}"),
        ("x:{request.user.__dict__}", "{request.user.__dict__}"),
        ("x:{request.user[pk]}", "{request.user[pk]}"),
    ],
)
def test_malformed_template_raises_improperly_configured_naming_the_placeholder(
    template: str, placeholder: str
) -> None:
    """A placeholder no view can supply fails at decoration time, named."""
    with pytest.raises(ImproperlyConfigured) as caught:
        distributed_lock(template)
    assert placeholder in str(caught.value)


@pytest.mark.parametrize(
    "template",
    ["x:{item", "x:}", "x y:{item}", "x*:{item}", "x:{{item}}", "", "x" * 201],
)
def test_template_with_bad_literal_text_raises_improperly_configured(
    template: str,
) -> None:
    """Unbalanced braces, separators, glob characters or excess length fail early."""
    with pytest.raises(ImproperlyConfigured, match="lock resource"):
        distributed_lock(template)


def test_mixin_with_a_malformed_template_fails_when_the_class_is_created() -> None:
    """DistributedLockMixin checks lock_resource in __init_subclass__."""
    with pytest.raises(ImproperlyConfigured, match=r"\{request\._meta\}"):

        class Bad(DistributedLockMixin, View):
            lock_resource = "x:{request._meta}"


@pytest.mark.parametrize(
    "options",
    [
        {"blocking": False, "timeout": 1.0},
        {"ttl": -1},
        {"ttl": "10"},
        {"timeout": "1"},
        {"on_locked": "not callable"},
        {"label": 42},
    ],
)
def test_bad_options_raise_improperly_configured(options: dict[str, Any]) -> None:
    """Options are validated when the decorator is built, not at the request."""
    with pytest.raises(ImproperlyConfigured):
        distributed_lock("x:{item}", **options)


def test_only_view_classes_can_be_decorated_as_classes() -> None:
    """A class that is not a View has no dispatch to lock."""
    with pytest.raises(TypeError, match="View classes"):
        distributed_lock("x")(int)


@pytest.mark.urls(__name__)
def test_system_check_names_the_placeholder_view_and_route_never_supplied() -> None:
    """redlock.E020 flags each pattern routing to a lock without its kwarg."""
    errors = check_url_placeholders()
    found = {(error.id, str(error.obj.pattern)) for error in errors}
    assert found == {
        (E020, "missing/<str:item>/"),
        (E020, "cbv/<str:item>/"),
        (E020, "mixin/<str:item>/"),
    }
    messages = "\n".join(error.msg for error in errors)
    assert len(errors) == 3
    assert f"{__name__}.needs_other" in messages
    assert f"{__name__}.NeedsOtherView" in messages
    assert f"{__name__}.NeedsOtherMixinView" in messages


def test_system_check_passes_on_the_test_projects_views() -> None:
    """Every locked view in tests/views.py gets the kwargs its template names."""
    assert check_url_placeholders() == []


@pytest.mark.urls(__name__)
@pytest.mark.parametrize(
    ("url", "view"),
    [
        ("/missing/a/", "needs_other"),
        ("/cbv/a/", "NeedsOtherView"),
        ("/mixin/a/", "NeedsOtherMixinView"),
    ],
)
def test_first_request_without_the_kwarg_raises_improperly_configured(
    client: Client, redlock_settings: dict[str, Any], nodes: Any, url: str, view: str
) -> None:
    """At the request, the error names the placeholder, the view and the route."""
    with pytest.raises(ImproperlyConfigured) as caught:
        client.get(url)
    message = str(caught.value)
    assert "{other}" in message
    assert f"{__name__}.{view}" in message
    assert url.strip("/").split("/")[0] in message
    assert lock_keys(nodes) == set()


@pytest.mark.urls(__name__)
def test_views_given_the_kwarg_by_any_route_form_run(
    client: Client, redlock_settings: dict[str, Any]
) -> None:
    """Captured, pattern-kwarg, included and regex kwargs all fill {other}."""
    for url in ["/given/a/", "/default/", "/outer/7/inner/", "/re/b/"]:
        assert client.get(url).status_code == 200, url


def test_mixin_without_a_resource_raises_improperly_configured(rf: Any) -> None:
    """A mixin view that never set lock_resource cannot guess a lock."""

    class Unset(DistributedLockMixin, View):
        def get(self, request: HttpRequest) -> HttpResponse:
            return HttpResponse("ran")

    with pytest.raises(ImproperlyConfigured, match="lock_resource"):
        Unset.as_view()(rf.get("/"))


# Holding the lock around sync, async and class-based views.


@pytest.mark.parametrize("url", SYNC_URLS)
def test_sync_view_runs_holding_the_lock_and_releases_it(
    client: Client, redlock_settings: dict[str, Any], nodes: Any, url: str
) -> None:
    """The body runs with the lock on every node; it is gone after the response."""
    seen = record_holders(nodes, "item:a")
    response = client.get(url.format("a"))
    assert response.status_code == 200
    body = response.json()
    assert body["resource"] == "item:a"
    assert body["owned"] is True
    assert 0 < body["validity"] <= 10
    assert len(seen) == 1 and None not in seen[0] and len(set(seen[0])) == 1
    assert tokens(nodes, "item:a") == [None] * 5


@pytest.mark.parametrize("url", ASYNC_URLS)
async def test_async_view_runs_holding_the_lock_and_releases_it(
    async_client: Any, redlock_settings: dict[str, Any], nodes: Any, url: str
) -> None:
    """Async views and async CBVs hold the lock from their own task (aacquire)."""
    seen = record_holders(nodes, "item:a")
    holders: list[tuple[str, str]] = []

    def holder(request: HttpRequest) -> None:
        meta = json.loads(nodes[0].client().hget(lock_key("item:a"), "meta"))
        task = asyncio.current_task()
        holders.append((meta["holder"], task.get_name() if task else "no task"))

    views.PROBES.append(holder)
    response = await async_client.get(url.format("a"))
    assert response.status_code == 200
    assert response.json()["resource"] == "item:a"
    assert response.json()["owned"] is True
    assert len(seen) == 1 and None not in seen[0]
    # Acquired by the view's task, not by a worker thread.
    assert holders[0][0] == holders[0][1] != threading.current_thread().name
    assert tokens(nodes, "item:a") == [None] * 5


@pytest.mark.parametrize("url", ASYNC_URLS)
def test_async_view_called_from_a_sync_client_holds_the_lock(
    client: Client, redlock_settings: dict[str, Any], nodes: Any, url: str
) -> None:
    """Under WSGI, Django runs async views in an event loop; the lock follows."""
    seen = record_holders(nodes, "item:b")
    response = client.get(url.format("b"))
    assert response.status_code == 200
    assert len(seen) == 1 and None not in seen[0]
    assert tokens(nodes, "item:b") == [None] * 5


def test_request_redlock_exposes_validity_and_fencing_tokens(
    client: Client, redlock_settings: dict[str, Any]
) -> None:
    """request.redlock is the Redlock: owned, its validity and fencing token."""
    first = client.get("/views/fenced/a/").json()
    second = client.get("/views/fenced/a/").json()
    assert first["resource"] == "fenced:a" and first["owned"] is True
    assert 9 < first["validity"] <= 10
    assert isinstance(first["fencing_token"], int)
    assert second["fencing_token"] > first["fencing_token"]


def test_label_is_the_method_and_path_without_the_query_string(
    client: Client, redlock_settings: dict[str, Any], nodes: Any
) -> None:
    """The admin sees who holds what; a query string (maybe a secret) is left out."""
    metas: list[dict[str, Any]] = []
    views.PROBES.append(
        lambda request: metas.extend(
            json.loads(node.client().hget(lock_key("item:q"), "meta")) for node in nodes
        )
    )
    response = client.post("/views/sync/q/?token=s3cret")
    assert response.status_code == 200
    assert [meta["label"] for meta in metas] == ["POST /views/sync/q/"] * 5
    assert metas[0]["holder"] == threading.current_thread().name


def test_label_option_replaces_the_default(
    rf: Any, redlock_settings: dict[str, Any], nodes: Any
) -> None:
    """label= may be a string or a callable of the request."""
    metas: list[str] = []

    def view(request: HttpRequest) -> HttpResponse:
        metas.append(json.loads(nodes[0].client().hget(lock_key("x"), "meta"))["label"])
        return HttpResponse("ran")

    distributed_lock("x", label="nightly export")(view)(rf.get("/"))
    distributed_lock("x", label=lambda r: f"by {r.method}")(view)(rf.put("/"))
    assert metas == ["nightly export", "by PUT"]


# Contention (423) and outages (503).


@pytest.mark.parametrize("url", SYNC_URLS)
def test_locked_elsewhere_gives_423_with_retry_after(
    client: Client, redlock_settings: dict[str, Any], url: str
) -> None:
    """Still held after the wait: 423 Locked, Retry-After = ceil(TTL), no body run."""
    lock = Redlock("item:a")
    assert lock.acquire()
    try:
        started = time.monotonic()
        response = client.get(url.format("a"))
        waited = time.monotonic() - started
    finally:
        lock.release()
    assert response.status_code == 423
    assert response["Retry-After"] == "10"
    assert response.json() == {
        "error": "locked",
        "resource": "item:a",
        "detail": "'item:a' is held by another request; retry in 10 seconds",
    }
    assert waited >= views.WAIT
    assert views.CALLS == []


@pytest.mark.parametrize("url", ASYNC_URLS)
async def test_async_view_locked_elsewhere_gives_423(
    async_client: Any, redlock_settings: dict[str, Any], url: str
) -> None:
    """The async path waits with aacquire and answers 423 (or the mixin's hook)."""
    lock = Redlock("item:a")
    assert await lock.aacquire()
    try:
        response = await async_client.get(url.format("a"))
    finally:
        await lock.arelease()
    if "amixin" in url:
        assert response.status_code == 409
        assert response.content == b"mixin busy item:a"
    else:
        assert response.status_code == 423
        assert response["Retry-After"] == "10"
        assert response.json()["error"] == "locked"
    assert views.CALLS == []


def test_nonblocking_view_answers_at_once_with_its_own_ttl_as_retry_after(
    client: Client, redlock_settings: dict[str, Any]
) -> None:
    """blocking=False makes one attempt; Retry-After is ceil(ttl=2.5) = 3."""
    lock = Redlock("item:n")
    assert lock.acquire()
    try:
        started = time.monotonic()
        response = client.get("/views/nonblocking/n/")
        waited = time.monotonic() - started
    finally:
        lock.release()
    assert response.status_code == 423
    assert response["Retry-After"] == "3"
    # WAIT_TIMEOUT is 2.0 s: a blocking call would have waited that long.
    assert waited < 1.0
    assert client.get("/views/nonblocking/n/").status_code == 200


@pytest.mark.parametrize("url", ["/views/sync/{}/", "/views/cbv/mixin/{}/"])
def test_three_of_five_nodes_stopped_gives_503_and_the_view_never_runs(
    client: Client,
    redlock_settings: dict[str, Any],
    nodes: Any,
    url: str,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Fewer than a quorum reachable: 503 with Retry-After, not 423, no body run."""
    for node in nodes[:3]:
        node.stop()
    with caplog.at_level("WARNING", logger="redlock_django.decorators"):
        response = client.get(url.format("a"))
    # The log says which nodes failed and how: one line, no exception trace.
    [record] = [r for r in caplog.records if r.name == "redlock_django.decorators"]
    assert record.exc_info is None
    message = record.getMessage()
    assert message.startswith(f"GET {url.format('a')} not run: could not acquire")
    assert "too few nodes answered" in message and "node[0]" in message
    assert response.status_code == 503
    assert response["Retry-After"] == "5"
    body = response.json()
    assert body["error"] == "unavailable"
    assert body["resource"] == "item:a"
    assert "2 of 5 granted, 3 needed" in body["detail"]
    assert views.CALLS == []


@pytest.mark.parametrize("url", ["/views/async/{}/", "/views/cbv/aclass/{}/"])
async def test_async_view_with_three_nodes_stopped_gives_503(
    async_client: Any,
    redlock_settings: dict[str, Any],
    nodes: Any,
    url: str,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The async path reports the outage the same way, in the response and the log."""
    for node in nodes[:3]:
        node.stop()
    with caplog.at_level("WARNING", logger="redlock_django.decorators"):
        response = await async_client.get(url.format("a"))
    assert any(
        "not run: could not acquire" in r.getMessage()
        for r in caplog.records
        if r.name == "redlock_django.decorators"
    )
    assert response.status_code == 503
    assert response["Retry-After"] == "5"
    assert response.json()["error"] == "unavailable"
    assert views.CALLS == []


def test_two_of_five_nodes_stopped_still_locks(
    client: Client, redlock_settings: dict[str, Any], nodes: Any
) -> None:
    """Negative control for the 503: with a quorum left, the view runs."""
    for node in nodes[:2]:
        node.stop()
    assert client.get("/views/sync/a/").status_code == 200
    assert views.CALLS == ["sync_item"]


@pytest.mark.parametrize(
    ("headers", "json_body"),
    [
        ({}, True),
        ({"accept": "application/json"}, True),
        ({"accept": "*/*"}, True),
        ({"accept": "text/html, application/json"}, False),
        ({"accept": BROWSER_ACCEPT}, False),
        ({"accept": "application/xml"}, False),
        ({"accept": BROWSER_ACCEPT, "content-type": "application/json"}, True),
        ({"accept": BROWSER_ACCEPT, "content-type": "application/vnd.x+json"}, True),
    ],
)
def test_error_body_is_json_for_json_requests_and_html_otherwise(
    client: Client,
    redlock_settings: dict[str, Any],
    headers: dict[str, str],
    json_body: bool,
) -> None:
    """Accept (JSON preferred over HTML) or a JSON body selects JSON."""
    lock = Redlock("item:<b>")
    assert lock.acquire()
    try:
        response = client.post(
            "/views/nonblocking/%3Cb%3E/",
            data=b"{}",
            headers=headers,
            content_type=headers.get("content-type", "text/plain"),
        )
    finally:
        lock.release()
    assert response.status_code == 423
    assert "Accept" in response["Vary"]
    if json_body:
        assert response["Content-Type"] == "application/json"
        assert response.json()["resource"] == "item:<b>"
    else:
        assert response["Content-Type"].startswith("text/html")
        page = response.content.decode()
        assert "<h1>Locked</h1>" in page
        assert "&lt;b&gt;" in page and "<b>" not in page


# Hooks.


def test_sync_hooks_replace_the_423_and_503_responses(
    client: Client, redlock_settings: dict[str, Any], nodes: Any
) -> None:
    """on_locked / on_unavailable get (request, exc) and return the response."""
    lock = Redlock("item:h")
    assert lock.acquire()
    try:
        busy = client.get("/views/hooked/h/")
    finally:
        lock.release()
    assert (busy.status_code, busy.content) == (409, b"busy item:h")
    for node in nodes[:3]:
        node.stop()
    down = client.get("/views/hooked/h/")
    assert (down.status_code, down.content) == (502, b"down 3/5")
    assert views.CALLS == []


async def test_async_hooks_on_an_async_view(
    async_client: Any, redlock_settings: dict[str, Any], nodes: Any
) -> None:
    """Coroutine hooks are awaited on the async path."""
    lock = Redlock("item:h")
    assert await lock.aacquire()
    try:
        busy = await async_client.get("/views/ahooked/h/")
    finally:
        await lock.arelease()
    assert (busy.status_code, busy.content) == (409, b"async busy item:h")
    for node in nodes[:3]:
        node.stop()
    down = await async_client.get("/views/ahooked/h/")
    assert (down.status_code, down.content) == (502, b"async down 3/5")


def test_async_hooks_on_a_sync_view(
    client: Client, redlock_settings: dict[str, Any], nodes: Any
) -> None:
    """A coroutine hook on a sync view is run to completion, not returned raw."""
    lock = Redlock("item:h")
    assert lock.acquire()
    try:
        busy = client.get("/views/sync-async-hooked/h/")
    finally:
        lock.release()
    assert (busy.status_code, busy.content) == (409, b"async busy item:h")
    for node in nodes[:3]:
        node.stop()
    down = client.get("/views/sync-async-hooked/h/")
    assert (down.status_code, down.content) == (502, b"async down 3/5")


def test_hook_returning_none_keeps_the_default_response(
    client: Client, redlock_settings: dict[str, Any], nodes: Any
) -> None:
    """A hook that only observes (returns None) leaves the 423 / 503 in place."""
    lock = Redlock("item:h")
    assert lock.acquire()
    try:
        assert client.get("/views/hook-declines/h/").status_code == 423
    finally:
        lock.release()
    for node in nodes[:3]:
        node.stop()
    assert client.get("/views/hook-declines/h/").status_code == 503
    assert views.CALLS == [
        "hook saw LockContentionError",
        "hook saw QuorumUnavailableError",
    ]


# Untrusted values.


@pytest.mark.parametrize(
    ("value", "reason"),
    [
        ("1:admin", "contains ':'"),
        ("*", "contains '*'"),
        ("a?b", "contains '?'"),
        ("[ab]", "contains '['"),
        ("{item}", "contains '{'"),
        ("a\\b", "contains '\\\\'"),
        ("a b", "contains ' '"),
        ("a\nb", "contains '\\n'"),
        ("a\tb", "contains '\\t'"),
        ("a\u200bb", "contains '\\u200b'"),
        ("a\u3000b", "contains '\\u3000'"),
        ("x" * 65, "65 characters long; the limit is 64"),
        ("x" * 5000, "5000 characters long"),
    ],
)
def test_untrusted_kwarg_is_refused_with_400_before_any_lock(
    client: Client,
    redlock_settings: dict[str, Any],
    nodes: Any,
    value: str,
    reason: str,
) -> None:
    """Separators, globs, whitespace, invisible characters, excess length: 400."""
    response = client.get(f"/views/sync/{quote(value, safe='')}/")
    assert response.status_code == 400
    body = response.json()
    assert body["error"] == "bad_resource"
    assert "{item}" in body["detail"] and reason in body["detail"]
    assert views.CALLS == []
    assert lock_keys(nodes) == set()


def test_a_kwarg_cannot_take_another_resources_lock(
    client: Client, redlock_settings: dict[str, Any], nodes: Any
) -> None:
    """ "1:admin" is refused rather than mapped onto the lock 'item:1:admin'."""
    other = Redlock("item:1:admin")
    assert other.acquire()
    try:
        before = tokens(nodes, "item:1:admin")
        response = client.get("/views/sync/1%3Aadmin/")
        after = tokens(nodes, "item:1:admin")
    finally:
        other.release()
    # Not 423: the request never tried the other resource, and left it alone.
    assert response.status_code == 400
    assert before == after and None not in after
    assert lock_keys(nodes) == set()


def test_longest_allowed_value_locks(
    client: Client, redlock_settings: dict[str, Any], nodes: Any
) -> None:
    """Negative control for the length cap: 64 characters pass."""
    response = client.get("/views/sync/{}/".format("x" * 64))
    assert response.status_code == 200
    assert response.json()["resource"] == "item:" + "x" * 64


def test_whole_resource_length_is_capped(
    rf: Any, redlock_settings: dict[str, Any]
) -> None:
    """Values within their cap can still add up past 200 characters: 400."""

    @distributed_lock("{a}:{b}:{c}:{d}")
    def view(request: HttpRequest, **kwargs: Any) -> HttpResponse:
        return HttpResponse("ran")

    values = {name: "y" * 49 for name in "abcd"}  # 4 x 49 + 3 separators = 199
    assert view(rf.get("/"), **values).status_code == 200
    values["d"] = "y" * 51
    response = view(rf.get("/"), **values)
    assert response.status_code == 400
    assert (
        "201 characters long; the limit is 200"
        in json.loads(response.content)["detail"]
    )


@pytest.mark.django_db
def test_request_attribute_placeholder(
    client: Client, redlock_settings: dict[str, Any], django_user_model: Any
) -> None:
    """{request.user.pk} locks per user; an anonymous user has no pk: 400."""
    anonymous = client.get("/views/user/")
    assert anonymous.status_code == 400
    assert "{request.user.pk} has no value" in anonymous.json()["detail"]
    user = django_user_model.objects.create_user("ada")
    client.force_login(user)
    response = client.get("/views/user/")
    assert response.status_code == 200
    assert response.json()["resource"] == f"user:{user.pk}"


@pytest.mark.django_db(transaction=True)
def test_an_async_views_request_attribute_placeholder_reads_the_user_in_a_thread(
    client: Client, redlock_settings: dict[str, Any], django_user_model: Any
) -> None:
    """The README's ``{request.user.pk}`` on an ``async def`` view: request.user
    loads the session and the user from the database, which Django refuses in
    the event loop (it was a 500, SynchronousOnlyOperation, for any logged-in
    user); the resource is now computed in a thread. A sync hook that reads the
    database runs in a thread too."""
    user = django_user_model.objects.create_user("ada")
    client.force_login(user)
    response = client.get("/views/auser/")
    assert response.status_code == 200, response.content[:300]
    assert response.json()["resource"] == f"user:{user.pk}"
    with Redlock("item:busy-orm"):
        busy = client.get("/views/ahooked-orm/busy-orm/")
    assert (busy.status_code, busy.content) == (
        409,
        f"busy for user {user.pk}".encode(),
    )


@pytest.mark.django_db(transaction=True)
async def test_an_async_views_request_user_placeholder_under_asgi(
    async_client: Any, redlock_settings: dict[str, Any], django_user_model: Any
) -> None:
    """The same view under ASGI (AsyncClient), for a logged-in user."""
    try:
        user = await sync_to_async(django_user_model.objects.create_user)("ada")
        await async_client.aforce_login(user)
        response = await async_client.get("/views/auser/")
        assert response.status_code == 200, response.content[:300]
        assert response.json()["resource"] == f"user:{user.pk}"
    finally:
        await sync_to_async(connections.close_all)()


def test_callable_resource_result_is_checked(
    client: Client, redlock_settings: dict[str, Any], nodes: Any
) -> None:
    """A callable's name is used as is, but whitespace or globs in it give 400."""
    assert client.get("/views/order/42/").json()["resource"] == "order:42"
    for bad in ["a%20b", "a%2A"]:
        response = client.get(f"/views/order/{bad}/")
        assert response.status_code == 400
    assert lock_keys(nodes) == set()


def test_callable_resource_must_return_a_string(rf: Any) -> None:
    """Returning anything but str is a programming error, not a 400."""
    view = distributed_lock(lambda request: None)(lambda request: HttpResponse())  # type: ignore[arg-type, return-value]
    with pytest.raises(TypeError, match="returned NoneType"):
        view(rf.get("/"))


# Release: when the view returns or raises, lost leases.


@pytest.mark.parametrize("url", ["/views/raises/{}/", "/views/araises/{}/"])
def test_view_exception_propagates_and_the_lock_is_released(
    client: Client, redlock_settings: dict[str, Any], nodes: Any, url: str
) -> None:
    """The view's own exception reaches the caller; the lock is freed anyway."""
    seen = record_holders(nodes, "item:r")
    with pytest.raises(RuntimeError, match="view failed"):
        client.get(url.format("r"))
    assert len(seen) == 1 and None not in seen[0]
    assert tokens(nodes, "item:r") == [None] * 5


def test_lost_lease_is_logged_at_error_and_the_response_returned(
    client: Client, redlock_settings: dict[str, Any], caplog: Any
) -> None:
    """ttl=0.2 s, the view takes 0.4 s: ERROR with resource and durations, 200."""
    with caplog.at_level(logging.ERROR, logger="redlock_django.decorators"):
        response = client.get("/views/outlives/s/")
    assert response.status_code == 200
    assert response.json()["owned"] is False
    errors = [r for r in caplog.records if r.name == "redlock_django.decorators"]
    assert len(errors) == 1 and errors[0].levelno == logging.ERROR
    message = errors[0].getMessage()
    assert "'slow:s'" in message
    assert "tests.views.outlives" in message
    held = re.search(r"held (\d+\.\d{3})s with a ttl of 0\.200s", message)
    assert held is not None and float(held.group(1)) >= 0.4


def test_release_failure_never_masks_the_views_exception(
    client: Client, redlock_settings: dict[str, Any], caplog: Any
) -> None:
    """A view that outlives its lease and raises: its exception, and an ERROR log."""
    with (
        caplog.at_level(logging.ERROR, logger="redlock_django.decorators"),
        pytest.raises(RuntimeError, match="slow view failed"),
    ):
        client.get("/views/outlives-and-raises/s/")
    errors = [r for r in caplog.records if r.name == "redlock_django.decorators"]
    assert len(errors) == 1 and errors[0].levelno == logging.ERROR
    message = errors[0].getMessage()
    assert "'slow:s' lost" in message and "the view's exception propagates" in message


def test_a_view_that_finishes_in_time_logs_nothing(
    client: Client, redlock_settings: dict[str, Any], caplog: Any
) -> None:
    """Negative control for the lost-lease log."""
    with caplog.at_level(logging.DEBUG, logger="redlock_django"):
        assert client.get("/views/sync/ok/").status_code == 200
    assert [r for r in caplog.records if r.levelno >= logging.WARNING] == []


# Transactions: release after the commit, and on rollback.


@pytest.fixture
def atomic_requests(monkeypatch: pytest.MonkeyPatch) -> None:
    """Turn on ATOMIC_REQUESTS for the default database during the test."""
    monkeypatch.setitem(connections.settings["default"], "ATOMIC_REQUESTS", True)


def _bump(request: HttpRequest, name: str) -> HttpResponse:
    counter = Counter.objects.get(name=name)
    counter.value += 1
    counter.save(update_fields=["value"])
    return JsonResponse({"value": counter.value})


@pytest.mark.django_db(transaction=True)
def test_release_waits_for_the_commit_of_atomic_requests(
    client: Client, redlock_settings: dict[str, Any], atomic_requests: None, caplog: Any
) -> None:
    """After the view returns, the lock stays held until the transaction commits.

    Released exactly once: at the commit, not again when the response closes.
    """
    Counter.objects.create(name="c")
    lock = Redlock("counter:c")
    after_view: list[tuple[bool, bool]] = []
    at_commit: list[bool] = []

    def probe(request: HttpRequest) -> None:
        after_view.append((connection.in_atomic_block, lock.locked()))
        # Runs after the decorator's own on-commit release, before the response
        # is closed.
        transaction.on_commit(lambda: at_commit.append(lock.locked()))

    views.AFTER_VIEW.append(probe)
    with caplog.at_level(logging.DEBUG, logger="redlock_django"):
        response = client.post("/views/bump/c/")
    assert response.status_code == 200
    assert after_view == [(True, True)]
    assert at_commit == [False]
    assert not lock.locked()
    assert Counter.objects.get(name="c").value == 1
    assert [r for r in caplog.records if r.levelno >= logging.WARNING] == []


@pytest.mark.django_db(transaction=True)
def test_rolled_back_request_releases_the_lock_when_the_response_closes(
    client: Client, redlock_settings: dict[str, Any], atomic_requests: None
) -> None:
    """A rollback drops on-commit callbacks; the response's closer releases."""
    Counter.objects.create(name="c")
    lock = Redlock("counter:c")
    held_after_view: list[bool] = []
    views.AFTER_VIEW.append(lambda request: held_after_view.append(lock.locked()))
    response = client.post("/views/bump-rollback/c/")
    assert response.status_code == 200
    assert held_after_view == [True]
    assert not lock.locked()
    assert Counter.objects.get(name="c").value == 0


async def _asgi_post(path: str) -> int:
    """POST ``path`` through Django's ASGIHandler, as an ASGI server would."""
    scope = {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": path,
        "raw_path": path.encode(),
        "query_string": b"",
        "root_path": "",
        "headers": [(b"host", b"testserver")],
        "client": ("127.0.0.1", 40000),
        "server": ("testserver", 80),
    }
    incoming = [{"type": "http.request", "body": b"", "more_body": False}]
    sent: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:
        if incoming:
            return incoming.pop()
        await asyncio.Event().wait()  # no disconnect until the handler is done
        raise AssertionError("unreachable")

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    await ASGIHandler()(scope, receive, send)
    return int(sent[0]["status"])


@pytest.mark.django_db(transaction=True)
async def test_rolled_back_request_under_asgi_releases_when_the_response_closes(
    redlock_settings: dict[str, Any], atomic_requests: None
) -> None:
    """Django's ASGIHandler closes the response on the view's thread: released."""
    lock = Redlock("counter:c")
    held_after_view: list[bool] = []
    views.AFTER_VIEW.append(lambda request: held_after_view.append(lock.locked()))
    try:
        await Counter.objects.acreate(name="c")
        assert await _asgi_post("/views/bump-rollback/c/") == 200
        assert held_after_view == [True]
        assert not await lock.alocked()
        assert (await Counter.objects.aget(name="c")).value == 0
    finally:
        # The async ORM's worker thread keeps its connection open otherwise.
        await sync_to_async(connections.close_all)()


@pytest.mark.django_db(transaction=True)
async def test_response_closed_on_another_thread_leaves_the_lock_with_a_warning(
    async_client: Any,
    redlock_settings: dict[str, Any],
    atomic_requests: None,
    caplog: Any,
) -> None:
    """A response closed off the view's thread leaves the lock to its lease.

    Django's AsyncClient closes responses on a worker thread, where the rolled
    back request's lock cannot be released; a WARNING says so.
    """
    lock = Redlock("counter:c")
    try:
        await Counter.objects.acreate(name="c")
        with caplog.at_level(logging.WARNING, logger="redlock_django.decorators"):
            response = await async_client.post("/views/bump-rollback/c/")
        assert response.status_code == 200
        assert await lock.alocked()
        messages = [r.getMessage() for r in caplog.records]
        assert any("closed on another thread" in m for m in messages), messages
    finally:
        await sync_to_async(connections.close_all)()


@pytest.mark.django_db(transaction=True)
def test_outer_atomic_commit_releases_at_the_commit(
    rf: Any, redlock_settings: dict[str, Any], caplog: Any
) -> None:
    """An outer atomic() the view returns into: released when it commits."""
    Counter.objects.create(name="c")
    lock = Redlock("counter:c")
    view = distributed_lock("counter:{name}")(_bump)
    with caplog.at_level(logging.DEBUG, logger="redlock_django"):
        with transaction.atomic():
            response = view(rf.post("/"), name="c")
            assert lock.locked()
        assert not lock.locked()
        response.close()
    assert [r for r in caplog.records if r.levelno >= logging.WARNING] == []


@pytest.mark.django_db(transaction=True)
def test_outer_atomic_rollback_releases_when_the_response_closes(
    rf: Any, redlock_settings: dict[str, Any]
) -> None:
    """Rolled back: held past the transaction until the response is closed."""
    Counter.objects.create(name="c")
    lock = Redlock("counter:c")
    view = distributed_lock("counter:{name}")(_bump)
    with transaction.atomic():
        response = view(rf.post("/"), name="c")
        transaction.set_rollback(True)
    assert lock.locked()
    response.close()
    assert not lock.locked()
    assert Counter.objects.get(name="c").value == 0


@pytest.mark.django_db(transaction=True)
def test_view_raising_inside_a_transaction_releases_at_once(
    rf: Any, redlock_settings: dict[str, Any]
) -> None:
    """Nothing the failed view did will commit, so the lock is freed right away."""
    Counter.objects.create(name="c")
    lock = Redlock("counter:c")

    @distributed_lock("counter:{name}")
    def failing(request: HttpRequest, name: str) -> HttpResponse:
        _bump(request, name)
        raise ValueError("no")

    with transaction.atomic():
        with pytest.raises(ValueError, match="no"):
            failing(rf.post("/"), name="c")
        assert not lock.locked()
        transaction.set_rollback(True)


THREADS = 6
REQUESTS_EACH = 3


def _post_concurrently(url: str) -> int:
    """POST ``url`` from THREADS threads REQUESTS_EACH times; return the count."""
    Counter.objects.create(name="c")
    barrier = threading.Barrier(THREADS)
    failures: list[BaseException | int] = []

    def worker() -> None:
        client = Client()
        try:
            barrier.wait()
            for _ in range(REQUESTS_EACH):
                status = client.post(url).status_code
                if status != 200:
                    failures.append(status)
        except BaseException as exc:
            failures.append(exc)
        finally:
            connections.close_all()

    threads = [threading.Thread(target=worker) for _ in range(THREADS)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert failures == []
    return Counter.objects.get(name="c").value


needs_postgresql = pytest.mark.skipif(
    connection.vendor != "postgresql",
    reason="concurrent transactions need PostgreSQL (set DATABASE_URL); SQLite "
    "serialises writers with a database lock, so it cannot show lost updates",
)


@needs_postgresql
@pytest.mark.django_db(transaction=True)
def test_concurrent_requests_under_atomic_requests_lose_no_update(
    redlock_settings: dict[str, Any], atomic_requests: None
) -> None:
    """Read-sleep-write under the decorator: every increment lands.

    Each request still has AFTER_VIEW_SECONDS of work inside its transaction
    after the locked view returns; the lock is released only at the commit.
    """
    assert _post_concurrently("/views/bump/c/") == THREADS * REQUESTS_EACH


@needs_postgresql
@pytest.mark.django_db(transaction=True)
def test_releasing_before_the_commit_loses_updates(
    redlock_settings: dict[str, Any], atomic_requests: None
) -> None:
    """Negative control: the same view unlocking inside its transaction.

    The next holder reads the value before the previous write commits.
    """
    assert _post_concurrently("/views/bump-early/c/") < THREADS * REQUESTS_EACH


@pytest.mark.parametrize("is_async", [False, True])
def test_on_locked_hook_gets_the_nodes_that_granted_and_failed(
    rf: Any,
    redlock_settings: dict[str, Any],
    nodes: Any,
    settings: Any,
    is_async: bool,
) -> None:
    """on_locked gets the contention error of the failed attempt itself: its
    ``granted`` count and ``failed`` nodes (one that did not answer is named)."""
    settings.REDLOCK = {**redlock_settings, "WAIT_TIMEOUT": 0.3}
    seen: list[Any] = []

    def hook(request: HttpRequest, exc: Exception) -> HttpResponse:
        seen.append(exc)
        return HttpResponse("busy", status=409)

    def sync_view(request: HttpRequest, item: str) -> HttpResponse:
        return HttpResponse("ran")

    async def async_view(request: HttpRequest, item: str) -> HttpResponse:
        return HttpResponse("ran")

    view: Any = distributed_lock("item:{item}", on_locked=hook)(
        async_view if is_async else sync_view
    )
    lock = Redlock("item:g")
    assert lock.acquire()
    nodes[4].pause()
    try:
        response = view(rf.get("/"), item="g")
        if is_async:
            response = asyncio.run(response)
    finally:
        nodes[4].resume()
        lock.release()
    assert (response.status_code, response.content) == (409, b"busy")
    (exc,) = seen
    assert (exc.granted, exc.nodes, exc.quorum) == (0, 5, 3)
    assert list(exc.failed) == [lock._resolve().spec.node_names[4]]
