"""System checks for ``settings.REDLOCK`` (tag ``redlock``).

The static checks need no Redis server; the deploy checks (``check_nodes``) run
against the real test nodes, a real replica and a proxy.
"""

from __future__ import annotations

import io
import time
from pathlib import Path
from typing import Any

import pytest
import redis
from django.apps import apps
from django.core import checks as django_checks
from django.core.management import call_command
from django.core.management.base import SystemCheckError

from harness.nodes import RedisNode
from harness.proxy import FaultProxy
from redlock_django import checks
from redlock_django.apps import RedlockConfig
from redlock_django.checks import check_nodes, check_settings

GOOD = {
    "NODES": [f"redis://10.0.0.{i}:6379/0" for i in range(1, 6)],
    "KEY_PREFIX": "redlock",
    "TTL": 10.0,
    "WAIT_TIMEOUT": 10.0,
    "RETRY_DELAY": 0.05,
    "RETRY_JITTER": 0.05,
    "DRIFT_FACTOR": 0.01,
    "NODE_TIMEOUT": 0.05,
    "AUTO_EXTEND": False,
    "MAX_HOLD": 300.0,
}
THREE = ["redis://h1:6379/0", "redis://h2:6379/0", "redis://h3:6379/0"]
SECRET = "s3cret-pw"


def run(settings: Any, redlock: object) -> list[django_checks.CheckMessage]:
    settings.REDLOCK = redlock
    return check_settings(None)


def ids(settings: Any, redlock: object) -> list[str]:
    return [message.id or "" for message in run(settings, redlock)]


def test_a_good_five_node_config_passes_every_check(settings: Any) -> None:
    """Every key set to a sane value, five distinct servers: no message at all."""
    assert run(settings, GOOD) == []


def test_a_single_node_is_single_instance_mode_without_warning(settings: Any) -> None:
    """One node needs no quorum, so it is neither an error nor a warning."""
    assert run(settings, {"NODES": ["redis://127.0.0.1:6379/0"]}) == []


@pytest.mark.parametrize(
    ("redlock", "expected"),
    [
        (["redis://h:6379/0"], checks.E001),
        (None, checks.E001),
        ({**GOOD, "NODE": THREE}, checks.E001),
        ({**GOOD, "NODES": []}, checks.E002),
        ({**GOOD, "NODES": "redis://h1:6379/0"}, checks.E002),
        ({**GOOD, "NODES": [*THREE[:2], {"host": "h3"}]}, checks.E002),
        ({**GOOD, "NODES": [*THREE[:2], "redis://h3:port/0"]}, checks.E003),
        ({**GOOD, "NODES": [*THREE[:2], "redis://h3/db0"]}, checks.E003),
        ({**GOOD, "NODES": [*THREE[:2], "nosuchcache"]}, checks.E004),
        ({**GOOD, "NODES": [*THREE[:2], "redis://H1:6379/0"]}, checks.E005),
        ({**GOOD, "TTL": 0}, checks.E006),
        ({**GOOD, "TTL": 86401, "MAX_HOLD": None}, checks.E006),
        ({**GOOD, "DRIFT_FACTOR": 0.5}, checks.E007),
        ({**GOOD, "NODE_TIMEOUT": -1}, checks.E008),
        ({**GOOD, "NODE_TIMEOUT": 10.0}, checks.E008),
        ({**GOOD, "TTL": 0.01, "MAX_HOLD": 1, "NODE_TIMEOUT": 0.008}, checks.E008),
        ({**GOOD, "WAIT_TIMEOUT": -1}, checks.E009),
        ({**GOOD, "WAIT_TIMEOUT": "5"}, checks.E009),
        ({**GOOD, "RETRY_DELAY": -0.1}, checks.E009),
        ({**GOOD, "RETRY_DELAY": 0, "RETRY_JITTER": 0}, checks.E009),
        ({**GOOD, "MAX_HOLD": 0}, checks.E009),
        ({**GOOD, "MAX_HOLD": 5}, checks.E009),
        ({**GOOD, "QUEUE_LIFE": 0}, checks.E009),
        ({**GOOD, "QUEUE_LIFE": "2"}, checks.E009),
        ({**GOOD, "QUEUE_LIFE": 86401}, checks.E009),
        ({**GOOD, "QUEUE_LIFE": 0.4}, checks.W008),
        ({**GOOD, "FAIR": True, "NODE_TIMEOUT": 0.25}, checks.W008),
        ({**GOOD, "KEY_PREFIX": ""}, checks.E010),
        ({**GOOD, "KEY_PREFIX": "my lock"}, checks.E010),
        ({**GOOD, "KEY_PREFIX": "lock\x00"}, checks.E010),
        ({**GOOD, "KEY_PREFIX": "lock*"}, checks.E010),
        ({**GOOD, "KEY_PREFIX": "lock[1]"}, checks.E010),
        ({**GOOD, "KEY_PREFIX": "x" * 65}, checks.E010),
        ({**GOOD, "KEY_PREFIX": b"redlock"}, checks.E010),
        ({**GOOD, "AUTO_EXTEND": "yes"}, checks.E011),
        ({**GOOD, "NODES": THREE[:2]}, checks.W001),
        ({**GOOD, "NODES": [*THREE, "redis://h4:6379/0"]}, checks.W001),
        ({**GOOD, "NODES": [*THREE[:2], "redis://h1:6379/1"]}, checks.W002),
        ({**GOOD, "TTL": 1, "MAX_HOLD": 1, "NODE_TIMEOUT": 0.06}, checks.W003),
        (
            {**GOOD, "NODES": [*THREE[:2], "rediss://h3:6380/0?ssl_cert_reqs=none"]},
            checks.W004,
        ),
    ],
)
def test_each_bad_config_gets_exactly_its_check_id(
    settings: Any, redlock: object, expected: str
) -> None:
    """A config with one fault produces that fault's id and nothing else."""
    assert ids(settings, redlock) == [expected]


