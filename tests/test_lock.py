"""Redlock behaviour on five real redis-server nodes, through both APIs."""

from __future__ import annotations

import asyncio
import json
import math
import os
import socket
import threading
import time
from typing import Any

import pytest

from harness.held import lock_key, tokens
from redlock_django import (
    LockContentionError,
    LockLostError,
    LockNotOwnedError,
    Redlock,
)
from redlock_django.scripts import RELEASE_SCRIPT
from tests._api import SyncAPI, make_api


def pttls(nodes: Any, resource: str) -> list[int]:
    return [node.client().pttl(lock_key(resource)) for node in nodes]


async def test_acquire_holds_the_lock_on_every_node_until_release(
    api: SyncAPI, nodes: Any
) -> None:
    lock = Redlock("basic")
    assert not await api.locked(lock)
    assert await api.acquire(lock)
    held = tokens(nodes, "basic")
    assert None not in held and len(set(held)) == 1
    assert len(held[0]) >= 27  # 20 random bytes, url-safe base64
    assert held[0].endswith(b".1")  # then the number of the attempt that won
    assert await api.locked(lock)
    assert await api.look(lock, "owned")
    await api.release(lock)
    assert tokens(nodes, "basic") == [None] * 5
    assert not await api.locked(lock)


async def test_every_acquisition_uses_a_fresh_random_token(
    api: SyncAPI, nodes: Any
) -> None:
    lock = Redlock("fresh")
    seen = set()
    for _ in range(5):
        await api.acquire(lock)
        seen.add(tokens(nodes, "fresh")[0])
        await api.release(lock)
    assert len(seen) == 5


async def test_another_owner_cannot_acquire_while_held(
    api: SyncAPI, other: SyncAPI
) -> None:
    lock = Redlock("busy")
    assert await api.acquire(lock)
    assert not await other.acquire(lock, blocking=False)
    started = time.monotonic()
    assert not await other.acquire(lock, timeout=0.3)
    assert time.monotonic() - started >= 0.3
    await api.release(lock)
    assert await other.acquire(lock, blocking=False)
    await other.release(lock)


async def test_waiting_owner_gets_the_lock_once_it_is_released(
    api: SyncAPI, other: SyncAPI
) -> None:
    lock = Redlock("handoff")
    await api.acquire(lock)
    waiter = asyncio.create_task(other.acquire(lock, timeout=5))
    await asyncio.sleep(0.2)
    assert not waiter.done()
    await api.release(lock)
    assert await asyncio.wait_for(waiter, 3)
    await other.release(lock)


async def test_context_manager_raises_contention_and_skips_the_body(
    api: SyncAPI, other: SyncAPI, settings: Any, redlock_settings: dict[str, Any]
) -> None:
    settings.REDLOCK = {**redlock_settings, "WAIT_TIMEOUT": 0.2}
    lock = Redlock("ctx")
    await other.acquire(lock)
    ran = False
    with pytest.raises(LockContentionError) as info:
        async with api.hold(lock):
            ran = True
    assert not ran
    assert info.value.resource == "ctx"
    assert (info.value.nodes, info.value.quorum) == (5, 3)
    await other.release(lock)


async def test_context_manager_raises_the_protocols_contention_error(
    api: SyncAPI,
    other: SyncAPI,
    nodes: Any,
    settings: Any,
    redlock_settings: dict[str, Any],
) -> None:
    """``with`` raises the error of the failed attempt itself: it names the nodes
    that granted and those that did not answer, not a copy without them."""
    settings.REDLOCK = {**redlock_settings, "WAIT_TIMEOUT": 0.3}
    lock = Redlock("ctx-real")
    await other.acquire(lock)
    nodes[4].pause()
    try:
        with pytest.raises(LockContentionError) as info:
            async with api.hold(lock):
                pass
    finally:
        nodes[4].resume()
    await other.release(lock)
    assert info.value.granted == 0
    assert list(info.value.failed) == [lock._resolve().spec.node_names[4]]
    assert "held by another owner: 0/5 nodes, quorum 3" in str(info.value)


