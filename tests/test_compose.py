"""docker-compose.yml agrees with the shop's settings, nginx and the Redis nodes.

Docker is not available where the tests run, so the compose file is checked by
reading it, as ``docker compose config`` would, and against the files it mounts
(deploy/nginx.conf, deploy/redis.conf), the Dockerfile and shop/settings.py (run in
a subprocess with the compose environment, recording every variable it reads).

Each ``check_*`` function returns a list of problems; the real deployment has none,
and every check is shown to catch a deliberately broken copy.
"""

from __future__ import annotations

import copy
import json
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time
import tomllib
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import dj_database_url
import pytest
import redis
import yaml

from redlock_django import conf

ROOT = Path(__file__).resolve().parent.parent
COMPOSE_FILE = ROOT / "docker-compose.yml"

# Variables of the shop's contract (issue 4) that compose must set in any case.
REQUIRED_SHOP_ENV = {
    "DATABASE_URL",
    "REDLOCK_NODES",
    "DEBUG",
    "SECRET_KEY",
    "ALLOWED_HOSTS",
    "SHOP_WORK_MS",
}
NGINX_PORT = 8000
LOCUST_WEB_PORT = 8089
GUNICORN_DEFAULT_BIND = "127.0.0.1:8000"
REDIS_DEFAULT_PORT = 6379
POSTGRES_DEFAULT_PORT = 5432
CONDITIONS = {
    "service_started",
    "service_healthy",
    "service_completed_successfully",
}
TOP_LEVEL_KEYS = {"name", "services", "networks", "volumes", "configs", "secrets"}


# --- loading, the way `docker compose config` normalises the file ---------------


_VARIABLE = re.compile(
    r"\$(?:(?P<escaped>\$)"
    r"|\{(?P<braced>[A-Za-z_][A-Za-z0-9_]*)(?:(?P<op>:?[-?+])(?P<arg>[^}]*))?\}"
    r"|(?P<named>[A-Za-z_][A-Za-z0-9_]*))"
)


def interpolate(value: Any, env: dict[str, str]) -> Any:
    """Substitute ``$VAR`` / ``${VAR:-default}`` in every string, as Compose does."""
    if isinstance(value, dict):
        return {key: interpolate(item, env) for key, item in value.items()}
    if isinstance(value, list):
        return [interpolate(item, env) for item in value]
    if not isinstance(value, str):
        return value

    def substitute(match: re.Match[str]) -> str:
        if match["escaped"]:
            return "$"
        name = match["braced"] or match["named"]
        op, arg = match["op"], match["arg"] or ""
        current = env.get(name)
        unset = current is None or (
            op is not None and op.startswith(":") and not current
        )
        if op in ("-", ":-"):
            return arg if unset else str(current)
        if op in ("?", ":?"):
            if unset:
                raise ValueError(f"required variable {name} is unset: {arg}")
            return str(current)
        if op in ("+", ":+"):
            return "" if unset else arg
        if current is None:
            raise ValueError(f"variable {name} is unset and has no default")
        return current

    return _VARIABLE.sub(substitute, value)


def load_compose(text: str, env: dict[str, str] | None = None) -> dict[str, Any]:
    """Parse and interpolate a compose file (anchors and ``<<`` merges resolved)."""
    data = yaml.safe_load(text)
    assert isinstance(data, dict), "the compose file must be a mapping"
    return interpolate(data, env or {})


def as_list(command: Any) -> list[str]:
    """Return a command (a string or a list) as an argument list."""
    if command is None:
        return []
    if isinstance(command, str):
        return shlex.split(command)
    return [str(item) for item in command]


def environment(service: dict[str, Any]) -> dict[str, str | None]:
    """Return a service's environment as a mapping, from either compose form."""
    env = service.get("environment") or {}
    if isinstance(env, list):
        pairs = (item.split("=", 1) for item in env)
        return {pair[0]: (pair[1] if len(pair) > 1 else None) for pair in pairs}
    return {key: (None if value is None else str(value)) for key, value in env.items()}


def published(service: dict[str, Any]) -> dict[int, int]:
    """Return a service's published ports as ``{host port: container port}``."""
    ports: dict[int, int] = {}
    for entry in service.get("ports") or []:
        if isinstance(entry, dict):
            ports[int(entry["published"])] = int(entry["target"])
            continue
        parts = str(entry).split("/")[0].split(":")
        if len(parts) == 1:
            continue  # container port only: Docker picks a random host port
        ports[int(parts[-2])] = int(parts[-1])
    return ports


def option(args: list[str], *names: str) -> str | None:
    """Return the value of ``--name value`` / ``--name=value`` (the last one)."""
    found = None
    for index, arg in enumerate(args):
        for name in names:
            if arg == name and index + 1 < len(args):
                found = args[index + 1]
            elif arg.startswith(name + "=") and name.startswith("--"):
                found = arg.split("=", 1)[1]
    return found


def depends_on(service: dict[str, Any]) -> dict[str, str]:
    """Return ``{service: condition}`` from either form of ``depends_on``."""
    deps = service.get("depends_on") or {}
    if isinstance(deps, list):
        return dict.fromkeys(deps, "service_started")
    return {
        name: (spec or {}).get("condition", "service_started")
        for name, spec in deps.items()
    }


