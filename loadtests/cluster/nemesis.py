"""The nemesis: faults on a schedule while Locust buys through nginx, then the verdict.

Each fault is applied from outside the processes (nftables rules in a host's
namespace, SIGKILL / SIGSTOP, a restart under libfaketime) and logged with its
start and end in seconds of CLOCK_MONOTONIC since the load began. Times scale with
``--duration`` (each fault at least ``MIN_HOLD`` seconds and longer than the TTL
by ``RESUME_MARGIN``, the restart and the pause at least the lease they must
outlast).
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
import time
from collections import Counter, defaultdict
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from harness.processes import gunicorn_workers
from loadtests.cluster import checks, net, topology
from loadtests.verdict import restart_delay

if TYPE_CHECKING:
    import argparse

    from loadtests.cluster.run import Cluster

MIN_HOLD = 4.0
MIN_GAP = 2.5
#: A fault that cuts the lock's holder off in the middle of its hold strands its
#: lease on the nodes it can no longer reach, so nobody can sell until that lease
#: expires: up to a TTL, by design. Each fault lasts this much longer than the TTL,
#: so that its phase shows the sale going on again.
RESUME_MARGIN = 2.0
FRESH_GRANT = 0.004  # seconds: a worker stopped this soon after its grant
LAST_RESORT = 2.0  # the pauser's last seconds take any holder of the lock
LOCUST_STOP_TIMEOUT = 30  # in-flight purchases finish, so each has its answer


@dataclass
class Step:
    name: str
    hold: float
    apply: Callable[[], str]
    heal: Callable[[], str]
    minority_hosts: tuple[str, ...] = ()
    heal_host: str | None = None
    # Hosts known only once applied (the paused worker's): cut off like a minority.
    affected: Callable[[], tuple[str, ...]] | None = None


def _cut(app: str, redis_hosts: list[str], cluster: Cluster) -> Callable[[], str]:
    def apply() -> str:
        targets = ", ".join(cluster.addresses[h] for h in redis_hosts)
        net.nft(
            app,
            f"add rule inet {net.NFT_TABLE} output ip daddr {{ {targets} }} "
            f"tcp dport {topology.REDIS_PORT} drop",
        )
        return f"nft on {app}: drop its packets to {', '.join(redis_hosts)}:6379"

    return apply


def _heal(*hosts: str) -> Callable[[], str]:
    def heal() -> str:
        for host in hosts:
            net.heal(host)
        return f"nft rules of {', '.join(hosts)} flushed"

    return heal


def _isolate(redis_hosts: list[str]) -> Callable[[], str]:
    def apply() -> str:
        for host in redis_hosts:
            net.nft(
                host,
                f"add rule inet {net.NFT_TABLE} input tcp dport {topology.REDIS_PORT} "
                "drop",
            )
        return f"nft on {', '.join(redis_hosts)}: drop every client's packets to 6379"

    return apply


def _one_way(redis_host: str) -> Callable[[], str]:
    def apply() -> str:
        net.nft(
            redis_host,
            f"add rule inet {net.NFT_TABLE} output "
            f"tcp sport {topology.REDIS_PORT} drop",
        )
        return f"nft on {redis_host}: requests arrive, its replies (sport 6379) dropped"

    return apply


def _lb_loses(app: str, cluster: Cluster) -> Callable[[], str]:
    def apply() -> str:
        net.nft(
            topology.NGINX_HOST,
            f"add rule inet {net.NFT_TABLE} output ip daddr "
            f"{cluster.addresses[app]} tcp dport {topology.APP_PORT} "
            "reject with tcp reset",
        )
        return f"nft on nginx: connections to {app}:8000 reset"

    return apply


class Pauser:
    """SIGSTOP a gunicorn worker while it holds the product lock; SIGCONT later."""

    def __init__(self, cluster: Cluster, product_id: int) -> None:
        self.cluster = cluster
        self.resource = f"{checks.PRODUCT_RESOURCE_PREFIX}{product_id}"
        self.paused: int | None = None
        self.host: str | None = None
        self.token: int | None = None

    def holding(self, path: Path) -> dict[str, Any] | None:
        """The open grant of the product lock in a worker's log, if any."""
        import json

        state: dict[str, Any] | None = None
        with contextlib.suppress(OSError):
            for line in path.read_text().splitlines():
                with contextlib.suppress(ValueError):
                    event = json.loads(line)
                    if event.get("r") == self.resource:
                        state = event if event["e"] == "acq" else None
        return state

    def apply(self) -> str:
        deadline = time.monotonic() + 8.0
        tries = 0
        while time.monotonic() < deadline:
            for host in topology.APP_HOSTS:
                master = self.cluster.apps.get(host)
                if master is None:
                    continue
                for pid in gunicorn_workers(master.pid):
                    tries += 1
                    stopped_at = time.monotonic()
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, signal.SIGSTOP)
                    time.sleep(0.01)
                    log = self.cluster.lock_log / f"{host}-{pid}.jsonl"
                    grant = self.holding(log)
                    # Granted moments before the stop: still before its fenced
                    # write (the purchase works SHOP_WORK_MS first). After a while
                    # any holder will do.
                    fresh = grant is not None and (
                        stopped_at - grant["t"] < FRESH_GRANT
                        or time.monotonic() > deadline - LAST_RESORT
                    )
                    if (
                        fresh
                        and grant is not None
                        and grant["until"] > time.monotonic()
                    ):
                        self.paused, self.host = pid, host
                        self.token = grant.get("tok")
                        return (
                            f"SIGSTOP worker {pid} on {host} holding {self.resource} "
                            f"(token {grant.get('tok')}, granted "
                            f"{(stopped_at - grant['t']) * 1e3:.1f} ms before the "
                            f"stop, lease to +"
                            f"{grant['until'] - time.monotonic():.2f} s) after "
                            f"{tries} tries"
                        )
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, signal.SIGCONT)
            time.sleep(0.02)
        return f"no worker caught holding {self.resource} in {tries} tries"

    def heal(self) -> str:
        if self.paused is None:
            return "nothing paused"
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.paused, signal.SIGCONT)
        return f"SIGCONT worker {self.paused}"


