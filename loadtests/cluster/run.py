"""``python -m loadtests.cluster``: the deployment on network namespaces, under faults.

One namespace per host of ``topology.HOSTS`` on a bridge made for the run: five
Redis hosts on ``deploy/redis.conf``, a PostgreSQL host (a cluster made with
``initdb`` for the run), three gunicorn app hosts with compose's shop environment,
nginx on ``deploy/nginx.conf`` (rendered for fixed upstreams) and a Locust host
buying through nginx. The nemesis (``nemesis.py``) injects faults on a schedule;
the checks (``checks.py``) decide; exit 0 when every invariant held, 1 on a
violation, 2 on a setup error, 77 when skipped (not root, tools missing).
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from harness.processes import Children, log_tail
from loadtests.cluster import checks, net, topology

REPO = topology.REPO
VENV_BIN = Path(sys.executable).parent
PG_BIN_GLOB = "/usr/lib/postgresql/*/bin"
FAKETIME_LIBS = (
    "/usr/lib/x86_64-linux-gnu/faketime/libfaketime.so.1",
    "/usr/lib/aarch64-linux-gnu/faketime/libfaketime.so.1",
    "/usr/lib/faketime/libfaketime.so.1",
)
LOCK_FILE = Path("/run/lock/rlkc-cluster.lock")
SKIP_EXIT = 77


class ClusterError(RuntimeError):
    """Setup failed: the message says which host and shows its log."""


def pg_bin() -> Path | None:
    found = sorted(Path("/").glob(PG_BIN_GLOB.lstrip("/")))
    for directory in reversed(found):
        if (directory / "initdb").exists() and (directory / "postgres").exists():
            return directory
    return None


def faketime_lib() -> str | None:
    return next((p for p in FAKETIME_LIBS if Path(p).exists()), None)


def missing_requirements() -> str | None:
    """Why the cluster cannot run here, or None."""
    if sys.platform != "linux":
        return "needs Linux network namespaces"
    if os.geteuid() != 0:
        return "needs root (network namespaces, nftables)"
    for tool in ("ip", "nft", "nginx", "redis-server", "runuser"):
        if shutil.which(tool) is None:
            return f"{tool} is not installed (iproute2, nftables, nginx, redis-server)"
    if pg_bin() is None:
        return f"PostgreSQL's initdb/postgres not found in {PG_BIN_GLOB}"
    for tool in ("gunicorn", "locust"):
        if not (VENV_BIN / tool).exists():
            return f"{tool} is not in {VENV_BIN} (pip install -e '.[shop,load]')"
    try:
        import pwd

        pwd.getpwnam("postgres")
    except KeyError:
        return "no 'postgres' user to run PostgreSQL as (initdb refuses root)"
    if faketime_lib() is None:
        return "libfaketime is not installed (Debian: faketime)"
    with contextlib.suppress(ImportError):
        import psycopg  # noqa: F401

        return None
    return "psycopg is not installed (pip install -e '.[shop]')"


class Cluster:
    """The hosts of one run: started in order, torn down in reverse, always."""

    def __init__(self, run_dir: Path, env_overrides: dict[str, str]) -> None:
        self.run_dir = run_dir
        self.logs = run_dir / "logs"
        self.lock_log = run_dir / "locks"
        self.children = Children()
        self.addresses: dict[str, str] = {}
        self.redis: dict[str, subprocess.Popen[bytes]] = {}
        self.apps: dict[str, subprocess.Popen[bytes]] = {}
        self.shop_env = {**topology.SHOP_ENV, **env_overrides}
        self.pg_dir = Path(tempfile.mkdtemp(prefix="rlkc-pg-"))
        self.pg_bin = pg_bin() or Path("/nonexistent")

    # -- environment --------------------------------------------------------------

    def base_env(self) -> dict[str, str]:
        return {
            "PATH": f"{VENV_BIN}:/usr/sbin:/usr/bin:/sbin:/bin",
            "PYTHONPATH": str(REPO),
            "PYTHONUNBUFFERED": "1",
            "LANG": "C.UTF-8",
            "HOME": str(self.run_dir),
        }

    def app_env(self, host: str) -> dict[str, str]:
        return {
            **self.base_env(),
            **self.shop_env,
            "DJANGO_SETTINGS_MODULE": "shop.settings",
            "CLUSTER_LOCK_LOG": str(self.lock_log),
            "CLUSTER_HOST": host,
        }

    def url(self, host: str, port: int, path: str = "/") -> str:
        return f"http://{self.addresses[host]}:{port}{path}"

    # -- hosts --------------------------------------------------------------------

    def start(self) -> None:
        for directory in (self.logs, self.lock_log):
            directory.mkdir(parents=True, exist_ok=True)
        self.addresses = net.setup(net.pick_subnet())
        for name in topology.REDIS_HOSTS:
            self.start_redis(name)
        self.start_postgres()
        self.manage("app1", topology.MIGRATE_COMMAND[2:])
        for name in topology.APP_HOSTS:
            self.start_app(name)
        self.start_nginx()

    def start_redis(self, name: str, *, empty: bool = False) -> None:
        data = self.run_dir / "redis" / name
        if empty:
            shutil.rmtree(data, ignore_errors=True)
        data.mkdir(parents=True, exist_ok=True)
        command = net.in_ns(
            name, "redis-server", str(REPO / topology.REDIS_CONF), "--dir", str(data)
        )
        self.redis[name] = self.children.start(
            name, command, self.base_env(), self.logs / f"{name}.log"
        )
        self.wait_tcp(name, topology.REDIS_PORT, self.redis[name])

    def kill_redis(self, name: str) -> None:
        process = self.redis.pop(name)
        with contextlib.suppress(ProcessLookupError):
            os.kill(process.pid, signal.SIGKILL)
        process.wait(10)
        self.children.processes = [
            (n, p) for n, p in self.children.processes if p is not process
        ]

    def start_postgres(self) -> None:
        data, sock = self.pg_dir / "data", self.pg_dir / "sock"
        sock.mkdir()
        shutil.chown(self.pg_dir, "postgres")
        shutil.chown(sock, "postgres")
        self.pg_dir.chmod(0o755)
        subprocess.run(
            ["runuser", "-u", "postgres", "--", str(self.pg_bin / "initdb"),
             "-D", str(data), "-U", "postgres", "--auth-local=trust",
             "--auth-host=scram-sha-256", "-E", "UTF8"],
            check=True, capture_output=True, cwd=self.pg_dir,
        )  # fmt: skip
        subnet = self.addresses[topology.POSTGRES_HOST].rsplit(".", 1)[0] + ".0/24"
        with (data / "pg_hba.conf").open("a") as hba:
            hba.write(f"host all all {subnet} scram-sha-256\n")
        command = net.in_ns(
            topology.POSTGRES_HOST, "runuser", "-u", "postgres", "--",
            str(self.pg_bin / "postgres"), "-D", str(data),
            "-c", "listen_addresses=*", "-c", f"port={topology.POSTGRES_PORT}",
            "-c", f"unix_socket_directories={sock}",
        )  # fmt: skip
        process = self.children.start(
            "postgres", command, self.base_env(), self.logs / "postgres.log"
        )
        self.wait_tcp(topology.POSTGRES_HOST, topology.POSTGRES_PORT, process)
        statements = (
            f"CREATE ROLE {topology.POSTGRES_USER} LOGIN "
            f"PASSWORD '{topology.POSTGRES_PASSWORD}'",
            f"CREATE DATABASE {topology.POSTGRES_DB} OWNER {topology.POSTGRES_USER}",
        )
        for statement in statements:
            deadline = time.monotonic() + 20
            while True:
                result = subprocess.run(
                    net.in_ns(topology.POSTGRES_HOST, "runuser", "-u", "postgres",
                              "--", "psql", "-h", str(sock), "-p",
                              str(topology.POSTGRES_PORT), "-d", "postgres",
                              "-v", "ON_ERROR_STOP=1", "-c", statement),
                    capture_output=True, text=True,
                )  # fmt: skip
                if result.returncode == 0:
                    break
                if time.monotonic() > deadline:
                    raise ClusterError(f"postgres: {statement.split()[:2]}: "
                                       f"{result.stderr.strip()}")  # fmt: skip
                time.sleep(0.3)

    def manage(self, host: str, args: list[str]) -> str:
        command = net.in_ns(host, str(VENV_BIN / "python"), "manage.py", *args)
        result = subprocess.run(
            command,
            cwd=REPO,
            env=self.app_env(host),
            capture_output=True,
            text=True,
            timeout=180,
        )
        if result.returncode != 0:
            raise ClusterError(
                f"{host}: manage.py {' '.join(args)} failed:\n"
                f"{result.stdout[-2000:]}{result.stderr[-2000:]}"
            )
        return result.stdout

    def start_app(self, name: str, *, extra_env: dict[str, str] | None = None) -> None:
        command = net.in_ns(
            name,
            str(VENV_BIN / "gunicorn"),
            *topology.GUNICORN_COMMAND[1:],
            "--config",
            "python:loadtests.cluster.hooks",
        )
        env = {**self.app_env(name), **(extra_env or {})}
        self.apps[name] = self.children.start(
            name, command, env, self.logs / f"{name}.log"
        )
        self.wait_http(self.url(name, topology.APP_PORT, "/shop/"), self.apps[name])

    def stop_app(self, name: str) -> None:
        process = self.apps.pop(name)
        self.children.stop(process)
        self.children.processes = [
            (n, p) for n, p in self.children.processes if p is not process
        ]

    def start_nginx(self) -> None:
        root = self.run_dir / "nginx"
        root.mkdir(exist_ok=True)
        for temp in ("body", "proxy", "fastcgi", "uwsgi", "scgi"):
            (root / temp).mkdir(exist_ok=True)
            (root / temp).chmod(0o777)
        rendered = topology.render_nginx((REPO / topology.NGINX_CONF).read_text())
        (root / "default.conf").write_text(rendered)
        (root / "nginx.conf").write_text(
            f"""# Generated by loadtests/cluster: deploy/nginx.conf inside a main file.