def test_a_long_node_timeout_without_fair_locks_gets_no_queue_warning(
    settings: Any,
) -> None:
    """QUEUE_LIFE is judged against NODE_TIMEOUT only where fair locks are on by
    default or it was set: a config that never queues is not warned about it."""
    assert ids(settings, {**GOOD, "NODE_TIMEOUT": 0.25}) == []
    assert ids(settings, {**GOOD, "NODE_TIMEOUT": 0.25, "QUEUE_LIFE": 3.0}) == []


def test_errors_and_warnings_have_the_right_level_object_and_hint(
    settings: Any,
) -> None:
    """Errors are Error, warnings Warning, both on settings.REDLOCK with a hint."""
    messages = run(settings, {**GOOD, "NODES": THREE[:2], "TTL": -1})

    assert [(type(m), m.id, m.obj) for m in messages] == [
        (django_checks.Warning, checks.W001, "settings.REDLOCK"),
        (django_checks.Error, checks.E006, "settings.REDLOCK"),
    ]
    assert "5 recommended" in (messages[0].hint or "")
    assert "TTL" in (messages[1].hint or "")


def test_unknown_key_message_suggests_the_closest_key(settings: Any) -> None:
    """A typo such as NODE names itself and proposes NODES."""
    [message] = run(settings, {**GOOD, "NODE": THREE})

    assert message.msg == "REDLOCK has an unknown key 'NODE'; did you mean 'NODES'?"


def test_even_node_count_message_gives_quorum_and_tolerance(settings: Any) -> None:
    """Four nodes: quorum 3, one failure tolerated, the same as three nodes."""
    [message] = run(settings, {**GOOD, "NODES": [*THREE, "redis://h4:6379/0"]})

    assert message.msg == (
        "REDLOCK['NODES'] has 4 nodes, an even number: the quorum is 3, so it "
        "tolerates 1 failed node(s), no more than 3 nodes would"
    )


@pytest.mark.parametrize("count", [1, 3, 5, 7])
def test_odd_node_counts_do_not_warn(settings: Any, count: int) -> None:
    """W001 is for even counts only."""
    nodes = [f"redis://h{i}:6379/0" for i in range(count)]

    assert run(settings, {**GOOD, "NODES": nodes}) == []


def test_malformed_url_message_names_the_index_and_masks_the_password(
    settings: Any,
) -> None:
    """E003 says which entry and why, with userinfo and query string hidden."""
    nodes = [*THREE[:2], f"redis://admin:{SECRET}@h3:port/0?password={SECRET}"]

    [message] = run(settings, {**GOOD, "NODES": nodes})

    assert message.msg == (
        "REDLOCK['NODES'][2] 'redis://***@h3:port/0' is not a valid Redis URL: "
        "the port is not a number from 1 to 65535"
    )


def test_duplicate_servers_are_found_through_localhost_and_cache_aliases(
    settings: Any,
) -> None:
    """localhost, 127.0.0.1 and a cache on the same address are one server."""
    settings.CACHES = {
        **settings.CACHES,
        "locks": {
            "BACKEND": "django_redis.cache.RedisCache",
            "LOCATION": f"redis://:{SECRET}@127.0.0.1:7001/0",
        },
    }
    nodes = ["redis://localhost:7001/0", "locks", "redis://h3:7001/0"]

    [message] = run(settings, {**GOOD, "NODES": nodes})

    assert message.id == checks.E005
    assert message.msg == (
        "NODES[0] and NODES[1] are the same Redis server and database "
        "(redis://localhost:7001/0), not independent nodes"
    )


