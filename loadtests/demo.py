"""``make demo``: a flash sale across several app servers, without and with the lock.

Starts five local Redis nodes (unless ``REDLOCK_NODES`` is set), migrates a fresh
SQLite database under ``.demo/`` (or the one ``DATABASE_URL`` names), seeds a
product with 200 units, starts three app servers (gunicorn, two workers each) on
their own ports, then runs Locust headless twice with the same load: first on
``POST /shop/products/<id>/buy-unsafe/`` (no lock), then, after re-seeding, on
``POST /shop/products/<id>/buy/`` (Redlock on the product and the customer). It
prints both runs side by side and writes Locust's HTML reports under
``reports/``.

Exit code 0 when the unlocked run oversold and the locked one did not (the claim
of the demo), 1 otherwise, 130 when interrupted. Everything it started (Redis,
gunicorn and their workers, Locust) is stopped on the way out, Ctrl-C included.

Usage: python -m loadtests.demo [--users 40] [--spawn-rate 20] [--run-time 15]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from harness.locust import locust_command, locust_env
from harness.nodes import NodeSet
from harness.processes import HOST, REPO, Children, log_tail, pick_ports
from loadtests import holds


def run_manage(args: list[str], env: dict[str, str]) -> str:
    """Run ``manage.py`` with ``args``; return its output, exit on failure."""
    result = subprocess.run(
        [sys.executable, str(REPO / "manage.py"), *args],
        cwd=REPO,
        env=env,
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=120,
    )
    if result.returncode != 0:
        raise DemoError(
            f"manage.py {' '.join(args)} failed ({result.returncode}):\n"
            f"{result.stdout}{result.stderr}"
        )
    return result.stdout


def seed(env: dict[str, str], stock: int) -> int:
    output = run_manage(["seed_sale", "--stock", str(stock)], env)
    last = output.strip().splitlines()[-1] if output.strip() else ""
    if not last.startswith("product_id="):
        raise DemoError(f"seed_sale did not print product_id=<id>:\n{output}")
    return int(last.split("=", 1)[1])


def verify(env: dict[str, str], product_id: int) -> int:
    """Return the exit code of ``manage.py verify_sale`` (1: oversold)."""
    command = [sys.executable, str(REPO / "manage.py"), "verify_sale"]
    return subprocess.run(
        [*command, "--product", str(product_id)],
        cwd=REPO,
        env=env,
        stdin=subprocess.DEVNULL,
        capture_output=True,
        timeout=120,
    ).returncode


def get_json(url: str, timeout: float = 2.0) -> Any:
    request = urllib.request.Request(url, headers={"Accept": "application/json"})
    with urllib.request.urlopen(request, timeout=timeout) as reply:
        return json.loads(reply.read())


class DemoError(RuntimeError):
    """A step of the demo failed; the message says which and why."""


class Progress:
    """One status line, rewritten in place on a terminal."""

    def __init__(self) -> None:
        self.tty = sys.stdout.isatty()
        self.last_print = 0.0

    def update(self, text: str) -> None:
        if self.tty:
            sys.stdout.write("\r\033[K" + text)
            sys.stdout.flush()
        elif time.monotonic() - self.last_print >= 5.0:
            print(text, flush=True)
            self.last_print = time.monotonic()

    def done(self, text: str) -> None:
        if self.tty:
            sys.stdout.write("\r\033[K")
        print(text, flush=True)


Server = tuple[str, subprocess.Popen[bytes], Path]  # (http://host:port, master, log)


@dataclass
class Stage:
    """What a run has set up: its environment, processes, nodes and app servers.

    The steps below (:func:`prepare`, :func:`start_redis`, :func:`start_servers`)
    fill it in; ``make demo`` and ``make chaos`` both run them, then drive their
    own Locust runs against ``hosts``. :meth:`close` stops everything started.
    """

    workdir: Path
    reports: Path
    env: dict[str, str] = field(default_factory=dict)
    children: Children = field(default_factory=Children)
    nodes: Any = None  # a harness.nodes.NodeSet when the run started its own
    servers: list[Server] = field(default_factory=list)

    @property
    def hosts(self) -> list[str]:
        return [host for host, _, _ in self.servers]

    def close(self) -> None:
        self.children.stop_all()
        if self.nodes is not None:
            self.nodes.stop_all()
            self.nodes = None


def prepare(stage: Stage, work_ms: int | None) -> None:
    """Empty the work directory and build the app servers' environment."""
    if stage.workdir.exists():
        shutil.rmtree(stage.workdir)
    stage.workdir.mkdir(parents=True)
    stage.reports.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ)
    env.update(
        DJANGO_SETTINGS_MODULE="shop.settings",
        PYTHONUNBUFFERED="1",
        DEBUG=env.get("DEBUG", "0"),
    )
    if work_ms is not None:
        env["SHOP_WORK_MS"] = str(work_ms)
    if not env.get("DATABASE_URL"):
        env["DATABASE_URL"] = f"sqlite:///{stage.workdir / 'shop.sqlite3'}"
    stage.env = env


