"""redlock_django.listing on real nodes: listing, merging, health, force release."""

from __future__ import annotations

import contextlib
import functools
import gc
import hashlib
import json
import os
import random
import signal
import socket
import threading
import time
import traceback
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest

from harness.held import fence_key, lock_key, token_on
from harness.nodes import NodeSet, RedisNode, find_redis_server
from redlock_django import LockError, Redlock
from redlock_django import listing as redlock_listing
from redlock_django.listing import (
    ForceRelease,
    ListedLock,
    describe,
    force_release,
    held_locks,
    lock_resources,
    node_status,
)
from redlock_django.scripts import FORCE_RELEASE_SCRIPT
from tests._forked import in_forked_child

PASSWORD = "s3cret-pass"


def sha1_prefix(token: bytes) -> str:
    return hashlib.sha1(token).hexdigest()[:12]


def test_held_locks_lists_a_lock_with_its_holder_on_every_node(
    nodes: NodeSet, hold: Callable[..., Redlock]
) -> None:
    """A held lock is listed once, held on 5/5, with its holder and fencing token."""
    before = datetime.now(UTC)
    lock = hold("order:42", label="POST /orders/42/pay", fencing=True)
    (held,) = held_locks()
    token = token_on(nodes[0], "order:42")
    assert held.resource == "order:42"
    assert held.nodes == (0, 1, 2, 3, 4)
    assert (held.held_on, held.node_count, held.quorum) == (5, 5, 3)
    assert not held.below_quorum
    assert held.host == socket.gethostname()
    assert held.pid == os.getpid()
    assert held.holder == threading.current_thread().name
    assert held.label == "POST /orders/42/pay"
    assert held.acquired_at is not None and held.acquired_at.tzinfo is not None
    assert before - timedelta(seconds=1) <= held.acquired_at <= datetime.now(UTC)
    assert held.ttl == 10.0
    assert 8.0 < held.time_left <= 10.0
    assert held.fencing_token == lock.fencing_token is not None
    assert held.other_tokens == 0
    assert held.token_digest == sha1_prefix(token)
    # The token is a capability: only its digest leaves the module.
    assert token.decode() not in repr(held)


def test_lock_resources_escapes_glob_characters_in_the_search(
    nodes: NodeSet, hold: Callable[..., Redlock]
) -> None:
    """Search terms match literally: '*' finds 'a*b' only, not every lock."""
    names = ["a*b", "axb", "a?c", "abc", "a[b]", "ab", "back\\slash", "plain"]
    for name in names:
        hold(name)
    assert lock_resources() == sorted(names)
    assert lock_resources("*") == ["a*b"]
    assert lock_resources("a*b") == ["a*b"]
    assert lock_resources("?") == ["a?c"]
    assert lock_resources("[b]") == ["a[b]"]
    assert lock_resources("\\") == ["back\\slash"]
    assert lock_resources("b") == sorted(n for n in names if "b" in n)
    assert lock_resources("nothing-like-it") == []
    # Negative control: the same terms unescaped are patterns matching other locks.
    with nodes[0].client() as client:
        unescaped = {k.decode() for k in client.scan_iter("redlock:lock:*a*b*")}
        assert lock_key("axb") in unescaped and lock_key("ab") in unescaped


def test_lock_resources_sorts_and_merges_keys_found_on_any_node(
    nodes: NodeSet, hold: Callable[..., Redlock]
) -> None:
    """The union over nodes, sorted; a key held on one node only is listed too."""
    for name in ["b", "c", "a"]:
        hold(name)
    with nodes[4].client() as client:
        client.hset(lock_key("only-on-4"), mapping={"token": "x", "meta": "{}"})
        client.pexpire(lock_key("only-on-4"), 10_000)
        # Fencing counters live beside the locks and are not locks.
        client.set(fence_key("counter-only"), 7)
    assert lock_resources() == ["a", "b", "c", "only-on-4"]
    assert lock_resources(descending=True) == ["only-on-4", "c", "b", "a"]