async def test_release_by_an_owner_that_does_not_hold_it_leaves_the_lock(
    api: SyncAPI, other: SyncAPI, nodes: Any
) -> None:
    lock = Redlock("shared")  # one object, shared by two owners
    await api.acquire(lock)
    before = tokens(nodes, "shared")
    with pytest.raises(LockNotOwnedError):
        await other.release(lock)
    assert tokens(nodes, "shared") == before
    assert await api.look(lock, "depth") == 1
    assert await other.look(lock, "depth") == 0
    await api.release(lock)


async def test_release_script_with_a_wrong_token_leaves_the_key(nodes: Any) -> None:
    client = nodes[0].client()
    client.hset(lock_key("scripted"), mapping={"token": "right"})
    client.pexpire(lock_key("scripted"), 10_000)
    assert client.eval(RELEASE_SCRIPT.source, 1, lock_key("scripted"), "wrong") == 0
    assert client.hget(lock_key("scripted"), "token") == b"right"
    # The control: the right token deletes it, so the script is what protects it.
    assert client.eval(RELEASE_SCRIPT.source, 1, lock_key("scripted"), "right") == 1
    assert client.exists(lock_key("scripted")) == 0


async def test_expired_holder_releasing_late_leaves_the_new_holder_alone(
    api: SyncAPI, other: SyncAPI, nodes: Any
) -> None:
    lock = Redlock("late", ttl=0.2)
    await api.acquire(lock)
    await asyncio.sleep(0.3)
    # The new holder's lease is long: the checks below must not race its expiry
    # (with 0.2 s, a loaded machine saw one node's key expire before the last look).
    new = Redlock("late", ttl=10.0)
    assert await other.acquire(new, blocking=False)
    theirs = tokens(nodes, "late")
    with pytest.raises(LockLostError):
        await api.release(lock)
    assert tokens(nodes, "late") == theirs
    await other.release(new)


async def test_double_release_raises_not_owned(api: SyncAPI) -> None:
    lock = Redlock("twice")
    await api.acquire(lock)
    await api.release(lock)
    with pytest.raises(LockNotOwnedError):
        await api.release(lock)


async def test_same_owner_reacquires_and_only_the_outermost_release_frees(
    api: SyncAPI, other: SyncAPI, nodes: Any
) -> None:
    lock = Redlock("nested")
    assert await api.acquire(lock)
    token = tokens(nodes, "nested")
    assert await api.acquire(lock, blocking=False)
    assert await api.acquire(
        Redlock("nested"), blocking=False
    )  # another object, same lock
    assert await api.look(lock, "depth") == 3
    assert tokens(nodes, "nested") == token
    await api.release(lock)
    await api.release(lock)
    assert await api.locked(lock)
    assert not await other.acquire(lock, blocking=False)
    await api.release(lock)
    assert not await api.locked(lock)
    assert await api.look(lock, "depth") == 0


async def test_non_reentrant_lock_makes_its_own_owner_wait(api: SyncAPI) -> None:
    lock = Redlock("strict", reentrant=False)
    await api.acquire(lock)
    assert not await api.acquire(lock, timeout=0.1)
    await api.release(lock)


async def test_extend_resets_the_lease_on_every_node(api: SyncAPI, nodes: Any) -> None:
    lock = Redlock("extend", ttl=1.0)
    await api.acquire(lock)
    await asyncio.sleep(0.3)
    assert max(pttls(nodes, "extend")) <= 800
    assert await api.extend(lock, 5.0)
    assert min(pttls(nodes, "extend")) > 4000
    assert await api.look(lock, "validity") > 4.5
    await api.release(lock)


async def test_extend_after_the_lease_ran_out_fails_and_revives_nothing(
    api: SyncAPI, nodes: Any
) -> None:
    lock = Redlock("expired", ttl=0.2)
    await api.acquire(lock)
    await asyncio.sleep(0.3)
    assert await api.look(lock, "lost")
    with pytest.raises(LockLostError):
        await api.extend(lock)
    assert tokens(nodes, "expired") == [None] * 5
    with pytest.raises(LockLostError):
        await api.release(lock)


async def test_extend_confirmed_only_by_a_minority_fails_without_recreating_keys(
    api: SyncAPI, nodes: Any
) -> None:
    lock = Redlock("minority", ttl=5.0)
    await api.acquire(lock)
    for node in nodes[:3]:
        node.client().delete(lock_key("minority"))
    assert not await api.extend(lock, 8.0)
    assert tokens(nodes, "minority")[:3] == [None] * 3
    with pytest.raises(LockLostError, match="only 2/5"):
        await api.release(lock)


