"""``make chaos``: the flash sale under faults, and the invariants checked after it.

Sets up what ``make demo`` sets up, with the demo's own steps (``prepare``,
``start_redis``, ``start_servers`` on a ``Stage``, from ``loadtests.demo``): five
Redis nodes started here (this tool kills them, so ``REDLOCK_NODES`` is ignored), a
fresh database, one product on sale (1000 units), three gunicorn app servers with
three sync workers each, plus one more that only serves the audit the timeline
samples. Then one headless Locust run on the locked ``buy/`` endpoint, new
customers buying and customers double-clicking (two POSTs at once, to two app
servers), while a schedule injects real faults, each logged with its monotonic
time since Locust started:

1. SIGSTOP one Redis node (it keeps its connections and answers nothing), SIGCONT
   it later;
2. while it is paused, SIGKILL another node (2 of 5 unavailable: every lock needs
   all 3 left) and restart it only after the delayed-restart rule: down for at
   least the lock TTL plus drift plus a margin, so that no lock it granted can
   still be alive when it comes back empty (the nodes persist nothing);
3. SIGKILL one gunicorn worker (not the master) in the middle of the load; the
   master starts a new one.

When Locust ends, the sale is checked with ``manage.py verify_sale`` (the shop's
own audit): units sold <= initial stock, initial - remaining == units sold ==
orders, no customer with two orders, nothing oversold, no double click that made
two orders. Refusals a sale expects (409, 423 and 503 with a JSON reason) and
the connection errors of requests in flight on the killed worker are counted,
not failed; any other 5xx fails the run.

Controls: ``--unsafe`` runs the same chaos on ``buy-unsafe/`` (no lock); it
oversells, and the checker must fail it. ``--restart-immediately`` breaks the
delayed-restart rule on another schedule: two nodes killed, then a third, and all
three back empty at once, twice; holders overlap, and the count of ``409
stale_lock`` answers shows the fenced write refusing the second holder.

Exit code 0 when every invariant holds, 1 on any violation (or when the run
could not be set up), 130 when interrupted. Everything started is stopped on
the way out. Usage: python -m loadtests.chaos [--duration 75] [--users 40]
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from harness.locust import locust_command, locust_env
from harness.processes import REPO, gunicorn_workers, log_tail
from loadtests.demo import (
    DemoError,
    Progress,
    Server,
    Stage,
    prepare,
    rel,
    run_manage,
    run_to_the_end,
    seed,
    start_redis,
    start_servers,
)
from loadtests.observers import Prober, Sampler
from loadtests.verdict import (
    Fault,
    check_run,
    check_sale,
    format_report,
    restart_delay,
    server_errors,
)

DEFAULT_TTL = 5.0
# Lines of the app servers' logs worth counting in the report.
APP_LOG_MARKERS = {
    "Traceback": "tracebacks",
    # distributed_lock's log line, for the product and the customer lock alike.
    "lost while": "lock lost while held",
    "did not answer and expire": "release missed nodes",
    "was sent SIGKILL": "workers killed",
}


# -- faults ---------------------------------------------------------------------


@dataclass
class Step:
    """A scheduled fault: run ``do`` at ``at`` seconds into the Locust run."""

    at: float
    name: str
    do: Callable[[], str]
    done: bool = False


# -- the run ----------------------------------------------------------------------


class Chaos:
    """One Locust run on the demo's :class:`Stage`, faults on a schedule, the checks."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        workdir = Path(args.workdir).resolve()
        self.stage = Stage(workdir, (REPO / args.reports_dir).resolve())
        self.faults: list[Fault] = []
        self.started = 0.0
        self.sampler: Sampler | None = None
        self.prober: Prober | None = None
        self.monitor: Server | None = None
        self.killed_at: float | None = None
        self.run_seconds = 0.0
        self.progress = Progress()
        self.steps: list[Step] = []
        #: How many scheduled faults ran while Locust ran (the rest at clean-up).
        self.under_load = 0
        self.delay = 0.0 if args.restart_immediately else restart_delay(args.ttl)

    def start_app_servers(self, product_id: int) -> None:
        # One more app server than Locust gets: it serves only the audit that the
        # timeline samples, so busy or killed buy workers do not delay the samples.
        args = self.args
        start_servers(self.stage, args.servers + 1, args.workers, product_id)
        self.monitor = self.stage.servers.pop()

    def close(self) -> None:
        self.stage.close()

    # -- fault actions -------------------------------------------------------------

    def node_label(self, index: int) -> str:
        node = self.stage.nodes[index]
        return f"redis node {index} (port {node.port}, pid {node.pid})"

    def pause_node(self, index: int) -> str:
        label = self.node_label(index)
        self.stage.nodes[index].pause()
        return f"SIGSTOP {label}"

    def resume_node(self, index: int, since: float) -> str:
        self.stage.nodes[index].resume()
        return f"SIGCONT redis node {index} (paused {self.now() - since:.2f} s)"

    def kill_node(self, index: int) -> str:
        label = self.node_label(index)
        self.stage.nodes[index].kill()
        self.killed_at = self.now()
        # The delayed-restart rule counts from the moment the node is dead.
        for step in self.steps:
            if step.name == "restart":
                step.at = self.killed_at + self.delay
        return f"SIGKILL {label}"

    def restart_node(self, index: int) -> str:
        node = self.stage.nodes[index]
        port = node.port
        down = self.now() - (self.killed_at or self.now())
        node.start()
        if node.port != port:
            raise DemoError(
                f"redis node {index} came back on port {node.port}, not {port}: the "
                "app servers still point at the old port"
            )
        rule = restart_delay(self.args.ttl)
        kept = "kept" if down >= rule else "BROKEN"
        return (
            f"restarted redis node {index} (pid {node.pid}), empty (no persistence), "
            f"after {down:.2f} s down; delayed-restart rule (>= {rule:.2f} s) {kept}"
        )

    def kill_worker(self, server: int) -> str:
        host, process, _ = self.stage.servers[server]
        workers = gunicorn_workers(process.pid)
        if not workers:
            raise DemoError(f"app server {host} (pid {process.pid}) has no workers")
        victim = workers[0]
        os.kill(victim, signal.SIGKILL)
        # The master notices the death (SIGCHLD) and forks a replacement.
        deadline = time.monotonic() + 10.0
        replaced = ""
        while time.monotonic() < deadline:
            now = gunicorn_workers(process.pid)
            fresh = sorted(set(now) - set(workers))
            if victim not in now and fresh:
                replaced = f"; replaced by pid {fresh[0]}"
                break
            time.sleep(0.05)
        else:
            replaced = "; NOT replaced within 10 s"
        return (
            f"SIGKILL gunicorn worker pid {victim} of {host} "
            f"(master {process.pid}, {len(workers)} workers){replaced}"
        )

    def kill_two(self, pair: tuple[int, int]) -> str:
        labels = [self.node_label(index) for index in pair]
        for index in pair:
            self.stage.nodes[index].kill()
        return f"SIGKILL {' and '.join(labels)}: every lock rests on the 3 others"

    def flap(self, killed: int, pair: tuple[int, int], since: float) -> str:
        node = self.stage.nodes[killed]
        old_pid = node.pid
        began = time.monotonic()
        node.kill()
        for index in (killed, *pair):
            self.stage.nodes[index].start()
        took = (time.monotonic() - began) * 1000
        return (
            f"SIGKILL redis node {killed} (pid {old_pid}), then restarted it and "
            f"nodes {pair[0]} and {pair[1]} (down {self.now() - since:.2f} s) empty "
            f"at once, within {took:.0f} ms: delayed-restart rule BROKEN"
        )

    def rule_breaking_schedule(self) -> list[Step]:
        """Return the ``--restart-immediately`` faults: a majority forgets, twice.

        Two nodes are killed, so each lock is then granted by exactly the three
        others; one of those three is killed too and all three come back empty at
        once: a buyer can win the lock on them while its holder still runs.
        """
        args = self.args
        duration = float(args.duration)
        killed = args.kill_node
        spare = next(
            i
            for i in range(len(self.stage.nodes))
            if i not in (killed, args.pause_node)
        )
        pair = (args.pause_node, spare)
        steps = []
        for at in (0.10 * duration, 0.40 * duration):
            steps += [
                Step(at, "kill-two", functools.partial(self.kill_two, pair)),
                Step(at + 2.0, "flap", functools.partial(self.flap, killed, pair, at)),
            ]
        steps.append(Step(0.75 * duration, "kill-worker", lambda: self.kill_worker(-1)))
        return steps

    def schedule(self) -> list[Step]:
        """Return the faults of one run, times scaled to ``--duration``."""
        args = self.args
        if args.restart_immediately:
            return self.rule_breaking_schedule()
        duration = float(args.duration)
        paused, killed = args.pause_node, args.kill_node
        pause_at, resume_at = 0.10 * duration, 0.40 * duration
        kill_at = 0.20 * duration
        restart_at = kill_at + self.delay  # moved to the actual kill time + delay
        worker_at = 0.60 * duration
        steps = [
            Step(pause_at, "pause", lambda: self.pause_node(paused)),
            Step(resume_at, "resume", lambda: self.resume_node(paused, pause_at)),
            Step(kill_at, "kill", lambda: self.kill_node(killed)),
            Step(restart_at, "restart", lambda: self.restart_node(killed)),
            Step(worker_at, "kill-worker", lambda: self.kill_worker(-1)),
        ]
        return sorted(steps, key=lambda step: step.at)

    def now(self) -> float:
        return time.monotonic() - self.started

    def run_step(self, step: Step) -> None:
        orders = None
        if self.sampler is not None and (sample := self.sampler.latest()):
            orders = sample.orders
        at = self.now()
        detail = step.do()
        step.done = True
        fault = Fault(round(at, 2), step.name, detail, orders)
        self.faults.append(fault)
        self.progress.done(f"  {fault.line()}")

    # -- one Locust run under the schedule ---------------------------------------

    def run_locust_under_chaos(self, product_id: int) -> dict[str, Any]:
        args = self.args
        mode = "chaos-unsafe" if args.unsafe else "chaos"
        if args.restart_immediately:
            mode += "-restart-immediately"
        html = self.stage.reports / f"{mode}.html"
        summary_path = self.stage.workdir / f"locust-{mode}.json"
        log = self.stage.workdir / f"locust-{mode}.log"
        scenario = "unsafe" if args.unsafe else "locked,double-click"
        command = locust_command(
            hosts=self.stage.hosts,
            product_id=product_id,
            scenario=scenario,
            users=args.users,
            spawn_rate=args.spawn_rate,
            run_time=args.duration,
            summary_json=summary_path,
            html=html,
            expect_oversell="no",
        )
        env = locust_env(self.stage.env)
        self.steps = steps = self.schedule()
        self.progress = Progress()
        process = self.stage.children.start(f"locust:{mode}", command, env, log)
        self.started = time.monotonic()
        monitor = self.monitor[0] if self.monitor else self.stage.hosts[0]
        audit_url = f"{monitor}/shop/products/{product_id}/audit/"
        self.sampler = Sampler(audit_url, self.started)
        sampler = threading.Thread(target=self.sampler.run, daemon=True)
        sampler.start()
        self.prober = Prober(self.stage.hosts, product_id, self.started)
        threading.Thread(target=self.prober.run, daemon=True).start()
        try:
            while process.poll() is None:
                for step in steps:
                    if not step.done and self.now() >= step.at:
                        self.run_step(step)
                pending = [s.at for s in steps if not s.done]
                sample = self.sampler.latest()
                state = (
                    f"orders {sample.orders:>5}  stock {sample.stock:>5}"
                    if sample
                    else "(audit not available yet)"
                )
                self.progress.update(
                    f"  {mode} {self.now():5.1f}/{args.duration} s  {state}"
                )
                wait = min([0.5, *(at - self.now() for at in pending)])
                with contextlib.suppress(subprocess.TimeoutExpired):
                    process.wait(max(wait, 0.01))
        finally:
            self.under_load = sum(step.done for step in steps)
            if process.poll() is None:
                self.stage.children.stop(process)
            self.sampler.stop.set()
            self.prober.stop.set()
            # Whatever the run did not get to, undo it: nodes resumed and running.
            for step in steps:
                if not step.done and step.name in ("resume", "restart", "flap"):
                    self.run_step(step)
        self.run_seconds = self.now()
        self.progress.done(
            f"  {mode} done in {self.run_seconds:.1f} s "
            f"(Locust exit code {process.returncode}; log {rel(log)})"
        )
        if not summary_path.exists():
            raise DemoError(f"Locust wrote no summary; {log}:\n{log_tail(log)}")
        summary: dict[str, Any] = json.loads(summary_path.read_text())
        summary["locust_exit_code"] = process.returncode
        summary["html"] = str(html)
        return summary

    def verify(self, product_id: int) -> tuple[int, dict[str, Any]]:
        """Run ``manage.py verify_sale``; return its exit code and its audit."""
        result = subprocess.run(
            [
                *(sys.executable, str(REPO / "manage.py"), "verify_sale"),
                *("--product", str(product_id)),
            ],
            cwd=REPO,
            env=self.stage.env,
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            timeout=120,
        )
        lines = [line for line in result.stdout.splitlines() if line.startswith("{")]
        if result.returncode == 2 or not lines:
            raise DemoError(
                f"verify_sale failed ({result.returncode}):\n"
                f"{result.stdout}{result.stderr}"
            )
        audit: dict[str, Any] = json.loads(lines[-1])
        return result.returncode, audit

    def app_log_counts(self) -> dict[str, int]:
        """Count the notable lines the app servers logged (tracebacks, lost locks)."""
        counts = dict.fromkeys(APP_LOG_MARKERS.values(), 0)
        for path in sorted(self.stage.workdir.glob("app-*.log")):
            for line in path.read_text(errors="replace").splitlines():
                for marker, name in APP_LOG_MARKERS.items():
                    if marker in line:
                        counts[name] += 1
        return counts

    def phases(self) -> list[dict[str, Any]]:
        """Return the orders made between consecutive faults, until sold out."""
        sampler = self.sampler
        if sampler is None or not sampler.samples:
            return []
        sold_out = next((s.at for s in sampler.samples if s.stock <= 0), None)
        end = min(self.run_seconds, sold_out or self.run_seconds)
        bounds = [("start", 0.0), *((f.action, f.at) for f in self.faults)]
        phases = []
        stops = [*bounds[1:], ("end", end)]
        for (name, start), (_, stop) in zip(bounds, stops, strict=True):
            stop = min(stop, end)
            # The sale was seeded just before Locust started: no orders at 0 s.
            first = sampler.orders_at(start) if start > 0 else 0
            last = sampler.orders_at(stop)
            if stop - start < 0.5 or first is None or last is None:
                continue
            probes = [
                p
                for p in (self.prober.probes if self.prober else [])
                if start <= p.at < stop
            ]
            answers = Counter(
                "order" if p.status == 201 else f"{p.status} {p.answer}" for p in probes
            )
            phases.append(
                {
                    "after": name,
                    "from_s": round(start, 1),
                    "to_s": round(stop, 1),
                    "orders": last - first,
                    "orders_per_s": round((last - first) / (stop - start), 1),
                    "probes": dict(answers.most_common()),
                }
            )
        return phases

    # -- the whole run --------------------------------------------------------------

    def run(self) -> int:
        args = self.args
        began = time.monotonic()
        prepare(self.stage, args.work_ms)
        self.stage.env["REDLOCK_TTL"] = str(args.ttl)
        if args.work_ms is None:
            self.stage.env.setdefault("SHOP_WORK_MS", "5")
        # Always its own nodes, whatever REDLOCK_NODES says: they get killed.
        redis_nodes = start_redis(self.stage, args.redis_nodes, reuse_env=False)
        print(f"[1/5] Redis: {redis_nodes}", flush=True)
        run_manage(["migrate", "--noinput"], self.stage.env)
        product_id = seed(self.stage.env, args.stock)
        database = self.stage.env["DATABASE_URL"]
        shown = database if database.startswith("sqlite") else "DATABASE_URL"
        print(
            f"[2/5] database {shown}: product {product_id}, {args.stock} units",
            flush=True,
        )
        self.start_app_servers(product_id)
        hosts = self.stage.hosts
        ports = ", ".join(host.rsplit(":", 1)[1] for host in hosts)
        monitor = self.monitor[0].rsplit(":", 1)[1] if self.monitor else "-"
        print(
            f"[3/5] {len(hosts)} app servers (gunicorn, {args.workers} sync "
            f"workers each) on ports {ports}, and one for the audit only on "
            f"{monitor}; lock TTL {args.ttl:g} s",
            flush=True,
        )
        endpoint = (
            "buy-unsafe/ (NO lock: negative control)"
            if args.unsafe
            else ("buy/ (Redlock), new customers and double clicks")
        )
        print(
            f"[4/5] Locust on POST {endpoint}: {args.users} users, "
            f"{args.duration} s, faults on schedule:",
            flush=True,
        )
        setup_seconds = time.monotonic() - began
        summary = self.run_locust_under_chaos(product_id)
        verify_code, audit = self.verify(product_id)
        print("[5/5] checked with manage.py verify_sale", flush=True)
        outcomes: dict[str, int] = summary.get("outcomes") or {}
        errors = server_errors(outcomes)
        checks = check_sale(
            audit,
            double_orders=int(summary.get("double_orders") or 0),
            double_clicks=int(summary.get("double_clicks") or 0),
            server_errors=errors,
            verify_exit_code=verify_code,
        )
        checks += check_run(
            duration=float(args.duration),
            ran=self.run_seconds,
            scheduled=len(self.steps),
            under_load=self.under_load,
            rule_broken=any(
                "rule" in f.detail and "BROKEN" in f.detail for f in self.faults
            ),
            on_purpose=args.restart_immediately,
        )
        report = {
            "mode": "unsafe" if args.unsafe else "locked",
            "restart_immediately": args.restart_immediately,
            "users": args.users,
            "duration_s": args.duration,
            "stock": args.stock,
            "ttl_s": args.ttl,
            "restart_delay_s": round(restart_delay(args.ttl), 2),
            "servers": len(self.stage.hosts),
            "workers": args.workers,
            "redis_nodes": len(self.stage.nodes),
            "setup_s": round(setup_seconds, 1),
            "run_s": round(self.run_seconds, 1),
            "requests": summary.get("requests"),
            "requests_per_s": summary.get("requests_per_s"),
            "failures": summary.get("failures"),
            "p50_ms": summary.get("p50_ms"),
            "p99_ms": summary.get("p99_ms"),
            "outcomes": outcomes,
            "double_clicks": summary.get("double_clicks"),
            "audit": audit,
            "verify_sale_exit_code": verify_code,
            "faults": [asdict(fault) for fault in self.faults],
            "probes": [asdict(p) for p in (self.prober.probes if self.prober else [])],
            "timeline": [
                asdict(s) for s in (self.sampler.samples if self.sampler else [])
            ],
            "checks": [asdict(check) for check in checks],
            "ok": all(check.ok for check in checks),
            "html": str(summary.get("html")),
        }
        report["app_log"] = self.app_log_counts()
        report["phases"] = self.phases()
        samples = self.sampler.samples if self.sampler else []
        report["sold_out_at_s"] = next(
            (round(s.at, 1) for s in samples if s.stock <= 0), None
        )
        report["total_s"] = round(time.monotonic() - began, 1)
        path = Path(report["html"]).with_suffix(".json")
        path.write_text(json.dumps(report, sort_keys=True, indent=1) + "\n")
        if args.summary_json:
            Path(args.summary_json).write_text(json.dumps(report, sort_keys=True))
        print()
        print(format_report(report))
        print(
            f"Report: {rel(path)}; Locust: {rel(Path(report['html']))}; "
            f"logs: {rel(self.stage.workdir)}/"
        )
        return 0 if report["ok"] else 1


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m loadtests.chaos",
        description=(__doc__ or "").split("\n\n")[0],
    )
    parser.add_argument("--duration", type=int, default=75, help="Locust seconds")
    parser.add_argument("--users", type=int, default=40)
    parser.add_argument("--spawn-rate", type=float, default=20.0)
    parser.add_argument("--stock", type=int, default=1000)
    parser.add_argument("--servers", type=int, default=3)
    parser.add_argument("--workers", type=int, default=3, help="per app server")
    parser.add_argument("--redis-nodes", type=int, default=5)
    parser.add_argument(
        "--ttl",
        type=float,
        default=DEFAULT_TTL,
        help="the lock TTL of the app servers (REDLOCK_TTL), seconds",
    )
    parser.add_argument("--pause-node", type=int, default=1)
    parser.add_argument("--kill-node", type=int, default=3)
    parser.add_argument(
        "--work-ms",
        type=int,
        default=None,
        help="simulated payment time inside the critical section (default 5)",
    )
    parser.add_argument(
        "--unsafe",
        action="store_true",
        help="negative control: the same chaos on buy-unsafe/ (no lock)",
    )
    parser.add_argument(
        "--restart-immediately",
        action="store_true",
        help="negative control: restart the killed node at once (rule broken)",
    )
    parser.add_argument("--reports-dir", default="reports")
    parser.add_argument(
        "--workdir",
        default=str(REPO / ".demo" / "chaos"),
        help="logs, Redis files and the SQLite database (emptied first)",
    )
    parser.add_argument("--summary-json", default="", help="also write the report here")
    args = parser.parse_args(argv)
    problems = []
    if args.duration < 10:
        problems.append("--duration must be at least 10 s")
    if not 3 <= args.redis_nodes <= 15:
        problems.append("--redis-nodes must be 3 to 15")
    for name in ("pause_node", "kill_node"):
        if not 0 <= getattr(args, name) < args.redis_nodes:
            problems.append(f"--{name.replace('_', '-')} must be a node index")
    if args.pause_node == args.kill_node:
        problems.append("--pause-node and --kill-node must differ")
    if not 0 < args.ttl <= 60:
        problems.append("--ttl must be in (0, 60] seconds")
    if args.users < 1 or args.stock < 1 or args.servers < 1 or args.workers < 1:
        problems.append("--users, --stock, --servers and --workers must be >= 1")
    # The last node restart must come well before the end of the run.
    last, end = (0.4, 0.7) if args.restart_immediately else (0.2, 0.9)
    delay = 2.0 if args.restart_immediately else restart_delay(args.ttl)
    restart_at = last * args.duration + delay
    if restart_at > end * args.duration:
        problems.append(
            f"--duration {args.duration} is too short for --ttl {args.ttl:g}: the "
            f"node would come back at {restart_at:.1f} s; use at least "
            f"{delay / (end - last) + 1:.0f} s or a smaller --ttl"
        )
    if problems:
        parser.error("; ".join(problems))
    return args


def main(argv: list[str] | None = None) -> int:
    return run_to_the_end(Chaos(parse_args(argv)), "chaos run")


if __name__ == "__main__":
    sys.exit(main())
