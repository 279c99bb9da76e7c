"""The load tests' verdicts fail a run that tested nothing, and read what a run
leaves behind.

Found by an adversarial review: Locust, ``make demo`` and ``make chaos`` each
passed a sale in which nothing was sold (every purchase refused, or none reached
the shop), the chaos run passed a run whose Locust stopped before its faults
were injected, a 503 without the view's JSON reason was not an error, and a
timings file torn by a killed worker crashed the demo's report. Each test feeds
a verdict the input a real run can leave behind (a sale written through the
ORM, a timings file as a killed worker leaves it, the summary Locust writes, a
real Locust or chaos run) and states what the verdict must then say.
"""

from __future__ import annotations

import contextlib
import json
import logging
from pathlib import Path
from typing import Any

import pytest

from harness.processes import children_of
from loadtests import holds
from loadtests.demo import Demo, parse_args
from loadtests.verdict import check_sale, server_errors
from shop.models import Product, audit

# -- holds.py: the timings files ------------------------------------------------------


def _record(start: float, held: float, *, product: int = 7) -> dict[str, Any]:
    """A sold hold as shop/timings.py writes it (see tests/test_holds_report.py)."""
    end = start + held
    return {
        "pid": 4242,
        "product": product,
        "status": 201,
        "error": None,
        "marks": {
            "start": start - 0.05,
            "checked": start - 0.02,
            "product_acquired": start + 0.001,
            "read": start + 0.002,
            "paid": start + 0.007,
            "written": start + 0.008,
            "committed": start + 0.0085,
            "product_released": end,
            "end": end + 0.0001,
        },
        "held": held,
        "release_elapsed": 0.001,
        "waited": 0.02,
        "attempts": 1,
        "token": 1,
    }


def test_a_timings_file_torn_by_a_killed_worker_is_still_read(tmp_path: Path) -> None:
    """A worker SIGKILLed while appending its record (or a file read while another
    worker is mid-append) leaves a last line without its end: the complete
    records are the figures; a torn line must not crash the demo's report."""
    lines = [json.dumps(_record(t, 0.010), separators=(",", ":")) for t in (0, 0.01)]
    torn = json.dumps(_record(0.02, 0.010), separators=(",", ":"))[:57]
    (tmp_path / "timings-4242.jsonl").write_text("\n".join(lines) + "\n" + torn)
    (tmp_path / "timings-4243.jsonl").write_text(
        json.dumps(_record(0.03, 0.010), separators=(",", ":")) + "\n"
    )

    records = holds.read_records(tmp_path, 7)

    assert len(records) == 3
    assert holds.summarize(records).sales == 3


# -- verdict.py: what the chaos run calls a pass --------------------------------------


def _untouched_sale(stock: int = 1000) -> dict[str, Any]:
    """The audit of a sale seeded and then never bought from (as chaos seeds it)."""
    product = Product.objects.create(
        name="Flash sale", initial_stock=stock, stock=stock
    )
    return audit(product)


def _chaos_verdict(sale: dict[str, Any], outcomes: dict[str, int]) -> bool:
    """The chaos run's own verdict (loadtests/chaos.py, Chaos.run): all checks ok."""
    checks = check_sale(
        sale,
        double_orders=0,
        double_clicks=0,
        server_errors=server_errors(outcomes),
        verify_exit_code=0,
    )
    return all(check.ok for check in checks)


@pytest.mark.django_db
def test_chaos_verdict_fails_a_run_in_which_no_purchase_reached_the_shop() -> None:
    """Every request a connection error (the app servers died or never answered
    the buyers): nothing was sold, so nothing was tested; the chaos run must
    not report "RESULT: OK, every invariant held under the faults"."""
    sale = _untouched_sale()

    assert not _chaos_verdict(sale, {"connection error": 4000})


@pytest.mark.django_db
def test_chaos_verdict_fails_a_run_in_which_the_lock_never_granted() -> None:
    """Every purchase refused 503 (the lock never had a quorum): zero orders."""
    sale = _untouched_sale()

    assert not _chaos_verdict(sale, {"503 quorum_unavailable": 3500})


def test_a_503_without_a_json_reason_is_a_server_error() -> None:
    """verdict.check_sale and chaos.py: a 503 *with a JSON reason* is expected,
    any other 5xx fails the run. The locustfile names a 503 whose body is not the
    view's JSON "503 non-json" (or "503 no-error-field")."""
    errors = server_errors(
        {"201 order": 10, "503 non-json": 2, "503 no-error-field": 1}
    )

    assert errors == {"503 non-json": 2, "503 no-error-field": 1}


# -- demo.py: the demo's verdict ------------------------------------------------------


def _locust_summary(mode: str, **figures: Any) -> dict[str, Any]:
    """A summary as loadtests/locustfile.py writes it and Demo.run_locust extends."""
    endpoint = "buy-unsafe" if mode == "unsafe" else "buy"
    summary = {
        "mode": mode,
        "endpoint": endpoint,
        "requests": 0,
        "failures": 0,
        "requests_per_s": 0.0,
        "p50_ms": 0,
        "p99_ms": 0,
        "outcomes": {},
        "orders": 0,
        "units_sold": 0,
        "stock_left": 200,
        "oversold": 0,
        "duplicate_customers": 0,
        "orders_per_s": 0.0,
        "problems": [],
        "ok": True,
        "locust_exit_code": 0,
        "verify_sale_exit_code": 0,
        "html": f"reports/{mode}.html",
    }
    summary.update(figures)
    return summary


