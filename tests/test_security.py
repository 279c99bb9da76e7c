"""Security: TLS, ACL users, credentials on every surface, tokens, force release.

Everything runs against real ``redis-server`` processes: TLS-only servers with
certificates the tests make (``tests/_tls.py``), servers with ACL users and a
password on the default user, and the session's five plain nodes.
"""

from __future__ import annotations

import asyncio
import logging
import re
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import redis

from harness.held import held_on, lock_key
from harness.nodes import NodeSet, RedisNodeError
from redlock_django import QuorumUnavailableError, Redlock, listing, signals
from redlock_django import conf as redlock_conf
from redlock_django import nodes as node_pools
from redlock_django.address import parse_node
from redlock_django.keys import handoff_key, queue_keys
from tests._tls import (
    Certificates,
    TLSRedisNode,
    TLSUnavailableError,
    make_certificates,
)
from tests.test_fair import _heard_from_the_start

# Generous for a 2-core machine shared with other test runs. A new TLS connection
# costs 30-60 ms of CPU in redis-py (a fresh SSLContext loading the system CAs),
# and the asyncio driver makes them one after the other on its loop.
NODE_TIMEOUT = 0.5
#: NODE_TIMEOUT of the tests where every node fails: the failure must come within
#: node timeouts, never after WAIT_TIMEOUT (a node that refuses us is an outage,
#: not contention).
FAIL_TIMEOUT = 0.2


def bound(node_count: int) -> float:
    """Return the longest a refused acquisition may take.

    The blocking driver opens connections one node after the other, and a TLS
    handshake that hangs (a frozen server, or a plaintext one that waits for the
    end of a line) waits out the connect timeout on each: two fan-outs (the
    attempt and its clean-up) cost up to 2 x nodes x NODE_TIMEOUT, plus a margin.
    """
    return 2 * node_count * FAIL_TIMEOUT + 1.0


def lock_settings(urls: list[str], **overrides: Any) -> dict[str, Any]:
    return {
        "NODES": urls,
        "TTL": 10.0,
        "NODE_TIMEOUT": NODE_TIMEOUT,
        "RETRY_DELAY": 0.02,
        "RETRY_JITTER": 0.02,
        "WAIT_TIMEOUT": 5.0,
        **overrides,
    }


def refused(acquire: Callable[[], Any]) -> tuple[QuorumUnavailableError, float]:
    """Run ``acquire``, which must raise QuorumUnavailableError; return it and how
    long it took."""
    started = time.monotonic()
    with pytest.raises(QuorumUnavailableError) as caught:
        acquire()
    return caught.value, time.monotonic() - started


# --- TLS ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def certificates(tmp_path_factory: pytest.TempPathFactory) -> Certificates:
    try:
        return make_certificates(tmp_path_factory.mktemp("tls"))
    except TLSUnavailableError as exc:
        pytest.skip(str(exc))


def start_tls_nodes(
    count: int, directory: Path, certificates: Certificates, **options: Any
) -> NodeSet:
    node_set = NodeSet(
        TLSRedisNode(directory / f"node{i}", certificates, **options)
        for i in range(count)
    )
    try:
        node_set.start_all()
    except RedisNodeError as exc:
        if "tls" in str(exc).lower():
            pytest.skip(f"this redis-server cannot serve TLS: {exc}")
        raise
    return node_set