def test_describe_keeps_the_order_given_and_omits_resources_not_held(
    hold: Callable[..., Redlock],
) -> None:
    """describe() returns one row per held resource, in the order asked for."""
    for name in ["x", "y", "z"]:
        hold(name)
    rows = describe(["z", "missing", "x", "z"])
    assert [row.resource for row in rows] == ["z", "x"]
    assert describe([]) == []


def test_describe_flags_a_lock_held_on_fewer_than_a_quorum(
    nodes: NodeSet, hold: Callable[..., Redlock]
) -> None:
    """A lock left on 2 of 5 nodes is listed, flagged below quorum, not hidden."""
    hold("minority")
    for node in nodes[:3]:
        with node.client() as client:
            client.delete(lock_key("minority"))
    (held,) = held_locks()
    assert held.nodes == (3, 4)
    assert held.held_on == 2
    assert held.below_quorum
    assert held.other_tokens == 0


def test_describe_counts_other_tokens_and_takes_the_majority_token(
    nodes: NodeSet, hold: Callable[..., Redlock]
) -> None:
    """Nodes with another token or a foreign value count in other_tokens."""
    hold("contested")
    ours = token_on(nodes[0], "contested")
    with nodes[0].client() as client:
        client.delete(lock_key("contested"))
        client.hset(lock_key("contested"), "token", "leftover-of-another-attempt")
        client.pexpire(lock_key("contested"), 5000)
    with nodes[1].client() as client:
        client.delete(lock_key("contested"))
    nodes[1].clog(lock_key("contested"))  # a plain string: WRONGTYPE for HGETALL
    (held,) = held_locks()
    assert held.nodes == (2, 3, 4)
    assert held.other_tokens == 2
    assert held.token_digest == sha1_prefix(ours)
    assert not held.below_quorum

    # Now the other token holds 3 nodes: it becomes the lock shown.
    for node in nodes[1:3]:
        with node.client() as client:
            client.delete(lock_key("contested"))
            client.hset(lock_key("contested"), "token", "leftover-of-another-attempt")
            client.pexpire(lock_key("contested"), 5000)
    (held,) = held_locks()
    assert held.nodes == (0, 1, 2)
    assert held.token_digest == sha1_prefix(b"leftover-of-another-attempt")
    assert held.other_tokens == 2
    assert held.host is None and held.label == "" and held.acquired_at is None


def test_describe_omits_a_key_holding_only_foreign_values(
    nodes: NodeSet, redlock_settings: dict[str, Any]
) -> None:
    """A key with no token on any node (another writer's value) is no lock."""
    nodes[0].clog(lock_key("foreign"))
    assert lock_resources() == ["foreign"]
    assert describe(["foreign"]) == []


def test_node_status_reports_every_node_with_version_latency_and_lock_keys(
    nodes: NodeSet, hold: Callable[..., Redlock]
) -> None:
    """Every node is reachable, with its server, version and lock-key count."""
    hold("one")
    hold("two")
    nodes[3].clog(lock_key("three"))
    with nodes[0].client() as client:
        info = client.info("server")
    server = "valkey" if "valkey_version" in info else "redis"
    version = info.get("valkey_version", info["redis_version"])
    statuses = node_status()
    assert [s.index for s in statuses] == [0, 1, 2, 3, 4]
    for status, node in zip(statuses, nodes, strict=True):
        assert status.reachable and status.error is None
        assert status.address == f"redis://127.0.0.1:{node.port}/0"
        assert (status.server, status.version) == (server, str(version))
        assert status.latency_ms is not None and 0 < status.latency_ms < 500
    assert [s.lock_keys for s in statuses] == [2, 2, 2, 3, 2]


