"""docker-compose.yml agrees with loadtests/cluster/topology.py, the cluster's hosts.

What ``make cluster`` tests on network namespaces is what compose runs: the same
services, the same shop and Locust variables with the same values, the same Redlock
node list, the same configuration files (and nginx's rendering for fixed hosts
differs from deploy/nginx.conf only in the upstream servers). Each check is shown
to catch a broken copy.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import pytest

from loadtests.cluster import topology
from tests.test_compose import (
    Deployment,
    as_list,
    environment,
    parse_nginx,
    real_deployment,
)


def check_services(d: Deployment) -> list[str]:
    problems = []
    if set(d.services) != set(topology.SERVICES):
        problems.append(
            f"services differ: compose {sorted(d.services)}, "
            f"topology {sorted(topology.SERVICES)}"
        )
    app = d.services.get(topology.APP_SERVICE) or {}
    replicas = (app.get("deploy") or {}).get("replicas", 1)
    if replicas != topology.APP_REPLICAS:
        problems.append(
            f"compose runs {replicas} app replicas, the cluster "
            f"{topology.APP_REPLICAS} app hosts"
        )
    return problems


def check_environment(d: Deployment) -> list[str]:
    problems = []
    for name, service in d.services.items():
        env = environment(service)
        if "DATABASE_URL" in env and env != topology.SHOP_ENV:
            problems.append(
                f"service {name}: shop environment differs: "
                f"{_diff(env, topology.SHOP_ENV)}"
            )
        if name.startswith("locust") and env != topology.LOCUST_ENV:
            problems.append(
                f"service {name}: Locust environment differs: "
                f"{_diff(env, topology.LOCUST_ENV)}"
            )
    return problems


def _diff(compose: dict[str, Any], ours: dict[str, str]) -> str:
    keys = sorted(set(compose) | set(ours))
    return "; ".join(
        f"{key}: compose {compose.get(key)!r}, topology {ours.get(key)!r}"
        for key in keys
        if compose.get(key) != ours.get(key)
    )


def check_nodes(d: Deployment) -> list[str]:
    expected = topology.SHOP_ENV["REDLOCK_NODES"].split(",")
    if d.redlock_nodes() != expected:
        return [f"node list: compose {d.redlock_nodes()}, topology {expected}"]
    return []


def check_commands(d: Deployment) -> list[str]:
    commands = {
        topology.APP_SERVICE: topology.GUNICORN_COMMAND,
        "migrate": topology.MIGRATE_COMMAND,
        "seed": topology.SEED_COMMAND,
        **{h: topology.REDIS_COMMAND for h in topology.REDIS_HOSTS},
    }
    problems = []
    for name, command in commands.items():
        actual = as_list((d.services.get(name) or {}).get("command"))
        if actual != command:
            problems.append(f"service {name} runs {actual}, the cluster {command}")
    return problems


def check_configs(d: Deployment) -> list[str]:
    problems = []
    for name, mounts in topology.CONFIGS.items():
        service = d.services.get(name) or {}
        for source, target in mounts.items():
            if (d.mounted(service, target) or "").removeprefix("./") != source:
                problems.append(f"service {name} does not mount {source} at {target}")
    return problems


def _strip_upstream(tree: list[Any]) -> list[Any]:
    """The nginx tree without resolver lines and upstream servers."""
    out = []
    for name, args, children in tree:
        if name == "resolver":
            continue
        if children is not None:
            if name == "upstream":
                children = [c for c in children if c[0] != "server"]
            children = _strip_upstream(children)
        out.append((name, args, children))
    return out


def check_nginx_rendering(
    d: Deployment, render: Callable[[str], str] = topology.render_nginx
) -> list[str]:
    text = d.read(topology.NGINX_CONF) or ""
    try:
        rendered = parse_nginx(render(text))
    except ValueError as exc:
        return [str(exc)]
    original = parse_nginx(text)
    problems = []
    if _strip_upstream(rendered) != _strip_upstream(original):
        problems.append("the rendered nginx.conf differs beyond its upstream servers")
    servers = [
        args
        for name, _, children in rendered
        if name == "upstream" and children
        for directive, args, _ in children
        if directive == "server"
    ]
    expected = [[f"{h}:{topology.APP_PORT}"] for h in topology.APP_HOSTS]
    if servers != expected:
        problems.append(f"rendered upstream servers {servers}, expected {expected}")
    return problems


CHECKS = (
    check_services,
    check_environment,
    check_nodes,
    check_commands,
    check_configs,
    check_nginx_rendering,
)


def problems_of(d: Deployment) -> list[str]:
    return [problem for check in CHECKS for problem in check(d)]


def test_compose_matches_the_topology() -> None:
    assert problems_of(real_deployment()) == []


def test_topology_hosts_are_unique() -> None:
    names = [h.name for h in topology.HOSTS]
    octets = [h.octet for h in topology.HOSTS]
    assert len(set(names)) == len(names)
    assert len(set(octets)) == len(octets)
    assert topology.ORCHESTRATOR_OCTET not in octets
    with pytest.raises(ValueError, match="no host 'redis9'"):
        topology.host("redis9")


def _env(service: str, key: str, value: str | None) -> Any:
    def mutate(d: Deployment) -> None:
        env = d.services[service]["environment"] = dict(
            environment(d.services[service])
        )
        if value is None:
            env.pop(key, None)
        else:
            env[key] = value

    return mutate


def _setitem(service: str, key: str, value: Any) -> Any:
    def mutate(d: Deployment) -> None:
        d.services[service][key] = value

    return mutate


def _file(path: str, old: str, new: str) -> Any:
    def mutate(d: Deployment) -> None:
        text = d.read(path) or ""
        assert old in text
        d.files[path] = text.replace(old, new)

    return mutate


def _extra_service(d: Deployment) -> None:
    d.services["redis6"] = copy.deepcopy(d.services["redis5"])


BROKEN = {
    "extra service": (_extra_service, "services differ"),
    "replicas": (_setitem("app", "deploy", {"replicas": 2}), "2 app replicas"),
    "ttl": (_env("app", "REDLOCK_TTL", "30"), "REDLOCK_TTL: compose '30'"),
    "extra variable": (_env("seed", "EXTRA", "1"), "EXTRA: compose '1'"),
    "missing variable": (_env("migrate", "SHOP_WORK_MS", None), "SHOP_WORK_MS"),
    "locust scenario": (
        _env("locust-master", "SHOP_SCENARIO", "unsafe"),
        "Locust environment differs",
    ),
    "node order": (
        _env(
            "app",
            "REDLOCK_NODES",
            ",".join(f"redis://redis{i}:6379/0" for i in (2, 1, 3, 4, 5)),
        ),
        "node list",
    ),
    "gunicorn workers": (
        _setitem("app", "command", ["gunicorn", "shop.wsgi:application"]),
        "service app runs",
    ),
    "redis command": (
        _setitem("redis3", "command", ["redis-server", "--appendonly", "no"]),
        "service redis3 runs",
    ),
    "redis config": (
        _setitem("redis2", "volumes", ["./deploy/other.conf:/x", "redis2-data:/data"]),
        "redis2 does not mount deploy/redis.conf",
    ),
    "nginx upstream": (
        _file("deploy/nginx.conf", "server app:8000 resolve;", "server web:8000;"),
        "expected one 'server app:<port> resolve;'",
    ),
}


@pytest.mark.parametrize("case", sorted(BROKEN))
def test_checks_catch_a_broken_copy(case: str) -> None:
    mutate, expected = BROKEN[case]
    broken = Deployment(copy.deepcopy(real_deployment().compose))
    mutate(broken)
    problems = problems_of(broken)
    assert any(expected in problem for problem in problems), problems


def test_a_rendering_that_changes_more_than_the_upstream_is_caught() -> None:
    """The cluster's nginx must be deploy/nginx.conf with fixed upstream servers."""

    def render_and_retry_posts(text: str) -> str:
        return topology.render_nginx(text).replace(
            "proxy_next_upstream error timeout;",
            "proxy_next_upstream error timeout non_idempotent;",
        )

    def render_two_servers(text: str) -> str:
        return topology.render_nginx(text).replace("server app3:8000;", "")

    d = real_deployment()
    assert check_nginx_rendering(d) == []
    assert "differs beyond its upstream servers" in "".join(
        check_nginx_rendering(d, render_and_retry_posts)
    )
    assert "rendered upstream servers" in "".join(
        check_nginx_rendering(d, render_two_servers)
    )