@dataclass
class Deployment:
    """The compose file plus the repository files it refers to (overridable)."""

    compose: dict[str, Any]
    files: dict[str, str] = field(default_factory=dict)

    @property
    def services(self) -> dict[str, dict[str, Any]]:
        return self.compose.get("services") or {}

    def read(self, path: str) -> str | None:
        """Return a repository file's text (an override first), None if missing."""
        path = path.removeprefix("./")
        if path in self.files:
            return self.files[path]
        target = ROOT / path
        return target.read_text() if target.is_file() else None

    def mounted(self, service: dict[str, Any], container_path: str) -> str | None:
        """Return the repository path bind-mounted at ``container_path``."""
        for volume in service.get("volumes") or []:
            if isinstance(volume, dict):
                source, target = volume.get("source", ""), volume.get("target", "")
            else:
                source, target = ([*str(volume).split(":"), ""])[:2]
            if target == container_path and source.startswith("."):
                return source
        return None

    def shop_services(self) -> dict[str, dict[str, Any]]:
        """Return the services that run the shop (they get DATABASE_URL)."""
        return {
            name: service
            for name, service in self.services.items()
            if "DATABASE_URL" in environment(service)
        }

    def gunicorn_services(self) -> dict[str, dict[str, Any]]:
        return {
            name: service
            for name, service in self.services.items()
            if as_list(service.get("command"))[:1] == ["gunicorn"]
        }

    def shop_env(self) -> dict[str, str | None]:
        """Return the environment of the (first) gunicorn service."""
        for service in self.gunicorn_services().values():
            return environment(service)
        return {}

    def redlock_nodes(self) -> list[str]:
        value = self.shop_env().get("REDLOCK_NODES") or ""
        return [item.strip() for item in value.split(",") if item.strip()]


def real_deployment() -> Deployment:
    return Deployment(load_compose(COMPOSE_FILE.read_text()))


# --- the checks ---------------------------------------------------------------


def check_structure(d: Deployment) -> list[str]:
    """Check what ``docker compose config`` would refuse or silently ignore."""
    problems = []
    for key in d.compose:
        if key not in TOP_LEVEL_KEYS and not key.startswith("x-"):
            problems.append(f"unknown top-level key {key!r}")
    declared_volumes = set(d.compose.get("volumes") or {})
    for name, service in d.services.items():
        if "image" not in service and "build" not in service:
            problems.append(f"service {name} has neither image nor build")
        for dep, condition in depends_on(service).items():
            if dep not in d.services:
                problems.append(f"service {name} depends on unknown service {dep}")
                continue
            if condition not in CONDITIONS:
                problems.append(f"service {name}: unknown condition {condition!r}")
            if condition == "service_healthy" and "healthcheck" not in d.services[dep]:
                problems.append(
                    f"service {name} waits for {dep} to be healthy, "
                    f"but {dep} has no healthcheck"
                )
            if condition == "service_completed_successfully" and d.services[dep].get(
                "restart", "no"
            ) not in ("no", "on-failure"):
                problems.append(
                    f"service {name} waits for {dep} to complete, "
                    f"but {dep} restarts (restart: {d.services[dep]['restart']})"
                )
        for key, value in environment(service).items():
            if value is not None and not isinstance(value, str):
                problems.append(f"service {name}: {key} is not a string")
        for volume in service.get("volumes") or []:
            source = str(volume).split(":")[0] if isinstance(volume, str) else ""
            if source.startswith((".", "/")):
                if source.startswith(".") and d.read(source) is None:
                    problems.append(f"service {name} mounts missing file {source}")
            elif source and source not in declared_volumes:
                problems.append(f"service {name} uses undeclared volume {source}")
    # depends_on must not loop: Compose could never start such services.
    state: dict[str, int] = {}

    def visit(name: str, path: list[str]) -> None:
        if state.get(name) == 1:
            problems.append("depends_on cycle: " + " -> ".join([*path, name]))
            return
        if state.get(name) == 2 or name not in d.services:
            return
        state[name] = 1
        for dep in depends_on(d.services[name]):
            visit(dep, [*path, name])
        state[name] = 2

    for name in d.services:
        visit(name, [])
    return problems


def parse_redis_conf(text: str) -> dict[str, str]:
    """Parse redis.conf directives (last one wins, names lower-cased)."""
    config = {}
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        words = shlex.split(line)
        config[words[0].lower()] = " ".join(words[1:])
    return config


def redis_config(d: Deployment, service: dict[str, Any]) -> dict[str, str]:
    """Return the effective configuration: the mounted file, then ``--x y`` args."""
    args = as_list(service.get("command"))
    config: dict[str, str] = {}
    rest = args[1:] if args[:1] == ["redis-server"] else args
    if rest and not rest[0].startswith("--"):
        source = d.mounted(service, rest[0])
        text = d.read(source) if source else None
        if text is None:
            return {"error": f"config file {rest[0]} is not mounted from the repo"}
        config.update(parse_redis_conf(text))
        rest = rest[1:]
    index = 0
    while index < len(rest):
        name = rest[index].removeprefix("--").lower()
        values = []
        index += 1
        while index < len(rest) and not rest[index].startswith("--"):
            values.append(rest[index])
            index += 1
        config[name] = " ".join(values)
    return config