def schedule(
    cluster: Cluster, args: argparse.Namespace, product_id: int, faketime: str
) -> tuple[float, list[Step], Pauser | None]:
    """Return (the gap between faults, the steps, the pauser) for this run."""
    duration = float(args.duration)
    ttl = float(cluster.shop_env["REDLOCK_TTL"])
    gap = max(0.04 * duration, MIN_GAP)
    hold = max(0.07 * duration, MIN_HOLD, ttl + RESUME_MARGIN)
    r = list(topology.REDIS_HOSTS)
    if args.negative_control:
        stop = threading.Event()

        def apply() -> str:
            _cut("app1", r[3:], cluster)()
            _cut("app2", r[:2], cluster)()
            _lb_loses("app3", cluster)()

            def churn() -> None:
                while not stop.wait(1.5):
                    cluster.kill_redis("redis3")
                    cluster.start_redis("redis3", empty=True)

            threading.Thread(target=churn, daemon=True).start()
            return (
                "app1 cut from redis4,5 and app2 from redis1,2 (redis3 their only "
                "common node), nginx loses app3; redis3 SIGKILLed and restarted "
                "EMPTY at once every 1.5 s (the restart rule broken)"
            )

        def heal() -> str:
            stop.set()
            time.sleep(0.5)
            _heal("app1", "app2", topology.NGINX_HOST)()
            return "churn stopped, rules flushed"

        return (
            gap,
            [
                Step(
                    "NEGATIVE CONTROL: redis3 restarted empty at once",
                    max(0.4 * duration, 20.0),
                    apply,
                    heal,
                    minority_hosts=("app1", "app2"),
                )
            ],
            None,
        )

    pauser = Pauser(cluster, product_id)

    def kill3() -> str:
        cluster.kill_redis("redis3")
        return "SIGKILL redis3"

    def restart3() -> str:
        cluster.start_redis("redis3")
        return f"redis3 restarted with its AOF after {restart_delay(ttl):.2f} s"

    def skew(on: bool) -> Callable[[], str]:
        def step() -> str:
            cluster.stop_app("app2")
            extra = (
                {
                    "LD_PRELOAD": faketime,
                    "FAKETIME": "+1h",
                }
                if on
                else {}
            )
            cluster.start_app("app2", extra_env=extra)
            return "app2 restarted " + (
                "under libfaketime: its clocks +1 h" if on else "with the real clock"
            )

        return step

    steps = [
        Step("app1 cut from 2 of 5", hold, _cut("app1", r[:2], cluster), _heal("app1"),
             heal_host="app1"),
        Step("app1 cut from 3 of 5", hold, _cut("app1", r[:3], cluster), _heal("app1"),
             minority_hosts=("app1",), heal_host="app1"),
        Step("redis4,5 cut from all", hold, _isolate(r[3:]), _heal(*r[3:])),
        Step("one-way redis2", hold, _one_way("redis2"), _heal("redis2")),
        Step("redis3 killed", restart_delay(ttl), kill3, restart3),
        Step("worker SIGSTOPped", ttl + 3.0, pauser.apply, pauser.heal,
             affected=lambda: (pauser.host,) if pauser.host else ()),
        Step("app2 clock +1h", max(hold, 6.0), skew(True), skew(False),
             heal_host="app2"),
        Step("nginx loses app3", hold, _lb_loses("app3", cluster),
             _heal(topology.NGINX_HOST), heal_host="app3"),
    ]  # fmt: skip
    if args.only:
        return gap, pick(steps, args.only), pauser
    return gap, steps, pauser


