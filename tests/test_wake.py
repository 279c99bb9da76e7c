"""Waiters are woken by the release they wait for, not by their retry timer.

The proofs count attempts and waits (the ``lock_acquired`` signal's ``attempts``
and ``wakeups``), never wall time: with a 30 s retry delay a waiter that acquires
after one wait cut short was woken, and the negative control (keys that vanish
without a release, as on expiry) shows the timed fallback taking over.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import os
import resource
import socket
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from harness.held import lock_key
from harness.nodes import NodeSet
from harness.proxy import FaultProxy
from redlock_django import Redlock, wake
from redlock_django import nodes as nodes_module
from redlock_django.conf import parse_nodes
from tests._waiting import SLOW_RETRY, wait_for, wake_hub

pytestmark = pytest.mark.django_db(transaction=False)


def _subscribers(node_set: NodeSet) -> list[list[dict[str, str]]]:
    """Per node, the client connections that hold channel subscriptions."""
    found = []
    for node in node_set:
        clients = node.client().client_list()
        found.append([c for c in clients if int(c.get("sub", 0)) > 0])
    return found


def _waiter(lock: Redlock, results: list[bool], **kwargs: Any) -> threading.Thread:
    thread = threading.Thread(target=lambda: results.append(lock.acquire(**kwargs)))
    thread.start()
    return thread


def _assert_each_wait_woken(
    thread: threading.Thread,
    results: list[bool],
    acquisitions: list[dict[str, Any]],
    timeout: float,
) -> None:
    """The waiter ``thread`` got the lock, and no wait between its attempts ran
    out: each ended by a wake-up."""
    thread.join(timeout=timeout)
    assert results == [True]
    got = acquisitions[-1]
    assert got["wakeups"] == got["attempts"] - 1, "a wait ran out: nothing woke it"


def test_waiter_is_woken_by_the_release_instead_of_sleeping_out_its_retry_delay(
    redlock_settings: dict[str, Any], acquisitions: list[dict[str, Any]]
) -> None:
    holder = Redlock("wake:one")
    assert holder.acquire(blocking=False)
    waiter = Redlock("wake:one", retry_delay=SLOW_RETRY, retry_jitter=0)
    results: list[bool] = []
    thread = _waiter(waiter, results, timeout=SLOW_RETRY * 0.7)
    channel = holder._resolve().spec.key.encode()
    wait_for(lambda: wake_hub().waiting(channel) == 1, "the waiter waits")
    holder.release()
    thread.join(timeout=SLOW_RETRY * 0.8)
    assert results == [True], "the waiter was not woken by the release"
    got = acquisitions[-1]
    # One failed try, then every wait was cut short (the subscription's
    # confirmation may add one early retry); none ran its 30 s delay.
    assert 2 <= got["attempts"] <= 3
    assert got["wakeups"] == got["attempts"] - 1
    waiter_thread_owner = thread
    del waiter_thread_owner  # the hold dies with its thread; keys expire via TTL


def test_keys_that_vanish_without_a_release_fall_back_to_the_timed_retry(
    redlock_settings: dict[str, Any],
    nodes: NodeSet,
    acquisitions: list[dict[str, Any]],
) -> None:
    holder = Redlock("wake:expired")
    assert holder.acquire(blocking=False)
    waiter = Redlock("wake:expired", retry_delay=0.5, retry_jitter=0)
    results: list[bool] = []
    thread = _waiter(waiter, results, timeout=10)
    key = holder._resolve().spec.key
    channel = key.encode()
    hub = wake_hub()
    wait_for(lambda: hub.waiting(channel) == 1, "the waiter waits")
    # Let the subscription's confirmation (an early retry) pass first.
    wait_for(
        lambda: all(hub.listening(i, channel) for i in range(len(nodes))),
        "every node confirms the subscription",
    )
    for node in nodes:  # as if the lease ran out: nothing is published
        node.client().delete(key)
    thread.join(timeout=10)
    assert results == [True]
    got = acquisitions[-1]
    # The wait that ended in a free lock ran its full delay: no wake-up told it.
    assert got["attempts"] - 1 - got["wakeups"] >= 1


def test_async_waiter_is_woken_by_a_release_from_another_thread(
    redlock_settings: dict[str, Any], acquisitions: list[dict[str, Any]]
) -> None:
    holder = Redlock("wake:async")
    assert holder.acquire(blocking=False)
    channel = holder._resolve().spec.key.encode()

    async def wait_for_it() -> bool:
        waiter = Redlock("wake:async", retry_delay=SLOW_RETRY, retry_jitter=0)
        got = await waiter.aacquire(timeout=SLOW_RETRY * 0.7)
        await waiter.arelease()
        return got

    results: list[bool] = []
    thread = threading.Thread(target=lambda: results.append(asyncio.run(wait_for_it())))
    thread.start()
    wait_for(lambda: wake_hub().waiting(channel) == 1, "the async waiter waits")
    holder.release()
    thread.join(timeout=SLOW_RETRY * 0.8)
    assert results == [True]
    got = acquisitions[-1]
    assert got["wakeups"] == got["attempts"] - 1 >= 1


def test_a_release_reaching_the_nodes_at_different_times_still_wakes_the_waiter(
    redlock_settings: dict[str, Any],
    nodes: NodeSet,
    acquisitions: list[dict[str, Any]],
) -> None:
    # The holder reaches three of the five nodes through proxies that hold its
    # requests back 50 ms: its release lands on two nodes first (a holder thread
    # descheduled mid-release does the same). A waiter woken by those first
    # messages tries while a majority still holds the key; the later messages of
    # the same release must still wake it, or it sleeps out its 30 s retry.
    with contextlib.ExitStack() as stack:
        slow = [stack.enter_context(FaultProxy(node.port)) for node in list(nodes)[2:]]
        urls = [node.url for node in list(nodes)[:2]] + [proxy.url for proxy in slow]
        holder = Redlock("wake:partial", nodes=urls)
        assert holder.acquire(blocking=False)
        waiter = Redlock("wake:partial", retry_delay=SLOW_RETRY, retry_jitter=0)
        assert waiter._resolve().spec.key == holder._resolve().spec.key
        results: list[bool] = []
        # Not woken, it would try once more at its deadline and count no wake-up.
        thread = _waiter(waiter, results, timeout=6)
        channel = holder._resolve().spec.key.encode()
        hub = wake_hub()
        wait_for(lambda: hub.waiting(channel) == 1, "the waiter waits")
        wait_for(
            lambda: all(hub.listening(i, channel) for i in range(len(nodes))),
            "every node confirms the subscription",
        )
        for proxy in slow:
            proxy.delay(0, requests=0.05)
        holder.release()
        _assert_each_wait_woken(thread, results, acquisitions, 10)


def test_a_release_crossing_the_waiters_subscription_still_wakes_it(
    redlock_settings: dict[str, Any],
    nodes: NodeSet,
    acquisitions: list[dict[str, Any]],
) -> None:
    """A release that reaches nodes while the waiter's subscription is still
    being confirmed: nodes 2-4 run it before they take the SUBSCRIBE (their
    messages go to nobody), node 0 tells the waiter, node 1 only once all five
    listen. Two reports of five are no majority; the confirmation that completes
    the subscription must wake the waiter, whose attempt then finds the lock
    free on nodes 0, 2, 3 and 4, or it sleeps out its 30 s retry."""
    with contextlib.ExitStack() as stack:
        late_subscribe = [
            stack.enter_context(FaultProxy(node.port)) for node in list(nodes)[2:]
        ]
        late_release = stack.enter_context(FaultProxy(nodes[1].port))
        waiter_urls = [nodes[0].url, nodes[1].url] + [p.url for p in late_subscribe]
        holder_urls = [nodes[0].url, late_release.url] + [n.url for n in nodes[2:]]
        holder = Redlock("wake:crossing", nodes=holder_urls)
        assert holder.acquire(blocking=False)
        waiter = Redlock(
            "wake:crossing", nodes=waiter_urls, retry_delay=SLOW_RETRY, retry_jitter=0
        )
        assert waiter._resolve().spec.key == holder._resolve().spec.key
        config = waiter._resolve()
        hub = wake.hub(nodes_module.sync_pools(config.nodes, config.node_timeout))
        channel = config.spec.key.encode()
        stats = nodes[0].client().info("commandstats")
        tried = sum(
            stats.get(f"cmdstat_{c}", {}).get("calls", 0) for c in ("eval", "evalsha")
        )

        def attempts_on_node_0() -> int:
            stats = nodes[0].client().info("commandstats")
            return (
                sum(
                    stats.get(f"cmdstat_{c}", {}).get("calls", 0)
                    for c in ("eval", "evalsha")
                )
                - tried
            )

        for proxy in late_subscribe:
            proxy.hold_request(b"SUBSCRIBE")
        results: list[bool] = []
        thread = _waiter(waiter, results, timeout=8)
        wait_for(
            lambda: all(p.wait_for_held(0) for p in late_subscribe), "SUBSCRIBEs held"
        )
        wait_for(
            lambda: hub.listening(0, channel) and hub.listening(1, channel),
            "0, 1 listen",
        )
        # The first confirmation woke the waiter once: its attempt is refused too.
        wait_for(lambda: attempts_on_node_0() >= 2, "the waiter's second attempt")
        wait_for(lambda: hub.waiting(channel) == 1, "the waiter waits")
        late_release.hold_request(holder._resolve().spec.key.encode())
        holder.release()  # nodes 0, 2, 3, 4: a majority; node 1's is held back
        for proxy in late_subscribe:
            proxy.deliver_held()
        wait_for(
            lambda: all(hub.listening(i, channel) for i in range(len(nodes))),
            "every node confirms the subscription",
        )
        late_release.deliver_held()
        _assert_each_wait_woken(thread, results, acquisitions, 12)


def test_many_waiting_resources_share_one_subscriber_connection_per_node(
    redlock_settings: dict[str, Any], nodes: NodeSet
) -> None:
    count = 40
    holders = [Redlock(f"wake:many:{i}") for i in range(count)]
    for lock in holders:
        assert lock.acquire(blocking=False)
    results: list[bool] = []
    threads = [
        _waiter(
            Redlock(f"wake:many:{i}", retry_delay=SLOW_RETRY),
            results,
            timeout=SLOW_RETRY * 0.7,
        )
        for i in range(count)
    ]
    hub = wake_hub()
    channels = [lock._resolve().spec.key.encode() for lock in holders]
    wait_for(
        lambda: all(hub.listening(i, c) for i in range(len(nodes)) for c in channels),
        "every node confirms every channel",
    )
    # Readers of earlier tests' settings close within a poll; then one connection
    # per node carries all forty channels (forty would mean one per resource).
    wait_for(
        lambda: [len(c) for c in _subscribers(nodes)] == [1] * len(nodes),
        "one subscriber connection per node",
        limit=5,
    )
    assert all(int(clients[0]["sub"]) == count for clients in _subscribers(nodes))
    for lock in holders:
        lock.release()
    for thread in threads:
        thread.join(timeout=SLOW_RETRY * 0.8)
    assert results == [True] * count


def test_a_paused_node_does_not_stop_the_others_waking_the_waiter(
    redlock_settings: dict[str, Any],
    nodes: NodeSet,
    acquisitions: list[dict[str, Any]],
) -> None:
    holder = Redlock("wake:paused")
    assert holder.acquire(blocking=False)
    with nodes[4].paused():
        waiter = Redlock("wake:paused", retry_delay=SLOW_RETRY, retry_jitter=0)
        results: list[bool] = []
        # Not woken, it would try once more at its deadline and count no wake-up.
        thread = _waiter(waiter, results, timeout=6)
        channel = holder._resolve().spec.key.encode()
        hub = wake_hub()
        wait_for(
            lambda: all(hub.listening(i, channel) for i in range(4)),
            "the four live nodes confirm the subscription",
        )
        holder.release()
        thread.join(timeout=SLOW_RETRY * 0.8)
    assert results == [True]
    got = acquisitions[-1]
    assert got["wakeups"] == got["attempts"] - 1 >= 1


def test_readers_close_their_connections_once_nobody_waits(
    redlock_settings: dict[str, Any],
    nodes: NodeSet,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(wake, "LINGER", 0.1)
    holder = Redlock("wake:linger")
    assert holder.acquire(blocking=False)
    results: list[bool] = []
    thread = _waiter(Redlock("wake:linger"), results, timeout=5)
    channel = holder._resolve().spec.key.encode()
    hub = wake_hub()
    wait_for(lambda: hub.listening(0, channel), "node 0 confirms")
    holder.release()
    thread.join(timeout=5)
    assert results == [True]
    wait_for(
        lambda: (
            not any(t.name.startswith("redlock-wake-") for t in threading.enumerate())
        ),
        "the reader threads end",
    )
    assert _subscribers(nodes) == [[] for _ in nodes]


def test_wake_ups_off_leaves_waiters_on_their_timer_and_opens_no_subscriber(
    redlock_settings: dict[str, Any],
    settings: Any,
    nodes: NodeSet,
    acquisitions: list[dict[str, Any]],
) -> None:
    settings.REDLOCK = {**redlock_settings, "WAKE_UPS": False}
    holder = Redlock("wake:off")
    assert holder.acquire(blocking=False)
    results: list[bool] = []
    thread = _waiter(Redlock("wake:off", retry_delay=0.3, retry_jitter=0), results)
    time.sleep(0.1)
    holder.release()
    thread.join(timeout=10)
    assert results == [True]
    assert acquisitions[-1]["wakeups"] == 0
    # Readers of earlier tests close within a poll (0.2 s); one of this waiter's
    # would linger for LINGER (2 s) after it left.
    wait_for(
        lambda: _subscribers(nodes) == [[] for _ in nodes], "no subscribers", limit=1
    )


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_a_waiter_is_not_woken_by_the_clean_up_of_its_own_failed_attempt(
    nodes: NodeSet, redlock_settings: dict[str, Any], settings: Any, mode: str
) -> None:
    """A waiter granted only a minority (another owner holds the rest) cleans up
    its partial lock and sleeps its retry delay: that clean-up wakes nobody, so
    it makes a handful of attempts in a second, not thousands (it used to be
    woken by its own clean-up's announcement and retry at once, ~3,000/s)."""
    settings.REDLOCK = {**redlock_settings, "RETRY_DELAY": 0.2, "RETRY_JITTER": 0.0}
    for node in nodes[2:]:
        node.clog(lock_key("self-wake"), ttl=5)
    lock = Redlock("self-wake")
    before = [_evals(node) for node in nodes[:2]]
    if mode == "sync":
        assert not lock.acquire(timeout=1.0)
    else:
        assert not asyncio.run(lock.aacquire(timeout=1.0))
    attempts = max(_evals(node) - b for node, b in zip(nodes[:2], before, strict=True))
    # One acquire and one clean-up per attempt, an attempt every 0.2 s.
    assert attempts <= 2 * 8, attempts


def _evals(node: Any) -> int:
    stats = node.client().info("commandstats")
    return sum(
        int(v["calls"])
        for k, v in stats.items()
        if k in ("cmdstat_eval", "cmdstat_evalsha")
    )


@contextlib.contextmanager
def _unanswered_port() -> Iterator[int]:
    """A loopback port whose listen queue is full: a connect to it is never
    answered (its SYN dropped), as with a partitioned host, until it times out."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(0)
    port = listener.getsockname()[1]
    queued = []
    try:
        for _ in range(64):  # fill the queue until a connect hangs
            probe = socket.socket()
            probe.settimeout(0.2)
            try:
                probe.connect(("127.0.0.1", port))
            except TimeoutError:
                probe.close()
                break
            queued.append(probe)
        else:
            raise AssertionError("the listen queue never filled: connects still land")
        yield port
    finally:
        for probe in queued:
            probe.close()
        listener.close()


def test_a_node_whose_connect_hangs_does_not_hold_up_the_others_wake_ups(
    redlock_settings: dict[str, Any], nodes: NodeSet
) -> None:
    """The reader connects to each node in a thread of its own: with the fifth node
    unreachable (its connect hangs for the whole 3 s connect timeout), the four
    others' subscriptions are confirmed, and their messages read, at once."""
    with _unanswered_port() as port:
        urls = [*(node.url for node in nodes[:4]), f"redis://127.0.0.1:{port}/0"]
        hub = wake.hub(nodes_module.sync_pools(parse_nodes(urls), 3.0))
        watch = wake.SyncWatch(b"wake:hung-connect")
        hub.watch(watch)
        try:
            wait_for(
                lambda: all(hub.listening(i, watch.channel) for i in range(4)),
                "the four reachable nodes confirm the subscription",
                limit=1.5,
            )
            watch.wait(0.1)  # the confirmation's own wake-up (fresh watch), if any
            for node in nodes[:3]:  # a majority of the subscribed nodes
                node.client().publish(watch.channel, b"release-1")
            assert watch.wait(1.5)
        finally:
            hub.unwatch(watch)
            hub.close()


def test_a_waiter_named_by_a_minority_of_a_release_is_woken_after_a_grace(
    redlock_settings: dict[str, Any], nodes: NodeSet
) -> None:
    """While two waiters' ticket draws race, the nodes' queues may name different
    next waiters for one release, and each node tells only the process of the one
    it names: a waiter's process may then hear the release from fewer than a
    majority of the nodes. It is woken all the same once the rest did not come
    within ``wake.GRACE``, or it would sleep until its next refresh."""
    hub = wake_hub()
    watch = wake.SyncWatch(b"wake:split-release", "w1")
    hub.watch(watch)
    try:
        wait_for(
            lambda: all(hub.listening(i, watch.channel) for i in range(len(nodes))),
            "every node confirms the subscription",
        )
        watch.wait(0.1)  # the confirmation's own wake-up (fresh watch), if any
        for node in nodes[:2]:  # two of five: the others named other waiters
            node.client().publish(watch.channel, b"release-7 w1")
        assert watch.wait(2.0)
    finally:
        hub.unwatch(watch)


def test_a_wake_up_that_arrives_a_byte_at_a_time_still_wakes_the_waiter(
    redlock_settings: dict[str, Any],
    nodes: NodeSet,
    acquisitions: list[dict[str, Any]],
) -> None:
    """The reader reads what has arrived and parses it in place: a subscription's
    confirmation and a release's message split over many packets (every node's
    replies reach the waiter's process a byte per millisecond) are read whole once
    their last byte came, and the waiter is woken, not left to its 30 s retry."""
    with contextlib.ExitStack() as stack:
        proxies = [stack.enter_context(FaultProxy(node.port)) for node in nodes]
        urls = [proxy.url for proxy in proxies]
        holder = Redlock("wake:trickle", nodes=[node.url for node in nodes])
        waiter = Redlock(
            "wake:trickle", nodes=urls, retry_delay=SLOW_RETRY, retry_jitter=0
        )
        assert waiter._resolve().spec.key == holder._resolve().spec.key
        assert holder.acquire(blocking=False)
        for proxy in proxies:
            proxy.trickle(0.001)
        results: list[bool] = []
        thread = _waiter(waiter, results, timeout=20)
        channel = holder._resolve().spec.key.encode()
        config = waiter._resolve()
        hub = wake.hub(nodes_module.sync_pools(config.nodes, config.node_timeout))
        wait_for(lambda: hub.waiting(channel) == 1, "the waiter waits")
        wait_for(
            lambda: all(hub.listening(i, channel) for i in range(len(nodes))),
            "every node's confirmation, read a byte at a time",
        )
        holder.release()
        _assert_each_wait_woken(thread, results, acquisitions, 25)


@pytest.mark.parametrize("mode", ["threads", "threads and tasks"])
def test_waiters_of_one_process_sharing_its_connections_are_each_woken(
    redlock_settings: dict[str, Any],
    acquisitions: list[dict[str, Any]],
    mode: str,
) -> None:
    """Several waiters of one process, threads and asyncio tasks on their own
    loops, share its subscriber connections: each release wakes its own waiter,
    none sleeps out its 30 s retry."""
    names = [f"wake:many:{i}" for i in range(4)]
    holders = [Redlock(name) for name in names]
    for holder in holders:
        assert holder.acquire(blocking=False)
    results: list[bool] = []

    def take(name: str) -> None:
        lock = Redlock(name, retry_delay=SLOW_RETRY, retry_jitter=0)
        results.append(lock.acquire(timeout=20))
        lock.release()

    async def atake(name: str) -> None:
        lock = Redlock(name, retry_delay=SLOW_RETRY, retry_jitter=0)
        results.append(await lock.aacquire(timeout=20))
        await lock.arelease()

    threads = []
    for i, name in enumerate(names):
        if mode == "threads" or i % 2 == 0:
            threads.append(threading.Thread(target=take, args=(name,)))
        else:
            threads.append(threading.Thread(target=asyncio.run, args=(atake(name),)))
    for thread in threads:
        thread.start()
    hub = wake_hub()
    for holder in holders:
        channel = holder._resolve().spec.key.encode()
        wait_for(lambda channel=channel: hub.waiting(channel) == 1, "each waits")
        wait_for(lambda channel=channel: hub.listening(0, channel), "node 0 confirms")
    time.sleep(0.05)
    for holder in holders:
        holder.release()
        time.sleep(0.01)
    for thread in threads:
        thread.join(25)
    assert results == [True] * len(names)
    for got in acquisitions[-len(names) :]:
        assert got["wakeups"] == got["attempts"] - 1 >= 1, got


@pytest.mark.parametrize("mode", ["threads", "tasks"])
def test_a_release_wakes_one_waiter_of_a_process_not_all(
    redlock_settings: dict[str, Any],
    acquisitions: list[dict[str, Any]],
    mode: str,
) -> None:
    """Six waiters of one process on one (barging) lock, each acquiring and at once
    releasing: each release wakes one of them, which takes the lock, and its
    release the next. Woken all at once, five of them would make an attempt
    on every node that cannot win, at every release (27 attempts in all, the
    last waiter's 7); one at a time, each makes its first attempt, perhaps one
    when its subscription is confirmed, and the one it wins with."""
    count, resource = 6, "wake:herd"
    holder = Redlock(resource)
    assert holder.acquire(blocking=False)
    results: list[bool] = []

    def take() -> None:
        lock = Redlock(resource, retry_delay=SLOW_RETRY, retry_jitter=0)
        results.append(lock.acquire(timeout=20))
        lock.release()

    async def atakes() -> None:
        async def atake() -> None:
            lock = Redlock(resource, retry_delay=SLOW_RETRY, retry_jitter=0)
            results.append(await lock.aacquire(timeout=20))
            await lock.arelease()

        await asyncio.gather(*(atake() for _ in range(count)))

    if mode == "threads":
        threads = [threading.Thread(target=take) for _ in range(count)]
    else:
        threads = [threading.Thread(target=asyncio.run, args=(atakes(),))]
    for thread in threads:
        thread.start()
    hub = wake_hub()
    channel = holder._resolve().spec.key.encode()
    wait_for(lambda: hub.waiting(channel) == count, "every waiter waits")
    wait_for(lambda: hub.listening(0, channel), "node 0 confirms")
    time.sleep(0.05)  # the other nodes' confirmations, and their early retries
    holder.release()
    for thread in threads:
        thread.join(25)
    assert results == [True] * count, "a waiter slept out its retry delay"
    tries = [got["attempts"] for got in acquisitions[-count:]]
    assert max(tries) <= 3, f"attempts per waiter {tries}: woken more than once"
    assert all(got["wakeups"] >= 1 for got in acquisitions[-count:])


def test_a_waiter_woken_alone_that_stops_waiting_passes_the_wake_up_on(
    redlock_settings: dict[str, Any], acquisitions: list[dict[str, Any]]
) -> None:
    """The first of two waiters of one process, an asyncio task, is woken alone by
    a release and cancelled before its wait saw the wake-up (its loop was busy):
    the other waiter, a thread, is woken in its place instead of sleeping out
    its 30 s retry delay with the lock free."""
    resource = "wake:passed-on"
    holder = Redlock(resource)
    assert holder.acquire(blocking=False)
    hub = wake_hub()
    channel = holder._resolve().spec.key.encode()
    loop = asyncio.new_event_loop()
    looping = threading.Thread(target=loop.run_forever)
    looping.start()
    first = Redlock(resource, retry_delay=SLOW_RETRY, retry_jitter=0)
    task = asyncio.run_coroutine_threadsafe(first.aacquire(timeout=20), loop)
    try:
        wait_for(lambda: hub.waiting(channel) == 1, "the task waits")
        results: list[bool] = []

        def take() -> None:
            second = Redlock(resource, retry_delay=SLOW_RETRY, retry_jitter=0)
            results.append(second.acquire(timeout=20))
            second.release()

        thread = threading.Thread(target=take)
        thread.start()
        wait_for(lambda: hub.waiting(channel) == 2, "the thread waits too")
        wait_for(lambda: hub.listening(0, channel), "node 0 confirms")
        time.sleep(0.05)  # the other nodes' confirmations, and their early retries
        busy = threading.Event()
        # The task's loop blocked, then its cancellation queued ahead of the
        # wake-up the release is about to send it.
        loop.call_soon_threadsafe(lambda: (busy.set(), time.sleep(0.5)))
        busy.wait(5)
        loop.call_soon_threadsafe(task.cancel)
        holder.release()
        thread.join(15)
        assert results == [True], "the thread slept out its retry delay"
        assert acquisitions[-1]["wakeups"] >= 1
        with pytest.raises(concurrent.futures.CancelledError):
            task.result(10)
    finally:
        loop.call_soon_threadsafe(loop.stop)
        looping.join(10)
        loop.close()


#: A thread stack no address space can map: starting a thread then fails with
#: "can't start new thread", as it does at a container's pids limit.
HUGE_STACK = 1 << 40


@contextlib.contextmanager
def _threads_cannot_start() -> Iterator[None]:
    """While inside, no new thread of this process can start."""
    threading.stack_size(HUGE_STACK)
    try:
        probe = threading.Thread(target=lambda: None)
        with pytest.raises(RuntimeError):
            probe.start()
        yield
    finally:
        threading.stack_size(0)


@contextlib.contextmanager
def _a_waiter_behind_a_holder(
    name: str, make_nodes: Callable[..., NodeSet], retry_delay: float
) -> Iterator[Redlock]:
    """A lock ``name`` held on a node set of its own (a hub with no reader yet),
    and a waiter for it that retries every ``retry_delay`` s."""
    urls = make_nodes(3).urls
    holder = Redlock(name, nodes=urls)
    assert holder.acquire(blocking=False)
    try:
        yield Redlock(name, nodes=urls, retry_delay=retry_delay, reentrant=False)
    finally:
        holder.release()


def test_an_acquire_whose_wake_up_reader_cannot_start_still_waits_on_its_timer(
    redlock_settings: dict[str, Any], make_nodes: Callable[..., NodeSet]
) -> None:
    """Wake-ups are a hint: when the reader thread cannot start (the process is
    at its thread limit for a moment), a contended acquire still waits on its
    retry timer and answers False, instead of failing with the thread error."""
    outcome: Any
    with (
        _a_waiter_behind_a_holder("wake:no-thread", make_nodes, 0.05) as waiter,
        _threads_cannot_start(),
    ):
        try:
            outcome = waiter.acquire(timeout=0.3)
        except Exception as exc:  # reported below
            outcome = exc
    assert outcome is False, f"acquire() raised {outcome!r}"


def test_a_reader_that_failed_to_start_once_does_not_end_wake_ups_for_good(
    redlock_settings: dict[str, Any],
    make_nodes: Callable[..., NodeSet],
    acquisitions: list[dict[str, Any]],
) -> None:
    """A reader thread that failed to start once (a momentary thread limit) is
    not left in its hub's slot: the next waiter, once threads start again, gets
    its own reader and is woken by the release, not by its 30 s retry."""
    fresh = make_nodes(3)
    urls = fresh.urls
    holder = Redlock("wake:after-no-thread", nodes=urls)
    assert holder.acquire(blocking=False)
    first = Redlock(
        "wake:after-no-thread", nodes=urls, retry_delay=0.05, reentrant=False
    )
    with _threads_cannot_start(), contextlib.suppress(RuntimeError):
        assert not first.acquire(timeout=0.3)
    # Threads start again. A waiter with a 30 s retry delay waits for the release.
    results: list[bool] = []
    waiter = Redlock(
        "wake:after-no-thread",
        nodes=urls,
        retry_delay=SLOW_RETRY,
        retry_jitter=0,
        reentrant=False,
    )

    def wait_then_release() -> None:
        results.append(waiter.acquire(timeout=6))
        if results[-1]:
            waiter.release()

    thread = threading.Thread(target=wait_then_release)
    thread.start()
    time.sleep(1.0)  # its first attempt failed; it waits now
    subscribers = [len(found) for found in _subscribers(fresh)]
    began = time.monotonic()
    holder.release()
    thread.join(15)
    took = time.monotonic() - began
    assert results == [True]
    got = acquisitions[-1]
    assert got["wakeups"] >= 1 and took < 3.0, (
        f"not woken: acquired {took:.2f}s after the release, {got['attempts']} "
        f"attempts, {got['wakeups']} wake-ups; subscriber connections while it "
        f"waited: {subscribers}"
    )


def _open_descriptors() -> int:
    return len(os.listdir("/proc/self/fd"))


def test_wake_up_readers_that_cannot_start_leave_no_descriptors_open(
    redlock_settings: dict[str, Any], make_nodes: Callable[..., NodeSet]
) -> None:
    """At a thread limit that lasts (a container's pids limit), every contended
    acquire finds no reader and tries to start one: each failed try must give
    back what the reader opened (its wake-up pipe), or a busy process runs out of
    file descriptors."""
    with _a_waiter_behind_a_holder("wake:no-thread-fds", make_nodes, 0.01) as waiter:
        assert not waiter.acquire(blocking=False)  # its connections are open
        with _threads_cannot_start():
            before = _open_descriptors()
            for _ in range(TRIES):
                assert not waiter.acquire(timeout=0.03)
            after = _open_descriptors()
    assert after - before < TRIES // 2, (
        f"{after - before} more descriptors open after {TRIES} acquires that "
        "could not start a wake-up reader"
    )