def test_databases_of_one_server_warn_without_erroring(settings: Any) -> None:
    """Two dbs of one server are W002, not E005: they are different keyspaces."""
    nodes = ["redis://h1:7001/0", "redis://h1:7001/1", "redis://h1:7001/2"]

    [message] = run(settings, {**GOOD, "NODES": nodes})

    assert message.id == checks.W002
    assert message.msg.startswith(
        "NODES[0], NODES[1] and NODES[2] are different databases on one Redis server"
    )


def test_cache_alias_that_is_not_redis_is_an_error(settings: Any) -> None:
    """E004 names the alias and its backend."""
    settings.CACHES = {
        **settings.CACHES,
        "local": {"BACKEND": "django.core.cache.backends.locmem.LocMemCache"},
    }

    [message] = run(settings, {**GOOD, "NODES": [*THREE[:2], "local"]})

    assert message.id == checks.E004
    assert message.msg == (
        "REDLOCK['NODES'][2] names the cache alias 'local', whose BACKEND "
        "'django.core.cache.backends.locmem.LocMemCache' is not a Redis cache"
    )


def test_a_valid_cache_alias_passes(settings: Any) -> None:
    """A django-redis cache on its own server is a node like any URL."""
    settings.CACHES = {
        **settings.CACHES,
        "locks": {
            "BACKEND": "django_redis.cache.RedisCache",
            "LOCATION": "redis://h3:6379/0",
        },
    }

    assert run(settings, {**GOOD, "NODES": [*THREE[:2], "locks"]}) == []


@pytest.mark.parametrize("cert_reqs", [None, "none"])
def test_tls_cache_alias_without_certificate_check_warns(
    settings: Any, cert_reqs: str | None
) -> None:
    """W004 also reads ssl_cert_reqs from a cache's OPTIONS (None means none)."""
    settings.CACHES = {
        **settings.CACHES,
        "locks": {
            "BACKEND": "django.core.cache.backends.redis.RedisCache",
            "LOCATION": "rediss://h3:6380/0",
            "OPTIONS": {"ssl_cert_reqs": cert_reqs},
        },
    }

    assert ids(settings, {**GOOD, "NODES": [*THREE[:2], "locks"]}) == [checks.W004]


@pytest.mark.parametrize("query", ["", "?ssl_cert_reqs=required"])
def test_verified_tls_does_not_warn(settings: Any, query: str) -> None:
    """rediss:// with the default or required certificate check is fine."""
    nodes = [*THREE[:2], f"rediss://h3:6380/0{query}"]

    assert run(settings, {**GOOD, "NODES": nodes}) == []


def test_checks_and_runtime_report_the_same_message(settings: Any) -> None:
    """The check's message is the text of the runtime ImproperlyConfigured."""
    from django.core.exceptions import ImproperlyConfigured

    from redlock_django import conf

    [message] = run(settings, {**GOOD, "DRIFT_FACTOR": 1})

    with pytest.raises(ImproperlyConfigured) as excinfo:
        conf.get_settings()
    assert str(excinfo.value) == f"{message.id}: {message.msg}"


def test_app_config_registers_the_check_under_the_redlock_tag() -> None:
    """RedlockConfig is the app's config and its ready() registered the check."""
    config = apps.get_app_config("redlock_django")

    assert isinstance(config, RedlockConfig)
    assert config.verbose_name == "Redlock"
    assert checks.TAG == "redlock"
    assert "redlock" in django_checks.registry.registry.tags_available()
    assert check_settings in django_checks.registry.registry.get_checks()


def test_manage_py_check_fails_for_a_bad_config(settings: Any) -> None:
    """`manage.py check` stops with SystemCheckError naming the id."""
    settings.REDLOCK = {**GOOD, "NODES": []}

    with pytest.raises(SystemCheckError, match=r"redlock\.E002"):
        call_command("check", stdout=io.StringIO(), stderr=io.StringIO())


def test_manage_py_check_with_the_redlock_tag_fails_for_a_bad_config(
    settings: Any,
) -> None:
    """`manage.py check --tag redlock` runs this app's check."""
    settings.REDLOCK = {**GOOD, "TTL": "ten"}

    with pytest.raises(SystemCheckError, match=r"redlock\.E006"):
        call_command("check", tags=["redlock"], stdout=io.StringIO())