def pick(steps: list[Step], only: str) -> list[Step]:
    """The steps named in ``only`` (``;``-separated), in that order, repeats kept."""
    by_name = {step.name: step for step in steps}
    names = [name.strip() for name in only.split(";") if name.strip()]
    unknown = [name for name in names if name not in by_name]
    if unknown:
        raise SystemExit(
            f"--only: no fault named {', '.join(map(repr, unknown))}; "
            f"the faults are: {', '.join(by_name)}"
        )
    return [by_name[name] for name in names]


def run(
    cluster: Cluster, args: argparse.Namespace, product_id: int, faketime: str
) -> dict[str, Any]:
    """Run Locust under the schedule; return the report (checks included)."""
    from harness.processes import log_tail

    gap, steps, pauser = schedule(cluster, args, product_id, faketime)
    # Applying a step (a restart) takes time too: a margin per step.
    run_time = int(gap * (len(steps) + 1) + sum(s.hold + 3.0 for s in steps))
    reports = args.reports_dir
    html = reports / (
        "cluster-negative.html" if args.negative_control else "cluster.html"
    )
    answers_path = cluster.run_dir / "answers.jsonl"
    env = {
        **cluster.base_env(),
        **topology.LOCUST_ENV,
        "SHOP_PRODUCT_ID": str(product_id),
        "CLUSTER_ANSWERS": str(answers_path),
    }
    command = net.in_ns(
        topology.LOCUST_HOST, str(Path(sys.executable).parent / "locust"),
        "-f", str(topology.REPO / "loadtests" / "cluster" / "locustfile.py"),
        "--headless", "-u", str(args.users), "-r", str(args.spawn_rate),
        "-t", f"{run_time}s", "--stop-timeout", str(LOCUST_STOP_TIMEOUT),
        "--host", f"http://{topology.NGINX_HOST}:{topology.NGINX_PORT}",
        "--html", str(html), "--only-summary",
    )  # fmt: skip
    offset = time.time() - time.monotonic()
    started = time.monotonic()
    locust = cluster.children.start("locust", command, env, cluster.logs / "locust.log")
    print(f"  locust: {args.users} users for {run_time} s through nginx")
    faults: list[dict[str, Any]] = []

    def since() -> float:
        return round(time.monotonic() - started, 2)

    def sleep_until(at: float) -> None:
        time.sleep(max(0.0, started + at - time.monotonic()))

    at = gap
    for step in steps:
        sleep_until(at)
        begin = since()
        detail = step.apply()
        applied = since()
        print(f"  +{begin:7.2f} s  {step.name}: {detail}")
        sleep_until(applied + step.hold)
        end_detail = step.heal()
        end = since()
        print(f"  +{end:7.2f} s  healed {step.name}: {end_detail}")
        faults.append(
            {
                "name": step.name,
                "start": begin,
                "end": end,
                "detail": detail,
                "heal": end_detail,
                "minority_hosts": list(step.minority_hosts)
                + list(step.affected() if step.affected else ()),
                "heal_host": step.heal_host,
            }
        )
        at = end + gap
    try:
        locust.wait(run_time + LOCUST_STOP_TIMEOUT + 60)
    except Exception:
        cluster.children.stop(locust)
    load_s = since()

    # -- the verdict ---------------------------------------------------------------
    sale = cluster.sale(product_id)
    answers = checks.read_jsonl(answers_path)
    windows = checks.read_windows(cluster.lock_log)
    names = {
        f"{cluster.addresses[h]}:{topology.APP_PORT}": h for h in topology.APP_HOSTS
    }
    access = checks.parse_access_log(
        (cluster.run_dir / "nginx" / "access.log").read_text(), offset, started, names
    )
    phases = build_phases(faults, load_s)
    safety = checks.check_sale(sale, answers, windows)
    liveness = checks.check_liveness(phases, access, topology.APP_HOSTS)
    statuses = Counter(str(a["s"]) for a in answers)
    paused = None
    if pauser is not None and pauser.token is not None:
        mine = [o for o in sale.orders if o[3] == pauser.token]
        newer = [o for o in sale.orders if o[3] is not None and o[3] > pauser.token]
        paused = (
            f"token {pauser.token}: "
            + (
                f"its order {mine[0][0]} was written before the pause"
                if mine and (not newer or mine[0][0] < newer[0][0])
                else "made no order"
                if not mine
                else f"order {mine[0][0]} written AFTER a newer holder's"
            )
            + f"; {len(newer)} orders by newer holders"
        )
    all_checks = safety + liveness
    report = {
        "negative_control": bool(args.negative_control),
        "users": args.users,
        "duration_arg": args.duration,
        "load_s": load_s,
        "locust_exit": locust.returncode,
        "locust_log_tail": log_tail(cluster.logs / "locust.log", 5),
        "statuses": dict(sorted(statuses.items())),
        "sale": {
            "initial_stock": sale.initial_stock,
            "stock": sale.stock,
            "orders": len(sale.orders),
        },
        "windows": len(windows),
        "paused_purchase": paused,
        "faults": faults,
        "phases": [
            {
                "name": p.name,
                "start": round(p.start, 2),
                "end": round(p.end, 2),
                **p.stats,
            }
            for p in phases
        ],
        "checks": [
            {"name": c.name, "ok": c.ok, "detail": c.detail, "kind": kind}
            for kind, group in (("safety", safety), ("liveness", liveness))
            for c in group
        ],
        "series": series(access, load_s),
        "unavailable_reasons": checks.unavailable_reasons(
            [
                (cluster.logs / f"{host}.log").read_text(errors="replace")
                for host in topology.APP_HOSTS
                if (cluster.logs / f"{host}.log").exists()
            ]
        ),
        "html": str(html),
        "ok": all(c.ok for c in all_checks),
    }
    return report


