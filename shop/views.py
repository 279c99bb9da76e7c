"""The shop's HTTP API and storefront.

``POST /shop/products/<id>/buy/`` (JSON or form: ``customer``, ``quantity``):

1. The input is validated before any lock is taken: 400
   ``{"error": "bad_request", "detail": <reason>}``. An unknown product is a 404
   ``{"error": "not_found", ...}``.
2. ``@distributed_lock("shop:customer:<customer>")`` takes the customer lock,
   then ``@distributed_lock(<the product's model_resource>, fencing=True)`` the
   product lock, always in that order, so two locks never wait for each other
   crosswise (each waits up to ``REDLOCK["WAIT_TIMEOUT"]``; 423 / 503 from the
   decorator, naming the lock's resource: JSON, or a small HTML page for a
   request that asks for HTML, as the decorator answers).
3. Under the customer lock alone, before the product's: refuse a second order
   (409 ``already_ordered``: no other request of this customer runs, and their
   earlier orders were committed before their lock was released; the unique
   constraint still catches an order made after a customer lease ran out) and
   a stock already too low (409 ``sold_out``: stock only falls during a sale).
4. Under both, the product's critical section, kept to what needs it: read the
   product row (its stock and fencing token, in one query), refuse a stock too
   low (409 ``sold_out``), spend ``SHOP_WORK_SECONDS`` of "payment", then in one
   transaction write ``stock = <read value> - quantity`` with ``fenced_update``
   and create the order. A refused write is a 409 ``stale_lock`` and creates no
   order; a product deleted meanwhile is the 404. 201 ``{"order": {...},
   "stock": <left>}``. The product lock is released after the commit, then the
   customer lock.

With ``SHOP_TIMINGS_DIR`` set, each purchase's steps are timed
(``shop/timings.py``); ``make demo`` prints where a hold of the product lock goes.

The fenced write is a compare-and-set: it stores ``<read value> - quantity`` only
where the row still holds the token read with the stock, and that token is
older than this holder's. A lease can run out during a purchase (a pause: GC,
swap, SIGSTOP) and another buyer then takes the lock, so two purchases can
overlap. If the newer one wrote first, the older token is refused; if both read
the same stock, the first to write sells and the other's read no longer matches.
Either way no stale stock is written back and no unit is sold twice, however the
pause falls. The refusal comes after the payment: a real shop would refund it,
since the token guards the database, not the payment provider.

``POST /shop/products/<id>/buy-unsafe/``: the same steps with no lock and an
unfenced write of the absolute value: concurrent buyers read the same stock and
both sell, which is the race the lock prevents. The unique constraint still turns
a second order by one customer into a 409 ``already_ordered``.

Transactions. These views opt out of ``ATOMIC_REQUESTS``: a request transaction
would begin before the lock is taken. On SQLite with ``IMMEDIATE`` transactions
the request would then hold the database's write lock while it waits for the
Redis lock, which the current holder needs to commit; on SQLite in WAL mode a
read made before the lock would fix the transaction's snapshot, so the stock read
under the lock could be stale. Each view instead writes in a short
``transaction.atomic()`` after the lock is held, and the lock is released after
that transaction has committed. The read and the "payment" happen outside any
transaction, so a slow payment does not keep SQLite's write lock.
"""

from __future__ import annotations

import json
import re
import time
from typing import Any

from django.conf import settings
from django.core.exceptions import SuspiciousOperation
from django.db import IntegrityError, transaction
from django.http import HttpRequest, HttpResponse, JsonResponse
from django.http.multipartparser import MultiPartParserError
from django.shortcuts import render
from django.views.decorators.csrf import csrf_exempt

from redlock_django import (
    Redlock,
    distributed_lock,
    fenced_update,
    model_resource,
)

from . import timings
from .models import Order, Product, audit

#: A customer id: 1-64 characters of letters, digits and ``_ . @ -``.
CUSTOMER_RE = re.compile(r"[A-Za-z0-9_.@-]{1,64}\Z", re.ASCII)
_DIGITS = re.compile(r"[0-9]{1,18}\Z", re.ASCII)
#: Largest primary key the database can hold (bigint); larger ids are 404s.
_MAX_PK = 2**63 - 1


def work_seconds() -> float:
    return float(getattr(settings, "SHOP_WORK_SECONDS", 0.005))


def max_per_order() -> int:
    return int(getattr(settings, "SHOP_MAX_PER_ORDER", 5))


class BadRequest(Exception):
    """The request's input is invalid; the message is the 400's ``detail``."""


def _error(status: int, error: str, detail: str, **extra: Any) -> JsonResponse:
    return JsonResponse({"error": error, "detail": detail, **extra}, status=status)