def test_node_status_tells_valkey_from_redis_with_each_servers_own_version(
    settings: Any, tmp_path: Any, redlock_settings: dict[str, Any]
) -> None:
    """A mixed set shows "redis-7…" and "valkey-9…", not Valkey's fixed 7.2.4."""
    nodes = NodeSet(
        RedisNode(tmp_path / name, server=find_redis_server(name))
        for name in ("redis", "valkey", "valkey")
    )
    nodes.start_all()
    try:
        settings.REDLOCK = {**redlock_settings, "NODES": nodes.urls}
        statuses = node_status()
    finally:
        nodes.stop_all()
    assert [s.server for s in statuses] == ["redis", "valkey", "valkey"]
    assert statuses[0].version is not None and statuses[0].version[0] in "67"
    assert statuses[1].version is not None and statuses[1].version.startswith("9.")
    assert statuses[1].server_version == f"valkey-{statuses[1].version}"


def test_node_status_reports_stopped_and_paused_nodes_in_bounded_time(
    nodes: NodeSet, hold: Callable[..., Redlock]
) -> None:
    """A stopped and a paused node are unreachable; the listing still works."""
    hold("survivor")
    nodes[1].stop()
    with nodes[2].paused():
        started = time.monotonic()
        statuses = node_status()
        status_time = time.monotonic() - started
        started = time.monotonic()
        held = held_locks()
        listing_time = time.monotonic() - started
    assert [s.reachable for s in statuses] == [True, False, False, True, True]
    assert statuses[1].error is not None and "ConnectionError" in statuses[1].error
    assert statuses[2].error == "timed out"
    for status in statuses[1:3]:
        assert status.latency_ms is None and status.version is None
        assert status.lock_keys is None
    # Nodes are asked in parallel: one INSPECT_TIMEOUT, not one per bad node.
    assert status_time < 2 * redlock_listing.INSPECT_TIMEOUT + 0.5
    assert listing_time < 4 * redlock_listing.INSPECT_TIMEOUT + 0.5
    assert [h.nodes for h in held] == [(0, 3, 4)]
    # Once resumed, the node answers again: no stale reply is left on a connection.
    statuses = node_status()
    assert [s.reachable for s in statuses] == [True, False, True, True, True]
    assert statuses[2].lock_keys == 1
    assert [h.nodes for h in held_locks()] == [(0, 2, 3, 4)]


def test_password_never_appears_in_statuses_listings_or_errors(
    settings: Any,
    make_nodes: Callable[..., NodeSet],
    redlock_settings: dict[str, Any],
) -> None:
    """Nodes behind a password show masked addresses; a bad password is no leak."""
    secured = make_nodes(3)
    urls = secured.require_password(PASSWORD)
    urls[2] = f"redis://:wrong-{PASSWORD}@127.0.0.1:{secured[2].port}/0"
    settings.REDLOCK = {**redlock_settings, "NODES": urls}
    lock = Redlock("secured")
    assert lock.acquire(blocking=False)
    try:
        statuses = node_status()
        held = held_locks()
        outcome = force_release("secured", "0" * 12)
    finally:
        with contextlib.suppress(LockError):
            lock.release()
    assert [s.reachable for s in statuses] == [True, True, False]
    assert statuses[2].error is not None
    assert "Authentication" in statuses[2].error or "AUTH" in statuses[2].error
    assert [h.nodes for h in held] == [(0, 1)]
    assert list(outcome.failed) == [f"redis://127.0.0.1:{secured[2].port}/0"]
    text = repr(statuses) + repr(held) + repr(outcome)
    assert PASSWORD not in text
    assert all(
        s.address == f"redis://127.0.0.1:{n.port}/0"
        for s, n in zip(statuses, secured, strict=True)
    )