def test_demo_fails_when_the_locked_run_sold_nothing(capsys: Any) -> None:
    """REDLOCK_NODES (which the demo reuses) pointing at nodes that are down: every
    locked purchase is a 503, which Locust counts as a success, and no unit is
    sold. "with Redlock none were [oversold], and every order was paid for with
    stock" is then true of an empty sale: the demo showed nothing."""
    unsafe = _locust_summary(
        "unsafe",
        requests=9000,
        outcomes={"201 order": 950, "409 sold_out": 8050},
        orders=950,
        units_sold=950,
        stock_left=0,
        oversold=750,
        verify_sale_exit_code=1,
    )
    locked = _locust_summary(
        "locked",
        requests=5200,
        outcomes={"503 quorum_unavailable": 5200},
    )
    demo = Demo(parse_args([]))

    assert demo.report(unsafe, locked) != 0, capsys.readouterr().out


# -- locustfile.py: Locust's own verdict on a live shop --------------------------------


@pytest.mark.django_db(transaction=True)
def test_locust_fails_a_locked_run_in_which_nothing_was_sold(
    live_server: Any,
    redlock_settings: dict[str, Any],
    settings: Any,
    tmp_path: Path,
    caplog: Any,
) -> None:
    """A real headless Locust run on buy/ while no lock node answers: every
    purchase is a 503 (an "expected refusal"), 0 orders. The locustfile calls
    itself the proof ("so ``locust --headless`` itself is the proof") and
    ``make demo`` trusts its exit code: it must not pass a sale that sold nothing.
    """
    import os
    import subprocess

    from harness.locust import locust_command, locust_env
    from harness.nodes import free_port

    for noisy in ("redlock_django.decorators", "django.request"):
        caplog.set_level(logging.CRITICAL, logger=noisy)
    dead = [f"redis://127.0.0.1:{free_port()}/0" for _ in range(3)]
    settings.REDLOCK = {**redlock_settings, "NODES": dead, "WAIT_TIMEOUT": 0.2}
    product = Product.objects.create(name="Flash sale", initial_stock=30, stock=30)
    summary_path = tmp_path / "locked.json"
    command = locust_command(
        hosts=[live_server.url],
        product_id=product.pk,
        scenario="locked",
        users=4,
        spawn_rate=4,
        run_time=3,
        summary_json=summary_path,
    )
    result = subprocess.run(
        command,
        cwd=Path(__file__).resolve().parent.parent,
        env=locust_env(os.environ),
        capture_output=True,
        text=True,
        timeout=60,
    )
    summary = json.loads(summary_path.read_text())
    assert summary["requests"] > 0 and summary["orders"] == 0, summary

    assert (result.returncode, summary["ok"]) != (0, True), result.stdout[-1500:]


# -- chaos.py: a run whose Locust stopped early ---------------------------------


def _children(pid: int) -> list[tuple[int, str]]:
    """Return ``(pid, command line)`` of the direct children of ``pid`` (Linux)."""
    found = []
    for child in children_of(pid):
        with contextlib.suppress(OSError):
            cmdline = Path(f"/proc/{child}/cmdline").read_bytes()
            found.append((child, cmdline.replace(b"\0", b" ").decode()))
    return found


def test_chaos_run_fails_when_locust_stops_before_every_fault_was_injected(
    tmp_path: Path,
) -> None:
    """Locust stopped (SIGTERM: a CI step timeout, an operator) 5 s into a 20 s
    chaos run: it still writes its summary and the sale is consistent, but the
    gunicorn worker was never killed (due at 12 s) and the killed node is
    restarted at once by the clean-up, under no load. The run did not do what
    it reports; "exit code 0 when every invariant holds" must not mean exit 0
    for a run whose Locust died and whose faults were not all injected.

    Locust can take seconds to stop on a loaded machine (it took 2.6 s on one
    with its two cores busy): the worker kill is due 7 s after the SIGTERM."""
    import os
    import signal
    import subprocess
    import sys
    import time

    from harness.locust import locust_env

    repo = Path(__file__).resolve().parent.parent
    summary_path = tmp_path / "chaos.json"
    env = locust_env(os.environ)
    env.pop("REDLOCK_NODES", None)
    env.pop("DATABASE_URL", None)
    env["DEBUG"] = "0"
    command = [
        sys.executable, "-m", "loadtests.chaos",
        "--duration", "20", "--ttl", "2", "--users", "10", "--stock", "100",
        "--servers", "2", "--workers", "2",
        "--workdir", str(tmp_path / "work"),
        "--reports-dir", str(tmp_path / "reports"),
        "--summary-json", str(summary_path),
    ]  # fmt: skip
    chaos = subprocess.Popen(
        command, cwd=repo, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT
    )
    try:
        deadline = time.monotonic() + 90
        locust = None
        while locust is None and time.monotonic() < deadline and chaos.poll() is None:
            locust = next(
                (pid for pid, cmd in _children(chaos.pid) if " locust " in cmd), None
            )
            time.sleep(0.05)
        assert locust is not None, "the chaos run started no Locust"
        time.sleep(5)  # Locust up and selling (node 3 killed at 4 s)
        os.kill(locust, signal.SIGTERM)
        output, _ = chaos.communicate(timeout=120)
    finally:
        if chaos.poll() is None:
            chaos.kill()
            chaos.wait()
    text = output.decode(errors="replace")[-5000:]
    report = json.loads(summary_path.read_text()) if summary_path.exists() else {}
    injected = [fault["action"] for fault in report.get("faults", [])]
    assert "kill-worker" not in injected, text

    assert chaos.returncode != 0, text