def _not_found(product_id: int) -> JsonResponse:
    return _error(404, "not_found", f"no product with id {product_id}")


def _method_not_allowed(allowed: str) -> JsonResponse:
    response = _error(405, "method_not_allowed", f"use {allowed}")
    response["Allow"] = allowed
    return response


def parse_order(request: HttpRequest) -> tuple[str, int]:
    """Return ``(customer, quantity)`` from a JSON or form body; raise BadRequest."""
    content_type = request.content_type or ""
    data: Any
    try:
        if content_type == "application/json" or content_type.endswith("+json"):
            try:
                data = json.loads(request.body)
            except (ValueError, UnicodeDecodeError, RecursionError) as exc:
                raise BadRequest(f"malformed JSON: {exc}") from exc
            if not isinstance(data, dict):
                raise BadRequest("the JSON body must be an object")
        else:
            data = request.POST
    except (SuspiciousOperation, MultiPartParserError) as exc:
        # Refused by Django itself (too large, too many fields, no boundary): the
        # answer is this API's JSON 400 all the same.
        raise BadRequest(f"the request body was refused: {exc}") from exc
    customer = data.get("customer")
    if customer is None or customer == "":
        raise BadRequest("customer is missing")
    if not isinstance(customer, str):
        raise BadRequest("customer must be a string")
    if not CUSTOMER_RE.match(customer):
        raise BadRequest(
            "customer must be 1-64 characters of letters, digits, '_', '.', '@', '-'"
        )
    raw = data.get("quantity")
    if raw is None or raw == "":
        raise BadRequest("quantity is missing")
    if isinstance(raw, bool) or not isinstance(raw, int | str):
        raise BadRequest("quantity must be a positive integer")
    if isinstance(raw, str):
        text = raw.strip()
        if text.startswith("-") and _DIGITS.match(text[1:]):
            raise BadRequest("quantity must be a positive integer, not negative")
        if not _DIGITS.match(text):
            raise BadRequest("quantity must be a positive integer")
        raw = int(text)
    quantity = int(raw)
    limit = max_per_order()
    if quantity < 1:
        raise BadRequest(f"quantity must be a positive integer, not {quantity}")
    if quantity > limit:
        raise BadRequest(f"quantity must be at most {limit} per order")
    return customer, quantity


def _work() -> None:
    """Spend the simulated "payment" time inside the critical section."""
    seconds = work_seconds()
    if seconds > 0:
        time.sleep(seconds)


def _created(order: Order, stock: int) -> JsonResponse:
    return JsonResponse({"order": order.as_json(), "stock": stock}, status=201)


def _already_ordered(customer: str, product_id: int) -> JsonResponse:
    return _error(
        409,
        "already_ordered",
        f"customer {customer!r} already ordered product {product_id}",
        customer=customer,
    )


def _sold_out(product: Product, quantity: int) -> JsonResponse:
    return _error(
        409,
        "sold_out",
        f"{quantity} requested, {max(product.stock, 0)} left",
        stock=product.stock,
        requested=quantity,
    )


def _get_product(product_id: int) -> Product | None:
    if product_id > _MAX_PK:
        return None
    # get(), not filter().first(): no ORDER BY to build, a quarter less CPU for the
    # read inside the product's critical section (docs/benchmarks.md).
    try:
        return Product.objects.get(pk=product_id)
    except Product.DoesNotExist:
        return None


def _check_order(
    product_id: int, customer: str, quantity: int
) -> Product | JsonResponse:
    """Read the product; return it, or the response refusing the order."""
    product = _get_product(product_id)
    if product is None:
        return _not_found(product_id)
    if Order.objects.filter(product=product, customer=customer).exists():
        return _already_ordered(customer, product_id)
    if product.stock < quantity:
        return _sold_out(product, quantity)
    return product


def _prelude(request: HttpRequest, product_id: int) -> tuple[str, int] | JsonResponse:
    """Validate a buy request before any lock: (customer, quantity) or a 4xx."""
    if request.method != "POST":
        return _method_not_allowed("POST")
    try:
        customer, quantity = parse_order(request)
    except BadRequest as exc:
        return _error(400, "bad_request", str(exc))
    if _get_product(product_id) is None:
        return _not_found(product_id)
    return customer, quantity


@csrf_exempt
@transaction.non_atomic_requests
def buy(request: HttpRequest, product_id: int) -> HttpResponse:
    """Buy under the customer lock, then the product lock (fenced)."""
    timings.begin(product_id)
    checked = _prelude(request, product_id)
    if isinstance(checked, JsonResponse):
        timings.finish(checked.status_code)
        return checked
    customer, quantity = checked
    response: HttpResponse = _buy_as_customer(
        request, product_id=product_id, customer=customer, quantity=quantity
    )
    timings.finish(response.status_code)
    return response


