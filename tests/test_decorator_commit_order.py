"""A decorated view's lock is held until the transaction that wrote under it ends,
however the view ended, and the release closer does not stop a response being
cached.

README, "Views": inside a transaction (``ATOMIC_REQUESTS``, an outer ``atomic()``)
the lock is released only after the commit, or the rollback, and exactly once.
Found by an adversarial commit: a view that wrote and then raised, its exception
turned into a response inside the transaction (an error-handling decorator or
mixin, Django's 404), was released at once, before the transaction committed its
write; and ``cache_page`` / the per-site cache over a locked view under
``ATOMIC_REQUESTS`` failed with a 500 (the closer could not be pickled). The
views are mounted by this module's own ``urlpatterns``.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import pytest
from django.core.cache import cache
from django.db import connection, connections, transaction
from django.http import Http404, HttpRequest, HttpResponse
from django.test import Client, override_settings
from django.urls import path
from django.views import View
from django.views.decorators.cache import cache_page
from django.views.decorators.csrf import csrf_exempt

from harness.held import lock_key
from redlock_django.decorators import DistributedLockMixin, distributed_lock
from tests._decorated import free_for_another_owner
from tests.models import Counter

pytestmark = pytest.mark.urls(__name__)

TTL = 2.0

#: What the probes saw between the view's exit and the end of its transaction:
#: (transaction still open, the lock free for another owner).
GAP: list[tuple[bool, bool]] = []
#: On PostgreSQL: the counter another connection saw at the probe.
COMMITTED: list[int | None] = []


def _committed_value(name: str) -> int | None:
    """Read the counter from another thread (another connection): committed data."""
    seen: list[int | None] = []

    def read() -> None:
        try:
            row = Counter.objects.filter(name=name).first()
            seen.append(None if row is None else row.value)
        finally:
            connection.close()

    thread = threading.Thread(target=read)
    thread.start()
    thread.join(10)
    return seen[0] if seen else -1


def _probe(resource: str) -> None:
    GAP.append((connection.in_atomic_block, free_for_another_owner(resource)))
    if connection.vendor == "postgresql":
        # The view's write is not committed yet: another connection sees none.
        COMMITTED.append(_committed_value(resource.split(":")[1]))


def _bump(name: str) -> None:
    counter, _ = Counter.objects.get_or_create(name=name)
    counter.value += 1
    counter.save()


class Invalid(Exception):
    """A validation error raised by a view after it wrote."""


def _json_errors(view: Callable[..., HttpResponse]) -> Callable[..., HttpResponse]:
    """Turn ``Invalid`` into a 400, as API error-handling decorators do."""

    def wrapper(request: HttpRequest, *args: Any, **kwargs: Any) -> HttpResponse:
        try:
            return view(request, *args, **kwargs)
        except Invalid as exc:
            _probe(f"commit:{kwargs['name']}")
            return HttpResponse(str(exc), status=400)

    return wrapper


@csrf_exempt
@_json_errors
@distributed_lock("commit:{name}", ttl=TTL, timeout=0.5)
def writes_then_invalid(request: HttpRequest, name: str) -> HttpResponse:
    _bump(name)
    raise Invalid("quantity too large")


class ErrorsAsJsonMixin:
    """A dispatch mixin turning ``Invalid`` into a 400 (placed before the lock)."""

    def dispatch(self, request: HttpRequest, *args: Any, **kwargs: Any) -> Any:
        try:
            return super().dispatch(request, *args, **kwargs)  # type: ignore[misc]
        except Invalid as exc:
            _probe(f"commit:{kwargs['name']}")
            return HttpResponse(str(exc), status=400)


class MixinWritesThenInvalid(ErrorsAsJsonMixin, DistributedLockMixin, View):
    lock_resource = "commit:{name}"
    lock_ttl = TTL
    lock_timeout = 0.5

    def post(self, request: HttpRequest, name: str) -> HttpResponse:
        _bump(name)
        raise Invalid("quantity too large")


@csrf_exempt
@distributed_lock("commit:{name}", ttl=TTL, timeout=0.5)
def writes_then_404(request: HttpRequest, name: str) -> HttpResponse:
    _bump(name)
    raise Http404("no such thing")


class AtomicMiddleware:
    """Run the rest of the chain in one transaction (an outer ``atomic()``)."""

    def __init__(self, get_response: Callable[[HttpRequest], HttpResponse]) -> None:
        self.get_response = get_response

    def __call__(self, request: HttpRequest) -> HttpResponse:
        with transaction.atomic():
            response = self.get_response(request)
            _probe(f"commit:{request.path.strip('/').split('/')[-1]}")
            return response


@cache_page(60)
@distributed_lock("commit:{name}", ttl=TTL, timeout=0.5)
def cached_report(request: HttpRequest, name: str) -> HttpResponse:
    return HttpResponse(f"report {name}")


@distributed_lock("commit:{name}", ttl=TTL, timeout=0.5)
def report(request: HttpRequest, name: str) -> HttpResponse:
    response = HttpResponse(f"report {name}")
    response["Cache-Control"] = "max-age=60"
    return response


def _failing_hook() -> None:
    raise RuntimeError("an on-commit hook of the view failed")


@csrf_exempt
@distributed_lock("commit:{name}", ttl=TTL, timeout=0.5)
def hook_fails(request: HttpRequest, name: str) -> HttpResponse:
    _bump(name)
    transaction.on_commit(_failing_hook)
    return HttpResponse("written")


urlpatterns = [
    path("invalid/<str:name>/", writes_then_invalid),
    path("site-cached/<str:name>/", report),
    path("hook-fails/<str:name>/", hook_fails),
    path("mixin-invalid/<str:name>/", csrf_exempt(MixinWritesThenInvalid.as_view())),
    path("missing/<str:name>/", writes_then_404),
    path("report/<str:name>/", cached_report),
]


@pytest.fixture
def atomic_requests(monkeypatch: pytest.MonkeyPatch) -> None:
    """Turn on ATOMIC_REQUESTS for the default database during the test."""
    monkeypatch.setitem(connections.settings["default"], "ATOMIC_REQUESTS", True)


@pytest.fixture(autouse=True)
def _clean() -> Any:
    GAP.clear()
    COMMITTED.clear()
    cache.clear()
    yield
    GAP.clear()
    cache.clear()


def _keys(nodes: Any, resource: str) -> list[bool]:
    return [bool(node.client().exists(lock_key(resource))) for node in nodes]


# A view that raises inside a transaction which then commits.


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("url", ["/invalid/a/", "/mixin-invalid/a/"])
def test_lock_is_held_until_the_commit_when_a_raised_error_becomes_a_response(
    url: str, nodes: Any, redlock_settings: dict[str, Any], atomic_requests: None
) -> None:
    """The view wrote, then raised; a layer inside ATOMIC_REQUESTS answered 400,
    so the transaction commits the write. Until that commit no other owner may
    take the lock (README: released only after the commit, or the rollback)."""
    response = Client().post(url)
    assert response.status_code == 400
    assert Counter.objects.get(name="a").value == 1  # the write committed
    assert COMMITTED in ([], [None])  # the write was still uncommitted then
    assert GAP == [(True, False)], "lock free while its transaction was still open"
    assert _keys(nodes, "commit:a") == [False] * len(nodes)


@pytest.mark.django_db(transaction=True)
@override_settings(MIDDLEWARE=[f"{__name__}.AtomicMiddleware"])
def test_lock_is_held_until_an_outer_atomic_commits_after_http404(
    nodes: Any, redlock_settings: dict[str, Any]
) -> None:
    """Django turns the view's Http404 into a response inside the middleware's
    ``atomic()``, which then commits the view's write: the lock must be held
    until that commit."""
    response = Client().post("/missing/b/")
    assert response.status_code == 404
    assert Counter.objects.get(name="b").value == 1  # the write committed
    assert COMMITTED in ([], [None])  # the write was still uncommitted then
    assert GAP == [(True, False)], "lock free while its transaction was still open"
    assert _keys(nodes, "commit:b") == [False] * len(nodes)


# The closer put on the response.


@pytest.mark.django_db(transaction=True)
def test_cached_locked_view_under_atomic_requests_is_served(
    nodes: Any, redlock_settings: dict[str, Any], atomic_requests: None
) -> None:
    """``cache_page`` over a locked view (one request computes, the others read
    the cache) pickles the response, and with it the release closer."""
    response = Client().get("/report/c/")
    assert response.status_code == 200
    assert response.content == b"report c"
    assert _keys(nodes, "commit:c") == [False] * len(nodes)
    assert Client().get("/report/c/").content == b"report c"


@pytest.mark.django_db(transaction=True)
@override_settings(
    MIDDLEWARE=[
        "django.middleware.cache.UpdateCacheMiddleware",
        "django.middleware.common.CommonMiddleware",
        "django.middleware.cache.FetchFromCacheMiddleware",
    ],
    CACHE_MIDDLEWARE_SECONDS=60,
)
def test_site_cache_middleware_caches_a_locked_view_under_atomic_requests(
    nodes: Any, redlock_settings: dict[str, Any], atomic_requests: None
) -> None:
    """Django's per-site cache stores the response after the transaction has
    committed and the lock is released; the spent closer is still on it."""
    response = Client().get("/site-cached/d/")
    assert response.status_code == 200
    assert _keys(nodes, "commit:d") == [False] * len(nodes)


# Pinned: behaviour that held up.


@pytest.mark.django_db(transaction=True)
def test_failing_on_commit_hook_of_the_view_still_frees_the_lock(
    nodes: Any, redlock_settings: dict[str, Any], atomic_requests: None
) -> None:
    """A view's on-commit hook that raises drops the release's hook queued after
    it; the 500's request_finished frees the lock (after the commit)."""
    response = Client(raise_request_exception=False).post("/hook-fails/e/")
    assert response.status_code == 500
    assert Counter.objects.get(name="e").value == 1
    assert _keys(nodes, "commit:e") == [False] * len(nodes)