TRIES = 20


@contextlib.contextmanager
def _no_descriptor_can_open() -> Iterator[None]:
    """While inside, this process can open no new file descriptor (EMFILE): its
    soft RLIMIT_NOFILE is the lowest descriptor number still free."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    probe = os.open(os.devnull, os.O_RDONLY)  # the lowest free number
    os.close(probe)
    resource.setrlimit(resource.RLIMIT_NOFILE, (probe, hard))
    try:
        with pytest.raises(OSError):
            os.pipe()
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def test_a_wake_up_reader_out_of_descriptors_ends_quietly_and_its_waiter_waits_on(
    redlock_settings: dict[str, Any], make_nodes: Callable[..., NodeSet]
) -> None:
    """A process out of file descriptors (EMFILE) starts a wake-up reader that
    cannot make its pipe: wake-ups are a hint, so it ends without a thread
    traceback, frees its hub's slot, and the waiter sleeps out its retries and
    answers as it would have."""
    crashed: list[str] = []
    previous = threading.excepthook

    def record(args: Any) -> None:
        name = args.thread.name if args.thread else "?"
        crashed.append(f"{name}: {args.exc_value!r}")

    threading.excepthook = record
    outcome: Any
    try:
        with _a_waiter_behind_a_holder("wake:no-fds", make_nodes, 0.05) as waiter:
            assert not waiter.acquire(blocking=False)  # its connections are open
            with _no_descriptor_can_open():
                try:
                    outcome = waiter.acquire(timeout=0.3)
                except Exception as exc:  # reported below
                    outcome = exc
                time.sleep(0.3)  # the reader has run (and ended) by now
    finally:
        threading.excepthook = previous
    assert outcome is False, f"acquire() raised {outcome!r}"
    assert crashed == [], f"a thread died with a traceback: {crashed}"


# KEYS: channels; ARGV[1] a round number; publishes BURST releases on each channel.
BURST = 100
BURST_SCRIPT = f"""
for i = 1, {BURST} do
  for _, channel in ipairs(KEYS) do
    redis.call('PUBLISH', channel, 'release-' .. ARGV[1] .. '-' .. i)
  end
