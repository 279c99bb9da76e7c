"""Views locked with ``distributed_lock`` for tests/test_decorators.py, and the
shop's purchase with its old stock write for tests/test_shop_fencing.py.

Every view body appends its name to ``CALLS`` and runs the callables in ``PROBES``
while it holds its lock, so a test can look at the nodes from inside the view.
``AFTER_VIEW`` probes run after a locked view returned but before the request's
transaction ends (see ``_then``).
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from typing import Any

from django.db import transaction
from django.http import HttpRequest, HttpResponse, JsonResponse
from django.urls import path
from django.utils.decorators import method_decorator
from django.views import View
from django.views.decorators.csrf import csrf_exempt

from redlock_django import (
    LockContentionError,
    QuorumUnavailableError,
    Redlock,
    fenced_update,
)
from redlock_django.decorators import DistributedLockMixin, distributed_lock
from shop import views as shop_views
from shop.models import Order, Product
from tests.models import Counter

CALLS: list[str] = []
PROBES: list[Callable[[HttpRequest], None]] = []
AFTER_VIEW: list[Callable[[HttpRequest], None]] = []
#: Work done after the locked view returned, before the request's transaction
#: commits (rendering, other queries): the window a too-early release exposes.
AFTER_VIEW_SECONDS = 0.05

WAIT = 0.2


def _ran(request: HttpRequest, name: str) -> JsonResponse:
    CALLS.append(name)
    for probe in PROBES:
        probe(request)
    lock: Redlock = request.redlock  # type: ignore[attr-defined]
    return JsonResponse(
        {
            "view": name,
            "resource": lock.resource,
            "owned": lock.owned(),
            "validity": lock.validity,
            "fencing_token": lock.fencing_token,
        }
    )


# Function views.


@distributed_lock("item:{item}", timeout=WAIT)
def sync_item(request: HttpRequest, item: str) -> HttpResponse:
    return _ran(request, "sync_item")


@distributed_lock("item:{item}", timeout=WAIT)
async def async_item(request: HttpRequest, item: str) -> HttpResponse:
    return _ran(request, "async_item")


@distributed_lock("item:{item}", blocking=False, ttl=2.5)
def nonblocking(request: HttpRequest, item: str) -> HttpResponse:
    return _ran(request, "nonblocking")


@distributed_lock("fenced:{item}", fencing=True, timeout=WAIT)
def fenced(request: HttpRequest, item: str) -> HttpResponse:
    return _ran(request, "fenced")


@distributed_lock("user:{request.user.pk}", timeout=WAIT)
def per_user(request: HttpRequest) -> HttpResponse:
    return _ran(request, "per_user")


@distributed_lock("user:{request.user.pk}", timeout=WAIT)
async def aper_user(request: HttpRequest) -> HttpResponse:
    return _ran(request, "aper_user")


def _order(request: HttpRequest, *args: Any, **kwargs: Any) -> str:
    return f"order:{kwargs['order']}"


@distributed_lock(_order, timeout=WAIT)
def by_callable(request: HttpRequest, order: str) -> HttpResponse:
    return _ran(request, "by_callable")


@distributed_lock("slow:{item}", ttl=0.2)
def outlives(request: HttpRequest, item: str) -> HttpResponse:
    time.sleep(0.4)
    return _ran(request, "outlives")


@distributed_lock("item:{item}", timeout=WAIT)
def raises(request: HttpRequest, item: str) -> HttpResponse:
    _ran(request, "raises")
    raise RuntimeError("the view failed")


@distributed_lock("item:{item}", timeout=WAIT)
async def araises(request: HttpRequest, item: str) -> HttpResponse:
    _ran(request, "araises")
    raise RuntimeError("the async view failed")


@distributed_lock("slow:{item}", ttl=0.2)
def outlives_and_raises(request: HttpRequest, item: str) -> HttpResponse:
    time.sleep(0.4)
    _ran(request, "outlives_and_raises")
    raise RuntimeError("the slow view failed")


# Hooks.


def _busy(request: HttpRequest, exc: LockContentionError) -> HttpResponse:
    return HttpResponse(f"busy {exc.resource}", status=409)


def _down(request: HttpRequest, exc: QuorumUnavailableError) -> HttpResponse:
    return HttpResponse(f"down {len(exc.failed)}/{exc.nodes}", status=502)


async def _abusy(request: HttpRequest, exc: LockContentionError) -> HttpResponse:
    return HttpResponse(f"async busy {exc.resource}", status=409)


async def _adown(request: HttpRequest, exc: QuorumUnavailableError) -> HttpResponse:
    return HttpResponse(f"async down {len(exc.failed)}/{exc.nodes}", status=502)


def _default(request: HttpRequest, exc: Exception) -> None:
    CALLS.append(f"hook saw {type(exc).__name__}")


@distributed_lock("item:{item}", timeout=WAIT, on_locked=_busy, on_unavailable=_down)
def hooked(request: HttpRequest, item: str) -> HttpResponse:
    return _ran(request, "hooked")


@distributed_lock("item:{item}", timeout=WAIT, on_locked=_abusy, on_unavailable=_adown)
async def ahooked(request: HttpRequest, item: str) -> HttpResponse:
    return _ran(request, "ahooked")


def _busy_with_orm(request: HttpRequest, exc: LockContentionError) -> HttpResponse:
    """A sync hook that reads the database (here: the session's user)."""
    return HttpResponse(f"busy for user {request.user.pk}", status=409)


@distributed_lock("item:{item}", timeout=WAIT, on_locked=_busy_with_orm)
async def ahooked_orm(request: HttpRequest, item: str) -> HttpResponse:
    return _ran(request, "ahooked_orm")


@distributed_lock("item:{item}", timeout=WAIT, on_locked=_abusy, on_unavailable=_adown)
def sync_async_hooked(request: HttpRequest, item: str) -> HttpResponse:
    return _ran(request, "sync_async_hooked")


@distributed_lock(
    "item:{item}", timeout=WAIT, on_locked=_default, on_unavailable=_default
)
def hook_declines(request: HttpRequest, item: str) -> HttpResponse:
    return _ran(request, "hook_declines")


# Class-based views.


@method_decorator(distributed_lock("item:{item}", timeout=WAIT), name="dispatch")
class MethodDecorated(View):
    def get(self, request: HttpRequest, item: str) -> HttpResponse:
        return _ran(request, "MethodDecorated")


@method_decorator(distributed_lock("item:{item}", timeout=WAIT), name="dispatch")
class AsyncMethodDecorated(View):
    async def get(self, request: HttpRequest, item: str) -> HttpResponse:
        return _ran(request, "AsyncMethodDecorated")


class Mixin(DistributedLockMixin, View):
    lock_resource = "item:{item}"
    lock_timeout = WAIT

    def get(self, request: HttpRequest, item: str) -> HttpResponse:
        return _ran(request, "Mixin")


class AsyncMixin(DistributedLockMixin, View):
    lock_resource = "item:{item}"
    lock_timeout = WAIT

    async def get(self, request: HttpRequest, item: str) -> HttpResponse:
        return _ran(request, "AsyncMixin")

    async def lock_on_locked(
        self, request: HttpRequest, exc: LockContentionError
    ) -> HttpResponse:
        return HttpResponse(f"mixin busy {exc.resource}", status=409)


@distributed_lock("item:{item}", timeout=WAIT)
class ClassDecorated(View):
    def get(self, request: HttpRequest, item: str) -> HttpResponse:
        return _ran(request, "ClassDecorated")


@distributed_lock("item:{item}", timeout=WAIT)
class AsyncClassDecorated(View):
    async def get(self, request: HttpRequest, item: str) -> HttpResponse:
        return _ran(request, "AsyncClassDecorated")


# Transactions: a Counter read, bumped after a pause, and written back.


def _bump(name: str) -> int:
    counter = Counter.objects.get(name=name)
    time.sleep(0.005)
    counter.value += 1
    counter.save(update_fields=["value"])
    return counter.value


def _then(view: Callable[..., HttpResponse]) -> Callable[..., HttpResponse]:
    """Run AFTER_VIEW probes and more work after ``view`` returns.

    Still inside the transaction that ATOMIC_REQUESTS wraps around the callback.
    """

    @functools.wraps(view)
    def wrapper(request: HttpRequest, *args: Any, **kwargs: Any) -> HttpResponse:
        response = view(request, *args, **kwargs)
        for probe in AFTER_VIEW:
            probe(request)
        time.sleep(AFTER_VIEW_SECONDS)
        return response

    return wrapper


@csrf_exempt
@_then
@distributed_lock("counter:{name}", timeout=10)
def bump(request: HttpRequest, name: str) -> HttpResponse:
    return JsonResponse({"value": _bump(name)})


@csrf_exempt
@_then
def bump_release_before_commit(request: HttpRequest, name: str) -> HttpResponse:
    """The mistake the decorator avoids: unlock inside the open transaction."""
    lock = Redlock(f"counter:{name}")
    assert lock.acquire(timeout=10)
    try:
        value = _bump(name)
    finally:
        lock.release()
    return JsonResponse({"value": value})


@csrf_exempt
@_then
@distributed_lock("counter:{name}", timeout=WAIT)
def bump_then_roll_back(request: HttpRequest, name: str) -> HttpResponse:
    value = _bump(name)
    transaction.set_rollback(True)
    return JsonResponse({"value": value})


# The shop's purchase with the stock write it had before the compare-and-set, for
# the negative control of tests/test_shop_fencing.py: fenced by the token only.


@csrf_exempt
@transaction.non_atomic_requests
def shop_buy_by_token_only(request: HttpRequest, product_id: int) -> HttpResponse:
    """``/shop/products/<id>/buy/`` whose write does not compare the read token."""
    checked = shop_views._prelude(request, product_id)
    if isinstance(checked, JsonResponse):
        return checked
    customer, quantity = checked
    response: HttpResponse = _shop_sell_by_token_only(
        request, product_id=product_id, customer=customer, quantity=quantity
    )
    return response


@distributed_lock(shop_views._product_resource, fencing=True)
def _shop_sell_by_token_only(
    request: HttpRequest, product_id: int, customer: str, quantity: int
) -> HttpResponse:
    lock: Redlock = request.redlock  # type: ignore[attr-defined]
    product = shop_views._check_order(product_id, customer, quantity)
    if isinstance(product, JsonResponse):
        return product
    shop_views._work()
    with transaction.atomic():
        row = Product.objects.filter(pk=product.pk)
        if not fenced_update(row, lock, stock=product.stock - quantity):
            return JsonResponse({"error": "stale_lock"}, status=409)
        order = Order.objects.create(
            product=product,
            customer=customer,
            quantity=quantity,
            fencing_token=lock.fencing_token,
        )
    return JsonResponse({"order": order.as_json()}, status=201)


urlpatterns = [
    path("sync/<str:item>/", sync_item),
    path("async/<str:item>/", async_item),
    path("nonblocking/<str:item>/", nonblocking),
    path("fenced/<str:item>/", fenced),
    path("user/", per_user),
    path("auser/", aper_user),
    path("order/<str:order>/", by_callable),
    path("outlives/<str:item>/", outlives),
    path("raises/<str:item>/", raises),
    path("araises/<str:item>/", araises),
    path("outlives-and-raises/<str:item>/", outlives_and_raises),
    path("hooked/<str:item>/", hooked),
    path("ahooked/<str:item>/", ahooked),
    path("ahooked-orm/<str:item>/", ahooked_orm),
    path("sync-async-hooked/<str:item>/", sync_async_hooked),
    path("hook-declines/<str:item>/", hook_declines),
    path("cbv/method/<str:item>/", MethodDecorated.as_view()),
    path("cbv/amethod/<str:item>/", AsyncMethodDecorated.as_view()),
    path("cbv/mixin/<str:item>/", Mixin.as_view()),
    path("cbv/amixin/<str:item>/", AsyncMixin.as_view()),
    path("cbv/class/<str:item>/", ClassDecorated.as_view()),
    path("cbv/aclass/<str:item>/", AsyncClassDecorated.as_view()),
    path("bump/<str:name>/", bump),
    path("bump-early/<str:name>/", bump_release_before_commit),
    path("bump-rollback/<str:name>/", bump_then_roll_back),
    path("shop/<int:product_id>/buy-by-token-only/", shop_buy_by_token_only),
]
