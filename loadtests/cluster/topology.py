"""The deployment's topology, once: hosts, addresses, services, variables, configs.

``docker-compose.yml`` runs this deployment with containers; ``python -m
loadtests.cluster`` runs it with one Linux network namespace per host. Both are
driven by (or checked against) the description below: ``tests/test_topology.py``
proves the compose file has the same services, the same shop variables with the
same values, the same Redlock node list and mounts the same configuration files.

Names, not addresses, are what the services use (``redis1``, ``postgres``,
``nginx``): compose's DNS resolves them in containers, the cluster writes them to
each namespace's ``/etc/hosts`` (``ip netns exec`` bind-mounts
``/etc/netns/<ns>/hosts``). So the shop's environment is the same text in both.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent.parent
REDIS_CONF = "deploy/redis.conf"
NGINX_CONF = "deploy/nginx.conf"

REDIS_PORT = 6379
POSTGRES_PORT = 5432
APP_PORT = 8000  # gunicorn's --bind in the app service
NGINX_PORT = 8000
LOCUST_WEB_PORT = 8089

REDIS_HOSTS = tuple(f"redis{i}" for i in range(1, 6))
APP_HOSTS = ("app1", "app2", "app3")  # compose: the `app` service, 3 replicas
APP_SERVICE = "app"
APP_REPLICAS = len(APP_HOSTS)
POSTGRES_HOST = "postgres"
NGINX_HOST = "nginx"
LOCUST_HOST = "locust"

# The shop's environment (compose's `x-shop-env`), for every shop process.
POSTGRES_USER = "shop"
POSTGRES_PASSWORD = "shop"  # reachable on the private network only, as in compose
POSTGRES_DB = "shop"
SHOP_ENV: dict[str, str] = {
    "DATABASE_URL": (
        f"postgres://{POSTGRES_USER}:{POSTGRES_PASSWORD}@{POSTGRES_HOST}:"
        f"{POSTGRES_PORT}/{POSTGRES_DB}"
    ),
    "REDLOCK_NODES": ",".join(f"redis://{h}:{REDIS_PORT}/0" for h in REDIS_HOSTS),
    "DEBUG": "0",
    "SECRET_KEY": "compose-demo-only-insecure-secret-key",
    "ALLOWED_HOSTS": f"localhost,127.0.0.1,{NGINX_HOST}",
    "REDLOCK_TTL": "5",
    "REDLOCK_WAIT_TIMEOUT": "2",
    "REDLOCK_FAIR": "1",
    "SHOP_WORK_MS": "5",
    "SHOP_MAX_PER_ORDER": "5",
    "SHOP_TIMINGS_DIR": "",  # off (shop/timings.py)
    "CONN_MAX_AGE": "60",  # each worker keeps its database connection
}
# Locust's environment (compose's `x-locust-env`, the locked scenario).
LOCUST_ENV: dict[str, str] = {"SHOP_PRODUCT_ID": "1", "SHOP_SCENARIO": "locked"}

# The app service's command (compose's `app.command`).
GUNICORN_COMMAND = [
    "gunicorn",
    "shop.wsgi:application",
    "--bind",
    f"0.0.0.0:{APP_PORT}",
    "--workers",
    "3",
    "--worker-tmp-dir",
    "/dev/shm",
    "--timeout",
    "60",
]
MIGRATE_COMMAND = ["python", "manage.py", "migrate", "--noinput"]
SEED_COMMAND = ["python", "manage.py", "seed_sale", "--stock", "200"]
REDIS_COMMAND = ["redis-server", "/usr/local/etc/redis/redis.conf"]

# Compose services and the cluster hosts that play them.
SERVICES: dict[str, tuple[str, ...]] = {
    **{h: (h,) for h in REDIS_HOSTS},
    POSTGRES_HOST: (POSTGRES_HOST,),
    "migrate": (APP_HOSTS[0],),  # one-shot, before any gunicorn starts
    "seed": (APP_HOSTS[0],),  # one-shot
    APP_SERVICE: APP_HOSTS,
    NGINX_HOST: (NGINX_HOST,),
    "locust-master": (LOCUST_HOST,),
    "locust-worker": (LOCUST_HOST,),
}
# Repository configuration files each service mounts: {service: {file: mountpoint}}.
CONFIGS: dict[str, dict[str, str]] = {
    **{h: {REDIS_CONF: "/usr/local/etc/redis/redis.conf"} for h in REDIS_HOSTS},
    NGINX_HOST: {NGINX_CONF: "/etc/nginx/conf.d/default.conf"},
}


@dataclass(frozen=True)
class Host:
    """One machine of the deployment: a network namespace in the cluster."""

    name: str
    role: str  # redis | postgres | app | nginx | locust
    octet: int  # last byte of its address on the run's /24


HOSTS: tuple[Host, ...] = (
    *(Host(h, "redis", 11 + i) for i, h in enumerate(REDIS_HOSTS)),
    Host(POSTGRES_HOST, "postgres", 20),
    *(Host(h, "app", 31 + i) for i, h in enumerate(APP_HOSTS)),
    Host(NGINX_HOST, "nginx", 40),
    Host(LOCUST_HOST, "locust", 50),
)
ORCHESTRATOR_OCTET = 1  # the bridge's own address, in the root namespace


def host(name: str) -> Host:
    """Return the host called ``name`` (ValueError naming the known ones)."""
    for item in HOSTS:
        if item.name == name:
            return item
    raise ValueError(f"no host {name!r}; hosts: {', '.join(h.name for h in HOSTS)}")


def hosts_file(prefix: str) -> str:
    """Return /etc/hosts text for every namespace: the names, on ``prefix``.x."""
    lines = ["127.0.0.1 localhost"]
    lines += [f"{prefix}.{h.octet} {h.name}" for h in HOSTS]
    return "\n".join(lines) + "\n"


_RESOLVER = re.compile(r"^\s*resolver\s[^;]*;\s*$", re.MULTILINE)
_UPSTREAM_SERVER = re.compile(
    rf"^(?P<indent>\s*)server\s+{APP_SERVICE}:(?P<port>\d+)\s+resolve;\s*$",
    re.MULTILINE,
)


def render_nginx(text: str) -> str:
    """Render deploy/nginx.conf for fixed hosts: one upstream server per app host.

    Compose's nginx resolves ``app`` through Docker's DNS (``resolver`` and the
    ``resolve`` parameter); the cluster has fixed hosts instead, so the resolver
    line goes and ``server app:PORT resolve;`` becomes one ``server appN:PORT;``
    per app host. Everything else is the file as it is. ValueError if the file
    no longer has that shape (then this rendering must be updated with it).
    """
    if len(_UPSTREAM_SERVER.findall(text)) != 1:
        raise ValueError(
            f"{NGINX_CONF}: expected one 'server {APP_SERVICE}:<port> resolve;' line "
            "in the upstream block"
        )

    def servers(match: re.Match[str]) -> str:
        indent, port = match["indent"], match["port"]
        return "\n".join(f"{indent}server {h}:{port};" for h in APP_HOSTS)

    return _UPSTREAM_SERVER.sub(servers, _RESOLVER.sub("", text))
