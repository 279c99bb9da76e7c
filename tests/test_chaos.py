"""The flash sale under chaos (``loadtests/chaos.py``), short, and its checker.

One bounded run of the real tool (about 25 s: its own five redis-server nodes,
three gunicorn app servers plus a monitor, Locust for 16 s) while one node is
paused, another killed and restarted after the delayed-restart rule, and a
gunicorn worker killed: every invariant holds and the tool exits 0. The checker
itself is shown to fail on database states that violate each invariant, so a
passing run means something. ``make chaos`` is the long version (75 s of load).

Marked ``slow`` like ``tests/test_loadtest.py``: it runs in ``make test``, and
``-m "not slow"`` leaves it out.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

import pytest

from harness.locust import locust_env
from loadtests.verdict import Check, check_sale, restart_delay, server_errors
from shop.models import Order, Product, audit

REPO = Path(__file__).resolve().parent.parent


def _is_postgres(url: str) -> bool:
    return url.startswith(("postgres://", "postgresql://", "pgsql://"))


@pytest.fixture
def chaos_database(tmp_path: Path) -> Iterator[str]:
    """Yield the DATABASE_URL of an empty database for one chaos run."""
    base = os.environ.get("DATABASE_URL", "")
    if not _is_postgres(base):
        yield f"sqlite:///{tmp_path / 'chaos.sqlite3'}"
        return
    import psycopg

    name = f"redlock_chaos_{uuid.uuid4().hex[:12]}"
    with psycopg.connect(base, autocommit=True) as admin:
        admin.execute(f'CREATE DATABASE "{name}"')
    try:
        yield urlunsplit(urlsplit(base)._replace(path=f"/{name}"))
    finally:
        with psycopg.connect(base, autocommit=True) as admin:
            admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


@pytest.mark.slow
def test_flash_sale_keeps_every_invariant_under_paused_killed_nodes_and_a_killed_worker(
    tmp_path: Path, chaos_database: str
) -> None:
    """A short chaos run: all five faults happen, nothing oversold, exit code 0."""
    summary_path = tmp_path / "chaos.json"
    env = locust_env(os.environ)
    env.update(DATABASE_URL=chaos_database, DEBUG="0")
    env.pop("REDLOCK_NODES", None)
    command = [
        sys.executable, "-m", "loadtests.chaos",
        "--duration", "16",
        "--ttl", "2",
        "--users", "20",
        "--stock", "150",
        "--workdir", str(tmp_path / "work"),
        "--reports-dir", str(tmp_path / "reports"),
        "--summary-json", str(summary_path),
    ]  # fmt: skip
    result = subprocess.run(
        command, cwd=REPO, env=env, capture_output=True, text=True, timeout=120
    )
    output = (result.stdout + result.stderr)[-6000:]

    assert summary_path.exists(), output
    report = json.loads(summary_path.read_text())
    assert result.returncode == 0, output
    assert report["ok"], output
    assert all(check["ok"] for check in report["checks"])
    assert [fault["action"] for fault in report["faults"]] == [
        "pause",
        "kill",
        "restart",
        "resume",
        "kill-worker",
    ]
    restart = report["faults"][2]
    assert "rule (>= 3.02 s) kept" in restart["detail"], restart
    assert "replaced by pid" in report["faults"][4]["detail"]
    sale = report["audit"]
    assert sale["orders"] > 0
    assert sale["units_sold"] + sale["stock"] == 150
    assert report["double_clicks"] > 0
    assert report["outcomes"].get("201 order", 0) > 0
    assert "RESULT: OK" in result.stdout


def _sale(initial: int, stock: int, customers: int) -> Product:
    product = Product.objects.create(name="chaos", initial_stock=initial, stock=stock)
    Order.objects.bulk_create(
        Order(product=product, customer=f"c{i}", quantity=1) for i in range(customers)
    )
    return product


def _failed(checks: list[Check]) -> set[str]:
    return {check.name for check in checks if not check.ok}


@pytest.mark.django_db
def test_checker_passes_a_correct_sale_and_flags_an_oversell() -> None:
    """12 orders for 10 units, stock written down to 0: sold > stock, oversold."""
    assert _failed(check_sale(audit(_sale(10, 10 - 7, 7)))) == set()

    oversold = audit(_sale(10, 0, 12))

    assert _failed(check_sale(oversold)) == {
        "sold <= stock",
        "initial - remaining == units sold",
        "audit: nothing oversold",
    }


@pytest.mark.django_db
def test_checker_flags_a_lost_update_before_the_sale_runs_out() -> None:
    """6 orders but the stock went down by 4 only: two buyers wrote one decrement."""
    lost = audit(_sale(10, 6, 6))

    assert _failed(check_sale(lost)) == {
        "initial - remaining == units sold",
        "audit: nothing oversold",
    }


@pytest.mark.django_db
def test_checker_flags_a_negative_stock() -> None:
    """Stock below zero is a violation even when the arithmetic adds up."""
    negative = audit(_sale(10, -2, 12))

    assert "remaining stock >= 0" in _failed(check_sale(negative))


def test_checker_flags_duplicates_double_orders_server_errors_and_verify_sale() -> None:
    """Outside the stock: a customer twice, a double click sold twice, a 500."""
    correct = {
        "initial_stock": 10,
        "stock": 0,
        "units_sold": 10,
        "orders": 10,
        "oversold": 0,
        "duplicate_customers": 0,
    }
    assert _failed(check_sale(correct, server_errors={})) == set()

    failed = _failed(
        check_sale(
            {**correct, "duplicate_customers": 1},
            double_orders=1,
            double_clicks=40,
            server_errors=server_errors({"500 unexpected": 2, "503 unavailable": 9}),
            verify_exit_code=1,
        )
    )

    assert failed == {
        "no customer with two orders",
        "no double click made two orders",
        "no server errors (5xx but 503)",
        "manage.py verify_sale",
    }


def test_server_errors_keep_the_answers_a_sale_expects() -> None:
    """201, 409, 423 and 503 are expected; other statuses are server errors."""
    outcomes = {
        "201 order": 5,
        "409 sold_out": 3,
        "423 locked": 2,
        "503 unavailable": 4,
        "connection error": 1,
        "500 unexpected": 1,
        "502 unexpected": 2,
    }

    assert server_errors(outcomes) == {"500 unexpected": 1, "502 unexpected": 2}


def test_killed_node_stays_down_for_the_ttl_plus_drift_and_a_margin() -> None:
    """The delayed-restart rule outlasts every lock the node could have granted."""
    assert restart_delay(5.0) == pytest.approx(5.0 + 0.05 + 1.0)
    assert restart_delay(2.0, drift_factor=0.1) == pytest.approx(2.0 + 0.2 + 1.0)
