"""Locust scenarios for the flash-sale shop: the proof that the lock never oversells.

Scenarios (``--scenario``, env ``SHOP_SCENARIO``; comma-separated to combine):

- ``locked`` (default): many customers, each a fresh one, buy one unit of the
  product on ``POST /shop/products/<id>/buy/`` (the Redlock-protected view);
- ``unsafe``: the same load on ``buy-unsafe/``, the view without a lock, kept to
  show the race; it cannot be combined with the others (its oversell would be
  blamed on them);
- ``double-click``: each customer sends two POSTs at once, to two app servers,
  as a double click through a load balancer would; both succeeding is a failure;
- ``browse-and-buy``: customers look at the storefront and the stock, and now
  and then buy.

The scenarios are user classes (``LockedBuyer``, ``UnsafeBuyer``,
``DoubleClicker``, ``BrowseAndBuy``); naming classes on the command line, as
Locust allows, overrides ``--scenario``.

Users are spread over several app servers, round-robin as a load balancer would:
``--app-hosts http://127.0.0.1:8001,http://127.0.0.1:8002`` (env
``SHOP_APP_HOSTS``); without it every user targets ``--host``. ``--product-id``
(env ``SHOP_PRODUCT_ID``) names the product on sale.

409 (sold out, already ordered, stale lock), 423 (lock busy) and 503 (too few
lock nodes) are answers a flash sale expects: they count as successes, and each
is counted apart. Any other status (5xx above all) and connection errors are
failures.

When the run ends the locustfile reads the sale's audit
(``GET /shop/products/<id>/audit/``) from the first app server, prints it with
the orders per second and the p50 / p99 latencies, and sets the exit code:

- on the locked endpoint, 1 when anything was oversold, when a customer has two
  orders, or when ``units_sold + stock != initial_stock``: so ``locust
  --headless`` itself is the proof;
- on ``unsafe`` (``--expect-oversell auto``, the default, means "yes" for it),
  the oversell is the demonstration and is reported without failing; the run
  fails when nothing was oversold, since then the comparison shows nothing
  (``--expect-oversell no`` makes an oversell fail the run as on the locked
  endpoint).

``--summary-json PATH`` writes the result as one line of JSON (``make demo``
reads it). ``--stop-after-sold-out SECONDS`` ends the run that long after the
first "sold out" answer, instead of waiting for ``--run-time``.

Example, against three app servers::

    locust -f loadtests/locustfile.py --headless -u 40 -r 20 -t 15s \\
        --app-hosts http://127.0.0.1:8001,http://127.0.0.1:8002,http://127.0.0.1:8003 \\
        --product-id 1 --scenario locked --html reports/locked.html
"""

from __future__ import annotations

import itertools
import json
import time
import urllib.error
import urllib.request
import uuid
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import gevent
from locust import FastHttpUser, between, constant, events, task
from locust.env import Environment
from locust.runners import WorkerRunner

# Answers a flash sale expects besides 201: the sale ends, a customer clicks
# twice, the lock is busy or its nodes are down. They are not failures.
EXPECTED_REFUSALS = {409, 423, 503}

SCENARIO_CLASSES = {
    "locked": "LockedBuyer",
    "unsafe": "UnsafeBuyer",
    "double-click": "DoubleClicker",
    "browse-and-buy": "BrowseAndBuy",
}


@dataclass
class RunState:
    """What this Locust process saw during one run (reset at each test start)."""

    outcomes: Counter[str] = field(default_factory=Counter)
    started_at: float = 0.0
    first_order_at: float | None = None
    last_order_at: float | None = None
    sold_out_at: float | None = None
    double_clicks: int = 0
    double_orders: int = 0
    finished: bool = False
    stopper: Any = None


RUN = RunState()
_host_cycle: itertools.cycle[str] | None = None


@events.init_command_line_parser.add_listener
def _add_arguments(parser: Any) -> None:
    group = parser.add_argument_group("flash-sale shop")
    group.add_argument(
        "--app-hosts",
        env_var="SHOP_APP_HOSTS",
        default="",
        help="Comma-separated base URLs of the app servers; users are spread "
        "over them round-robin. Default: --host.",
    )
    group.add_argument(
        "--product-id",
        env_var="SHOP_PRODUCT_ID",
        type=int,
        default=1,
        help="The product on sale (what `manage.py seed_sale` printed).",
    )
    group.add_argument(
        "--scenario",
        env_var="SHOP_SCENARIO",
        default="locked",
        help="locked, unsafe, double-click, browse-and-buy, or a comma-separated "
        "mix of the locked ones.",
    )
    group.add_argument(
        "--quantity",
        env_var="SHOP_QUANTITY",
        type=int,
        default=1,
        help="Units per order.",
    )
    group.add_argument(
        "--expect-oversell",
        choices=["auto", "yes", "no"],
        default="auto",
        help="yes: an oversell is the expected demonstration (fail when there is "
        "none); no: an oversell fails the run; auto: yes for `unsafe` only.",
    )
    group.add_argument(
        "--summary-json",
        default="",
        help="Write the run's result to this file as one line of JSON.",
    )
    group.add_argument(
        "--stop-after-sold-out",
        type=float,
        default=-1.0,
        help="Stop the run this many seconds after the first sold-out answer "
        "(default: run until --run-time).",
    )