def test_force_release_deletes_only_the_token_that_was_shown(
    nodes: NodeSet, hold: Callable[..., Redlock]
) -> None:
    """A stale digest releases nothing (changed); the shown one releases all."""
    first = hold("shared")
    stale = held_locks()[0].token_digest
    first.release()
    hold("shared")  # a new holder, with a new token
    (held,) = held_locks()
    assert held.token_digest != stale

    outcome = force_release("shared", stale)
    assert outcome == ForceRelease(released=(), failed={}, changed=True)
    assert [h.token_digest for h in held_locks()] == [held.token_digest]

    outcome = force_release("shared", held.token_digest.upper())
    assert outcome == ForceRelease(released=(0, 1, 2, 3, 4), failed={}, changed=False)
    assert held_locks() == []
    for node in nodes:
        with node.client() as client:
            assert not client.exists(lock_key("shared"))


def test_force_release_leaves_other_tokens_and_foreign_values_alone(
    nodes: NodeSet, hold: Callable[..., Redlock]
) -> None:
    """Only nodes holding the shown token lose the key; others keep theirs."""
    hold("mixed")
    with nodes[0].client() as client:
        client.hset(lock_key("mixed"), "token", "another-token")
    with nodes[1].client() as client:
        client.delete(lock_key("mixed"))
    nodes[1].clog(lock_key("mixed"))
    (held,) = held_locks()
    outcome = force_release("mixed", held.token_digest)
    assert outcome.released == (2, 3, 4) and not outcome.changed
    with nodes[0].client() as client:
        assert client.hget(lock_key("mixed"), "token") == b"another-token"
    with nodes[1].client() as client:
        assert client.get(lock_key("mixed")) == b"foreign-token"


def test_force_release_reports_an_unreachable_node_without_raising(
    nodes: NodeSet, hold: Callable[..., Redlock]
) -> None:
    """A stopped node is named in failed; the reachable ones are released."""
    hold("partial")
    (held,) = held_locks()
    nodes[0].stop()
    outcome = force_release("partial", held.token_digest)
    assert outcome.released == (1, 2, 3, 4)
    assert list(outcome.failed) == [f"redis://127.0.0.1:{nodes[0].port}/0"]
    assert not outcome.changed


@pytest.mark.parametrize(
    ("resource", "digest"),
    [
        ("ok", ""),  # an empty prefix would match every token
        ("ok", "abc"),
        ("ok", "zz" * 6),
        ("ok", "a" * 41),
        ("", "a" * 12),
        ("bad\nname", "a" * 12),
        ("x" * 1001, "a" * 12),
    ],
)
def test_force_release_rejects_invalid_resources_and_digests(
    nodes: NodeSet, hold: Callable[..., Redlock], resource: str, digest: str
) -> None:
    """Bad input raises ValueError before any node is touched."""
    lock = hold("ok")
    with pytest.raises(ValueError):
        force_release(resource, digest)
    assert lock.locked()


def test_force_release_script_declares_its_key_and_never_deletes_blindly() -> None:
    """The script compares the token's SHA1 before DEL, deletes only KEYS[1], and
    reaches the queue (to wake its first waiter) only through declared KEYS."""
    source = FORCE_RELEASE_SCRIPT.source
    assert "redis.sha1hex" in source and "KEYS[1]" in source
    assert source.count("'del'") == 1 and "'del', KEYS[1]" in source
    assert "'keys'" not in source and "'scan'" not in source
    assert source.index("sha1hex") < source.index("'del'")