async def test_extend_rejects_a_non_positive_ttl_without_touching_the_lock(
    api: SyncAPI, nodes: Any
) -> None:
    lock = Redlock("badttl", ttl=5.0)
    await api.acquire(lock)
    for bad in (0, -1, float("nan"), float("inf"), 86401):
        with pytest.raises(ValueError):
            await api.extend(lock, bad)
    assert min(pttls(nodes, "badttl")) > 4000
    await api.release(lock)


async def test_extend_by_a_non_owner_raises_not_owned(
    api: SyncAPI, other: SyncAPI
) -> None:
    lock = Redlock("notmine")
    await api.acquire(lock)
    with pytest.raises(LockNotOwnedError):
        await other.extend(lock)
    await api.release(lock)


async def test_lease_that_ran_out_while_held_is_reported_lost_at_release(
    api: SyncAPI, nodes: Any
) -> None:
    lock = Redlock("overrun", ttl=0.2)
    await api.acquire(lock)
    assert 0 < await api.look(lock, "validity") <= 0.2
    await asyncio.sleep(0.3)
    assert await api.look(lock, "validity") == 0.0
    assert await api.look(lock, "lost")
    with pytest.raises(LockLostError) as info:
        await api.release(lock)
    assert "ran out" in str(info.value)
    assert await api.look(lock, "depth") == 0


async def test_lost_lease_does_not_mask_the_blocks_own_exception(api: SyncAPI) -> None:
    lock = Redlock("masked", ttl=0.2)
    with pytest.raises(ZeroDivisionError):
        async with api.hold(lock):
            await asyncio.sleep(0.3)
            1 / 0  # noqa: B018
    with pytest.raises(LockLostError):
        async with api.hold(lock):
            await asyncio.sleep(0.3)


async def test_holder_metadata_is_stored_with_the_lock(
    api: SyncAPI, nodes: Any
) -> None:
    lock = Redlock("meta", ttl=3.0, label="POST /shop/buy/")
    await api.acquire(lock)
    for node in nodes:
        raw = node.client().hget(lock_key("meta"), "meta")
        meta = json.loads(raw)
        assert meta["host"] == socket.gethostname()
        assert meta["pid"] == os.getpid()
        assert meta["label"] == "POST /shop/buy/"
        assert meta["ttl"] == 3.0
        assert meta["holder"] in {"owner-task"} | {
            t.name for t in threading.enumerate()
        }
        assert meta["acquired_at"].endswith("+00:00")
        assert 2000 < node.client().pttl(lock_key("meta")) <= 3000
    await api.release(lock)


async def test_watchdog_keeps_the_lock_alive_across_several_ttls(
    api: SyncAPI, other: SyncAPI, nodes: Any
) -> None:
    lock = Redlock("watched", ttl=0.3, auto_extend=True)
    await api.acquire(lock)
    await asyncio.sleep(1.2)  # four leases
    assert not await api.look(lock, "lost")
    assert await api.look(lock, "validity") > 0
    assert not await other.acquire(lock, blocking=False)
    assert None not in tokens(nodes, "watched")
    await api.release(lock)
    assert tokens(nodes, "watched") == [None] * 5


async def test_without_watchdog_the_same_hold_loses_the_lock(
    api: SyncAPI, other: SyncAPI
) -> None:
    lock = Redlock("unwatched", ttl=0.3)
    await api.acquire(lock)
    await asyncio.sleep(1.2)
    assert await other.acquire(lock, blocking=False)
    with pytest.raises(LockLostError):
        await api.release(lock)
    await other.release(lock)


async def test_max_hold_inf_extends_past_the_max_hold_setting(
    api: SyncAPI, other: SyncAPI, nodes: Any, settings: Any
) -> None:
    """``max_hold=math.inf`` lifts the cap of ``MAX_HOLD`` for one lock."""
    settings.REDLOCK = {**settings.REDLOCK, "TTL": 0.3, "MAX_HOLD": 0.6}
    capped = Redlock("capped-by-setting", ttl=0.3, auto_extend=True)
    uncapped = Redlock("uncapped", ttl=0.3, auto_extend=True, max_hold=math.inf)
    await api.acquire(capped)
    await api.acquire(uncapped)
    await asyncio.sleep(1.0)
    # The control: the setting's cap ended the first lock's extensions.
    assert await other.acquire(capped, blocking=False)
    assert not await other.acquire(uncapped, blocking=False)
    await api.release(uncapped)
    await other.release(capped)
    with pytest.raises(LockLostError):
        await api.release(capped)


