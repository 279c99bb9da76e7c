"""The shop's admin beside a purchase in progress.

A purchase reads the stock under the product lock, pays, then writes the stock
it computed (``fenced_update``). The admin's change form writes the stock under
the same lock, compared with the fencing token the form was shown with: an edit
that a sale overtook is refused with a message (it used to be written by plain
``save()``, and the purchase then wrote its stale stock over the restock), one
that nothing overtook is written with a fencing token of its own. A product the
admin deletes during a purchase makes that purchase a JSON 404 (it was a 500).
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import pytest
from django.contrib.admin.models import CHANGE, LogEntry
from django.contrib.auth.models import User
from django.db import connections
from django.test import Client

from harness.held import lock_key
from harness.nodes import NodeSet
from shop.models import Order, Product

pytestmark = pytest.mark.usefixtures("redlock_settings")

#: The purchase's payment: long enough for the admin to act during it.
PAYMENT = 1.5


@pytest.fixture
def admin_client() -> Client:
    client = Client()
    client.force_login(
        User.objects.create_superuser("root", "root@example.com", "not-a-secret")
    )
    return client


@pytest.fixture
def background() -> Iterator[Callable[..., Future[Any]]]:
    """``background(fn, *args)``: run ``fn`` on another thread (its own connection)."""
    pool = ThreadPoolExecutor(max_workers=2)

    def submit(fn: Callable[..., Any], *args: Any) -> Future[Any]:
        def run() -> Any:
            try:
                return fn(*args)
            finally:
                connections.close_all()

        return pool.submit(run)

    yield submit
    pool.shutdown(wait=True)


def _purchase(product_id: int) -> tuple[int, dict[str, Any]]:
    response = Client(raise_request_exception=False).post(
        f"/shop/products/{product_id}/buy/",
        {"customer": "alice", "quantity": 1},
        content_type="application/json",
    )
    return response.status_code, (
        response.json()
        if response["Content-Type"].startswith("application/json")
        else {"html": response.status_code}
    )


def _paying(
    background: Callable[..., Future[Any]], nodes: NodeSet, product: Product
) -> Future[Any]:
    """Start a purchase of one unit; return once it holds the product lock."""
    buying = background(_purchase, product.pk)
    key = lock_key(f"shop.product:{product.pk}")
    deadline = time.monotonic() + 5
    while sum(bool(node.client().exists(key)) for node in nodes) < 3:
        assert time.monotonic() < deadline, "the purchase never took the product lock"
        time.sleep(0.005)
    time.sleep(0.2)  # it has read the stock and pays
    return buying


def _change_form(admin_client: Client, product: Product) -> dict[str, Any]:
    """The change form's fields as the admin shows them (hidden ones included)."""
    page = admin_client.get(f"/admin/shop/product/{product.pk}/change/")
    assert page.status_code == 200
    seen = re.search(rb'name="seen_fence" value="(\d+)"', page.content)
    assert seen is not None, "the form carries the token it was shown with"
    return {
        "name": product.name,
        "initial_stock": product.initial_stock,
        "stock": product.stock,
        "seen_fence": seen.group(1).decode(),
        "_save": "Save",
    }


@pytest.mark.django_db(transaction=True)
def test_an_admin_edit_a_sale_overtook_is_refused_and_the_sale_stays(
    settings: Any,
    nodes: NodeSet,
    admin_client: Client,
    background: Callable[..., Future[Any]],
) -> None:
    """The form shows stock 10; a purchase of one unit is paying when the edit
    (stock 100) is saved. The save waits for the purchase's lock, finds the row
    written since the form was shown, and writes nothing: the sale stays (stock
    9), the admin says why, and no change is logged. The old admin's plain
    ``save()`` wrote 100, then the purchase wrote 9 over it: the restock lost."""
    settings.SHOP_WORK_SECONDS = PAYMENT
    product = Product.objects.create(name="Widget", initial_stock=10, stock=10)
    form = _change_form(admin_client, product)
    buying = _paying(background, nodes, product)
    saved = admin_client.post(
        f"/admin/shop/product/{product.pk}/change/",
        {**form, "initial_stock": 100, "stock": 100},
        follow=True,
    )
    assert buying.result(timeout=10)[0] == 201
    product.refresh_from_db()
    assert (product.stock, product.initial_stock) == (9, 10)
    assert Order.objects.filter(product=product).count() == 1
    assert b"Nothing was saved" in saved.content
    assert saved.redirect_chain[-1][0].endswith(f"/{product.pk}/change/")
    assert not LogEntry.objects.filter(action_flag=CHANGE).exists()


@pytest.mark.django_db(transaction=True)
def test_an_admin_edit_nothing_overtook_is_written_with_a_token_of_its_own(
    admin_client: Client,
) -> None:
    """With no sale since the form was shown the edit is written, fenced: the
    row's token moves past the one the form was shown with."""
    product = Product.objects.create(name="Widget", initial_stock=10, stock=10)
    form = _change_form(admin_client, product)
    saved = admin_client.post(
        f"/admin/shop/product/{product.pk}/change/",
        {**form, "initial_stock": 50, "stock": 50},
    )
    assert saved.status_code == 302
    product.refresh_from_db()
    assert (product.stock, product.initial_stock) == (50, 50)
    assert product.fence > int(form["seen_fence"])
    assert LogEntry.objects.filter(action_flag=CHANGE).count() == 1


@pytest.mark.django_db(transaction=True)
def test_an_admin_edit_without_the_token_it_was_shown_with_is_a_form_error(
    admin_client: Client,
) -> None:
    """A POST that does not say which version of the row it edits is refused by
    the form (nothing is written), not written blind."""
    product = Product.objects.create(name="Widget", initial_stock=10, stock=10)
    form = _change_form(admin_client, product)
    del form["seen_fence"]
    saved = admin_client.post(
        f"/admin/shop/product/{product.pk}/change/", {**form, "stock": 100}
    )
    assert saved.status_code == 200
    assert saved.context["adminform"].form.errors.get("seen_fence")
    product.refresh_from_db()
    assert product.stock == 10


@pytest.mark.django_db(transaction=True)
def test_a_product_the_admin_deletes_during_a_purchase_is_a_json_404(
    settings: Any,
    nodes: NodeSet,
    admin_client: Client,
    background: Callable[..., Future[Any]],
) -> None:
    """The admin deletes the product while a purchase pays for it: the purchase's
    fenced write finds no row and answers the API's JSON 404, not a 500."""
    settings.SHOP_WORK_SECONDS = PAYMENT
    product = Product.objects.create(name="Widget", initial_stock=10, stock=10)
    buying = _paying(background, nodes, product)
    deleted = admin_client.post(
        f"/admin/shop/product/{product.pk}/delete/", {"post": "yes"}
    )
    assert deleted.status_code == 302
    status, body = buying.result(timeout=10)
    assert (status, body.get("error")) == (404, "not_found"), (status, body)
    assert not Product.objects.filter(pk=product.pk).exists()