def check_redis(d: Deployment) -> list[str]:
    """Check every REDLOCK_NODES entry against a persistent Redis service."""
    problems = []
    urls = d.redlock_nodes()
    if len(urls) < 3 or len(urls) % 2 == 0:
        problems.append(
            f"REDLOCK_NODES lists {len(urls)} nodes: need an odd count >= 3"
        )
    hosts = []
    for url in urls:
        parts = urlsplit(url)
        host, port = parts.hostname or "", parts.port or REDIS_DEFAULT_PORT
        hosts.append(host)
        service = d.services.get(host)
        if parts.scheme not in ("redis", "rediss") or service is None:
            problems.append(f"node {url}: no service named {host!r}")
            continue
        if not str(service.get("image", "")).startswith("redis:"):
            problems.append(f"node {url}: service {host} is not a redis image")
        config = redis_config(d, service)
        if "error" in config:
            problems.append(f"node {url}: {config['error']}")
            continue
        listens = int(config.get("port", REDIS_DEFAULT_PORT))
        if listens != port:
            problems.append(f"node {url}: {host} listens on port {listens}, not {port}")
        expected = {
            "appendonly": "yes",
            "appendfsync": "always",
            "maxmemory-policy": "noeviction",
        }
        for name, value in expected.items():
            if config.get(name, "").lower() != value:
                problems.append(f"node {url}: {host} needs {name} {value}")
        if config.get("no-appendfsync-on-rewrite", "no").lower() == "yes":
            problems.append(f"node {url}: no-appendfsync-on-rewrite yes skips fsyncs")
        if not any(
            str(volume).endswith(":/data") for volume in service.get("volumes") or []
        ):
            problems.append(f"node {url}: {host} keeps its AOF in no volume (/data)")
        if published(service):
            problems.append(f"node {url}: {host} publishes ports (it has no password)")
    if len(set(hosts)) != len(hosts):
        problems.append("REDLOCK_NODES lists one service twice")
    for name, service in d.services.items():
        if str(service.get("image", "")).startswith("redis:") and name not in hosts:
            problems.append(f"redis service {name} is not in REDLOCK_NODES")
    return problems


def check_redlock_setting(d: Deployment) -> list[str]:
    """Validate the nodes with the library's own REDLOCK checks."""
    return [
        f"{problem.level} {problem.id}: {problem.msg}"
        for problem in conf.validate({"NODES": d.redlock_nodes()})
    ]


def check_database(d: Deployment) -> list[str]:
    """Check DATABASE_URL against the postgres service's POSTGRES_* settings."""
    problems = []
    urls = {environment(s).get("DATABASE_URL") for s in d.shop_services().values()}
    if len(urls) != 1:
        return [f"the shop services disagree on DATABASE_URL: {sorted(map(str, urls))}"]
    db = dj_database_url.parse(str(urls.pop()))
    service = d.services.get(db["HOST"])
    if service is None:
        return [f"DATABASE_URL host {db['HOST']!r} is not a service"]
    if db["ENGINE"] != "django.db.backends.postgresql":
        problems.append(f"DATABASE_URL engine is {db['ENGINE']}")
    if not str(service.get("image", "")).startswith("postgres:"):
        problems.append(f"service {db['HOST']} is not a postgres image")
    env = environment(service)
    user = env.get("POSTGRES_USER") or "postgres"
    expected = {
        "USER": user,
        "PASSWORD": env.get("POSTGRES_PASSWORD"),
        "NAME": env.get("POSTGRES_DB") or user,
        "PORT": POSTGRES_DEFAULT_PORT,
    }
    for key, value in expected.items():
        if db[key] != value:
            problems.append(
                f"DATABASE_URL {key} is {db[key]!r}, the service's {value!r}"
            )
    if "healthcheck" not in service:
        problems.append(f"service {db['HOST']} has no healthcheck")
    return problems


def parse_nginx(text: str) -> list[tuple[str, list[str], list[Any] | None]]:
    """Parse nginx configuration into ``(directive, args, children)`` tuples."""
    tokens = re.findall(r'"(?:[^"\\]|\\.)*"|[{};]|[^\s{};"]+', re.sub(r"#.*", "", text))
    position = 0

    def block() -> list[tuple[str, list[str], list[Any] | None]]:
        nonlocal position
        items = []
        words: list[str] = []
        while position < len(tokens):
            token = tokens[position]
            position += 1
            if token == ";":
                items.append((words[0], words[1:], None))
                words = []
            elif token == "{":
                items.append((words[0], words[1:], block()))
                words = []
            elif token == "}":
                return items
            else:
                words.append(token.strip('"'))
        return items

    return block()


def nginx_listen(tree: list[Any]) -> set[int]:
    return {
        int(args[0].split(":")[-1])
        for name, _, children in tree
        if name == "server" and children
        for directive, args, _ in children
        if directive == "listen"
    }