def build_phases(faults: list[dict[str, Any]], load_s: float) -> list[checks.Phase]:
    """The run cut into stretches: each fault, and the calm between them."""
    phases = []
    previous = 0.0
    for fault in faults:
        if fault["start"] > previous:
            phases.append(checks.Phase("calm", previous, fault["start"]))
        phases.append(
            checks.Phase(
                fault["name"],
                fault["start"],
                fault["end"],
                tuple(fault["minority_hosts"]),
                heal_host=fault["heal_host"],
            )
        )
        previous = fault["end"]
    if load_s > previous:
        phases.append(checks.Phase("calm", previous, load_s))
    return phases


def series(answers: list[checks.Answer], load_s: float) -> dict[str, Any]:
    """Per-second counts by app host: orders (201) and errors (423, 503, 5xx, 0)."""
    seconds = int(load_s) + 1
    orders: dict[str, list[int]] = defaultdict(lambda: [0] * seconds)
    errors: dict[str, list[int]] = defaultdict(lambda: [0] * seconds)
    for answer in answers:
        index = int(answer.at)
        if not 0 <= index < seconds:
            continue
        if answer.status == 201:
            orders[answer.host][index] += 1
        elif answer.status not in (409,):
            errors[answer.host][index] += 1
    return {"seconds": seconds, "orders": dict(orders), "errors": dict(errors)}


