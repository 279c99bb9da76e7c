"""The shop's stock write is fenced: a buyer whose lease ran out cannot write.

Two real gunicorn servers share one database and the five Redis nodes. Buyer A's
request is held up past its product lock's lease, for real: either its server
spends longer on the "payment" (SHOP_WORK_MS) than the lock's TTL, or its worker
process is frozen with SIGSTOP in the middle of the view. Meanwhile buyer B, on
the other server, takes the expired lock and sells. When A resumes it writes the
stock it computed from its stale read: the fenced write is refused (409
stale_lock), A gets no order, and the stock reflects B's sale only. Through the
unfenced write of ``buy-unsafe`` the same sequence overwrites B's sale.

The other order: A is frozen in its payment, B buys the last unit and is frozen
in its payment too, A resumes and writes, then B. The write is a compare-and-set
on the token read with the stock: A's lands, B's is refused (409 stale_lock, no
order). Through the write fenced by the token only (a test-only view) both land.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from harness.held import lock_key
from harness.nodes import NodeSet
from tests.test_shop import ROOT, ShopServers, request, shop_servers

__all__ = ["shop_servers"]  # the fixture, imported for the tests below


def _seed(servers: ShopServers, stock: int) -> int:
    seeded = servers.manage("seed_sale", "--stock", str(stock), "--name", "fenced")
    assert seeded.returncode == 0, seeded.stderr
    return int(seeded.stdout.strip().splitlines()[-1].removeprefix("product_id="))


def _wait_for(condition: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.005)


def _held_on(nodes: NodeSet, key: str) -> int:
    return sum(bool(node.client().exists(key)) for node in nodes)


def _in_background(
    url: str, body: dict[str, Any]
) -> tuple[threading.Thread, list[Any]]:
    reply: list[Any] = []
    thread = threading.Thread(target=lambda: reply.append(request("POST", url, body)))
    thread.start()
    return thread, reply


def _audit(servers: ShopServers, product_id: int) -> tuple[int, dict[str, Any]]:
    verified = servers.manage("verify_sale", "--product", str(product_id))
    return verified.returncode, json.loads(verified.stdout)


def _stale_sale(
    servers: ShopServers,
    nodes: NodeSet,
    slow: str,
    fast: str,
    path: str,
    pause: Callable[[], None] = lambda: None,
    resume: Callable[[], None] = lambda: None,
) -> tuple[tuple[int, dict[str, Any]], tuple[int, dict[str, Any]], int]:
    """A buys on ``slow`` and is held up; B buys on ``fast`` after A's lease ran out.

    Returns A's reply, B's reply and the product id.
    """
    product_id = _seed(servers, 10)
    key = lock_key(f"shop.product:{product_id}")

    def url(base: str) -> str:
        return f"{base}/shop/products/{product_id}/{path}/"

    thread, a_reply = _in_background(url(slow), {"customer": "a-slow", "quantity": 1})
    try:
        if path == "buy":
            # A holds the product lock: it is inside the view.
            _wait_for(lambda: _held_on(nodes, key) >= 3, 10, "A to take the lock")
            pause()
            # A's lease runs out on every node while A is held up.
            _wait_for(lambda: _held_on(nodes, key) == 0, 10, "A's lease to run out")
        else:
            time.sleep(0.5)  # no lock: give A the time to read the stock
            pause()
        b_reply = request("POST", url(fast), {"customer": "b-fast", "quantity": 1})
    finally:
        resume()
        thread.join(30)
    assert not thread.is_alive()
    return a_reply[0], b_reply, product_id


@pytest.mark.django_db(transaction=True)
def test_a_buyer_whose_lease_ran_out_during_payment_cannot_write_the_stock(
    shop_servers: ShopServers, nodes: NodeSet
) -> None:
    """A's payment (1.5 s) outlasts its lease (0.3 s): B sells, A's write is refused."""
    slow = shop_servers.start(workers=1, SHOP_WORK_MS="1500", REDLOCK_TTL="0.3")
    fast = shop_servers.start(workers=1, SHOP_WORK_MS="0")
    (a_status, a_body), (b_status, b_body), product_id = _stale_sale(
        shop_servers, nodes, slow, fast, "buy"
    )
    assert b_status == 201, b_body
    assert a_status == 409, a_body
    assert a_body["error"] == "stale_lock"
    # B's lock came after A's: a larger token, which the row now holds.
    assert b_body["order"]["fencing_token"] > a_body["fencing_token"]
    code, report = _audit(shop_servers, product_id)
    assert (code, report["orders"], report["stock"], report["oversold"]) == (0, 1, 9, 0)
    _, product = request("GET", f"{fast}/shop/products/{product_id}/")
    assert product["stock"] == 9


@pytest.mark.django_db(transaction=True)
def test_the_same_sequence_without_fencing_overwrites_the_other_sale(
    shop_servers: ShopServers, nodes: NodeSet
) -> None:
    """Negative control: through buy-unsafe's unfenced write, A's stale stock wins.

    Both orders exist but the stock says only one unit left the shelf: one unit
    is oversold (still on offer, though sold), and verify_sale exits 1.
    """
    slow = shop_servers.start(workers=1, SHOP_WORK_MS="1500")
    fast = shop_servers.start(workers=1, SHOP_WORK_MS="0")
    (a_status, a_body), (b_status, b_body), product_id = _stale_sale(
        shop_servers, nodes, slow, fast, "buy-unsafe"
    )
    assert (a_status, b_status) == (201, 201), (a_body, b_body)
    assert a_body["stock"] == b_body["stock"] == 9  # both computed 10 - 1
    code, report = _audit(shop_servers, product_id)
    assert (code, report["orders"], report["stock"], report["oversold"]) == (1, 2, 9, 1)


def _children(pid: int) -> list[int]:
    path = Path(f"/proc/{pid}/task/{pid}/children")
    return [int(child) for child in path.read_text().split()]


@pytest.mark.skipif(
    not Path(f"/proc/{os.getpid()}/task/{os.getpid()}/children").exists(),
    reason="needs Linux /proc to find the gunicorn worker to SIGSTOP",
)
@pytest.mark.django_db(transaction=True)
def test_a_buyer_frozen_mid_view_past_its_lease_cannot_write_the_stock(
    shop_servers: ShopServers, nodes: NodeSet
) -> None:
    """A's worker process is SIGSTOPped holding the lock (TTL 0.5 s) until B sold."""
    slow = shop_servers.start(workers=1, SHOP_WORK_MS="100", REDLOCK_TTL="0.5")
    fast = shop_servers.start(workers=1, SHOP_WORK_MS="0")
    (worker,) = _children(shop_servers.processes[0].pid)
    (a_status, a_body), (b_status, b_body), product_id = _stale_sale(
        shop_servers,
        nodes,
        slow,
        fast,
        "buy",
        pause=lambda: os.kill(worker, signal.SIGSTOP),
        resume=lambda: os.kill(worker, signal.SIGCONT),
    )
    assert b_status == 201, b_body
    assert (a_status, a_body["error"]) == (409, "stale_lock"), a_body
    code, report = _audit(shop_servers, product_id)
    assert (code, report["orders"], report["stock"], report["oversold"]) == (0, 1, 9, 0)