def start_redis(stage: Stage, count: int, *, reuse_env: bool = True) -> str:
    """Start ``count`` redis-server nodes, or use ``REDLOCK_NODES`` if allowed."""
    if reuse_env and os.environ.get("REDLOCK_NODES"):
        stage.env["REDLOCK_NODES"] = os.environ["REDLOCK_NODES"]
        count = len([u for u in stage.env["REDLOCK_NODES"].split(",") if u])
        return f"using REDLOCK_NODES ({count} nodes)"
    stage.nodes = NodeSet.create(count, stage.workdir / "redis")
    stage.nodes.start_all()
    stage.env["REDLOCK_NODES"] = ",".join(stage.nodes.urls)
    ports = ", ".join(str(p) for p in stage.nodes.ports)
    return f"{len(stage.nodes)} redis-server nodes on ports {ports}"


def start_servers(stage: Stage, count: int, workers: int, product_id: int) -> None:
    """Start ``count`` gunicorn app servers and wait until each serves the product."""
    started: list[Server] = []
    for port in pick_ports(count):
        log = stage.workdir / f"app-{port}.log"
        command = [
            sys.executable, "-m", "gunicorn", "shop.wsgi:application",
            "--bind", f"{HOST}:{port}",
            "--workers", str(workers),
            "--worker-class", "sync",
            "--backlog", "2048",
            "--timeout", "30",
            "--graceful-timeout", "3",
            "--log-level", "warning",
            "--error-logfile", "-",
        ]  # fmt: skip
        process = stage.children.start(f"app:{port}", command, stage.env, log)
        started.append((f"http://{HOST}:{port}", process, log))
    stage.servers += started
    deadline = time.monotonic() + 45.0
    for host, process, log in started:
        url = f"{host}/shop/products/{product_id}/"
        while True:
            if process.poll() is not None:
                raise DemoError(
                    f"the app server {host} exited ({process.returncode}); "
                    f"{log}:\n{log_tail(log)}"
                )
            try:
                get_json(url, timeout=1.0)
                break
            except (OSError, ValueError):
                pass
            if time.monotonic() > deadline:
                raise DemoError(f"{url} did not answer; {log}:\n{log_tail(log)}")
            time.sleep(0.2)


def rel(path: Path) -> str:
    """Return ``path`` relative to the current directory when it is below it."""
    with contextlib.suppress(ValueError):
        return str(path.relative_to(Path.cwd()))
    return str(path)