def format_report(report: dict[str, Any]) -> str:
    lines = [
        "=" * 78,
        "Flash sale across namespace hosts"
        + (" -- NEGATIVE CONTROL" if report["negative_control"] else "")
        + f": {report['users']} users through nginx, 3 app hosts, 5 Redis hosts",
        f"  time: setup {report.get('setup_s')} s, load {report['load_s']} s, "
        f"total {report.get('total_s')} s",
        "  answers: " + ", ".join(f"{k}: {v}" for k, v in report["statuses"].items()),
        f"  sale: {report['sale']['orders']} orders, stock "
        f"{report['sale']['stock']} of {report['sale']['initial_stock']}; "
        f"{report['windows']} lock windows recorded",
        "  faults (s since the load began, CLOCK_MONOTONIC):",
    ]
    for f in report["faults"]:
        lines.append(
            f"    +{f['start']:7.2f} .. +{f['end']:7.2f}  {f['name']}: {f['detail']}"
        )
    lines.append("  phases: orders/s, answers per app host, recovery after the heal")
    for p in report["phases"]:
        hosts = "; ".join(
            f"{h} " + ",".join(f"{s}x{n}" for s, n in counts.items())
            for h, counts in p["per_host"].items()
        )
        recovery = (
            "" if p["recovery_s"] is None else f", recovered in {p['recovery_s']} s"
        )
        if p.get("median_503_ms") is not None:
            recovery += f", 503s in {p['median_503_ms']} ms (median)"
        lines.append(
            f"    {p['start']:7.1f}-{p['end']:7.1f} {p['name']:<24} "
            f"{p['orders_per_s']:6.1f}/s{recovery}  [{hosts}]"
        )
    if report.get("paused_purchase"):
        lines.append(f"  the paused worker's purchase: {report['paused_purchase']}")
    if report.get("unavailable_reasons"):
        lines.append("  why the app hosts answered 503 (their logs, commonest first):")
        for why, count in report["unavailable_reasons"]:
            lines.append(f"    {count:5d}x {why[:300]}")
    lines.append("  invariants:")
    for c in report["checks"]:
        if c["kind"] == "liveness" and c["ok"]:
            continue
        lines.append(f"    {'ok  ' if c['ok'] else 'FAIL'} {c['name']}: {c['detail']}")
    passed = sum(1 for c in report["checks"] if c["kind"] == "liveness" and c["ok"])
    total = sum(1 for c in report["checks"] if c["kind"] == "liveness")
    lines.append(f"    liveness: {passed} of {total} per-phase checks held")
    lines.append(f"  reports: {report['html']}, {report.get('timeline_png')}")
    if report["ok"]:
        lines.append("  RESULT: OK, every invariant held")
    else:
        failed = [c["name"] for c in report["checks"] if not c["ok"]]
        lines.append(f"  RESULT: VIOLATED: {'; '.join(failed)}")
    lines.append("=" * 78)
    return "\n".join(lines)