daemon off;
worker_processes 1;
pid {root}/nginx.pid;
error_log {root}/error.log warn;
events {{ worker_connections 1024; }}
http {{
    log_format cluster '$msec $upstream_addr $status $request_time';
    access_log {root}/access.log cluster;
    client_body_temp_path {root}/body;
    proxy_temp_path {root}/proxy;
    fastcgi_temp_path {root}/fastcgi;
    uwsgi_temp_path {root}/uwsgi;
    scgi_temp_path {root}/scgi;
    include {root}/default.conf;
}}
"""
        )
        test = subprocess.run(
            net.in_ns(topology.NGINX_HOST, "nginx", "-t", "-p", str(root), "-c",
                      str(root / "nginx.conf")),
            capture_output=True, text=True,
        )  # fmt: skip
        if test.returncode != 0:
            raise ClusterError(f"nginx -t: {test.stderr.strip()}")
        command = net.in_ns(
            topology.NGINX_HOST,
            "nginx",
            "-p",
            str(root),
            "-c",
            str(root / "nginx.conf"),
        )
        process = self.children.start(
            "nginx", command, self.base_env(), self.logs / "nginx.log"
        )
        self.wait_http(
            self.url(topology.NGINX_HOST, topology.NGINX_PORT, "/nginx-health"), process
        )

    def seed(self, stock: int) -> int:
        output = self.manage("app1", ["seed_sale", "--stock", str(stock)])
        last = output.strip().splitlines()[-1]
        if not last.startswith("product_id="):
            raise ClusterError(f"seed_sale printed no product_id=: {output}")
        return int(last.split("=", 1)[1])

    # -- waiting ------------------------------------------------------------------

    def wait_tcp(
        self,
        host: str,
        port: int,
        process: subprocess.Popen[bytes],
        timeout: float = 30.0,
    ) -> None:
        import socket

        deadline = time.monotonic() + timeout
        while True:
            address = (self.addresses[host], port)
            with contextlib.suppress(OSError), socket.create_connection(address, 0.5):
                return
            self._still_waiting(host, process, deadline)

    def wait_http(
        self, url: str, process: subprocess.Popen[bytes], timeout: float = 60.0
    ) -> None:
        deadline = time.monotonic() + timeout
        while True:
            try:
                with urllib.request.urlopen(url, timeout=3) as reply:
                    if reply.status < 500:
                        return
            except urllib.error.HTTPError as exc:
                if exc.code < 500:
                    return
            except OSError:
                pass
            self._still_waiting(url, process, deadline)

    def _still_waiting(
        self, what: str, process: subprocess.Popen[bytes], deadline: float
    ) -> None:
        name = next((n for n, p in self.children.processes if p is process), what)
        if process.poll() is not None or time.monotonic() > deadline:
            raise ClusterError(
                f"{what} did not come up "
                f"({'exited' if process.poll() is not None else 'timed out'}); "
                f"log:\n{log_tail(self.logs / f'{name}.log')}"
            )
        time.sleep(0.1)

    # -- teardown -----------------------------------------------------------------

    def stop(self) -> list[str]:
        # A SIGSTOPped worker would never see SIGTERM: wake everything first.
        for _, process in self.children.processes:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGCONT)
        self.children.stop_all()
        removed = net.teardown()
        shutil.rmtree(self.pg_dir, ignore_errors=True)
        return removed

    # -- reading the results ------------------------------------------------------

    def sale(self, product_id: int) -> checks.Sale:
        import psycopg

        with psycopg.connect(
            host=self.addresses[topology.POSTGRES_HOST],
            port=topology.POSTGRES_PORT,
            user=topology.POSTGRES_USER,
            password=topology.POSTGRES_PASSWORD,
            dbname=topology.POSTGRES_DB,
            connect_timeout=10,
        ) as conn:
            row = conn.execute(
                "SELECT initial_stock, stock FROM shop_product WHERE id = %s",
                (product_id,),
            ).fetchone()
            if row is None:
                raise ClusterError(f"product {product_id} is not in PostgreSQL")
            orders = conn.execute(
                "SELECT id, customer, quantity, fencing_token FROM shop_order "
                "WHERE product_id = %s ORDER BY id",
                (product_id,),
            ).fetchall()
        return checks.Sale(int(row[0]), int(row[1]), [tuple(o) for o in orders])


def acquire_run_lock() -> Any:
    LOCK_FILE.parent.mkdir(parents=True, exist_ok=True)
    handle = LOCK_FILE.open("w")
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        raise ClusterError(
            f"another cluster run holds {LOCK_FILE}; wait for it to finish"
        ) from None
    return handle


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m loadtests.cluster",
        description="The flash sale on network-namespace hosts under a nemesis.",
    )
    parser.add_argument(
        "--duration",
        type=float,
        default=180.0,
        help="seconds of load under the nemesis (default 180, >= 40)",
    )
    parser.add_argument("--users", type=int, default=16)
    parser.add_argument("--spawn-rate", type=float, default=8.0)
    parser.add_argument(
        "--stock",
        type=int,
        default=50_000,
        help="units on sale (default 50000: the sale must not end "
        "before the faults do)",
    )
    parser.add_argument(
        "--negative-control",
        action="store_true",
        help="break the restart rule on purpose: the checks must fail",
    )
    parser.add_argument(
        "--only",
        default="",
        metavar="NAMES",
        help="run only these faults, separated by semicolons, each as often as named "
        "(e.g. 'one-way redis2;one-way redis2': a fault under study, repeated)",
    )
    parser.add_argument("--run-dir", type=Path, default=REPO / ".cluster")
    parser.add_argument("--reports-dir", type=Path, default=REPO / "reports")
    parser.add_argument("--summary-json", type=Path, default=None)
    parser.add_argument(
        "--no-teardown-check", action="store_true", help=argparse.SUPPRESS
    )
    args = parser.parse_args(argv)  # fmt: skip
    if args.duration < 40:
        parser.error("--duration must be at least 40 seconds (the schedule's faults)")
    if args.users < 1 or args.stock < 1:
        parser.error("--users and --stock must be at least 1")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    why = missing_requirements()
    if why is not None:
        print(f"skipped: {why}")
        return SKIP_EXIT
    from loadtests.cluster import nemesis, timeline

    try:
        run_lock = acquire_run_lock()
    except ClusterError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    stale = net.teardown()
    # PostgreSQL directories of killed runs (the run lock says none is running).
    for directory in Path(tempfile.gettempdir()).glob("rlkc-pg-*"):
        shutil.rmtree(directory, ignore_errors=True)
        stale.append(str(directory))
    if stale:
        print(f"removed stale hosts of an earlier run: {', '.join(stale)}")
    shutil.rmtree(args.run_dir, ignore_errors=True)
    args.run_dir.mkdir(parents=True)
    args.reports_dir.mkdir(parents=True, exist_ok=True)
    overrides = {"SHOP_WORK_MS": "200"} if args.negative_control else {}
    cluster = Cluster(args.run_dir, overrides)

    def terminate(signum: int, frame: Any) -> None:
        raise SystemExit(128 + signum)

    previous = signal.signal(signal.SIGTERM, terminate)
    began = time.monotonic()
    try:
        print(f"cluster: {len(topology.HOSTS)} hosts on namespaces {net.PREFIX}-*")
        cluster.start()
        product_id = cluster.seed(args.stock)
        setup_s = time.monotonic() - began
        print(
            f"  up in {setup_s:.1f} s: "
            + ", ".join(f"{h} {a}" for h, a in cluster.addresses.items())
        )
        report = nemesis.run(cluster, args, product_id, faketime_lib() or "")
        report["setup_s"] = round(setup_s, 1)
        picture = args.reports_dir / (
            "cluster-negative.png" if args.negative_control else "cluster.png"
        )
        try:
            timeline.draw(report, picture)
            report["timeline_png"] = str(picture)
        except ImportError as exc:
            report["timeline_png"] = (
                f"not drawn: {exc.name} is not installed (pip install -e '.[load]')"
            )
    except ClusterError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted: tearing down", file=sys.stderr)
        return 130
    finally:
        removed = cluster.stop()
        signal.signal(signal.SIGTERM, previous)
        left = net.stale_namespaces()
        print(
            f"teardown: removed {len(removed)} namespaces/links"
            + (f"; LEFT BEHIND: {left}" if left else "")
        )
        run_lock.close()
    report["total_s"] = round(time.monotonic() - began, 1)
    text = nemesis.format_report(report)
    print(text)
    summary = args.summary_json or args.reports_dir / (
        "cluster-negative.json" if args.negative_control else "cluster.json"
    )
    summary.write_text(json.dumps(report, indent=2, default=str))
    return 0 if report["ok"] else 1