class Demo:
    """The two Locust runs, unlocked then locked, on one :class:`Stage`."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.stage = Stage(REPO / ".demo", (REPO / args.reports_dir).resolve())
        self.timings_dir = self.stage.workdir / "timings"

    # -- a Locust run ----------------------------------------------------------

    def run_locust(self, mode: str, product_id: int) -> dict[str, Any]:
        args = self.args
        html = self.stage.reports / f"{mode}.html"
        summary_path = self.stage.reports / f"{mode}.json"
        summary_path.unlink(missing_ok=True)
        log = self.stage.workdir / f"locust-{mode}.log"
        command = locust_command(
            hosts=self.stage.hosts,
            product_id=product_id,
            scenario=mode,
            users=args.users,
            spawn_rate=args.spawn_rate,
            run_time=args.run_time,
            summary_json=summary_path,
            html=html,
            stop_after_sold_out=args.stop_after_sold_out,
        )
        env = locust_env(self.stage.env)
        process = self.stage.children.start(f"locust:{mode}", command, env, log)
        progress = Progress()
        started = time.monotonic()
        audit_url = f"{self.stage.hosts[0]}/shop/products/{product_id}/audit/"
        try:
            while process.poll() is None:
                elapsed = time.monotonic() - started
                try:
                    audit = get_json(audit_url, timeout=2.0)
                    state = (
                        f"orders {audit['orders']:>4}  stock {audit['stock']:>4}  "
                        f"oversold {audit['oversold']:>3}"
                    )
                except (OSError, ValueError, KeyError):
                    state = "(audit not available)"
                progress.update(
                    f"  {mode:<7} {elapsed:4.0f}/{args.run_time} s  "
                    f"{args.users} users  {state}"
                )
                with contextlib.suppress(subprocess.TimeoutExpired):
                    process.wait(1.0)
        finally:
            if process.poll() is None:
                self.stage.children.stop(process)
        progress.done(
            f"  {mode:<7} done in {time.monotonic() - started:.0f} s "
            f"(Locust exit code {process.returncode}; log {rel(log)})"
        )
        if not summary_path.exists():
            raise DemoError(
                f"Locust wrote no summary for the {mode} run; {log}:\n{log_tail(log)}"
            )
        summary: dict[str, Any] = json.loads(summary_path.read_text())
        summary["mode"] = mode
        summary["locust_exit_code"] = process.returncode
        summary["verify_sale_exit_code"] = verify(self.stage.env, product_id)
        summary["html"] = str(html)
        if mode == "locked":
            self.add_hold_figures(summary, product_id)
        return summary

    def work_ms(self) -> float:
        """The payment time the app servers spend (``--work-ms``, else theirs)."""
        if self.args.work_ms is not None:
            return float(self.args.work_ms)
        return float(self.stage.env.get("SHOP_WORK_MS") or 5)

    def add_hold_figures(self, summary: dict[str, Any], product_id: int) -> None:
        """Add the hot lock's utilization, median hold and payment share."""
        records = holds.read_records(self.timings_dir, product_id)
        report = holds.summarize(records)
        summary["holds"] = report.as_json()
        summary["work_ms"] = self.work_ms()
        summary["payment_share"] = holds.payment_share(
            int(summary.get("orders") or 0),
            self.work_ms(),
            summary.get("order_span_s"),
        )
        summary["phases_text"] = holds.format_phases(report)
        out = self.stage.reports / "holds.json"
        out.write_text(json.dumps(summary["holds"], indent=1) + "\n")

    # -- the whole demo ----------------------------------------------------------

    def run(self) -> int:
        args = self.args
        prepare(self.stage, args.work_ms)
        if args.fair is not None:
            self.stage.env["REDLOCK_FAIR"] = "1" if args.fair else "0"
        # The locked buy view writes per-phase timings here (shop/timings.py).
        self.stage.env["SHOP_TIMINGS_DIR"] = str(self.timings_dir)
        print(f"[1/6] Redis: {start_redis(self.stage, args.redis_nodes)}", flush=True)
        database = self.stage.env["DATABASE_URL"]
        shown = database if database.startswith("sqlite") else "DATABASE_URL"
        print(f"[2/6] database: {shown}: migrating", flush=True)
        run_manage(["migrate", "--noinput"], self.stage.env)
        product_id = seed(self.stage.env, args.stock)
        print(f"[3/6] seeded product {product_id} with {args.stock} units", flush=True)
        start_servers(self.stage, args.servers, args.workers, product_id)
        hosts = self.stage.hosts
        ports = ", ".join(host.rsplit(":", 1)[1] for host in hosts)
        print(
            f"[4/6] {len(hosts)} app servers (gunicorn, {args.workers} workers "
            f"each) on ports {ports}",
            flush=True,
        )
        print(
            f"[5/6] Locust on POST buy-unsafe/ (no lock): {args.users} users, "
            f"{args.run_time} s",
            flush=True,
        )
        unsafe = self.run_locust("unsafe", product_id)
        product_id = seed(self.stage.env, args.stock)
        fair = self.stage.env.get("REDLOCK_FAIR", "1").strip().lower()
        kind = "fair" if fair in {"1", "true", "yes", "on"} else "not fair"
        print(
            f"[6/6] re-seeded {args.stock} units; Locust on POST buy/ (Redlock, "
            f"{kind}): "
            f"{args.users} users, {args.run_time} s",
            flush=True,
        )
        locked = self.run_locust("locked", product_id)
        return self.report(unsafe, locked)

    def report(self, unsafe: dict[str, Any], locked: dict[str, Any]) -> int:
        print()
        print(format_table([unsafe, locked]))
        print()
        print(
            "hold util: share of the time from the first sale to the last in "
            "which the product lock was held (lock_released's held); work util: "
            "the same from acquire() returning to the release starting; hold p50: "
            f"median hold; pay share: (orders - 1) x {self.work_ms():g} ms payment "
            "over the time from the first order to the last, as Locust saw them; "
            "out of order: share of product-lock grants served before a request "
            "that asked earlier"
        )
        if locked.get("phases_text"):
            print("where a sold hold of the product lock goes (means, ms):")
            print(locked["phases_text"])
        print()
        for summary in (unsafe, locked):
            html = rel(Path(summary["html"]))
            print(f"Locust report ({summary['endpoint']}): {html}")
        print(
            "manage.py verify_sale exit codes (1 = oversold): "
            f"unsafe {unsafe['verify_sale_exit_code']}, "
            f"locked {locked['verify_sale_exit_code']}"
        )
        print(f"Logs: {rel(self.stage.workdir)}/")
        problems: list[str] = []
        if not unsafe.get("oversold"):
            problems.append(
                "the unlocked run did not oversell: the race did not show up "
                "(try more --users or a larger SHOP_WORK_MS)"
            )
        if locked.get("oversold") or locked.get("oversold") is None:
            problems.append(f"the LOCKED run oversold: {locked.get('oversold')}")
        if not locked.get("orders"):
            problems.append(
                "the locked run sold nothing (are the lock's nodes up? "
                "see its answers above)"
            )
        if locked.get("verify_sale_exit_code") != 0:
            problems.append("manage.py verify_sale failed on the locked run")
        if locked.get("locust_exit_code") != 0:
            reasons = "; ".join(locked.get("problems") or []) or (
                f"{locked.get('failures')} failed requests"
            )
            problems.append(f"the locked run failed: {reasons}")
        print()
        if problems:
            for problem in problems:
                print(f"DEMO FAILED: {problem}")
            return 1
        print(
            f"Without the lock {unsafe['oversold']} units were oversold; with "
            "Redlock none were, and every order was paid for with stock."
        )
        return 0

    def close(self) -> None:
        self.stage.close()