def test_manage_py_check_passes_a_good_config(settings: Any) -> None:
    """A good config makes `manage.py check` report no issues."""
    settings.REDLOCK = GOOD
    stdout = io.StringIO()

    call_command("check", stdout=stdout)

    assert "System check identified no issues" in stdout.getvalue()


def test_manage_py_check_prints_warnings_without_failing(settings: Any) -> None:
    """Warnings such as an even node count are shown but do not stop the command."""
    settings.REDLOCK = {**GOOD, "NODES": THREE[:2]}
    stdout, stderr = io.StringIO(), io.StringIO()

    call_command("check", stdout=stdout, stderr=stderr)

    assert "redlock.W001" in stderr.getvalue() + stdout.getvalue()


# Deploy checks: they ask the real nodes (scenario 15 of the fault matrix).


def deploy_run(
    tally: Any, expected: list[str], *, persistence: bool = False
) -> list[django_checks.CheckMessage]:
    """Run check_nodes once, count it in the matrix, compare the ids.

    The session's nodes persist nothing (``--appendonly no``), so each gets a
    W007; those are left out unless ``persistence`` is set.
    """
    start = time.monotonic()
    messages = checks.check_nodes(None)
    took = time.monotonic() - start
    if not persistence:
        messages = [message for message in messages if message.id != checks.W007]
    got = [message.id or "" for message in messages]
    tally.add(1, int(got == expected), [took])
    assert got == expected, messages
    return messages


def test_deploy_check_passes_five_independent_masters(
    redlock_settings: dict[str, Any], matrix: Any
) -> None:
    """The test nodes are five masters with noeviction: no message but W007."""
    deploy_run(matrix(15), [])
    deploy_run(matrix(15), [checks.W007] * 5, persistence=True)


def test_a_replica_node_is_a_deploy_error(
    settings: Any,
    redlock_settings: dict[str, Any],
    nodes: Any,
    tmp_path: Path,
    matrix: Any,
) -> None:
    """A real redis-server started with --replicaof one of the nodes reports
    role slave: E012 names it; the master itself passes."""
    replica = RedisNode(
        tmp_path / "replica",
        extra_args=["--replicaof", "127.0.0.1", str(nodes[0].port)],
    )
    replica.start()
    try:
        settings.REDLOCK = {
            **redlock_settings,
            "NODES": [*nodes.urls[:2], replica.url],
        }
        [message] = deploy_run(matrix(15), [checks.E012])
        assert isinstance(message, django_checks.Error)
        assert message.msg.startswith(
            f"REDLOCK['NODES'][2] redis://127.0.0.1:{replica.port}/0 is a replica "
            "(role slave)"
        )
        stdout, stderr = io.StringIO(), io.StringIO()
        with pytest.raises(SystemCheckError, match=r"redlock\.E012"):
            call_command("check", deploy=True, stdout=stdout, stderr=stderr)
        # Without --deploy nothing connects to the nodes.
        call_command("check", stdout=io.StringIO(), stderr=io.StringIO())
    finally:
        replica.stop()


def test_one_server_behind_two_addresses_is_a_deploy_error(
    settings: Any, redlock_settings: dict[str, Any], nodes: Any, matrix: Any
) -> None:
    """Node 0 and a TCP proxy in front of it are two addresses of one server:
    the static check cannot tell, the deploy check sees one run_id (E013)."""
    with FaultProxy(nodes[0].port) as proxy:
        settings.REDLOCK = {
            **redlock_settings,
            "NODES": [nodes[0].url, nodes[1].url, proxy.url],
        }
        assert check_settings(None) == []
        [message] = deploy_run(matrix(15), [checks.E013])
    assert message.msg.startswith(
        "NODES[0] and NODES[2] are the same Redis server and database (run_id "
    )


def test_two_databases_of_one_server_behind_two_addresses_are_a_deploy_warning(
    settings: Any, redlock_settings: dict[str, Any], nodes: Any, matrix: Any
) -> None:
    """db 0 and db 1 of node 0, reached as 127.0.0.1 and through a proxy: one
    failure domain holding 2 of 3 votes. The static W002 cannot see through two
    addresses; the deploy check sees one run_id with two databases (it said
    nothing: E013 compared the run_id with the database)."""
    with FaultProxy(nodes[0].port) as proxy:
        settings.REDLOCK = {
            **redlock_settings,
            "NODES": [nodes[0].url, nodes[1].url, proxy.url.replace("/0", "/1")],
        }
        assert check_settings(None) == []
        [message] = deploy_run(matrix(15), [checks.W002])
    assert message.msg.startswith(
        "NODES[0] and NODES[2] are different databases of one Redis server (run_id "
    )