def _app_hosts(environment: Environment) -> list[str]:
    options = environment.parsed_options
    raw = getattr(options, "app_hosts", "") if options else ""
    hosts = [h.strip().rstrip("/") for h in raw.split(",") if h.strip()]
    if not hosts and environment.host:
        hosts = [environment.host.rstrip("/")]
    return hosts


def _scenarios(environment: Environment) -> list[str]:
    options = environment.parsed_options
    raw = getattr(options, "scenario", "locked") if options else "locked"
    names = [s.strip() for s in raw.split(",") if s.strip()]
    unknown = [s for s in names if s not in SCENARIO_CLASSES]
    if unknown or not names:
        raise SystemExit(
            f"unknown --scenario {raw!r}: choose from {', '.join(SCENARIO_CLASSES)}"
        )
    if "unsafe" in names and len(names) > 1:
        raise SystemExit("--scenario unsafe cannot be combined with other scenarios")
    return names


@events.init.add_listener
def _on_init(environment: Environment, **_: Any) -> None:
    global _host_cycle
    options = environment.parsed_options
    if options is None:  # used as a library: keep the classes as given
        return
    hosts = _app_hosts(environment)
    if not hosts:
        raise SystemExit("give the app servers with --app-hosts (or --host)")
    _host_cycle = itertools.cycle(hosts)
    if not options.user_classes:  # no classes named on the command line
        wanted = {SCENARIO_CLASSES[name] for name in _scenarios(environment)}
        environment.user_classes[:] = [
            cls for cls in environment.user_classes if cls.__name__ in wanted
        ]


def _next_host() -> str:
    if _host_cycle is None:
        raise RuntimeError("the locustfile was not initialised (no app hosts)")
    return next(_host_cycle)


def _new_customer() -> str:
    return f"c-{uuid.uuid4().hex[:20]}"


class ShopUser(FastHttpUser):
    """A customer, talking to one app server as a load balancer would pick it."""

    abstract = True
    host = "http://127.0.0.1"  # replaced per user by an app host
    endpoint = "buy"

    def __init__(self, environment: Environment) -> None:
        super().__init__(environment)
        self.base = _next_host()
        options = environment.parsed_options
        self.product_id = options.product_id if options else 1
        self.quantity = options.quantity if options else 1
        self.stop_after = options.stop_after_sold_out if options else -1.0

    def product_url(self, suffix: str = "", base: str | None = None) -> str:
        return f"{base or self.base}/shop/products/{self.product_id}/{suffix}"

    def buy(self, customer: str, *, base: str | None = None) -> int:
        """POST one order; return the status (0 for a connection error)."""
        with self.client.post(
            self.product_url(f"{self.endpoint}/", base),
            json={"customer": customer, "quantity": self.quantity},
            headers={"Accept": "application/json"},
            name=f"POST {self.endpoint}",
            catch_response=True,
        ) as response:
            status = int(response.status_code or 0)
            if status == 201:
                response.success()
                RUN.outcomes["201 order"] += 1
                RUN.last_order_at = time.time()
                if RUN.first_order_at is None:
                    RUN.first_order_at = RUN.last_order_at
            elif status in EXPECTED_REFUSALS:
                response.success()
                reason = _error_name(response)
                RUN.outcomes[f"{status} {reason}"] += 1
                if reason == "sold_out":
                    self._sold_out()
            elif status == 0:
                response.failure(f"connection error: {response.error!r}")
                RUN.outcomes["connection error"] += 1
            else:
                response.failure(f"HTTP {status}: {(response.text or '')[:200]}")
                RUN.outcomes[f"{status} unexpected"] += 1
            return status

    def _sold_out(self) -> None:
        if RUN.sold_out_at is None:
            RUN.sold_out_at = time.time()
            runner = self.environment.runner
            if self.stop_after >= 0 and runner is not None and RUN.stopper is None:
                RUN.stopper = gevent.spawn_later(self.stop_after, runner.quit)


def _error_name(response: Any) -> str:
    try:
        body = json.loads(response.text or "")
    except ValueError:
        return "non-json"
    error = body.get("error") if isinstance(body, dict) else None
    return str(error) if error else "no-error-field"