def format_table(rows: list[dict[str, Any]]) -> str:
    """Return the side-by-side table of the runs."""
    header = (
        "mode",
        "requests/s",
        "orders",
        "orders/s",
        "stock left",
        "oversold",
        "errors",
        "p50 ms",
        "p99 ms",
        "hold util",
        "work util",
        "hold p50 ms",
        "pay share",
        "out of order",
    )
    lines = [header]
    for row in rows:
        figures = row.get("holds") or {}
        util, hold = figures.get("utilization"), figures.get("median_hold_ms")
        work = figures.get("work_utilization")
        share = row.get("payment_share")
        overtaken = figures.get("out_of_order")
        lines.append(
            (
                f"{row.get('mode', '?')} ({row.get('endpoint', '?')}/)",
                f"{row.get('requests_per_s', 0):.1f}",
                str(row.get("orders", "?")),
                f"{row.get('orders_per_s', 0):.1f}",
                str(row.get("stock_left", "?")),
                str(row.get("oversold", "?")),
                str(row.get("failures", "?")),
                str(row.get("p50_ms", "?")),
                str(row.get("p99_ms", "?")),
                "-" if util is None else f"{util:.2f}",
                "-" if work is None else f"{work:.2f}",
                "-" if hold is None else f"{hold:.1f}",
                "-" if share is None else f"{share:.2f}",
                "-" if overtaken is None else f"{overtaken:.3f}",
            )
        )
    widths = [max(len(line[i]) for line in lines) for i in range(len(header))]
    out = []
    for number, line in enumerate(lines):
        cells = [line[0].ljust(widths[0])]
        pairs = zip(line[1:], widths[1:], strict=True)
        cells += [cell.rjust(width) for cell, width in pairs]
        out.append("  ".join(cells))
        if number == 0:
            out.append("  ".join("-" * width for width in widths))
    return "\n".join(out)