async def test_watchdog_reports_loss_when_a_majority_of_nodes_stops_answering(
    api: SyncAPI, nodes: Any
) -> None:
    lock = Redlock("cut", ttl=0.5, auto_extend=True)
    await api.acquire(lock)
    for node in nodes[:3]:
        node.pause()
    try:
        await asyncio.sleep(0.8)
        assert await api.look(lock, "lost")
        assert await api.look(lock, "validity") == 0.0
        with pytest.raises(LockLostError):
            await api.release(lock)
    finally:
        for node in nodes[:3]:
            node.resume()


async def test_watchdog_stops_when_the_lock_is_released(
    api: SyncAPI, nodes: Any
) -> None:
    lock = Redlock("stopdog", ttl=0.3, auto_extend=True)
    await api.acquire(lock)
    await asyncio.sleep(0.2)
    await api.release(lock)
    await asyncio.sleep(0.5)
    assert tokens(nodes, "stopdog") == [None] * 5
    assert not [
        t for t in threading.enumerate() if t.name.startswith("redlock-watchdog")
    ]
    tasks = [t for t in asyncio.all_tasks() if "_run_task" in repr(t.get_coro())]
    assert not tasks


async def test_auto_extension_ends_at_max_hold(
    api: SyncAPI, other: SyncAPI, nodes: Any
) -> None:
    lock = Redlock("capped", ttl=0.3, auto_extend=True, max_hold=0.6)
    await api.acquire(lock)
    await asyncio.sleep(0.4)
    assert not await other.acquire(lock, blocking=False)  # extended past one ttl
    await asyncio.sleep(0.5)
    assert tokens(nodes, "capped") == [None] * 5  # but not past max_hold
    assert await other.acquire(lock, blocking=False)
    with pytest.raises(LockLostError):
        await api.release(lock)
    await other.release(lock)


async def test_function_decorated_with_a_lock_runs_under_it(
    api: SyncAPI, nodes: Any
) -> None:
    lock = Redlock("decorated")
    seen: list[list[bytes | None]] = []

    if api.mode == "sync":

        @lock
        def job(x: int) -> int:
            seen.append(tokens(nodes, "decorated"))
            return x * 2

        result = await asyncio.to_thread(job, 21)
    else:

        @lock
        async def ajob(x: int) -> int:
            seen.append(tokens(nodes, "decorated"))
            return x * 2

        result = await ajob(21)
    assert result == 42
    assert None not in seen[0]
    assert tokens(nodes, "decorated") == [None] * 5


@pytest.mark.parametrize(
    "resource", ["", "x" * 1001, "bad\nname", "nul\x00", "a\u202eb", 42, None]
)
def test_bad_resource_names_are_rejected(resource: Any) -> None:
    with pytest.raises(ValueError):
        Redlock(resource)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"ttl": 0},
        {"ttl": -1},
        {"ttl": float("nan")},
        {"ttl": float("inf")},
        {"ttl": 86401},
        {"max_hold": 0},
        {"max_hold": float("nan")},
        {"max_hold": -float("inf")},
        {"node_timeout": float("nan")},
        {"retry_delay": -0.1},
        {"drift_factor": 0.7},
        {"nodes": []},
        {"nodes": "redis://x"},
    ],
)
def test_bad_options_are_rejected(kwargs: dict[str, Any]) -> None:
    with pytest.raises(ValueError):
        Redlock("opts", **kwargs)


def test_non_blocking_acquire_with_a_timeout_is_rejected(
    redlock_settings: dict[str, Any],
) -> None:
    with pytest.raises(ValueError, match="non-blocking"):
        Redlock("nb").acquire(blocking=False, timeout=1)