def gunicorn_port(service: dict[str, Any]) -> tuple[str, int]:
    bind = option(as_list(service.get("command")), "--bind", "-b")
    host, _, port = (bind or GUNICORN_DEFAULT_BIND).rpartition(":")
    return host, int(port)


def nginx_tree(d: Deployment) -> list[Any] | None:
    service = d.services.get("nginx") or {}
    source = d.mounted(service, "/etc/nginx/conf.d/default.conf")
    text = d.read(source) if source else None
    return None if text is None else parse_nginx(text)


def check_nginx(d: Deployment) -> list[str]:
    """Check that nginx proxies to every gunicorn service on the port it binds."""
    tree = nginx_tree(d)
    if tree is None:
        return ["nginx: deploy/nginx.conf is not mounted as conf.d/default.conf"]
    problems = []
    upstreams = {
        args[0]: [args2 for name2, args2, _ in children if name2 == "server"]
        for name, args, children in tree
        if name == "upstream" and children
    }
    passes = [
        args[0]
        for name, _, children in tree
        if name == "server" and children
        for location, _, inner in children
        if location == "location" and inner
        for directive, args, _ in inner
        if directive == "proxy_pass"
    ]
    targets = set()
    for proxy_pass in passes:
        upstream = proxy_pass.removeprefix("http://").split("/")[0]
        if upstream not in upstreams:
            problems.append(f"nginx proxy_pass {proxy_pass}: no upstream {upstream}")
            continue
        for server in upstreams[upstream]:
            host, _, port = server[0].partition(":")
            targets.add(host)
            service = d.gunicorn_services().get(host)
            if service is None:
                problems.append(f"nginx upstream server {host}: no gunicorn service")
                continue
            bind_host, bind_port = gunicorn_port(service)
            if int(port or 80) != bind_port:
                problems.append(
                    f"nginx upstream {host}:{port or 80}, gunicorn binds {bind_port}"
                )
            if bind_host in ("127.0.0.1", "localhost"):
                problems.append(f"gunicorn in {host} binds loopback only")
            if "resolve" in server and "zone" not in {
                name2
                for name, args, children in tree
                if name == "upstream" and args[0] == upstream
                for name2, _, _ in children or []
            }:
                problems.append(f"nginx upstream {upstream}: resolve needs a zone")
    for name in d.gunicorn_services():
        if name not in targets:
            problems.append(f"gunicorn service {name} is behind no nginx upstream")
    if not passes:
        problems.append("nginx has no proxy_pass")
    return problems


def check_ports(d: Deployment) -> list[str]:
    """Check the published ports: nginx on 8000, the Locust UI on 8089, no others."""
    problems = []
    tree = nginx_tree(d) or []
    nginx = published(d.services.get("nginx") or {})
    if nginx.get(NGINX_PORT) not in nginx_listen(tree):
        problems.append(f"host port {NGINX_PORT} does not reach nginx's listen port")
    master = d.services.get("locust-master") or {}
    web_port = int(
        option(as_list(master.get("command")), "--web-port", "-P") or LOCUST_WEB_PORT
    )
    if published(master).get(LOCUST_WEB_PORT) != web_port:
        problems.append(f"host port {LOCUST_WEB_PORT} does not reach the Locust UI")
    for name, service in d.services.items():
        if published(service) and name not in ("nginx", "locust-master"):
            problems.append(f"service {name} publishes {published(service)}")
    return problems


def check_locust(d: Deployment) -> list[str]:
    """Check that Locust targets nginx and its workers find the master."""
    problems = []
    tree = nginx_tree(d) or []
    masters: list[str] = []
    workers: dict[str, str | None] = {}
    envs = set()
    for name, service in d.services.items():
        args = as_list(service.get("command"))
        if args[:1] != ["locust"]:
            continue
        envs.add(json.dumps(environment(service), sort_keys=True))
        locustfile = option(args, "-f", "--locustfile")
        if not locustfile or d.read(locustfile) is None:
            problems.append(f"{name}: locustfile {locustfile} is not in the repo")
        if "--master" in args:
            masters.append(name)
        elif "--worker" in args:
            workers[name] = option(args, "--master-host")
        # Every Locust process builds its host list at start-up (workers too).
        hosts = option(args, "--app-hosts") or environment(service).get(
            "SHOP_APP_HOSTS"
        )
        if not hosts:
            problems.append(f"{name} has no --app-hosts")
        for value in filter(None, [hosts, option(args, "--host", "-H")]):
            for url in value.split(","):
                parts = urlsplit(url)
                if parts.hostname != "nginx" or parts.port not in nginx_listen(tree):
                    problems.append(
                        f"Locust targets {url}, not nginx on its listen port"
                    )
    if len(masters) != 1:
        problems.append(f"expected one Locust master, found {masters}")
    if not workers:
        problems.append("no Locust workers")
    for name, master_host in workers.items():
        if masters and master_host != masters[0]:
            problems.append(f"{name}: --master-host={master_host}, not {masters[0]}")
    if len(envs) > 1:
        problems.append("the Locust master and workers have different environments")
    return problems