@pytest.fixture(scope="module")
def tls_servers(
    certificates: Certificates, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[NodeSet]:
    """Three TLS-only servers (no plaintext port) for the module."""
    node_set = start_tls_nodes(3, tmp_path_factory.mktemp("tls-nodes"), certificates)
    try:
        yield node_set
    finally:
        node_set.stop_all()


@pytest.fixture
def tls_nodes(tls_servers: NodeSet) -> Iterator[NodeSet]:
    tls_servers.ensure_running()
    tls_servers.flush_all()
    try:
        yield tls_servers
    finally:
        tls_servers.resume_all()


def test_tls_nodes_with_their_ca_lock_extend_and_release(
    settings: Any, tls_nodes: NodeSet
) -> None:
    """``rediss://`` URLs naming the CA in ``ssl_ca_certs`` work like plain ones."""
    assert all(url.startswith("rediss://") for url in tls_nodes.urls)
    settings.REDLOCK = lock_settings(tls_nodes.urls)
    with Redlock("over-tls") as lock:
        assert lock.owned()
        assert held_on(tls_nodes, "over-tls") == 3
        assert lock.extend(20.0)
        assert all(
            node.client().pttl(lock_key("over-tls")) > 10_000 for node in tls_nodes
        )
    assert held_on(tls_nodes, "over-tls") == 0


async def test_tls_nodes_with_their_ca_lock_and_release_from_asyncio(
    settings: Any, tls_nodes: NodeSet
) -> None:
    """The asyncio driver opens its own TLS connections with the same options."""
    settings.REDLOCK = lock_settings(tls_nodes.urls)
    async with Redlock("over-tls-async") as lock:
        assert lock.owned()
        assert await asyncio.to_thread(held_on, tls_nodes, "over-tls-async") == 3
        assert await lock.aextend(20.0)
    assert await asyncio.to_thread(held_on, tls_nodes, "over-tls-async") == 0


async def test_first_asyncio_acquire_over_tls_fits_a_short_node_timeout(
    settings: Any, tls_nodes: NodeSet
) -> None:
    """New asyncio TLS connections cost no CPU-heavy SSL setup inside a node call.

    Each SSL context loads the system CAs (30-60 ms of CPU); built per connection
    on the event loop, three of them overran the default 0.05 s NODE_TIMEOUT, so
    the first lock after start-up failed. The pools now build one context up front.
    """
    settings.REDLOCK = lock_settings(tls_nodes.urls, NODE_TIMEOUT=0.05)
    for attempt in range(3):
        node_pools.reset()  # new pools, new connections
        lock = Redlock(f"first-{attempt}")
        assert await lock.aacquire(blocking=False)
        await lock.arelease()


# redis-py < 5.3 requires a command name here; 5.3 and later deprecate passing one.
_GET_CONNECTION_ARGS = ("PING",) if redis.VERSION < (5, 3) else ()


def test_fresh_tls_connections_never_fail_on_session_tickets(
    settings: Any, tls_nodes: NodeSet
) -> None:
    """Every new TLS connection of a blocking pool works on its first use.

    TLS 1.3 session tickets arrive just after the handshake; redis-py's hiredis
    parser took them for a stray reply, and the pool then failed with "Connection
    not ready" (measured: 15 of 100 new connections). 40 new connections must all
    answer: with the bug, the chance that all 40 pass is about 0.85**40, 1 in 600.
    """
    settings.REDLOCK = lock_settings(tls_nodes.urls[:1])
    conf = redlock_conf.get_settings()
    [pool] = node_pools.sync_pools(conf.nodes, NODE_TIMEOUT)
    failures: list[str] = []
    for _ in range(40):
        pool.disconnect()  # the next get_connection() connects anew
        try:
            connection = pool.get_connection(*_GET_CONNECTION_ARGS)
        except redis.ConnectionError as exc:
            failures.append(str(exc))
            continue
        connection.send_command("PING")
        assert connection.read_response() == b"PONG"
        pool.release(connection)
    assert failures == []


def test_wrong_ca_fails_fast_naming_the_certificate_on_every_node(
    settings: Any, tls_nodes: NodeSet, certificates: Certificates
) -> None:
    """A server certificate the given CA did not sign is an outage, never a lock."""
    urls = [
        url.replace(str(certificates.ca), str(certificates.wrong_ca))
        for url in tls_nodes.urls
    ]
    settings.REDLOCK = lock_settings(urls, NODE_TIMEOUT=FAIL_TIMEOUT)
    error, took = refused(lambda: Redlock("wrong-ca").acquire())
    assert took < bound(3)
    assert error.granted == 0 and len(error.failed) == 3
    for name, reason in error.failed.items():
        assert name.startswith("rediss://127.0.0.1:")
        assert "CERTIFICATE_VERIFY_FAILED" in reason, reason
    assert "certificate verify failed" in str(error)
    assert held_on(tls_nodes, "wrong-ca") == 0


def test_tls_without_a_ca_does_not_trust_a_private_certificate(
    settings: Any, tls_nodes: NodeSet
) -> None:
    """Without ``ssl_ca_certs`` only the system's CAs count: the test CA is not one."""
    urls = [url.partition("?")[0] for url in tls_nodes.urls]
    settings.REDLOCK = lock_settings(urls, NODE_TIMEOUT=FAIL_TIMEOUT)
    error, took = refused(lambda: Redlock("no-ca").acquire())
    assert took < bound(3)
    assert all("CERTIFICATE_VERIFY_FAILED" in r for r in error.failed.values())


async def test_wrong_ca_fails_the_same_way_from_asyncio(
    settings: Any, tls_nodes: NodeSet, certificates: Certificates
) -> None:
    urls = [
        url.replace(str(certificates.ca), str(certificates.wrong_ca))
        for url in tls_nodes.urls
    ]
    settings.REDLOCK = lock_settings(urls, NODE_TIMEOUT=FAIL_TIMEOUT)
    started = time.monotonic()
    with pytest.raises(QuorumUnavailableError) as caught:
        await Redlock("wrong-ca-async").aacquire()
    assert time.monotonic() - started < bound(3)
    assert len(caught.value.failed) == 3
    for reason in caught.value.failed.values():
        assert "CERTIFICATE_VERIFY_FAILED" in reason, reason


def test_plaintext_client_on_the_tls_port_fails_clearly(
    settings: Any, tls_nodes: NodeSet
) -> None:
    """``redis://`` against a TLS-only port is refused per node, never a lock."""
    urls = [f"redis://127.0.0.1:{port}/0" for port in tls_nodes.ports]
    settings.REDLOCK = lock_settings(urls, NODE_TIMEOUT=FAIL_TIMEOUT)
    error, took = refused(lambda: Redlock("plaintext").acquire())
    assert took < bound(3)
    assert error.granted == 0 and len(error.failed) == 3
    for reason in error.failed.values():
        # The server resets the connection on the first plaintext bytes.
        assert reason.startswith("ConnectionError"), reason
    assert held_on(tls_nodes, "plaintext") == 0


def test_tls_client_on_a_plaintext_port_fails_clearly(
    settings: Any, nodes: NodeSet, certificates: Certificates
) -> None:
    """``rediss://`` against a plaintext server fails in the handshake."""
    urls = [
        f"rediss://127.0.0.1:{port}/0?ssl_ca_certs={certificates.ca}"
        for port in nodes.ports[:3]
    ]
    settings.REDLOCK = lock_settings(urls, NODE_TIMEOUT=FAIL_TIMEOUT)
    error, took = refused(lambda: Redlock("tls-to-plain").acquire())
    assert took < bound(3)
    assert len(error.failed) == 3
    for reason in error.failed.values():
        # The server reads the ClientHello as the start of an inline command and
        # waits for its end of line: the handshake times out. No node answered,
        # so the attempt is made once more (protocol._all_silent), and finds every
        # node held off for its timed-out connect (sync driver), or times out again.
        assert reason == "timed out" or reason.startswith(
            "skipped: connecting timed out"
        ), reason
    assert sum(n.client().exists(lock_key("tls-to-plain")) for n in nodes) == 0


def test_paused_tls_nodes_cost_at_most_a_node_timeout(
    settings: Any, tls_nodes: NodeSet
) -> None:
    """A frozen TLS server stalls the handshake; NODE_TIMEOUT bounds it too."""
    settings.REDLOCK = lock_settings(tls_nodes.urls, NODE_TIMEOUT=FAIL_TIMEOUT)
    with tls_nodes[2].paused():
        node_pools.reset()  # new connections: the handshake itself must time out
        with Redlock("one-frozen") as lock:
            assert lock.owned()
        with tls_nodes[1].paused():
            node_pools.reset()
            error, took = refused(lambda: Redlock("two-frozen").acquire())
    assert took < bound(3)
    assert sorted(error.failed.values()) == ["timed out", "timed out"]


def test_mutual_tls_needs_the_client_certificate(
    settings: Any, certificates: Certificates, tmp_path: Path
) -> None:
    """With ``tls-auth-clients yes`` a URL with ``ssl_certfile``/``ssl_keyfile``
    locks; the same URL without them is refused."""
    node_set = start_tls_nodes(1, tmp_path, certificates, client_certificates=True)
    try:
        [url] = node_set.urls
        assert "ssl_certfile=" in url
        settings.REDLOCK = lock_settings([url], NODE_TIMEOUT=FAIL_TIMEOUT)
        with Redlock("mtls") as lock:
            assert lock.owned()
        bare = f"rediss://127.0.0.1:{node_set[0].port}/0?ssl_ca_certs={certificates.ca}"
        settings.REDLOCK = lock_settings([bare], NODE_TIMEOUT=FAIL_TIMEOUT)
        error, took = refused(lambda: Redlock("mtls").acquire())
        assert took < bound(1)
        [reason] = error.failed.values()
        assert reason.startswith("ConnectionError"), reason
    finally:
        node_set.stop_all()


def test_tls_settings_never_show_the_certificate_paths_or_query(
    tls_nodes: NodeSet,
) -> None:
    """Node names are scheme, host, port and db: the query string is left out."""
    node = parse_node(tls_nodes.urls[0] + "&password=hunter2", 0)
    assert node.display == f"rediss://127.0.0.1:{tls_nodes.ports[0]}/0"
    assert "hunter2" not in repr(node) and "ssl_ca_certs" not in repr(node)


# --- ACL users ----------------------------------------------------------------------

DOCS = Path(__file__).resolve().parent.parent / "docs" / "security.md"
APP_PASSWORD = "app-pa55-never-shown"
OPS_PASSWORD = "ops-pa55-never-shown"
ADMIN_PASSWORD = "admin-pa55-never-shown"
PASSWORDS = (APP_PASSWORD, OPS_PASSWORD, ADMIN_PASSWORD)


def documented_acl(user: str) -> list[str]:
    """Return the ``ACL SETUSER <user>`` line of docs/security.md as arguments."""
    for line in DOCS.read_text().splitlines():
        if line.startswith(f"ACL SETUSER {user} "):
            return line.split()[2:]
    raise AssertionError(f"docs/security.md has no ACL SETUSER {user} line")


@pytest.fixture
def acl_nodes(make_nodes: Callable[..., NodeSet]) -> Iterator[list[redis.Redis]]:
    """Three servers with the documented users and a password on the default user.

    Yields one admin client per node (the tests' own view of the keys).
    """
    node_set = make_nodes(3)
    admins = []
    for node in node_set:
        with node.client() as client:
            for user, password in (
                ("redlock-app", APP_PASSWORD),
                ("redlock-ops", OPS_PASSWORD),
            ):
                rules = documented_acl(user)
                rules = [f">{password}" if r == ">CHANGE-ME" else r for r in rules]
                client.execute_command("ACL", "SETUSER", *rules)
            client.config_set("requirepass", ADMIN_PASSWORD)
        admins.append(node.client(password=ADMIN_PASSWORD))
    yield admins
    for admin in admins:
        admin.close()


def acl_urls(admins: list[redis.Redis], userinfo: str) -> list[str]:
    ports = [admin.connection_pool.connection_kwargs["port"] for admin in admins]
    at = f"{userinfo}@" if userinfo else ""
    return [f"redis://{at}127.0.0.1:{port}/0" for port in ports]


def test_documented_app_user_can_lock_extend_fence_and_release(
    settings: Any, acl_nodes: list[redis.Redis]
) -> None:
    """The least-privilege app user of docs/security.md is all a lock needs."""
    urls = acl_urls(acl_nodes, f"redlock-app:{APP_PASSWORD}")
    settings.REDLOCK = lock_settings(urls)
    with Redlock("acl:job", fencing=True) as lock:
        assert lock.owned() and lock.fencing_token == 1
        assert all(a.hget(lock_key("acl:job"), "token") for a in acl_nodes)
        assert lock.extend(20.0)
        assert lock.locked()
    assert sum(a.exists(lock_key("acl:job")) for a in acl_nodes) == 0


def test_documented_app_user_can_queue_for_a_fair_lock_and_be_served(
    settings: Any, acl_nodes: list[redis.Redis]
) -> None:
    """A fair lock's scripts (queue, tickets, the nodes' TIME) and a fenced one's
    counter draw run under the documented app user too."""
    urls = acl_urls(acl_nodes, f"redlock-app:{APP_PASSWORD}")
    settings.REDLOCK = lock_settings(urls, FAIR=True)
    handed: list[bool] = []

    def on_acquired(**kwargs: Any) -> None:
        handed.append(kwargs["handed"])

    signals.lock_acquired.connect(on_acquired, weak=False)
    holder = Redlock("acl:fair", fencing=True)
    assert holder.acquire(blocking=False)
    got: list[int | None] = []

    def wait() -> None:
        with Redlock("acl:fair", fencing=True, retry_delay=30.0) as lock:
            got.append(lock.fencing_token)

    # Listening before it waits: a waiter whose subscription is confirmed while it
    # waits is woken into one more attempt, which can cross the release and take
    # the handed key itself (the next token), the documented fallback.
    with _heard_from_the_start(holder) as waits:
        waiter = threading.Thread(target=wait)
        waiter.start()
        queue = queue_keys("acl:fair", "redlock")[0]
        deadline = time.monotonic() + 5
        while not all(a.zcard(queue) for a in acl_nodes):
            assert time.monotonic() < deadline, "the waiter never queued"
            time.sleep(0.01)
        waits()
        holder.release()
        waiter.join(timeout=10)
    signals.lock_acquired.disconnect(on_acquired)
    assert got == [2]  # woken by the release (not its 30 s retry), the next token
    # Handed over by the release, and the hand-off records gone with their waiter.
    assert handed == [False, True], handed
    records = handoff_key("acl:fair", "redlock")
    assert [a.exists(records) and a.zcard(records) for a in acl_nodes] == [0] * len(
        acl_nodes
    )


def test_an_app_user_without_the_fair_lock_commands_still_takes_fenced_locks(
    settings: Any, acl_nodes: list[redis.Redis]
) -> None:
    """The documented user minus what only fair locks need (the ACL of earlier
    versions): plain and fenced locks work, so an upgrade needs no ACL change."""
    fair_only = {"+incr", "+time", "+zadd", "+zrank", "+zrem", "+zrange"}
    fair_only |= {"+zrangebyscore", "+zscore"}
    rules = [r for r in documented_acl("redlock-app") if r not in fair_only]
    rules = ["no-fair" if r == "redlock-app" else r for r in rules]
    rules = [">no-fair-pw" if r == ">CHANGE-ME" else r for r in rules]
    for admin in acl_nodes:
        admin.execute_command("ACL", "SETUSER", *rules)
    settings.REDLOCK = lock_settings(acl_urls(acl_nodes, "no-fair:no-fair-pw"))
    tokens = []
    for _ in range(2):
        with Redlock("acl:fenced", fencing=True) as lock:
            tokens.append(lock.fencing_token)
    assert tokens == [1, 2]


async def test_documented_app_user_locks_from_asyncio(
    settings: Any, acl_nodes: list[redis.Redis]
) -> None:
    urls = acl_urls(acl_nodes, f"redlock-app:{APP_PASSWORD}")
    settings.REDLOCK = lock_settings(urls)
    async with Redlock("acl:async") as lock:
        assert lock.owned()
        assert await lock.aextend(20.0)


def test_documented_ops_user_can_inspect_and_force_release(
    settings: Any, acl_nodes: list[redis.Redis]
) -> None:
    """The ops user sees node health and held locks, and can force-release."""
    settings.REDLOCK = lock_settings(acl_urls(acl_nodes, f"redlock-app:{APP_PASSWORD}"))
    lock = Redlock("acl:stuck")
    assert lock.acquire()
    settings.REDLOCK = lock_settings(acl_urls(acl_nodes, f"redlock-ops:{OPS_PASSWORD}"))
    statuses = listing.node_status()
    assert [s.reachable for s in statuses] == [True] * 3
    assert all(s.version and s.lock_keys == 1 for s in statuses)
    [held] = listing.held_locks()
    assert held.resource == "acl:stuck" and held.held_on == 3
    outcome = listing.force_release("acl:stuck", held.token_digest)
    assert outcome.released == (0, 1, 2)
    assert sum(a.exists(lock_key("acl:stuck")) for a in acl_nodes) == 0


def test_app_user_cannot_touch_keys_outside_the_prefix(
    acl_nodes: list[redis.Redis],
) -> None:
    """Negative control of the key pattern: the app user is refused other keys."""
    port = acl_nodes[0].connection_pool.connection_kwargs["port"]
    app = redis.Redis(
        port=port, username="redlock-app", password=APP_PASSWORD, protocol=2
    )
    with pytest.raises(redis.exceptions.NoPermissionError):
        app.set("session:123", "x")
    with pytest.raises(redis.exceptions.NoPermissionError):
        app.flushall()
    app.close()


def acl_failure(
    settings: Any, urls: list[str], **overrides: Any
) -> QuorumUnavailableError:
    settings.REDLOCK = lock_settings(urls, NODE_TIMEOUT=FAIL_TIMEOUT, **overrides)
    error, took = refused(lambda: Redlock("acl:refused").acquire())
    assert took < bound(len(urls))
    assert error.granted == 0 and len(error.failed) == len(urls)
    text = str(error) + repr(error.failed) + repr(error)
    for password in PASSWORDS:
        assert password not in text
    ports = [url.rpartition(":")[2].partition("/")[0] for url in urls]
    assert list(error.failed) == [f"redis://127.0.0.1:{port}/0" for port in ports]
    return error


def test_no_password_given_is_a_clear_noauth_error_per_node(
    settings: Any, acl_nodes: list[redis.Redis]
) -> None:
    error = acl_failure(settings, acl_urls(acl_nodes, ""))
    for reason in error.failed.values():
        assert reason == "AuthenticationError: Authentication required.", reason


def test_wrong_password_is_a_clear_wrongpass_error_per_node(
    settings: Any, acl_nodes: list[redis.Redis]
) -> None:
    error = acl_failure(
        settings, acl_urls(acl_nodes, f"redlock-app:not-{APP_PASSWORD}")
    )
    for reason in error.failed.values():
        assert "invalid username-password pair" in reason, reason
        assert reason.startswith("AuthenticationError"), reason


def test_user_without_eval_gets_a_clear_noperm_error_per_node(
    settings: Any, acl_nodes: list[redis.Redis]
) -> None:
    for admin in acl_nodes:
        admin.execute_command(
            "ACL", "SETUSER", "no-eval", "on", ">no-eval-pw", "~redlock:*", "-@all",
            "+hget", "+hset", "+pexpire", "+del", "+get", "+set", "+pttl",
        )  # fmt: skip
    error = acl_failure(settings, acl_urls(acl_nodes, "no-eval:no-eval-pw"))
    for reason in error.failed.values():
        assert reason.startswith("NoPermissionError"), reason
        assert "no permissions to run the 'evalsha' command" in reason, reason


def test_key_pattern_not_covering_the_prefix_gets_a_clear_noperm_error(
    settings: Any, acl_nodes: list[redis.Redis]
) -> None:
    """The documented user, with KEY_PREFIX outside its ``~redlock:*`` pattern."""
    error = acl_failure(
        settings,
        acl_urls(acl_nodes, f"redlock-app:{APP_PASSWORD}"),
        KEY_PREFIX="other",
    )
    for reason in error.failed.values():
        assert reason.startswith("NoPermissionError"), reason
        # Redis: "... no permissions to access one of the keys used as arguments";
        # Valkey 9: "No permissions to access a key".
        noperm = r"no permissions to access (one of the keys|a key)"
        assert re.search(noperm, reason, re.IGNORECASE), reason


def test_failure_message_names_each_node_by_index(
    settings: Any, acl_nodes: list[redis.Redis]
) -> None:
    error = acl_failure(settings, acl_urls(acl_nodes, ""))
    for index, name in enumerate(error.failed):
        assert f"node[{index}] {name}" in str(error)


def test_user_without_hget_gets_a_noperm_error_not_contention(
    settings: Any, acl_nodes: list[redis.Redis]
) -> None:
    rules = [r for r in documented_acl("redlock-app") if r != "+hget"]
    rules = ["no-hget" if r == "redlock-app" else r for r in rules]
    rules = [">no-hget-pw" if r == ">CHANGE-ME" else r for r in rules]
    for admin in acl_nodes:
        admin.execute_command("ACL", "SETUSER", *rules)
    error = acl_failure(
        settings, acl_urls(acl_nodes, "no-hget:no-hget-pw"), WAIT_TIMEOUT=0.3
    )
    for reason in error.failed.values():
        assert "no permissions" in reason or "can't run this command" in reason


# --- credentials never shown ----------------------------------------------------------

SECRET = "n0de-pa55-never-shown"


@pytest.fixture
def secured(make_nodes: Callable[..., NodeSet]) -> list[str]:
    """Three servers behind ``requirepass``; return URLs, the last one's wrong."""
    node_set = make_nodes(3)
    urls = node_set.require_password(SECRET, user="default")
    urls[0] = f"redis://:{SECRET}@127.0.0.1:{node_set[0].port}/0?password={SECRET}"
    urls[2] = f"redis://:wrong-{SECRET}@127.0.0.1:{node_set[2].port}/0"
    return urls


def test_reprs_never_show_credentials(settings: Any, secured: list[str]) -> None:
    """Locks, settings, node specs, pools, clients and exceptions, once used."""
    settings.REDLOCK = lock_settings(secured)
    lock = Redlock("repr", nodes=secured)
    with lock:
        conf = redlock_conf.get_settings()
        pools = node_pools.sync_pools(conf.nodes, NODE_TIMEOUT)
        texts = [repr(lock), str(lock), repr(conf), *map(repr, conf.nodes)]
        texts += [repr(pool) for pool in pools]
        texts += [repr(c) for p in pools for c in p._available_connections]

        async def from_asyncio() -> list[str]:
            async with Redlock("repr-async"):
                clients = node_pools.async_clients(conf.nodes, NODE_TIMEOUT)
                return [repr(c) + repr(c.connection_pool) for c in clients]

        texts += asyncio.run(from_asyncio())
    settings.REDLOCK = lock_settings(secured[2:], NODE_TIMEOUT=FAIL_TIMEOUT)
    error, _ = refused(lambda: Redlock("repr").acquire())
    texts += [repr(error), str(error), repr(error.failed), repr(error.__dict__)]
    assert any("127.0.0.1" in text for text in texts)  # the texts are not empty
    for text in texts:
        assert SECRET not in text, text


def test_debug_logs_of_a_lock_cycle_and_a_failed_one_have_no_credentials(
    settings: Any, secured: list[str], caplog: pytest.LogCaptureFixture
) -> None:
    """Every logger at DEBUG, redis-py's included, through success and failure."""
    settings.REDLOCK = lock_settings(secured, NODE_TIMEOUT=FAIL_TIMEOUT)
    with caplog.at_level(logging.DEBUG):
        with Redlock("logged", auto_extend=True, ttl=1.0) as lock:
            assert lock.extend()
            time.sleep(0.6)  # one watchdog extension
        held = Redlock("listed")
        assert held.acquire()
        listing.held_locks()  # logs the node it skipped
        held.release()
        settings.REDLOCK = lock_settings(secured[1:], NODE_TIMEOUT=FAIL_TIMEOUT)
        refused(lambda: Redlock("logged").acquire())
    assert any("127.0.0.1" in record.getMessage() for record in caplog.records)
    for record in caplog.records:
        text = record.getMessage() + (record.exc_text or "")
        assert SECRET not in text, text


def failing_view(request: Any) -> Any:
    """Take a lock on nodes that all refuse the password: the error escapes."""
    with Redlock("reported"):
        raise AssertionError("never reached")


urlpatterns = [__import__("django.urls").urls.path("fail/", failing_view)]


@pytest.mark.parametrize("debug", [True, False])
def test_error_report_of_a_failed_lock_masks_node_passwords(
    settings: Any, secured: list[str], debug: bool
) -> None:
    """The DEBUG page and the e-mailed report (DEBUG off) show no node password.

    Needs ``DEFAULT_EXCEPTION_REPORTER_FILTER =
    "redlock_django.conf.SafeSettingsReporterFilter"``: Django's own filter hides
    settings by name only, and prints ``REDLOCK["NODES"]`` as written (the
    negative control below).
    """
    from django.test import Client, RequestFactory

    settings.ROOT_URLCONF = __name__
    settings.DEBUG = debug
    settings.REDLOCK = lock_settings(
        [url.replace(SECRET, "wrong-" + SECRET) for url in secured[:2]] + [secured[2]],
        NODE_TIMEOUT=FAIL_TIMEOUT,
    )
    settings.CACHES = {
        **settings.CACHES,
        "pw": {
            "BACKEND": "django.core.cache.backends.redis.RedisCache",
            "LOCATION": f"redis://:{SECRET}@127.0.0.1:1/0",
        },
    }
    use_reporter_filter(settings, "redlock_django.conf.SafeSettingsReporterFilter")
    response = Client(raise_request_exception=False).get("/fail/")
    assert response.status_code == 500
    # Built away from this function, whose locals hold the test's own URLs.
    error = report_of(RequestFactory().get("/fail/"))
    reports = [error.get_traceback_text(), error.get_traceback_html()]
    if debug:
        page = response.content.decode()
        assert "QuorumUnavailableError" in page and "REDLOCK" in page
        reports.append(page)
    for report in reports:
        assert "127.0.0.1" in report and "REDLOCK" in report
        assert SECRET not in report

    # Negative control: Django's own filter prints the URLs as written.
    use_reporter_filter(settings, "django.views.debug.SafeExceptionReporterFilter")
    assert SECRET in report_of(RequestFactory().get("/fail/")).get_traceback_text()


@pytest.mark.parametrize(
    "url",
    [
        "redis://:p@Tail-0f-the-pa55word@127.0.0.1:6379/0",  # an unencoded "@"
        "redis://:pa Tail-0f-the-pa55word@127.0.0.1:6379/0",  # a space
        "redis://127.0.0.1:6379/0?password=pa Tail-0f-the-pa55word",
    ],
    ids=["at-sign", "space", "query-space"],
)
def test_reporter_filter_masks_the_whole_of_a_password_the_nodes_accept(
    url: str,
) -> None:
    """redis-py takes a password with an unencoded "@" or a space whole (and the
    node is valid: no E003): the filter must mask all of it. It stopped at the
    first "@" or space, and the rest reached the DEBUG page and the e-mails."""
    from redlock_django import conf
    from redlock_django.address import connection_params, parse_node

    assert (
        "Tail-0f-the-pa55word" in connection_params(parse_node(url, 0))[1]["password"]
    )
    assert conf.validate({"NODES": [url]}) == []
    cleansed = conf.SafeSettingsReporterFilter().cleanse_setting(
        "REDLOCK", {"NODES": [url]}
    )
    assert "Tail-0f-the-pa55word" not in cleansed["NODES"][0], cleansed
    assert "127.0.0.1:6379" in cleansed["NODES"][0]


def use_reporter_filter(settings: Any, path: str) -> None:
    """Set DEFAULT_EXCEPTION_REPORTER_FILTER; Django caches the filter it made."""
    from django.views.debug import get_default_exception_reporter_filter

    settings.DEFAULT_EXCEPTION_REPORTER_FILTER = path
    get_default_exception_reporter_filter.cache_clear()


@pytest.fixture(autouse=True)
def _fresh_reporter_filter() -> Iterator[None]:
    from django.views.debug import get_default_exception_reporter_filter

    yield
    get_default_exception_reporter_filter.cache_clear()


def report_of(request: Any) -> Any:
    """Return Django's ExceptionReporter for ``failing_view`` failing on ``request``."""
    from django.views.debug import ExceptionReporter

    try:
        failing_view(request)
    except QuorumUnavailableError:
        return ExceptionReporter(request, *sys.exc_info())
    raise AssertionError("the view did not fail")


# --- tokens ------------------------------------------------------------------------


def test_tokens_come_from_secrets_with_at_least_128_bits(
    redlock_settings: dict[str, Any], nodes: NodeSet, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each acquisition asks ``secrets`` for >= 16 bytes; the stored token is that
    value plus the attempt number (``<base>.1`` for a first attempt that won)."""
    import base64
    import secrets

    import redlock_django.lock

    asked: list[tuple[int, str]] = []
    original = secrets.token_urlsafe

    def token_urlsafe(nbytes: int) -> str:
        token = original(nbytes)
        asked.append((nbytes, token))
        return token

    monkeypatch.setattr(redlock_django.lock.secrets, "token_urlsafe", token_urlsafe)
    stored = set()
    for round_ in range(50):
        with Redlock("tokens"):
            stored.add(nodes[round_ % 5].client().hget(lock_key("tokens"), "token"))
    assert len(asked) == 50
    # 50 distinct, all used; the lock was free, so each first attempt won.
    assert {f"{token}.1".encode() for _, token in asked} == stored
    for nbytes, token in asked:
        assert nbytes >= 16
        assert len(base64.urlsafe_b64decode(token + "=" * (-len(token) % 4))) >= 16


@pytest.mark.django_db
def test_full_token_never_shown_by_admin_command_or_listing(
    redlock_settings: dict[str, Any],
    nodes: NodeSet,
    admin_client: Any,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Only the 12-digit digest is shown; the token itself appears on no surface."""
    import io

    from django.core.management import call_command

    with caplog.at_level(logging.DEBUG), Redlock("shown", label="x") as lock:
        token = nodes[0].client().hget(lock_key("shown"), "token")
        assert token is not None and lock.owned()
        digest = listing.token_digest(token)
        surfaces = [
            admin_client.get("/admin/redlock_django/heldlock/").content.decode(),
            repr(listing.describe(["shown"])),
            repr(listing.held_locks()),
        ]
        for args in (["list"], ["list", "--json"], ["status"]):
            out, err = io.StringIO(), io.StringIO()
            call_command("redlock", *args, stdout=out, stderr=err)
            surfaces += [out.getvalue(), err.getvalue()]
    surfaces.append(caplog.text)
    assert digest in surfaces[0] and digest in surfaces[1]
    for text in surfaces:
        assert token.decode() not in text
        # Nor any 16-character piece of it (a prefix, say).
        assert all(
            token.decode()[i : i + 16] not in text for i in range(len(token) - 15)
        )


# --- admin force release: only keys under the prefix ----------------------------------


def plant_token(node_set: NodeSet, key: str, token: bytes) -> None:
    for node in node_set:
        with node.client() as client:
            client.hset(key, mapping={"token": token, "meta": "{}"})
            client.pexpire(key, 60_000)


@pytest.mark.django_db
def test_force_release_only_reaches_keys_under_the_configured_prefix(
    settings: Any, redlock_settings: dict[str, Any], nodes: NodeSet, admin_client: Any
) -> None:
    """Same token under other prefixes, bare, or as a glob match: left alone."""
    settings.REDLOCK = {**redlock_settings, "KEY_PREFIX": "app1"}
    token = b"shared-token"
    digest = listing.token_digest(token)
    others = ["app2:lock:x", "redlock:lock:x", "x", "app1:lock:xy", "app1:fence:x"]
    for key in ["app1:lock:x", *others]:
        plant_token(nodes, key, token)
    url = "/admin/redlock_django/heldlock/release/"
    for resource in ["*", "x*", "?", "[x]", "../x", "x\n"]:
        admin_client.post(
            url, {"resource": resource, "token_digest": digest, "confirm": "yes"}
        )
    for key in ["app1:lock:x", *others]:
        assert all(n.client().exists(key) for n in nodes), key
    response = admin_client.post(
        url, {"resource": "x", "token_digest": digest, "confirm": "yes"}
    )
    assert response.status_code == 302
    assert not any(n.client().exists("app1:lock:x") for n in nodes)
    for key in others:
        assert all(n.client().exists(key) for n in nodes), key


# --- resource names ----------------------------------------------------------------


@pytest.mark.parametrize(
    ("resource", "message"),
    [
        ("a" * 1001, "1001 characters long; the limit is"),
        ("job\n42", "contains control characters"),
        ("job\r\n", "contains control characters"),
        ("\x00", "contains control characters"),
        ("esc\x1b[31m", "contains control characters"),
        ("del\x7f", "contains control characters"),
        ("", "must be a non-empty string"),
    ],
)
def test_bad_resource_names_are_refused_before_any_key_is_built(
    redlock_settings: dict[str, Any], resource: str, message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        Redlock(resource)
    with pytest.raises(ValueError, match=message):
        listing.force_release(resource, "a" * 12)


def test_longest_allowed_resource_name_locks() -> None:
    """200 characters is the cap itself: accepted (the boundary of the test above)."""
    from redlock_django.keys import check_resource

    assert check_resource("é" * 200) == "é" * 200


@pytest.mark.parametrize("resource", ["a\x85b", "a\u2028b", "a\u202eb", "a\u200bb"])
def test_unicode_control_and_format_characters_are_refused(resource: str) -> None:
    from redlock_django.keys import check_resource

    with pytest.raises(ValueError):
        check_resource(resource)


def test_long_resource_names_are_kept_short_by_hashing_the_tail(
    redlock_settings: dict[str, Any], nodes: NodeSet
) -> None:
    resource = "report:" + "x" * 500
    with Redlock(resource):
        [key] = nodes[0].client().keys("redlock:lock:*")
        assert len(key) < 300


@pytest.mark.parametrize("search", ["*", "a?c", "[ab]", "\\", "a\\*"])
def test_search_terms_match_literally_in_scan_patterns(
    redlock_settings: dict[str, Any],
    hold: Callable[..., Redlock],
    search: str,
) -> None:
    """Glob characters in a search match themselves only, never other names."""
    hold("abc")
    hold("aXc")
    hold(f"has{search}inside")
    assert listing.lock_resources(search) == [f"has{search}inside"]