async def test_blocking_api_inside_an_event_loop_points_to_the_async_one(
    redlock_settings: dict[str, Any],
) -> None:
    with pytest.raises(RuntimeError, match="aacquire"):
        Redlock("loop").acquire()


def test_lock_runs_on_explicit_nodes_instead_of_the_settings(
    nodes: Any, make_nodes: Any, redlock_settings: dict[str, Any]
) -> None:
    extra = make_nodes(3)
    lock = Redlock("explicit", nodes=extra.urls)
    with lock:
        assert [n.client().exists(lock_key("explicit")) for n in extra] == [1, 1, 1]
        assert tokens(nodes, "explicit") == [None] * 5


def test_explicit_nodes_are_parsed_once_per_list_until_caches_change(
    settings: Any, nodes: Any, make_nodes: Any, redlock_settings: dict[str, Any]
) -> None:
    """Locks built over and over with one ``nodes=[...]`` list share its parsed
    nodes; an alias in it follows a change of CACHES, as the settings path does."""
    extra = make_nodes(3)
    urls = extra.urls
    first, again = Redlock("a", nodes=urls), Redlock("b", nodes=list(urls))
    assert first._nodes is again._nodes
    backend = "django.core.cache.backends.redis.RedisCache"
    settings.CACHES = {
        "default": {"BACKEND": "django.core.cache.backends.locmem.LocMemCache"},
        "locks": {"BACKEND": backend, "LOCATION": nodes[0].url},
    }
    with Redlock("aliased", nodes=["locks", *urls[1:]]):
        assert nodes[0].client().exists(lock_key("aliased")) == 1
    settings.CACHES = {
        **settings.CACHES,
        "locks": {"BACKEND": backend, "LOCATION": urls[0]},
    }
    with Redlock("aliased", nodes=["locks", *urls[1:]]):
        assert extra[0].client().exists(lock_key("aliased")) == 1
        assert nodes[0].client().exists(lock_key("aliased")) == 0
    assert Redlock("c", nodes=urls)._nodes is not first._nodes  # parsed anew


def test_settings_change_takes_effect_on_existing_lock_objects(
    settings: Any, nodes: Any, make_nodes: Any, redlock_settings: dict[str, Any]
) -> None:
    lock = Redlock("moved")
    with lock:
        assert None not in tokens(nodes, "moved")
    extra = make_nodes(3)
    settings.REDLOCK = {**redlock_settings, "NODES": extra.urls, "KEY_PREFIX": "other"}
    with lock:
        assert [n.client().exists("other:lock:moved") for n in extra] == [1, 1, 1]
    assert tokens(nodes, "moved") == [None] * 5


async def test_cancelled_waiter_leaves_nothing_behind(
    nodes: Any, redlock_settings: dict[str, Any]
) -> None:
    holder = make_api("async")
    lock = Redlock("cancel-wait")
    await holder.acquire(lock)
    theirs = tokens(nodes, "cancel-wait")

    async def wait() -> bool:
        return await lock.aacquire(timeout=10)

    waiter = asyncio.create_task(wait())
    await asyncio.sleep(0.3)
    waiter.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiter
    assert tokens(nodes, "cancel-wait") == theirs
    await holder.release(lock)
    assert tokens(nodes, "cancel-wait") == [None] * 5
    await holder.aclose()


async def test_cancelling_an_acquire_in_flight_cleans_up_its_partial_lock(
    nodes: Any, redlock_settings: dict[str, Any], settings: Any
) -> None:
    """Cancelled while two live nodes granted it (a third holds another token and
    two are frozen, so no quorum can decide the attempt early), the acquire
    removes its partial lock before the cancellation propagates."""
    settings.REDLOCK = {**redlock_settings, "NODE_TIMEOUT": 0.5}
    lock = Redlock("cancel-flight")
    nodes[2].clog(lock_key("cancel-flight"), ttl=30)
    for node in nodes[3:]:
        node.pause()
    try:
        task = asyncio.create_task(lock.aacquire(timeout=5))
        deadline = time.monotonic() + 2
        while None in tokens(nodes[:2], "cancel-flight"):
            assert time.monotonic() < deadline
            await asyncio.sleep(0.005)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
    finally:
        for node in nodes[3:]:
            node.resume()
    assert tokens(nodes[:2], "cancel-flight") == [None] * 2
    nodes[2].client().delete(lock_key("cancel-flight"))
    assert not await lock.alocked()
    # The connection pools were not left with replies due: the next call works.
    async with lock:
        assert await lock.alocked()