@contextlib.contextmanager
def signals_as_interrupt() -> Iterator[None]:
    """Turn Ctrl-C, SIGTERM and SIGHUP into KeyboardInterrupt, for cleanup.

    SIGINT is set explicitly: a shell starting the demo in the background leaves
    it ignored, and Python then installs no handler of its own.
    """

    def handler(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt(f"signal {signum}")

    previous = {
        sig: signal.signal(sig, handler)
        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
    }
    try:
        yield
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m loadtests.demo",
        description=(__doc__ or "").split("\n\n")[0],
    )
    parser.add_argument("--users", type=int, default=40)
    parser.add_argument("--spawn-rate", type=float, default=20.0)
    parser.add_argument("--run-time", type=int, default=15, help="seconds per run")
    parser.add_argument("--stock", type=int, default=200)
    parser.add_argument("--servers", type=int, default=3)
    parser.add_argument("--workers", type=int, default=2, help="per app server")
    parser.add_argument("--redis-nodes", type=int, default=5)
    parser.add_argument(
        "--work-ms",
        type=int,
        default=None,
        help="simulated payment time inside the critical section "
        "(default: SHOP_WORK_MS or the shop's own default)",
    )
    parser.add_argument(
        "--fair",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="grant the product lock in arrival order (the shop's default: "
        "REDLOCK_FAIR, else on); --no-fair for the barging lock",
    )
    parser.add_argument(
        "--stop-after-sold-out",
        type=float,
        default=None,
        help="end each run this many seconds after it sells out",
    )
    parser.add_argument("--reports-dir", default="reports")
    return parser.parse_args(argv)


def run_to_the_end(job: Any, what: str) -> int:
    """Run ``job`` (its ``run()`` gives the exit code) and always ``close()`` it.

    Ctrl-C or SIGTERM stops the run (exit 130), a ``DemoError`` fails it (exit 1);
    either way every process it started is stopped first.
    """
    started = time.monotonic()
    try:
        with signals_as_interrupt():
            try:
                code = int(job.run())
            finally:
                # Cleanup must not be cut short by a second Ctrl-C or a SIGTERM.
                stoppers = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
                previous = {sig: signal.signal(sig, signal.SIG_IGN) for sig in stoppers}
                try:
                    job.close()
                finally:
                    for sig, old in previous.items():
                        signal.signal(sig, old)
    except KeyboardInterrupt:
        print(f"\ninterrupted: stopped every process the {what} started", flush=True)
        return 130
    except DemoError as exc:
        print(f"\n{what.upper()} FAILED: {exc}", file=sys.stderr, flush=True)
        return 1
    print(f"({time.monotonic() - started:.0f} s in total)")
    return code


def main(argv: list[str] | None = None) -> int:
    return run_to_the_end(Demo(parse_args(argv)), "demo")


if __name__ == "__main__":
    sys.exit(main())