def _customer_resource(request: HttpRequest, *args: Any, **kwargs: Any) -> str:
    """Name the customer's lock: ``shop:customer:<customer>``."""
    return f"shop:customer:{kwargs['customer']}"


def _product_resource(request: HttpRequest, *args: Any, **kwargs: Any) -> str:
    """Name the product's lock from its model and pk: ``shop.product:<id>``."""
    return model_resource(Product, kwargs["product_id"])


@distributed_lock(_customer_resource)
def _buy_as_customer(
    request: HttpRequest, product_id: int, customer: str, quantity: int
) -> HttpResponse:
    """Under the customer lock: refuse what can be refused, then take the product's.

    No other request of this customer runs now, and any order it made earlier
    was committed before its customer lock was released, so ``already_ordered``
    is decided here. Stock only falls during a sale, so a stock already too low
    is ``sold_out`` whenever it is read; a stock high enough is read again under
    the product lock.
    """
    if Order.objects.filter(product_id=product_id, customer=customer).exists():
        return _already_ordered(customer, product_id)
    product = _get_product(product_id)
    if product is None:
        return _not_found(product_id)
    if product.stock < quantity:
        return _sold_out(product, quantity)
    timings.mark("checked")
    response: HttpResponse = _buy_locked(
        request, product_id=product_id, customer=customer, quantity=quantity
    )
    return response


@distributed_lock(_product_resource, fencing=True)
def _buy_locked(
    request: HttpRequest, product_id: int, customer: str, quantity: int
) -> HttpResponse:
    """The product's critical section: read, pay, fenced write, commit."""
    lock: Redlock = request.redlock  # type: ignore[attr-defined]
    product = _get_product(product_id)  # read under the lock, with its fencing token
    timings.mark("read")
    if product is None:
        return _not_found(product_id)
    if product.stock < quantity:
        return _sold_out(product, quantity)
    _work()
    timings.mark("paid")
    token = lock.fencing_token
    try:
        with transaction.atomic():
            # Compared with the token read with the stock: refused if the row was
            # written since, or holds a newer token.
            if not fenced_update(product, lock, stock=product.stock - quantity):
                return _error(
                    409,
                    "stale_lock",
                    "the stock was written after this purchase read it, or by a "
                    "newer holder of the product lock (a lease ran out during a "
                    "purchase); nothing was sold",
                    fencing_token=token,
                )
            order = Order.objects.create(
                product=product,
                customer=customer,
                quantity=quantity,
                fencing_token=token,
            )
            timings.mark("written")
    except Product.DoesNotExist:
        return _not_found(product_id)  # deleted (the admin) while it was paid for
    except IntegrityError:
        return _already_ordered(customer, product_id)
    timings.mark("committed")
    return _created(order, product.stock)


@csrf_exempt
@transaction.non_atomic_requests
def buy_unsafe(request: HttpRequest, product_id: int) -> HttpResponse:
    """The same read-decrement-write with no lock: demonstrates the race."""
    checked = _prelude(request, product_id)
    if isinstance(checked, JsonResponse):
        return checked
    customer, quantity = checked
    product = _check_order(product_id, customer, quantity)
    if isinstance(product, JsonResponse):
        return product
    _work()
    left = product.stock - quantity
    try:
        with transaction.atomic():
            Product.objects.filter(pk=product.pk).update(stock=left)
            order = Order.objects.create(
                product=product, customer=customer, quantity=quantity
            )
    except IntegrityError:
        return _already_ordered(customer, product_id)
    return _created(order, left)


@transaction.non_atomic_requests
def product_detail(request: HttpRequest, product_id: int) -> HttpResponse:
    """``{"id", "name", "initial_stock", "stock"}``."""
    if request.method not in ("GET", "HEAD"):
        return _method_not_allowed("GET")
    product = _get_product(product_id)
    if product is None:
        return _not_found(product_id)
    return JsonResponse(product.as_json())


@transaction.non_atomic_requests
def product_audit(request: HttpRequest, product_id: int) -> HttpResponse:
    """The sale's audit; see ``shop.models.audit`` for the fields."""
    if request.method not in ("GET", "HEAD"):
        return _method_not_allowed("GET")
    product = _get_product(product_id)
    if product is None:
        return _not_found(product_id)
    return JsonResponse(audit(product))


@transaction.non_atomic_requests
def storefront(request: HttpRequest) -> HttpResponse:
    """A small page listing the products with their live stock."""
    products = list(Product.objects.all()[:20])
    context = {"products": products, "max_per_order": max_per_order()}
    return render(request, "shop/storefront.html", context)