end
"""


def test_releases_heard_while_a_channel_is_dropped_leave_no_state_behind(
    redlock_settings: dict[str, Any], nodes: NodeSet
) -> None:
    """A channel whose last waiter left is dropped after ``LINGER``; releases
    published by other processes until its UNSUBSCRIBE reached the node must not
    recreate its per-channel state: nothing would ever remove it again, so a
    long-lived process would keep an entry for every resource it ever waited on."""
    hub = wake_hub()
    keeper = wake.SyncWatch(b"wake:dropped:keeper")  # keeps the reader running
    hub.watch(keeper)
    channels = [f"wake:dropped:{i}".encode() for i in range(10)]
    watches = [wake.SyncWatch(channel) for channel in channels]
    for watch in watches:
        hub.watch(watch)
    stop = threading.Event()
    try:
        wait_for(
            lambda: all(
                hub.listening(i, c) for i in range(len(nodes)) for c in channels
            ),
            "every node confirms every channel",
        )

        def publish() -> None:  # other processes releasing these locks, nonstop
            clients = [node.client() for node in nodes]
            n = 0
            while not stop.is_set():
                n += 1
                for client in clients:  # a burst of releases on every channel
                    client.eval(BURST_SCRIPT, len(channels), *channels, n)
                time.sleep(0.001)

        publisher = threading.Thread(target=publish)
        publisher.start()
        for watch in watches:
            hub.unwatch(watch)
        try:
            wait_for(
                lambda: (
                    not any(
                        hub.listening(i, c) for i in range(len(nodes)) for c in channels
                    )
                ),
                "every channel is dropped",
                limit=wake.LINGER + 8,
            )
        finally:
            stop.set()
            publisher.join(10)
        time.sleep(0.5)
        assert not any(c in hub.wanted() for c in channels)
        leaked = sorted(c for c in channels if c in hub._seen or c in hub._last)
        assert leaked == [], f"{len(leaked)} of {len(channels)} dropped channels kept"
    finally:
        stop.set()
        hub.unwatch(keeper)