@pytest.mark.parametrize(
    ("policy", "expected"),
    [
        ("noeviction", []),
        ("allkeys-lru", [checks.W005]),
        ("volatile-lru", [checks.W005]),
        ("volatile-ttl", [checks.W005]),
    ],
)
def test_an_evicting_memory_policy_is_a_deploy_warning(
    redlock_settings: dict[str, Any],
    nodes: Any,
    matrix: Any,
    policy: str,
    expected: list[str],
) -> None:
    """Any maxmemory-policy but noeviction can evict lock keys (they all carry
    a TTL, so volatile-* too): W005 names the node and the policy."""
    with nodes[1].client() as client:
        client.config_set("maxmemory-policy", policy)
    try:
        messages = deploy_run(matrix(15), expected)
    finally:
        with nodes[1].client() as client:
            client.config_set("maxmemory-policy", "noeviction")
    if expected:
        assert messages[0].msg.startswith(
            f"REDLOCK['NODES'][1] {nodes[1].url} has maxmemory-policy {policy}"
        )


def test_deploy_check_with_nodes_down_is_bounded_by_the_node_timeout(
    settings: Any, redlock_settings: dict[str, Any], nodes: Any, matrix: Any
) -> None:
    """A frozen node and a killed one give W006 each, and the check takes at
    most a connect and a read timeout per node, never redis-py's 5 s."""
    settings.REDLOCK = {**redlock_settings, "NODE_TIMEOUT": 0.1}
    nodes[3].kill()
    with nodes[4].paused():
        start = time.monotonic()
        messages = deploy_run(matrix(15), [checks.W006, checks.W006])
        took = time.monotonic() - start
    assert took < 2 * 5 * 0.1 + 1.0
    assert "did not answer the deploy check: timed out" in messages[1].msg


def test_a_node_without_appendfsync_always_is_a_deploy_warning(
    settings: Any,
    redlock_settings: dict[str, Any],
    nodes: Any,
    make_nodes: Any,
    tmp_path: Path,
    matrix: Any,
) -> None:
    """Only appendonly yes with appendfsync always passes: W007 names the node
    and its setting, and says what a restart loses (fencing counters too)."""
    [always] = make_nodes(1, appendfsync_always=True)
    everysec = RedisNode(
        tmp_path / "everysec",
        appendfsync_always=True,
        extra_args=["--appendfsync", "everysec"],
    )
    everysec.start()
    try:
        settings.REDLOCK = {
            **redlock_settings,
            "NODES": [always.url, nodes[0].url, everysec.url],
        }
        off, lazy = deploy_run(matrix(15), [checks.W007, checks.W007], persistence=True)
    finally:
        everysec.stop()
    assert isinstance(off, django_checks.Warning)
    assert off.msg.startswith(
        f"REDLOCK['NODES'][1] {nodes[0].url} runs with appendonly no: "
    )
    assert lazy.msg.startswith(
        f"REDLOCK['NODES'][2] {everysec.url} runs with appendonly yes and "
        "appendfsync everysec: "
    )
    assert "fencing" in off.msg
    assert "appendfsync always" in (off.hint or "")


def test_config_refused_by_acl_leaves_only_what_info_shows(
    settings: Any,
    redlock_settings: dict[str, Any],
    make_nodes: Any,
    matrix: Any,
) -> None:
    """CONFIG refused (managed services do that): a node whose INFO shows the
    append-only file on passes silently, since its fsync policy is unknown; one
    without it still gets W007."""
    [always] = make_nodes(1, appendfsync_always=True)
    [off] = make_nodes(1)
    for node in (always, off):
        with node.client() as client:
            client.acl_setuser(
                "default", enabled=True, nopass=True, categories=["-@admin"]
            )
            with pytest.raises(redis.exceptions.NoPermissionError):
                client.config_get("appendfsync")
    settings.REDLOCK = {**redlock_settings, "NODES": [always.url, off.url]}
    [message] = deploy_run(matrix(15), [checks.W007], persistence=True)
    assert message.msg.startswith(f"REDLOCK['NODES'][1] {off.url} runs with ")


def test_deploy_check_registered_for_deploy_only() -> None:
    """check_nodes is a deployment check under the redlock tags."""
    registry = django_checks.registry.registry
    assert check_nodes in registry.get_checks(include_deployment_checks=True)
    assert check_nodes not in registry.get_checks()
    assert checks.NODES_TAG in registry.tags_available(deployment_checks=True)