async def test_cancelled_release_finishes_its_release_before_the_cancellation(
    nodes: Any, redlock_settings: dict[str, Any], settings: Any
) -> None:
    """A release cancelled mid-way still completes, as a blocking one would: the
    live nodes drop the lock, the hold is gone, and the cancellation (here the
    caller's timeout) surfaces only once the release has ended."""
    settings.REDLOCK = {**redlock_settings, "NODE_TIMEOUT": 0.5}
    lock = Redlock("cancel-release")
    await lock.aacquire()
    # A majority frozen: the release cannot settle on a quorum, so it waits up to
    # NODE_TIMEOUT, and the caller's 50 ms timeout cancels it mid-way.
    for node in nodes[2:]:
        node.pause()
    try:
        began = time.monotonic()
        with pytest.raises(TimeoutError):
            async with asyncio.timeout(0.05):
                await lock.arelease()
        # The whole fan-out ran: the frozen nodes were waited for.
        assert time.monotonic() - began >= 0.45
    finally:
        for node in nodes[2:]:
            node.resume()
    assert tokens(nodes[:2], "cancel-release") == [None] * 2
    # Released (the frozen nodes' keys expire with the lease, as after a blocking
    # release with nodes down): a second release finds nothing to release.
    assert lock.depth == 0
    with pytest.raises(LockNotOwnedError):
        await lock.arelease()


async def test_watchdog_stops_when_its_owner_ends_without_releasing(
    nodes: Any, redlock_settings: dict[str, Any]
) -> None:
    thread_lock = Redlock("orphan-thread", ttl=0.3, auto_extend=True, max_hold=None)
    task_lock = Redlock("orphan-task", ttl=0.3, auto_extend=True, max_hold=None)
    owner = threading.Thread(target=thread_lock.acquire)
    owner.start()
    owner.join()

    async def grab() -> None:
        await task_lock.aacquire()

    await asyncio.create_task(grab())
    assert None not in tokens(nodes, "orphan-thread") + tokens(nodes, "orphan-task")
    await asyncio.sleep(0.8)
    assert tokens(nodes, "orphan-thread") == [None] * 5
    assert tokens(nodes, "orphan-task") == [None] * 5


async def test_release_after_the_keys_were_removed_reports_the_lock_lost(
    api: SyncAPI, nodes: Any
) -> None:
    lock = Redlock("evicted", ttl=10.0)
    await api.acquire(lock)
    for node in nodes[:3]:  # an admin's force release, or an eviction, on a majority
        node.client().delete(lock_key("evicted"))
    with pytest.raises(LockLostError, match="only 2/5 nodes still held it"):
        await api.release(lock)
    assert tokens(nodes, "evicted") == [None] * 5


async def test_release_with_a_minority_of_nodes_down_is_not_a_loss(
    api: SyncAPI, nodes: Any
) -> None:
    lock = Redlock("outage", ttl=10.0)
    await api.acquire(lock)
    for node in nodes[:2]:
        node.stop()
    await api.release(lock)  # 3 released, 2 did not answer: still a clean release
    assert tokens(nodes[2:], "outage") == [None] * 3


@pytest.mark.parametrize(
    ("ttl", "node_timeout"), [(0.05, 0.049), (0.1, 0.1), (0.1, 0.5), (0.003, 0.001)]
)
def test_ttl_that_can_leave_no_validity_is_rejected_before_sending(
    nodes: Any, redlock_settings: dict[str, Any], ttl: float, node_timeout: float
) -> None:
    lock = Redlock("tiny", ttl=ttl, node_timeout=node_timeout)
    with pytest.raises(ValueError, match="leaves no validity"):
        lock.acquire()
    assert tokens(nodes, "tiny") == [None] * 5
    # The control: a TTL with room for the timeout and the drift is granted. Its
    # node timeout is an ordinary one: a tenth of 1 ms (what the last case's
    # tenth would be) timed a connect out on a busy CI machine.
    with Redlock("tiny", ttl=0.2, node_timeout=0.05):
        assert None not in tokens(nodes, "tiny")