_READ_SETTINGS = """
import json, os, sys

class RecordingEnviron(dict):
    reads = set()
    def __getitem__(self, key):
        self.reads.add(key)
        return super().__getitem__(key)
    def get(self, key, default=None):
        self.reads.add(key)
        return super().get(key, default)
    def __contains__(self, key):
        self.reads.add(key)
        return super().__contains__(key)
    def setdefault(self, key, default=None):
        self.reads.add(key)
        return super().setdefault(key, default)
    def pop(self, key, *default):
        self.reads.add(key)
        return super().pop(key, *default)

os.environ = RecordingEnviron(json.loads(sys.argv[1]))
from shop import settings

print(json.dumps({
    "reads": sorted(os.environ.reads),
    "database": {k: settings.DATABASES["default"].get(k)
                 for k in ("ENGINE", "HOST", "PORT", "NAME", "USER", "PASSWORD")},
    "nodes": list(settings.REDLOCK["NODES"]),
    "allowed_hosts": list(settings.ALLOWED_HOSTS),
    "debug": settings.DEBUG,
    "secret_key": settings.SECRET_KEY,
}))
"""


def read_settings(env: dict[str, str | None]) -> dict[str, Any]:
    """Import shop/settings.py with only ``env``; return what it read and built."""
    values = {key: value for key, value in env.items() if value is not None}
    result = subprocess.run(
        [sys.executable, "-c", _READ_SETTINGS, json.dumps(values)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    return json.loads(result.stdout.splitlines()[-1])


def check_environment(d: Deployment, seen: dict[str, Any]) -> list[str]:
    """Check the shop env against what shop/settings.py reads (``seen``)."""
    problems = []
    envs = {name: environment(s) for name, s in d.shop_services().items()}
    if len({json.dumps(env, sort_keys=True) for env in envs.values()}) > 1:
        problems.append(
            f"the shop services have different environments: {sorted(envs)}"
        )
    env = d.shop_env()
    reads = set(seen["reads"])
    for key in sorted(set(env) - reads):
        problems.append(f"{key} is set but shop/settings.py never reads it")
    for key in sorted(reads - set(env)):
        problems.append(f"shop/settings.py reads {key}, which compose does not set")
    for key in sorted(REQUIRED_SHOP_ENV - set(env)):
        problems.append(f"the shop's contract variable {key} is not set")
    if seen["nodes"] != d.redlock_nodes():
        problems.append(f"settings built REDLOCK NODES {seen['nodes']}")
    database = seen["database"]
    if database["HOST"] not in d.services:
        problems.append(f"settings built a database on host {database['HOST']}")
    hosts = set(seen["allowed_hosts"])
    # nginx forwards the Host header: the browser's, and "nginx" from Locust; the
    # healthcheck asks 127.0.0.1.
    for host in ("localhost", "127.0.0.1", "nginx"):
        if host not in hosts and "*" not in hosts:
            problems.append(f"ALLOWED_HOSTS lacks {host}")
    if seen["debug"]:
        problems.append("DEBUG is on in the deployment")
    return problems


def check_dependencies(d: Deployment) -> list[str]:
    """Check the start order: backends healthy, migrate once, then the replicas."""
    problems = []
    migrations = [
        name
        for name, service in d.services.items()
        if "migrate" in as_list(service.get("command"))
    ]
    if len(migrations) != 1:
        return [f"expected one one-shot migrate service, found {migrations}"]
    migrate = migrations[0]
    replicas = (d.services[migrate].get("deploy") or {}).get("replicas", 1)
    if d.services[migrate].get("restart", "no") != "no" or replicas != 1:
        problems.append(f"{migrate} must run once (restart: no, one replica)")
    backends = {dj_database_url.parse(str(d.shop_env().get("DATABASE_URL")))["HOST"]}
    backends |= {urlsplit(url).hostname or "" for url in d.redlock_nodes()}

    def waits_for(name: str, target: str, condition: str, seen: set[str]) -> bool:
        deps = depends_on(d.services.get(name) or {})
        if deps.get(target) == condition:
            return True
        return any(
            waits_for(dep, target, condition, seen | {name})
            for dep in deps
            if dep not in seen
        )

    for name in d.shop_services():
        for backend in sorted(backends):
            if not waits_for(name, backend, "service_healthy", set()):
                problems.append(f"{name} does not wait for {backend} to be healthy")
    for name in d.gunicorn_services():
        if (
            depends_on(d.services[name]).get(migrate)
            != "service_completed_successfully"
        ):
            problems.append(f"{name} does not wait for {migrate} to complete")
        if "healthcheck" not in d.services[name]:
            problems.append(f"gunicorn service {name} has no healthcheck")
    seeds = [
        name
        for name, service in d.services.items()
        if "seed_sale" in as_list(service.get("command"))
    ]
    if not seeds:
        problems.append("no seed_sale service")
    for name in seeds:
        if not waits_for(name, migrate, "service_completed_successfully", set()):
            problems.append(f"{name} does not wait for {migrate} to complete")
    nginx_deps = depends_on(d.services.get("nginx") or {})
    for name in d.gunicorn_services():
        if nginx_deps.get(name) != "service_healthy":
            problems.append(f"nginx does not wait for {name} to be healthy")
    return problems


def check_image(d: Deployment) -> list[str]:
    """Check the Dockerfile installs the servers and copies what commands run."""
    problems = []
    dockerfile = d.read("Dockerfile") or ""
    copied = [
        shlex.split(line)[1:-1]
        for line in dockerfile.splitlines()
        if line.strip().upper().startswith("COPY ")
    ]
    sources = [source.rstrip("/") for args in copied for source in args]
    # The words of every `RUN pip install`, with `.[extra]` replaced by the
    # extra's requirements from pyproject.toml.
    project = tomllib.loads(d.read("pyproject.toml") or "")["project"]
    installed = []
    for line in dockerfile.replace("\\\n", " ").splitlines():
        words = shlex.split(line.split("#")[0]) if "pip install" in line else []
        for word in words[words.index("install") + 1 :] if words else []:
            match = re.fullmatch(r"\.\[([\w,-]+)\]", word)
            extras = match[1].split(",") if match else []
            installed += [
                re.split(r"[\[<>=;\s]", dep)[0]
                for extra in extras
                for dep in project["optional-dependencies"].get(extra, [])
            ]
            installed.append(re.split(r"[\[<>=;\s]", word)[0])
    for package in ("gunicorn", "locust", "psycopg", "dj-database-url"):
        if package not in installed:
            problems.append(f"the image does not install {package}")
    ignored = [
        line.strip()
        for line in (d.read(".dockerignore") or "").splitlines()
        if line.strip() and not line.startswith("#")
    ]
    for name, service in d.services.items():
        if "build" not in service:
            continue
        args = as_list(service.get("command"))
        args += as_list((service.get("healthcheck") or {}).get("test"))
        for arg in args:
            if not re.fullmatch(r"[\w./-]+\.py", arg):
                continue
            if not any(arg == s or arg.startswith(s + "/") for s in sources):
                problems.append(f"{name} runs {arg}, which the Dockerfile never copies")
            if any(arg == i or arg.startswith(i.rstrip("/") + "/") for i in ignored):
                problems.append(f"{name} runs {arg}, which .dockerignore excludes")
    return problems


# --- tests ----------------------------------------------------------------------


@pytest.fixture(scope="module")
def deployment() -> Deployment:
    return real_deployment()


@pytest.fixture(scope="module")
def settings_seen(deployment: Deployment) -> dict[str, Any]:
    return read_settings(deployment.shop_env())


def all_problems(d: Deployment, seen: dict[str, Any]) -> list[str]:
    return [
        *check_structure(d),
        *check_redis(d),
        *check_redlock_setting(d),
        *check_database(d),
        *check_nginx(d),
        *check_ports(d),
        *check_locust(d),
        *check_environment(d, seen),
        *check_dependencies(d),
        *check_image(d),
    ]


def test_compose_file_is_structurally_valid(deployment: Deployment) -> None:
    """Every service has an image, depends_on is acyclic and names real services."""
    assert check_structure(deployment) == []


def test_redlock_nodes_are_five_persistent_redis_services(
    deployment: Deployment,
) -> None:
    """Each node the app is told about is a redis service on that port, fsyncing."""
    assert len(deployment.redlock_nodes()) == 5
    assert check_redis(deployment) == []


def test_redlock_nodes_pass_the_library_validation(deployment: Deployment) -> None:
    """conf.validate() finds no error or warning in the compose REDLOCK_NODES."""
    assert check_redlock_setting(deployment) == []


def test_database_url_matches_the_postgres_service(deployment: Deployment) -> None:
    """DATABASE_URL's host, user, password and db are the postgres service's."""
    assert check_database(deployment) == []


def test_nginx_balances_over_the_gunicorn_replicas(deployment: Deployment) -> None:
    """nginx's upstream is the app service on gunicorn's bind port."""
    assert check_nginx(deployment) == []
    replicas = deployment.services["app"]["deploy"]["replicas"]
    assert replicas >= 3


def test_published_ports_line_up(deployment: Deployment) -> None:
    """Host 8000 reaches nginx, host 8089 the Locust UI; nothing else is published."""
    assert check_ports(deployment) == []


def test_locust_targets_nginx(deployment: Deployment) -> None:
    """The Locust master targets nginx; its workers point at the master."""
    assert check_locust(deployment) == []


def test_shop_env_is_exactly_what_settings_read(
    deployment: Deployment, settings_seen: dict[str, Any]
) -> None:
    """The compose variables are the ones shop/settings.py reads, none missing."""
    assert set(settings_seen["reads"]) >= REQUIRED_SHOP_ENV
    assert check_environment(deployment, settings_seen) == []
    assert settings_seen["database"]["HOST"] == "postgres"
    assert len(settings_seen["nodes"]) == 5


def test_services_start_in_order(deployment: Deployment) -> None:
    """Backends healthy, then one migrate run, then the replicas, then nginx."""
    assert check_dependencies(deployment) == []


def test_image_copies_and_installs_what_the_commands_run(
    deployment: Deployment,
) -> None:
    """The Dockerfile installs what the shop runs with and copies the scripts."""
    assert check_image(deployment) == []


def _set_env(service: str, key: str, value: str | None) -> Callable[[Deployment], None]:
    def mutate(d: Deployment) -> None:
        # A copy: YAML aliases share one environment between services.
        env = dict(environment(d.services[service]))
        if value is None:
            env.pop(key, None)
        else:
            env[key] = value
        d.services[service]["environment"] = env

    return mutate


def _set(service: str, key: str, value: Any) -> Callable[[Deployment], None]:
    def mutate(d: Deployment) -> None:
        if value is None:
            d.services[service].pop(key, None)
        else:
            d.services[service][key] = value

    return mutate


def _edit_file(path: str, old: str, new: str) -> Callable[[Deployment], None]:
    def mutate(d: Deployment) -> None:
        text = d.read(path)
        assert text is not None and old in text, f"{old!r} not in {path}"
        d.files[path] = text.replace(old, new)

    return mutate


def _drop_service(name: str) -> Callable[[Deployment], None]:
    def mutate(d: Deployment) -> None:
        del d.services[name]

    return mutate


def _set_all_shop_env(key: str, value: str | None) -> Callable[[Deployment], None]:
    def mutate(d: Deployment) -> None:
        for name in d.shop_services():
            _set_env(name, key, value)(d)

    return mutate


FOUR_NODES = ",".join(f"redis://redis{i}:6379/0" for i in range(1, 5))
BROKEN = {
    "node missing": (_drop_service("redis3"), "no service named 'redis3'"),
    "node port": (
        _set_all_shop_env(
            "REDLOCK_NODES",
            FOUR_NODES.replace("redis1:6379", "redis1:6380") + ",redis://redis5:6379/0",
        ),
        "listens on port 6379, not 6380",
    ),
    "node on command-line port": (
        _set("redis2", "command", ["redis-server", "--port", "7000"]),
        "redis2 listens on port 7000",
    ),
    "even node count": (
        _set_all_shop_env("REDLOCK_NODES", FOUR_NODES),
        "4 nodes: need an odd count",
    ),
    "duplicate node": (
        _set_all_shop_env(
            "REDLOCK_NODES", FOUR_NODES.replace("redis4", "redis1") + ",redis://redis5"
        ),
        "redlock.E005",
    ),
    "fsync everysec": (
        _edit_file("deploy/redis.conf", "appendfsync always", "appendfsync everysec"),
        "needs appendfsync always",
    ),
    "no aof": (
        _set("redis4", "command", ["redis-server", "--appendonly", "no"]),
        "needs appendonly yes",
    ),
    "eviction": (
        _edit_file("deploy/redis.conf", "policy noeviction", "policy allkeys-lru"),
        "needs maxmemory-policy noeviction",
    ),
    "not a redis image": (_set("redis5", "image", "memcached:1.6"), "not a redis"),
    "redis published": (_set("redis1", "ports", ["6379:6379"]), "publishes ports"),
    "database host": (
        _set_all_shop_env("DATABASE_URL", "postgres://shop:shop@db:5432/shop"),
        "host 'db' is not a service",
    ),
    "database password": (
        _set_env("postgres", "POSTGRES_PASSWORD", "secret"),
        "PASSWORD is 'shop', the service's 'secret'",
    ),
    "database name": (
        _set_env("postgres", "POSTGRES_DB", "sale"),
        "NAME is 'shop', the service's 'sale'",
    ),
    "upstream port": (
        _edit_file("deploy/nginx.conf", "server app:8000", "server app:8001"),
        "nginx upstream app:8001, gunicorn binds 8000",
    ),
    "upstream host": (
        _edit_file("deploy/nginx.conf", "server app:8000", "server web:8000"),
        "nginx upstream server web: no gunicorn service",
    ),
    "nginx listen": (
        _edit_file("deploy/nginx.conf", "listen 8000", "listen 80"),
        "host port 8000 does not reach nginx",
    ),
    "locust port": (
        _set("locust-master", "ports", ["8089:8090"]),
        "host port 8089 does not reach the Locust UI",
    ),
    "app published": (_set("app", "ports", ["8001:8000"]), "service app publishes"),
    "locust target": (
        _set(
            "locust-master",
            "command",
            [
                "locust",
                "-f",
                "loadtests/locustfile.py",
                "--master",
                "--app-hosts",
                "http://app:8000",
            ],
        ),
        "Locust targets http://app:8000, not nginx",
    ),
    "worker without hosts": (
        _set(
            "locust-worker",
            "command",
            [
                "locust",
                "-f",
                "loadtests/locustfile.py",
                "--worker",
                "--master-host=locust-master",
            ],
        ),
        "locust-worker has no --app-hosts",
    ),
    "locust scenario": (
        _set_env("locust-worker", "SHOP_SCENARIO", "unsafe"),
        "different environments",
    ),
    "locust worker": (
        _set(
            "locust-worker",
            "command",
            [
                "locust",
                "-f",
                "loadtests/locustfile.py",
                "--worker",
                "--master-host=localhost",
            ],
        ),
        "--master-host=localhost",
    ),
    "misspelt variable": (
        _set_all_shop_env("REDLOCK_NODE", "redis://redis1:6379/0"),
        "REDLOCK_NODE is set but shop/settings.py never reads it",
    ),
    "missing variable": (
        _set_all_shop_env("SECRET_KEY", None),
        "reads SECRET_KEY, which compose does not set",
    ),
    "host not allowed": (
        _set_all_shop_env("ALLOWED_HOSTS", "localhost,127.0.0.1"),
        "ALLOWED_HOSTS lacks nginx",
    ),
    "debug on": (_set_all_shop_env("DEBUG", "1"), "DEBUG is on"),
    "no migrate wait": (
        _set("app", "depends_on", {"postgres": {"condition": "service_healthy"}}),
        "app does not wait for migrate to complete",
    ),
    "healthy without healthcheck": (
        _set("postgres", "healthcheck", None),
        "postgres has no healthcheck",
    ),
    "restarting one-shot": (
        _set("migrate", "restart", "always"),
        "migrate must run once",
    ),
    "unknown dependency": (
        _set("nginx", "depends_on", ["application"]),
        "nginx depends on unknown service application",
    ),
    "dependency cycle": (
        _set("postgres", "depends_on", {"app": {"condition": "service_started"}}),
        "depends_on cycle",
    ),
    "undeclared volume": (
        _set("redis1", "volumes", ["redis-one:/data"]),
        "undeclared volume redis-one",
    ),
    "script not copied": (
        _edit_file("Dockerfile", "COPY deploy/healthcheck.py", "# COPY nothing"),
        "runs deploy/healthcheck.py, which the Dockerfile never copies",
    ),
    "no driver": (
        _edit_file("Dockerfile", '".[shop,load]"', '".[load]"'),
        "does not install psycopg",
    ),
}


@pytest.mark.parametrize("case", sorted(BROKEN))
def test_checks_catch_a_broken_copy(case: str, settings_seen: dict[str, Any]) -> None:
    """Each deliberate breakage of the deployment is reported by the checks."""
    mutate, expected = BROKEN[case]
    broken = Deployment(copy.deepcopy(real_deployment().compose))
    mutate(broken)
    seen = settings_seen
    if any(key in case for key in ("variable", "host", "debug")):
        seen = read_settings(broken.shop_env())
    problems = all_problems(broken, seen)
    assert any(expected in problem for problem in problems), problems


def test_interpolation_uses_defaults_and_overrides() -> None:
    """${VAR:-default} takes the default when unset and the value when set."""
    text = "services:\n  a:\n    image: x\n    environment:\n      K: ${K:-dflt}$$\n"
    assert load_compose(text)["services"]["a"]["environment"]["K"] == "dflt$"
    loaded = load_compose(text, {"K": "set"})
    assert loaded["services"]["a"]["environment"]["K"] == "set$"
    with pytest.raises(ValueError, match="UNSET"):
        load_compose("a: ${UNSET}")


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _start_redis(tmp_path: Path, port: int, *extra: str) -> subprocess.Popen[bytes]:
    process = subprocess.Popen(
        [
            "redis-server",
            str(ROOT / "deploy" / "redis.conf"),
            "--bind",
            "127.0.0.1",
            "--port",
            str(port),
            "--dir",
            str(tmp_path),
            *extra,
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    client = redis.Redis(port=port, socket_timeout=0.5)
    deadline = time.monotonic() + 10
    while True:
        try:
            if client.ping():
                return process
        except redis.ConnectionError:
            if process.poll() is not None or time.monotonic() > deadline:
                process.kill()
                raise RuntimeError(
                    "redis-server did not start with deploy/redis.conf"
                ) from None
            time.sleep(0.02)


def _lock_survives_kill_9(tmp_path: Path, *extra: str) -> bool:
    port = _free_port()
    process = _start_redis(tmp_path, port, *extra)
    try:
        client = redis.Redis(port=port, socket_timeout=0.5)
        assert client.set("redlock:lock:sale", "token", nx=True, px=30_000)
        process.send_signal(signal.SIGKILL)
        process.wait(timeout=5)
        process = _start_redis(tmp_path, port, *extra)
        return client.get("redlock:lock:sale") == b"token"
    finally:
        process.kill()
        process.wait(timeout=5)


@pytest.mark.skipif(
    shutil.which("redis-server") is None,
    reason="redis-server is not installed",
)
def test_redis_conf_keeps_a_granted_lock_across_kill_9(tmp_path: Path) -> None:
    """A real redis-server on deploy/redis.conf still holds a lock after kill -9.

    Without the AOF the same node restarts empty, free to grant the lock again:
    the restart caveat the compose file documents.
    """
    (tmp_path / "aof").mkdir()
    (tmp_path / "none").mkdir()
    assert _lock_survives_kill_9(tmp_path / "aof")
    assert not _lock_survives_kill_9(tmp_path / "none", "--appendonly", "no")