class LockedBuyer(ShopUser):
    """Many customers, each new, buying one product on the locked endpoint."""

    wait_time = constant(0)
    endpoint = "buy"

    @task
    def buy_one(self) -> None:
        self.buy(_new_customer())


class UnsafeBuyer(LockedBuyer):
    """The same load against ``buy-unsafe/``: no lock, a read-modify-write race."""

    endpoint = "buy-unsafe"


class DoubleClicker(ShopUser):
    """A customer who clicks "buy" twice: two POSTs at once, to two app servers."""

    wait_time = between(0.05, 0.2)
    endpoint = "buy"

    @task
    def double_click(self) -> None:
        customer = _new_customer()
        other = _next_host()
        first = gevent.spawn(self.buy, customer)
        second = gevent.spawn(self.buy, customer, base=other)
        gevent.joinall([first, second])
        statuses = [first.value, second.value]
        RUN.double_clicks += 1
        if statuses.count(201) > 1:
            RUN.double_orders += 1
            # The two orders are already recorded as requests; add the verdict.
            self.environment.events.request.fire(
                request_type="CHECK",
                name="double click: one order",
                response_time=0,
                response_length=0,
                exception=AssertionError(f"{customer} got two orders"),
                context={},
            )


class BrowseAndBuy(ShopUser):
    """Customers browsing the storefront and the stock, buying now and then."""

    wait_time = between(0.1, 0.5)
    endpoint = "buy"

    @task(2)
    def storefront(self) -> None:
        self.client.get(f"{self.base}/shop/", name="GET storefront")

    @task(5)
    def stock(self) -> None:
        self.client.get(self.product_url(), name="GET product")

    @task(1)
    def buy_one(self) -> None:
        self.buy(_new_customer())


@events.test_start.add_listener
def _on_test_start(environment: Environment, **_: Any) -> None:
    global RUN
    RUN = RunState(started_at=time.time())


def fetch_audit(host: str, product_id: int, timeout: float = 10.0) -> dict[str, Any]:
    """Return the product's audit JSON from one app server."""
    url = f"{host}/shop/products/{product_id}/audit/"
    request = urllib.request.Request(url, headers={"Accept": "application/json"})
    with urllib.request.urlopen(request, timeout=timeout) as reply:
        data: dict[str, Any] = json.loads(reply.read())
    return data


def _settled_audit(host: str, product_id: int) -> dict[str, Any]:
    # Requests cut off when the run stopped may still be finishing on the
    # servers: read until two audits a moment apart agree.
    gevent.sleep(0.3)
    audit = fetch_audit(host, product_id)
    deadline = time.monotonic() + 5.0
    while time.monotonic() < deadline:
        gevent.sleep(0.3)
        again = fetch_audit(host, product_id)
        if again == audit:
            break
        audit = again
    return audit