#: shop.settings serving tests/urls.py as well, for the test-only view.
SHOP_WITH_TEST_VIEWS = """\
from shop.settings import *  # noqa: F403

INSTALLED_APPS = [*INSTALLED_APPS, "tests"]  # noqa: F405
ROOT_URLCONF = "tests.urls"
"""


def _paying(pid: int) -> bool:
    """Whether the worker's main thread sleeps in time.sleep: the payment."""
    return "nanosleep" in Path(f"/proc/{pid}/wchan").read_text()


@pytest.mark.skipif(
    not Path(f"/proc/{os.getpid()}/task/{os.getpid()}/children").exists()
    or not Path(f"/proc/{os.getpid()}/wchan").exists(),
    reason="needs Linux /proc to find the gunicorn workers and see them sleep",
)
@pytest.mark.parametrize(
    "path",
    ["shop/products/{id}/buy/", "views/shop/{id}/buy-by-token-only/"],
    ids=["buy", "negative-control-token-only"],
)
@pytest.mark.django_db(transaction=True)
def test_a_buyer_frozen_in_payment_and_its_successor_sell_the_last_unit_once(
    shop_servers: ShopServers, nodes: NodeSet, path: str
) -> None:
    """A pays for the last unit (0.8 s, inside its 1.5 s lease) and is SIGSTOPped
    past its lease; B buys it on the other server and is SIGSTOPped in its
    payment; A resumes and writes, then B. A sells; B gets 409 stale_lock and no
    order: the stock was written after B read it. The negative control (the
    token-only write) sells the unit twice.
    """
    control = "by-token-only" in path
    env: dict[str, str] = {"SHOP_WORK_MS": "800"}
    if control:
        (shop_servers.tmp_path / "shop_with_test_views.py").write_text(
            SHOP_WITH_TEST_VIEWS
        )
        env.update(
            DJANGO_SETTINGS_MODULE="shop_with_test_views",
            PYTHONPATH=os.pathsep.join([str(ROOT), str(shop_servers.tmp_path)]),
        )
    slow = shop_servers.start(workers=1, REDLOCK_TTL="1.5", **env)
    fast = shop_servers.start(workers=1, **env)
    worker_a, worker_b = (_children(p.pid)[0] for p in shop_servers.processes)
    product_id = _seed(shop_servers, 1)
    key = lock_key(f"shop.product:{product_id}")
    url = path.format(id=product_id)
    a_thread, a_reply = _in_background(
        f"{slow}/{url}", {"customer": "a", "quantity": 1}
    )
    b_thread: threading.Thread | None = None
    try:
        _wait_for(
            lambda: _held_on(nodes, key) >= 3 and _paying(worker_a), 10, "A to pay"
        )
        os.kill(worker_a, signal.SIGSTOP)
        _wait_for(lambda: _held_on(nodes, key) == 0, 10, "A's lease to run out")
        b_thread, b_reply = _in_background(
            f"{fast}/{url}", {"customer": "b", "quantity": 1}
        )
        _wait_for(
            lambda: _held_on(nodes, key) >= 3 and _paying(worker_b), 10, "B to pay"
        )
        os.kill(worker_b, signal.SIGSTOP)
        os.kill(worker_a, signal.SIGCONT)
        a_thread.join(30)
        assert a_reply, "A did not answer"
    finally:
        os.kill(worker_a, signal.SIGCONT)
        os.kill(worker_b, signal.SIGCONT)
        a_thread.join(30)
        if b_thread is not None:
            b_thread.join(30)
    (a_status, a_body), (b_status, b_body) = a_reply[0], b_reply[0]
    assert a_status == 201, a_body
    code, report = _audit(shop_servers, product_id)
    if control:
        assert b_status == 201, b_body
        assert (code, report["orders"], report["oversold"]) == (1, 2, 1), report
        return
    assert (b_status, b_body.get("error")) == (409, "stale_lock"), b_body
    assert b_body["fencing_token"] > a_body["order"]["fencing_token"]
    assert (code, report["orders"], report["stock"], report["oversold"]) == (0, 1, 0, 0)