def test_ten_thousand_locks_list_and_page_quickly(
    nodes: NodeSet, redlock_settings: dict[str, Any]
) -> None:
    """10,000 locks on 5 nodes: names by SCAN (never KEYS), a page of 100 fast."""
    count = 10_000
    meta = json.dumps(
        {
            "host": "bulk",
            "pid": 1,
            "holder": "MainThread",
            "acquired_at": datetime.now(UTC).isoformat(),
            "ttl": 60.0,
            "label": "bulk",
        }
    )

    def fill(index: int) -> None:
        with nodes[index].client(socket_timeout=10) as client:
            pipe = client.pipeline(transaction=False)
            for i in range(count):
                name = lock_key(f"bulk:{i:05d}")
                pipe.hset(name, mapping={"token": f"token-{i}", "meta": meta})
                pipe.pexpire(name, 60_000)
            pipe.execute()
            client.config_resetstat()

    threads = [threading.Thread(target=fill, args=(i,)) for i in range(len(nodes))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()

    started = time.monotonic()
    resources = lock_resources()
    page = describe(resources[:100])
    elapsed = time.monotonic() - started
    print(f"\n10,000 locks: lock_resources() + describe(100) took {elapsed:.3f}s")

    assert len(resources) == count
    assert [h.resource for h in page] == [f"bulk:{i:05d}" for i in range(100)]
    assert all(h.held_on == 5 and h.label == "bulk" for h in page)
    assert elapsed < 5.0
    for node in nodes:
        with node.client() as client:
            stats = client.info("commandstats")
        assert "cmdstat_keys" not in stats
        assert stats["cmdstat_scan"]["calls"] >= count // 1000


def test_scans_stop_at_the_key_cap_and_the_deadline(
    nodes: NodeSet,
    redlock_settings: dict[str, Any],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """SCAN_CAP bounds the keys read per node; INSPECT_DEADLINE bounds a walk."""
    with nodes[0].client() as client:
        pipe = client.pipeline(transaction=False)
        for i in range(3000):
            pipe.hset(lock_key(f"many:{i}"), "token", "t")
        pipe.execute()
    monkeypatch.setattr(redlock_listing, "SCAN_CAP", 1500)
    assert node_status()[0].lock_keys == 1500
    assert len(lock_resources()) == 1500

    monkeypatch.setattr(redlock_listing, "SCAN_CAP", 100_000)
    monkeypatch.setattr(redlock_listing, "INSPECT_DEADLINE", 0.0)
    failed: dict[str, str] = {}
    assert lock_resources(failed=failed) == []
    assert failed == {nodes[0].url: "scan took longer than 0s"}
    (first, *others) = node_status()
    assert first.reachable and first.lock_keys is None
    assert [status.lock_keys for status in others] == [0, 0, 0, 0]


def test_listing_records_the_nodes_it_skipped(
    nodes: NodeSet, hold: Callable[..., Redlock]
) -> None:
    """``failed=`` collects each node a listing skipped, with the reason."""
    hold("noted")
    nodes[3].stop()
    failed: dict[str, str] = {}
    assert [h.nodes for h in held_locks(failed=failed)] == [(0, 1, 2, 4)]
    assert list(failed) == [nodes[3].url]
    assert failed[nodes[3].url].startswith("ConnectionError")


def test_held_lock_rows_are_plain_frozen_values(
    hold: Callable[..., Redlock],
) -> None:
    """Rows are frozen dataclasses: safe to cache or hand to templates."""
    hold("frozen")
    (held,) = held_locks()
    assert isinstance(held, ListedLock)
    with pytest.raises(AttributeError):
        held.resource = "other"  # type: ignore[misc]


@pytest.mark.parametrize("fair", [False, True], ids=["plain", "fair"])
def test_a_force_release_wakes_the_waiter_instead_of_leaving_it_to_its_timer(
    fair: bool, nodes: NodeSet, redlock_settings: dict[str, Any], settings: Any
) -> None:
    """Waiters sleep on their wake-up subscription (RETRY_DELAY long here); an
    operator's forced release wakes them, as a release does (it woke nobody: the
    waiter got the lock at its own timer, 4 s later). A fair lock's first waiter
    is told on its process's channel, as a release names it (it was not: the
    waiter slept out its 30 s retry delay)."""
    settings.REDLOCK = {**redlock_settings, "RETRY_DELAY": 30.0, "FAIR": fair}
    holder = Redlock("stuck")
    assert holder.acquire(blocking=False)
    started = threading.Event()
    got_at: list[float] = []

    def wait() -> None:
        lock = Redlock("stuck")
        started.set()
        if lock.acquire(timeout=5):
            got_at.append(time.monotonic())
            lock.release()

    waiter = threading.Thread(target=wait)
    waiter.start()
    try:
        started.wait(5)
        time.sleep(1.0)  # the waiter's first attempt is refused; it sleeps
        (shown,) = held_locks()
        released_at = time.monotonic()
        assert force_release("stuck", shown.token_digest).released == (0, 1, 2, 3, 4)
        waiter.join(15)
        assert got_at, "the waiter never got the lock"
        assert got_at[0] - released_at < 2.0, (
            f"the waiter got the freed lock only {got_at[0] - released_at:.1f}s "
            "after the forced release (its timer, not a wake-up)"
        )
    finally:
        waiter.join(15)
        with contextlib.suppress(LockError):
            holder.release()


class _Interrupted(Exception):
    """What the test's signal handler raises (as Celery's soft time limit does)."""


def _interrupted_listings(search: str) -> list[str]:
    """In a forked child: timers at random points of one-node listings; return
    where each shot landed that did not come out of ``lock_resources()``."""
    fired: list[str] = []

    def raise_interrupted(signum: int, frame: Any) -> None:
        fired.append("".join(traceback.format_stack(frame, limit=4)))
        raise _Interrupted("interrupted by a signal handler")

    signal.signal(signal.SIGALRM, raise_interrupted)
    gc.freeze()  # what the process holds now: never collected, never scanned
    started = time.monotonic()
    lock_resources(search)
    took = time.monotonic() - started
    rng = random.Random(7)
    swallowed: list[str] = []
    for _ in range(_LISTING_SHOTS):
        # Garbage is collected now, not while a shot may land in a finalizer
        # (where Python drops an exception).
        gc.collect()
        fired.clear()
        try:
            signal.setitimer(signal.ITIMER_REAL, rng.uniform(0.0, took))
            _listed_until(search, fired)
            # Fired, yet the listing returned. Not counted: a shot inside redis-py's
            # own metrics hooks (redis-py 7's ``observability``), which swallow
            # every exception by design, before or after any of our code runs.
            if "/redis/observability/" not in fired[0]:
                swallowed.append(fired[0])
        except _Interrupted:
            pass
    signal.setitimer(signal.ITIMER_REAL, 0)
    return swallowed


def _listed_until(search: str, fired: list[str]) -> None:
    """List until a shot fired (a frame of its own: python/cpython#108214)."""
    while not fired:
        lock_resources(search)


_LISTING_SHOTS = 60


def test_a_signal_handlers_exception_while_listing_one_node_comes_out_of_it(
    nodes: NodeSet, redlock_settings: dict[str, Any], settings: Any
) -> None:
    """A listing of one node runs its command on the caller's thread, where a
    Ctrl-C or a Celery soft time limit raises from a signal handler. Packed by
    redis-py with hiredis, a number in the command (SCAN's COUNT) went to
    ``repr()``, which runs pending signal handlers, and hiredis never checked it
    failed: the process died of a segmentation fault. A long search (its packing
    takes a while, so the shots land there) makes the window wide; every shot
    must come out of ``lock_resources()`` as itself, in a child process that
    lives."""
    settings.REDLOCK = {**redlock_settings, "NODES": [nodes.urls[0]]}
    report = in_forked_child(
        functools.partial(_interrupted_listings, "\u00e9" * 200_000), 60
    )
    assert report.outcome != "raised", report.value
    assert report.exitcode == 0, (
        f"the child process ended with status {report.exitcode} "
        f"(-{int(signal.SIGSEGV)}: a segmentation fault)"
    )
    assert report.outcome == "done", report.outcome
    assert report.value == [], (
        f"{len(report.value)} of {_LISTING_SHOTS} interruptions were swallowed; "
        f"the first landed in:\n{report.value[0]}"
    )