def summarize(environment: Environment) -> dict[str, Any]:
    """Return the run's result: traffic, latencies, outcomes, audit and verdict."""
    options = environment.parsed_options
    hosts = _app_hosts(environment)
    if options is not None and options.user_classes:
        classes = sorted(options.user_classes)
    else:
        classes = sorted(cls.__name__ for cls in environment.user_classes)
    unsafe = "UnsafeBuyer" in classes
    expect = getattr(options, "expect_oversell", "auto") if options else "auto"
    expect_oversell = expect == "yes" or (expect == "auto" and unsafe)
    total = environment.stats.total
    end = total.last_request_timestamp or time.time()
    duration = max(end - (total.start_time or RUN.started_at or end), 1e-9)
    sale_end = RUN.last_order_at or end
    sale_seconds = max(sale_end - (total.start_time or RUN.started_at), 1e-9)
    product_id = options.product_id if options else 1

    summary: dict[str, Any] = {
        "scenario": ",".join(
            name for name, cls in SCENARIO_CLASSES.items() if cls in classes
        ),
        "endpoint": "buy-unsafe" if unsafe else "buy",
        "user_classes": classes,
        "product": product_id,
        "hosts": hosts,
        "users": getattr(options, "num_users", None),
        "duration_s": round(duration, 2),
        "requests": total.num_requests,
        "failures": total.num_failures,
        "requests_per_s": round(total.num_requests / duration, 1),
        "p50_ms": total.get_response_time_percentile(0.5),
        "p99_ms": total.get_response_time_percentile(0.99),
        "outcomes": dict(sorted(RUN.outcomes.items())),
        "double_clicks": RUN.double_clicks,
        "double_orders": RUN.double_orders,
        "expect_oversell": expect_oversell,
        # Seconds from the first 201 Locust saw to the last (None: under two).
        "order_span_s": (
            round(RUN.last_order_at - RUN.first_order_at, 4)
            if RUN.first_order_at is not None and RUN.last_order_at is not None
            else None
        ),
    }
    problems: list[str] = []
    try:
        audit = _settled_audit(hosts[0], product_id)
    except (OSError, ValueError, urllib.error.URLError) as exc:
        audit = None
        problems.append(f"could not read the audit from {hosts[0]}: {exc}")
    summary["audit"] = audit
    if audit is not None:
        orders = int(audit["orders"])
        summary.update(
            orders=orders,
            units_sold=audit["units_sold"],
            stock_left=audit["stock"],
            oversold=audit["oversold"],
            duplicate_customers=audit["duplicate_customers"],
            orders_per_s=round(orders / sale_seconds, 1) if orders else 0.0,
        )
        if audit["duplicate_customers"]:
            problems.append(f"{audit['duplicate_customers']} customers ordered twice")
        if expect_oversell:
            if not audit["oversold"]:
                problems.append(
                    "expected the unlocked endpoint to oversell, and nothing was "
                    "oversold: raise the users or SHOP_WORK_MS to show the race"
                )
        else:
            if not orders:
                # Every purchase refused (no quorum, a lock never granted) or
                # failed: the invariants below hold of an untouched sale.
                problems.append("nothing was sold: no purchase succeeded")
            if audit["oversold"]:
                problems.append(f"OVERSOLD {audit['oversold']} units")
            if audit["stock"] < 0:
                problems.append(f"negative stock {audit['stock']}")
            if audit["units_sold"] + audit["stock"] != audit["initial_stock"]:
                problems.append(
                    f"units sold ({audit['units_sold']}) + stock ({audit['stock']}) "
                    f"!= initial stock ({audit['initial_stock']})"
                )
    if RUN.double_orders:
        problems.append(f"{RUN.double_orders} double clicks made two orders")
    summary["problems"] = problems
    summary["ok"] = not problems
    return summary


def print_report(summary: dict[str, Any]) -> None:
    """Print the run's result for a human."""
    lines = [
        "",
        "=" * 72,
        f"Flash sale on product {summary['product']} — scenario "
        f"{summary['scenario']} (POST {summary['endpoint']}/), "
        f"{len(summary['hosts'])} app server(s)",
        f"  requests {summary['requests']} ({summary['requests_per_s']}/s), "
        f"failures {summary['failures']}, "
        f"p50 {summary['p50_ms']} ms, p99 {summary['p99_ms']} ms",
    ]
    if summary.get("audit") is not None:
        lines.append(
            f"  orders {summary['orders']} ({summary['orders_per_s']}/s while "
            f"selling), units sold {summary['units_sold']}, "
            f"stock left {summary['stock_left']}, oversold {summary['oversold']}, "
            f"duplicate customers {summary['duplicate_customers']}"
        )
        lines.append(f"  audit: {json.dumps(summary['audit'], sort_keys=True)}")
    if summary["outcomes"]:
        counts = ", ".join(f"{k}: {v}" for k, v in summary["outcomes"].items())
        lines.append(f"  answers: {counts}")
    if summary["double_clicks"]:
        lines.append(
            f"  double clicks {summary['double_clicks']}, "
            f"with two orders {summary['double_orders']}"
        )
    if summary["ok"] and summary["expect_oversell"]:
        lines.append(
            f"  RESULT: the unlocked endpoint oversold {summary['oversold']} units, "
            "as expected: this is the race the lock prevents"
        )
    elif summary["ok"]:
        lines.append("  RESULT: OK, nothing oversold, no customer ordered twice")
    else:
        lines.extend(f"  RESULT: FAILED: {problem}" for problem in summary["problems"])
    lines.append("=" * 72)
    print("\n".join(lines), flush=True)


def _finish(environment: Environment) -> None:
    if RUN.finished or isinstance(environment.runner, WorkerRunner):
        return
    RUN.finished = True
    if RUN.stopper is not None and RUN.stopper is not gevent.getcurrent():
        RUN.stopper.kill(block=False)
    summary = summarize(environment)
    print_report(summary)
    options = environment.parsed_options
    path = getattr(options, "summary_json", "") if options else ""
    if path:
        with open(path, "w", encoding="utf-8") as out:
            out.write(json.dumps(summary, sort_keys=True) + "\n")
    if not summary["ok"]:
        environment.process_exit_code = 1


@events.test_stop.add_listener
def _on_test_stop(environment: Environment, **_: Any) -> None:
    _finish(environment)


@events.quitting.add_listener
def _on_quitting(environment: Environment, **_: Any) -> None:
    # Ctrl-C: Locust fires "quitting" before it stops the users.
    _finish(environment)
