"""The verdict of a chaos run: the sale's invariants, the restart rule, the report.

Kept apart from the run itself (``loadtests/chaos.py``) so the checker can be
tested on database states alone (``tests/test_chaos.py``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

# Answers of the buy view that a sale under faults expects: not failures.
EXPECTED_STATUSES = ("201", "409", "423", "503")
# Extra time the killed node stays down beyond TTL + drift: process scheduling
# on a loaded 2-core machine, and the time a grant's reply takes to arrive.
RESTART_MARGIN = 1.0
DRIFT_FACTOR = 0.01  # the library's default REDLOCK["DRIFT_FACTOR"]


def restart_delay(ttl: float, drift_factor: float = DRIFT_FACTOR) -> float:
    """Return how long a killed node must stay down before it may come back empty.

    A lock key it held expires at most ``ttl`` after it was set, and clocks may
    drift by ``ttl * drift_factor``: after that no lock it granted can be alive.
    """
    return ttl + ttl * drift_factor + RESTART_MARGIN


# -- the checker ------------------------------------------------------------------


@dataclass(frozen=True)
class Check:
    """One invariant, whether it held, and the figures that show it."""

    name: str
    ok: bool
    detail: str


def check_sale(
    audit: dict[str, Any],
    *,
    double_orders: int = 0,
    double_clicks: int = 0,
    server_errors: dict[str, int] | None = None,
    verify_exit_code: int | None = None,
) -> list[Check]:
    """Return the invariants of a finished sale, each held or violated.

    ``audit`` is ``shop.models.audit`` of the product (what ``verify_sale``
    prints); ``double_orders`` / ``double_clicks`` come from Locust;
    ``server_errors`` counts unexpected answers (5xx other than a 503 with a JSON
    reason) by kind.
    """
    initial = int(audit["initial_stock"])
    stock = int(audit["stock"])
    sold = int(audit["units_sold"])
    orders = int(audit["orders"])
    duplicates = int(audit["duplicate_customers"])
    oversold = int(audit["oversold"])
    checks = [
        # An empty sale keeps every invariant below: it tested nothing (every
        # request refused, or none reached the shop).
        Check("the sale sold something", orders > 0, f"{orders} orders"),
        Check("sold <= stock", sold <= initial, f"{sold} sold of {initial}"),
        Check("remaining stock >= 0", stock >= 0, f"{stock} left"),
        Check(
            "initial - remaining == units sold",
            initial - stock == sold,
            f"{initial} - {stock} = {initial - stock}, units sold {sold}",
        ),
        Check(
            "units sold == orders (1 unit each)",
            sold == orders,
            f"{sold} units, {orders} orders",
        ),
        Check(
            "no customer with two orders",
            duplicates == 0,
            f"{duplicates} duplicate customers",
        ),
        Check("audit: nothing oversold", oversold == 0, f"oversold {oversold}"),
        Check(
            "no double click made two orders",
            double_orders == 0,
            f"{double_orders} of {double_clicks} double clicks",
        ),
    ]
    if verify_exit_code is not None:
        checks.append(
            Check(
                "manage.py verify_sale",
                verify_exit_code == 0,
                f"exit code {verify_exit_code}",
            )
        )
    if server_errors is not None:
        total = sum(server_errors.values())
        detail = ", ".join(f"{k}: {v}" for k, v in sorted(server_errors.items()))
        checks.append(
            Check("no server errors (5xx but 503)", total == 0, detail or "none")
        )
    return checks


#: Outcome kinds (``loadtests/locustfile.py``) of an answer whose body is not the
#: view's JSON: unexpected whatever its status.
NOT_THE_VIEWS_ANSWER = ("non-json", "no-error-field")
#: A run shorter than this share of ``--duration`` ended early (Locust stopped).
RUN_SHARE = 0.9


def server_errors(outcomes: dict[str, int]) -> dict[str, int]:
    """Return the outcomes that are HTTP errors a sale does not expect: any status
    but 201/409/423/503, and any answer without the view's JSON reason."""
    return {
        kind: count
        for kind, count in outcomes.items()
        if kind[:3].isdigit()
        and (kind[:3] not in EXPECTED_STATUSES or kind.endswith(NOT_THE_VIEWS_ANSWER))
    }


def check_run(
    *,
    duration: float,
    ran: float,
    scheduled: int,
    under_load: int,
    rule_broken: bool,
    on_purpose: bool,
) -> list[Check]:
    """Return whether the run did what its report says: Locust ran for about its
    ``duration`` (it ``ran`` that long), every one of the ``scheduled`` faults was
    injected while it ran (``under_load`` were), and no node came back before the
    delayed-restart rule allowed (unless broken ``on_purpose``)."""
    checks = [
        Check(
            "Locust ran its whole duration",
            ran >= RUN_SHARE * duration,
            f"{ran:.1f} s of {duration:g} s",
        ),
        Check(
            "every fault injected under load",
            under_load == scheduled,
            f"{under_load} of {scheduled}",
        ),
    ]
    if not on_purpose:
        checks.append(
            Check(
                "delayed-restart rule kept",
                not rule_broken,
                "broken: a killed node came back early" if rule_broken else "kept",
            )
        )
    return checks


@dataclass
class Fault:
    """One fault-log line: monotonic seconds since Locust started, and what."""

    at: float
    action: str
    detail: str
    orders: int | None = None  # orders in the database just before it

    def line(self) -> str:
        orders = "" if self.orders is None else f"  [orders so far: {self.orders}]"
        return f"+{self.at:6.2f} s  {self.action:<14} {self.detail}{orders}"


def format_report(report: dict[str, Any]) -> str:
    """Return the human summary of a chaos run."""
    audit = report["audit"]
    outcomes = report["outcomes"]
    lines = [
        "=" * 78,
        f"Flash sale under chaos: POST "
        f"{'buy-unsafe/ (no lock)' if report['mode'] == 'unsafe' else 'buy/ (Redlock)'}"
        f", {report['users']} users, {report['servers']} app servers x "
        f"{report['workers']} workers, {report['redis_nodes']} Redis nodes, "
        f"TTL {report['ttl_s']:g} s",
        f"  time: setup {report['setup_s']} s, Locust {report['run_s']} s, "
        f"total {report['total_s']} s (checks included)",
        f"  requests {report['requests']} ({report['requests_per_s']}/s), "
        f"Locust failures {report['failures']}, p50 {report['p50_ms']} ms, "
        f"p99 {report['p99_ms']} ms",
        "  answers: " + ", ".join(f"{k}: {v}" for k, v in sorted(outcomes.items())),
        f"  sale: {audit['initial_stock']} units, {audit['units_sold']} sold in "
        f"{audit['orders']} orders, {audit['stock']} left, oversold "
        f"{audit['oversold']}, duplicate customers {audit['duplicate_customers']}, "
        f"double clicks {report['double_clicks']}",
        "  sold out: "
        + (
            f"at +{report['sold_out_at_s']} s (first audit sample at stock 0)"
            if report.get("sold_out_at_s") is not None
            else "no (more --users or --duration, or less --stock, to sell out)"
        ),
        "  app server logs: "
        + ", ".join(f"{k} {v}" for k, v in report.get("app_log", {}).items()),
        "  faults (seconds since Locust started, monotonic):",
    ]
    lines += [f"    {Fault(**fault).line()}" for fault in report["faults"]]
    if report.get("phases"):
        lines.append("  orders between faults (from the audit, sampled each second):")
        lines += [
            f"    {p['from_s']:6.1f}-{p['to_s']:6.1f} s after {p['after']:<12} "
            f"{p['orders']:>5} orders, {p['orders_per_s']:6.1f}/s"
            for p in report["phases"]
        ]
        lines.append("  probe purchases (one a second, by phase; refusal reasons):")
        for p in report["phases"]:
            answers = "; ".join(f"{k} x{v}" for k, v in p["probes"].items())
            lines.append(f"    after {p['after']:<12} {answers or '(none)'}")
    lines.append("  invariants:")
    for check in report["checks"]:
        mark = "ok  " if check["ok"] else "FAIL"
        lines.append(f"    {mark} {check['name']}: {check['detail']}")
    if report["restart_immediately"]:
        stale = outcomes.get("409 stale_lock", 0)
        lines.append(
            "  note: the delayed-restart rule was broken on purpose "
            f"(--restart-immediately); {stale} purchases were refused as "
            "409 stale_lock: a fenced write lost to a newer token or to a write "
            "made after its read"
        )
    if report["ok"]:
        lines.append("  RESULT: OK, every invariant held under the faults")
    else:
        failed = [c["name"] for c in report["checks"] if not c["ok"]]
        lines.append(f"  RESULT: VIOLATED: {'; '.join(failed)}")
    lines.append("=" * 78)
    return "\n".join(lines)
