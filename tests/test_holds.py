"""A hold's life in one process: forks, expiry, cancellation, re-entry, on real nodes.

Each test here reproduces a hole found by an adversarial review (issue 10) and fails
on the code before its fix: a forked child inheriting its parent's hold, an expired
hold poisoning its thread, a twice-cancelled ``arelease()`` skipping the release,
a re-entry through another ``Redlock`` ignoring that object's options, and a
release or an acquisition interrupted by a signal handler outside its fan-out
(while the watchdog stopped; once the nodes granted) leaving a hold registered as
valid.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import gc
import inspect
import itertools
import logging
import math
import multiprocessing
import os
import random
import signal
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import redis

from harness.held import held_on, lock_key
from harness.nodes import NodeSet
from harness.proxy import FaultProxy
from redlock_django import (
    LockContentionError,
    LockError,
    LockLostError,
    Redlock,
    aio,
    signals,
    sync,
    tracing,
    wake,
)
from redlock_django.readers import Reader
from redlock_django.scripts import EXTEND_SCRIPT
from tests._forked import Report, in_forked_child

# A forked child starts with none of its parent's holds.


def _child_tries(resource: str, urls: list[str], conn: Any) -> None:
    try:
        lock = Redlock(resource, nodes=urls)
        conn.send(("acquired", lock.acquire(blocking=False), lock.depth))
    except BaseException as exc:  # reported to the parent, never swallowed
        conn.send(("raised", repr(exc), 0))
    finally:
        conn.close()


def test_a_forked_child_does_not_inherit_its_parents_hold(
    redlock_settings: dict[str, Any], nodes: NodeSet
) -> None:
    """Inside ``with lock:``, a child process's ``acquire()`` of the same resource
    goes to the nodes and is refused; it never re-enters the parent's hold.
    (multiprocessing with the fork start method, as gunicorn --preload forks)."""
    context = multiprocessing.get_context("fork")
    with Redlock("forked", nodes=nodes.urls) as lock:
        assert lock.depth == 1
        parent_end, child_end = context.Pipe()
        child = context.Process(
            target=_child_tries, args=("forked", nodes.urls, child_end)
        )
        child.start()
        assert parent_end.poll(20), "the child did not answer"
        outcome = parent_end.recv()
        child.join(10)
        assert outcome == ("acquired", False, 0)
        # The parent's hold is untouched by the child.
        assert lock.owned() and lock.depth == 1
        assert held_on(nodes, "forked") == len(nodes)
    assert held_on(nodes, "forked") == 0


def test_os_fork_inside_a_hold_gives_the_child_no_hold_and_no_release(
    redlock_settings: dict[str, Any], nodes: NodeSet
) -> None:
    """A bare ``os.fork()`` inside ``with lock:``: the child's own ``with`` of the
    resource is refused, and its release of the parent's ``with`` deletes nothing."""
    read, write = os.pipe()
    with Redlock("bare-fork") as lock:
        pid = os.fork()
        if pid == 0:  # the child: report, never return into pytest
            code = 1
            try:
                try:
                    with Redlock("bare-fork"):
                        code = 2  # entered: the parent's hold was re-entered
                except LockContentionError:
                    code = 0
                try:
                    lock.release()
                    code = code or 3  # released the parent's hold
                except Exception:
                    pass
            finally:
                os.write(write, bytes([code]))
                os._exit(0)
        os.close(write)
        _, status = os.waitpid(pid, 0)
        code = os.read(read, 1)
        os.close(read)
        assert status == 0
        assert code == b"\x00", f"child outcome {code!r}"
        assert lock.owned()
        assert held_on(nodes, "bare-fork") == len(nodes)
    assert held_on(nodes, "bare-fork") == 0


# An expired hold does not poison its thread or task.


def test_an_expired_hold_is_dropped_and_the_next_acquire_proceeds(
    redlock_settings: dict[str, Any],
    nodes: NodeSet,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """``acquire()`` without ``release()``, lease runs out: the next ``with`` of the
    resource in that thread acquires afresh on the nodes (old code: LockLostError
    forever), ``lock_lost`` is sent once, and a warning names the resource."""
    lost: list[dict[str, Any]] = []

    def receiver(**kwargs: Any) -> None:
        lost.append(kwargs)

    signals.lock_lost.connect(receiver)
    try:
        forgotten = Redlock("poison", ttl=0.3)
        assert forgotten.acquire(blocking=False)
        time.sleep(0.45)  # the lease has run out; nobody released it
        assert held_on(nodes, "poison") == 0
        with caplog.at_level(logging.WARNING, logger="redlock_django"):
            for _ in range(3):
                with Redlock("poison", ttl=5) as lock:
                    assert lock.owned() and lock.depth == 1
                    assert held_on(nodes, "poison") == len(nodes)
                assert held_on(nodes, "poison") == 0
    finally:
        signals.lock_lost.disconnect(receiver)
    assert len(lost) == 1 and lost[0]["resource"] == "poison"
    assert any(
        "poison" in r.getMessage() and r.levelno == logging.WARNING
        for r in caplog.records
    )


async def test_an_expired_hold_does_not_poison_its_task(
    redlock_settings: dict[str, Any], nodes: NodeSet
) -> None:
    """The asyncio twin: after an unreleased ``aacquire()`` ran out, the same task
    acquires again with ``async with``."""
    forgotten = Redlock("apoison", ttl=0.3)
    assert await forgotten.aacquire(blocking=False)
    await asyncio.sleep(0.45)
    async with Redlock("apoison", ttl=5) as lock:
        assert lock.owned()
        assert held_on(nodes, "apoison") == len(nodes)
    assert held_on(nodes, "apoison") == 0


def test_an_outer_block_whose_hold_was_replaced_still_learns_it_lost_the_lock(
    redlock_settings: dict[str, Any], nodes: NodeSet
) -> None:
    """Nested ``with``: the outer hold runs out, the inner ``with`` acquires afresh
    and releases; the outer exit then raises ``LockLostError`` (its section did
    lose the lock), not ``LockNotOwnedError``, and leaves nothing on the nodes."""
    outer = Redlock("nested-expiry", ttl=0.3)
    inner_ran = False
    with pytest.raises(LockLostError, match="nested-expiry"), outer:
        time.sleep(0.45)
        with Redlock("nested-expiry", ttl=5) as inner:
            assert inner.owned()
            inner_ran = True
        assert held_on(nodes, "nested-expiry") == 0
    assert inner_ran
    assert held_on(nodes, "nested-expiry") == 0
    # Nothing is left over: the next use is clean.
    with Redlock("nested-expiry") as again:
        assert again.depth == 1


# Releasing from a task completes through any number of cancellations.


@pytest.mark.parametrize("auto_extend", [True, False])
async def test_a_release_completes_through_repeated_cancellations(
    redlock_settings: dict[str, Any], nodes: NodeSet, auto_extend: bool
) -> None:
    """A task holding an (auto-extended) lock is cancelled again and again while it
    stops its watchdog and releases: the release still reaches every node before
    the task ends cancelled (old code: the second cancel skipped the release and
    the lock stayed for its TTL)."""
    entered = asyncio.Event()

    async def holder() -> None:
        async with Redlock("cancel-release", ttl=10, auto_extend=auto_extend):
            entered.set()
            await asyncio.sleep(60)

    task = asyncio.ensure_future(holder())
    await entered.wait()
    for _ in range(200):
        task.cancel()
        await asyncio.sleep(0)
        if task.done():
            break
    with pytest.raises(asyncio.CancelledError):
        await task
    assert held_on(nodes, "cancel-release") == 0
    assert await Redlock("cancel-release").aacquire(blocking=False)


async def test_a_cancelled_release_still_raises_the_cancellation_within_a_timeout(
    redlock_settings: dict[str, Any], nodes: NodeSet
) -> None:
    """``asyncio.timeout()`` around a block whose release is cancelled: the release
    finishes and the timeout surfaces as ``TimeoutError``, as asyncio promises."""
    with pytest.raises(TimeoutError):
        async with asyncio.timeout(0.05):
            async with Redlock("timeout-release", ttl=10, auto_extend=True):
                await asyncio.sleep(1)
    assert held_on(nodes, "timeout-release") == 0


# Re-entry through another Redlock object with other options.


@pytest.mark.parametrize(
    ("outer", "inner", "option"),
    [
        ({"fencing": False}, {"fencing": True}, "fencing"),
        ({"ttl": 5}, {"ttl": 30}, "ttl"),
        ({"auto_extend": False}, {"auto_extend": True}, "auto_extend"),
        ({"auto_extend": True, "max_hold": 20}, {"auto_extend": True}, "max_hold"),
    ],
)
def test_reentry_with_conflicting_options_is_refused_by_name(
    redlock_settings: dict[str, Any],
    nodes: NodeSet,
    outer: dict[str, Any],
    inner: dict[str, Any],
    option: str,
) -> None:
    """Re-entering a held lock through another ``Redlock`` whose options differ
    raises a ``ValueError`` naming the option (old code silently ignored it: no
    fencing token, a shorter lease, no auto-extension); the outer hold stays."""
    with Redlock("reentry-options", **outer) as held:
        other = Redlock("reentry-options", **inner)
        with pytest.raises(ValueError, match=option):
            other.acquire()
        assert held.depth == 1 and held.owned()
    assert held_on(nodes, "reentry-options") == 0


def test_reentry_with_the_same_options_through_another_object_nests(
    redlock_settings: dict[str, Any], nodes: NodeSet
) -> None:
    """The control: equal options re-enter, and the fencing token is shared."""
    with Redlock("reentry-same", fencing=True, ttl=5) as held:
        with Redlock("reentry-same", fencing=True, ttl=5) as again:
            assert again.depth == 2
            assert again.fencing_token == held.fencing_token is not None
        assert held.depth == 1
    assert held_on(nodes, "reentry-same") == 0


@pytest.mark.parametrize("name", ["retry_delay", "retry_jitter"])
@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf])
def test_non_finite_retry_timings_are_refused_like_the_settings(
    redlock_settings: dict[str, Any], name: str, value: float
) -> None:
    """``Redlock(retry_delay=nan)`` is refused as ``RETRY_DELAY`` NaN is."""
    with pytest.raises(ValueError, match=name):
        Redlock("bad-timing", **{name: value})


def test_a_forked_child_inherits_no_waiters_or_wake_up_readers(
    redlock_settings: dict[str, Any], nodes: NodeSet
) -> None:
    """Forked while a parent thread waits (wake-up readers running): the child
    counts no waiters of its own, and its own wait on the lock is woken by the
    parent's release like any other process's."""
    import threading

    from redlock_django import wake

    holder = Redlock("fork-wake")
    assert holder.acquire()

    def wait_then_release() -> None:
        lock = Redlock("fork-wake")
        if lock.acquire(timeout=5):
            lock.release()

    waiting = threading.Thread(target=wait_then_release)
    waiting.start()
    deadline = time.monotonic() + 5
    while wake.watching() == 0 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert wake.watching() == 1
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:
        report = [-1, -1, -1]
        try:
            report[0] = wake.watching()
            lock = Redlock("fork-wake", retry_delay=3, retry_jitter=0)
            began = time.monotonic()
            report[1] = int(lock.acquire(timeout=6))
            report[2] = int((time.monotonic() - began) * 1000)
            lock.release()
        finally:
            os.write(write, ",".join(map(str, report)).encode())
            os._exit(0)
    os.close(write)
    time.sleep(0.3)  # the child is waiting now
    holder.release()
    waiting.join(10)
    _, status = os.waitpid(pid, 0)
    watched, acquired, waited_ms = map(int, os.read(read, 100).decode().split(","))
    os.close(read)
    assert status == 0
    assert watched == 0
    assert acquired == 1
    # Woken by a release (the parent's, then its waiting thread's), not by its
    # 3 s retry timer.
    assert waited_ms < 2500


async def test_an_acquire_cancelled_again_and_again_leaves_no_lock_behind(
    redlock_settings: dict[str, Any], nodes: NodeSet, settings: Any
) -> None:
    """A task cancelled repeatedly while it acquires (its requests 10 ms late
    through fault proxies): its clean-up still runs to the end, so no node keeps
    a key nobody holds. Before, a second cancellation cut the clean-up short and
    a granted quorum stayed locked for the whole TTL (most of 30 rounds)."""
    from harness.proxy import FaultProxy

    proxies = [FaultProxy(node.port).start() for node in nodes]
    settings.REDLOCK = {
        **redlock_settings,
        "NODES": [proxy.url for proxy in proxies],
        "WAKE_UPS": False,
    }
    key = lock_key("cancel-storm")
    left: list[int] = []
    try:
        for proxy in proxies:
            proxy.delay(0.0, requests=0.01)
        for node in nodes[3:]:
            node.clog(key, ttl=30)
        for round_ in range(30):
            lock = Redlock("cancel-storm", retry_delay=0.01, retry_jitter=0.0)
            task = asyncio.ensure_future(lock.aacquire(timeout=5))
            for _ in range(round_ % 6):
                await asyncio.sleep(0.004)
            for _ in range(300):
                task.cancel()
                await asyncio.sleep(0)
                if task.done():
                    break
            try:
                await task  # acquired before the first cancellation landed
            except asyncio.CancelledError:
                await asyncio.sleep(0.05)  # the requests' own delay, and more
                left.append(held_on(nodes[:3], "cancel-storm"))
            for node in nodes[:3]:
                node.client().delete(key)
    finally:
        for proxy in proxies:
            proxy.close()
    assert len(left) >= 10, "too few rounds were cancelled mid-way"
    assert left == [0] * len(left)


# Interrupted by a signal handler around the fan-outs (a Celery soft time limit,
# KeyboardInterrupt): the hold is never left registered as valid.


class _Interrupted(Exception):
    """What the test's SIGALRM handler raises (a Celery soft time limit does the
    same with SIGUSR1)."""


@pytest.fixture
def proxies(nodes: NodeSet) -> Iterator[list[FaultProxy]]:
    started = [FaultProxy(node.port).start() for node in nodes]
    try:
        yield started
    finally:
        for proxy in started:
            proxy.close()


@pytest.fixture
def alarm() -> Iterator[None]:
    def raise_interrupted(signum: int, frame: Any) -> None:
        raise _Interrupted("interrupted by a signal handler")

    previous = signal.signal(signal.SIGALRM, raise_interrupted)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def test_a_release_interrupted_while_stopping_the_watchdog_is_not_re_entered(
    settings: Any,
    redlock_settings: dict[str, Any],
    nodes: NodeSet,
    proxies: list[FaultProxy],
    alarm: None,
) -> None:
    """``release()`` of an auto-extended hold waits for the watchdog's extension
    under way (a slow node); a signal handler raises meanwhile (a Celery soft
    time limit). The watchdog is stopped by then, so the hold must no longer be
    trusted, as for a release interrupted during its fan-out: the owner's next
    ``with`` of the lock (the next Celery task on the same worker thread) must
    not re-enter the dead-watchdog hold and then lose its lock to another owner
    once the TTL runs out while it still works under an auto-extended lock."""
    settings.REDLOCK = {
        **redlock_settings,
        "NODES": [proxy.url for proxy in proxies],
        "TTL": 3.0,
        "NODE_TIMEOUT": 1.0,
        "WAIT_TIMEOUT": 6.0,
        "WAKE_UPS": False,
    }
    resource = "holds:interrupted-stop"
    for proxy in proxies:
        proxy.hold_reply_to(EXTEND_SCRIPT.sha.encode())
    lock = Redlock(resource, auto_extend=True)
    assert lock.acquire()
    # The watchdog extends a third into the lease; its replies are held back.
    assert all(proxy.wait_for_held_replies(1, timeout=5) for proxy in proxies)
    signal.setitimer(signal.ITIMER_REAL, 0.2)
    with pytest.raises(_Interrupted):
        lock.release()  # waits for the watchdog's extension: interrupted
    for proxy in proxies:
        proxy.release_held_replies()
    # The next section in this thread, under the same auto-extended lock, works
    # longer than the TTL; another owner must not get the lock meanwhile.
    stolen: list[float] = []
    stop = threading.Event()

    def other_owner() -> None:
        rival = Redlock(resource)
        while not stop.is_set():
            if rival.acquire(blocking=False):
                stolen.append(time.monotonic())
                rival.release()
                return
            time.sleep(0.05)

    began = time.monotonic()
    try:
        with Redlock(resource, auto_extend=True) as again:
            rival = threading.Thread(target=other_owner)
            rival.start()
            try:
                time.sleep(5.0)  # past the TTL of whatever lease it entered with
                still_held = held_on(nodes, resource)
            finally:
                stop.set()
                rival.join(10)
            depth = again.depth
    finally:
        with contextlib.suppress(LockError):
            while lock.depth:  # what an interrupted release left registered
                lock.release()
    assert stolen == [], (
        f"another owner acquired {stolen[0] - began:.2f}s into a section that "
        f"re-entered (depth {depth}) a hold whose watchdog was stopped"
    )
    assert still_held >= 3


class _Abort(BaseException):
    """A BaseException raised from a signal handler, as KeyboardInterrupt and
    SystemExit are (``signal.default_int_handler``, a SIGTERM handler)."""


def test_an_acquire_interrupted_after_the_grant_leaves_no_hold_and_no_keys(
    settings: Any, redlock_settings: dict[str, Any], nodes: NodeSet
) -> None:
    """A signal handler raises while ``acquire()`` finishes its bookkeeping after
    the nodes granted (here while a ``lock_acquired`` receiver, a tracing
    exporter say, runs). ``acquire()`` raised, so its caller never learns it
    holds the lock and never releases it: the library must release the keys (or
    at least not keep the hold), as it does for an interruption during the
    fan-out. Instead the keys stay for the whole TTL, and the thread keeps a hold
    without a watchdog that its next auto-extended ``with`` re-enters and then
    never releases."""
    resource = "holds:interrupted-grant"
    receiving = threading.Event()

    def slow_receiver(**kwargs: Any) -> None:
        receiving.set()
        time.sleep(1.0)

    def raise_abort(signum: int, frame: Any) -> None:
        raise _Abort("interrupted")

    previous = signal.signal(signal.SIGALRM, raise_abort)
    signals.lock_acquired.connect(slow_receiver, weak=False)
    lock = Redlock(resource, auto_extend=True)
    try:
        signal.setitimer(signal.ITIMER_REAL, 0.3)
        with pytest.raises(_Abort):
            lock.acquire()
        assert receiving.is_set()
        signals.lock_acquired.disconnect(slow_receiver)
        left_owned, left_depth = lock.owned(), lock.depth
        left_on = held_on(nodes, resource)
        # The next section of this thread, under the same lock.
        with Redlock(resource, auto_extend=True, ttl=10) as again:
            depth_inside = again.depth
        left_after = held_on(nodes, resource)
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
        signals.lock_acquired.disconnect(slow_receiver)
        with contextlib.suppress(LockError):
            while lock.depth:
                lock.release()
    found = {
        "owned after the interrupted acquire": left_owned,
        "depth after the interrupted acquire": left_depth,
        "depth inside the next with": depth_inside,
        "nodes holding it after every with ended": left_after,
    }
    assert found == {
        "owned after the interrupted acquire": False,
        "depth after the interrupted acquire": 0,
        "depth inside the next with": 1,
        "nodes holding it after every with ended": 0,
    }, f"{left_on}/5 nodes held it after the interrupted acquire"


# A block entered in an async generator ends in whichever task closes it.


@pytest.mark.parametrize("closed_by", ["aclose-in-another-task", "dropped"])
async def test_an_async_generators_hold_is_released_by_the_task_that_closes_it(
    redlock_settings: dict[str, Any], nodes: NodeSet, closed_by: str
) -> None:
    """``async with`` inside an async generator: a consumer that stops early leaves
    the generator to be closed by another task (the loop's finalizer schedules
    ``aclose()`` in a task of its own for a dropped generator; a streaming
    response abandoned on disconnect is one). The block's exit there releases the
    hold its entry took (old code: ``LockNotOwnedError`` in that task, the hold
    left registered to the consumer, its watchdog extending the lock until
    ``MAX_HOLD``)."""
    released: list[dict[str, Any]] = []

    def receiver(**kwargs: Any) -> None:
        released.append(kwargs)

    signals.lock_released.connect(receiver)

    async def rows() -> Any:
        async with Redlock("agen", ttl=1, auto_extend=True):
            yield 1
            yield 2

    try:
        if closed_by == "dropped":

            async def consume() -> None:
                async for _ in rows():
                    break

            await consume()
        else:
            agen = rows()
            assert await agen.__anext__() == 1
            await asyncio.create_task(agen.aclose())
        for _ in range(50):
            if released:
                break
            await asyncio.sleep(0.05)
        await asyncio.sleep(1.5)  # past the TTL: no watchdog keeps it
        assert held_on(nodes, "agen") == 0
        assert [r["resource"] for r in released] == ["agen"]
        # This task holds nothing: a new block here is a fresh acquisition.
        async with Redlock("agen") as again:
            assert again.depth == 1
    finally:
        signals.lock_released.disconnect(receiver)


async def test_closing_a_generator_whose_task_is_gone_releases_no_other_tasks_hold(
    redlock_settings: dict[str, Any], nodes: NodeSet
) -> None:
    """A task enters ``async with`` in an async generator and ends, the
    generator kept open; its lease runs out. Another task then holds the lock
    through the same object, inside its own block, when the generator is
    closed: that exit ends the gone task's block, and must not release the
    other task's hold (while it still runs its critical section)."""
    import gc

    lock = Redlock("agen-gone", ttl=0.5)

    async def rows() -> Any:
        async with lock:
            yield 1
            yield 2

    kept = rows()

    async def first() -> None:
        assert await kept.__anext__() == 1

    await asyncio.create_task(first())
    gc.collect()  # the task object is gone; its hold went with it
    await asyncio.sleep(0.7)  # its lease ran out on the nodes
    inside = asyncio.Event()
    done = asyncio.Event()

    async def second() -> None:
        async with lock:
            inside.set()
            await done.wait()

    holder = asyncio.create_task(second())
    await inside.wait()
    with contextlib.suppress(LockError):
        await asyncio.create_task(kept.aclose())
    held = held_on(nodes, "agen-gone")
    done.set()
    await holder
    assert held == len(nodes), "the second task's hold was released under it"
    assert held_on(nodes, "agen-gone") == 0


async def test_a_release_whose_own_task_is_cancelled_leaves_no_hold_to_re_enter(
    redlock_settings: dict[str, Any], nodes: NodeSet
) -> None:
    """``arelease()`` runs the release in a task of its own; a sweep that cancels
    every task (``asyncio.Runner`` closing, a "cancel all" shutdown) may cancel
    that task itself while its fan-out is under way (replies 0.3 s late). The
    release may have reached the nodes: a caller that goes on (it caught the
    cancellation) must not re-enter the hold without asking the nodes (old code:
    ``aacquire(blocking=False)`` returned True at depth 2, with no network call,
    as the blocking ``release()`` interrupted does not)."""
    with contextlib.ExitStack() as stack:
        proxies = [stack.enter_context(FaultProxy(node.port)) for node in nodes]
        lock = Redlock("cancel-own-release", nodes=[p.url for p in proxies], ttl=10)
        outcome: list[Any] = []

        async def owner() -> None:
            assert await lock.aacquire(blocking=False)
            for proxy in proxies:
                proxy.delay(0.3)
            try:
                await lock.arelease()
            except asyncio.CancelledError:
                outcome.append("cancelled")
            for proxy in proxies:
                proxy.pass_through()
            outcome.append(await lock.aacquire(blocking=False))
            outcome.append(lock.depth)

        task = asyncio.create_task(owner())
        await asyncio.sleep(0.1)
        inner = [
            t for t in asyncio.all_tasks() if "_arelease_hold" in repr(t.get_coro())
        ]
        assert len(inner) == 1, [repr(t.get_coro()) for t in asyncio.all_tasks()]
        inner[0].cancel()
        await asyncio.wait_for(task, 10)
        assert outcome[0] == "cancelled", outcome
        assert outcome[2] != 2, f"re-entered the interrupted release's hold: {outcome}"
        with contextlib.suppress(Exception):
            await lock.arelease()


async def test_an_acquire_undone_after_its_grant_and_cancelled_meanwhile_is_paired(
    redlock_settings: dict[str, Any], nodes: NodeSet
) -> None:
    """A ``lock_acquired`` receiver raises a ``BaseException`` (``SystemExit``, a
    Celery soft time limit): ``aacquire()`` undoes the grant, releasing on the
    nodes, and the task is cancelled while that release waits for its replies
    (0.3 s late). The release still ends on the nodes, and ``lock_released``
    pairs the ``lock_acquired`` already sent, as without the cancellation (old
    code: no ``lock_released``, so a receiver counting holds, the
    ``redlock_held`` gauge, stays one too high)."""
    resource = "holds:undo-cancelled"
    acquired: list[Any] = []
    released: list[Any] = []

    def raising_receiver(**kwargs: Any) -> None:
        acquired.append(kwargs["resource"])
        if kwargs["resource"] == resource:
            for proxy in proxies:
                proxy.delay(0.3)
            raise _Abort("receiver gave up")

    def on_released(**kwargs: Any) -> None:
        released.append(kwargs["resource"])

    with contextlib.ExitStack() as stack:
        proxies = [stack.enter_context(FaultProxy(node.port)) for node in nodes]
        lock = Redlock(resource, nodes=[p.url for p in proxies])
        signals.lock_acquired.connect(raising_receiver, weak=False)
        signals.lock_released.connect(on_released, weak=False)
        try:
            task = asyncio.create_task(lock.aacquire(blocking=False))
            for _ in range(100):
                await asyncio.sleep(0.01)
                if acquired:
                    break
            await asyncio.sleep(0.05)
            task.cancel()
            with pytest.raises((asyncio.CancelledError, _Abort)):
                await task
        finally:
            signals.lock_acquired.disconnect(raising_receiver)
            signals.lock_released.disconnect(on_released)
    assert acquired == [resource]
    assert released == [resource]
    assert held_on(nodes, resource) == 0


def _refused_until(waiter: Redlock, fired: list[str], wait: float) -> None:
    """Refused attempts (each waiting up to ``wait`` seconds) until a shot fired.

    A frame of its own: CPython (3.11 to 3.13 at least, python/cpython#108214)
    can miss the ``try`` around a loop this small when a signal handler raises at
    the loop's backward jump; an exception leaving the frame is never missed."""
    while not fired:
        assert not waiter.acquire(blocking=wait > 0, timeout=wait or None)


def _shot_handler(fired: list[str]) -> Callable[[int, Any], None]:
    """A SIGALRM handler that notes where it landed in ``fired`` and raises."""

    def raise_interrupted(signum: int, frame: Any) -> None:
        fired.append("".join(traceback.format_stack(frame, limit=4)))
        raise _Interrupted("interrupted by a signal handler")

    return raise_interrupted


def _interrupted_attempts(resource: str, urls: list[str], wait: float) -> Any:
    """In a forked child: aim timers at random points of refused attempts; return
    the interruptions ``acquire()`` swallowed (where each landed) and the depth."""
    fired: list[str] = []
    signal.signal(signal.SIGALRM, _shot_handler(fired))
    # No spans: the OpenTelemetry SDK catches and logs what its span processors
    # raise, a shot landing there included, and once a test set its provider (for
    # the whole process, as test_tracing does) every refusal makes a span.
    tracing.uninstall()
    gc.freeze()  # what the process holds now: never collected, never scanned
    rng = random.Random(12)
    waiter = Redlock(resource, nodes=urls, reentrant=False)
    assert not waiter.acquire(blocking=False)  # connected, scripts loaded
    swallowed: list[str] = []
    for _ in range(_SHOTS):
        # What the last shot dropped (connections in reference cycles) is
        # collected now: a signal landing in a finalizer is lost by Python.
        gc.collect()
        fired.clear()
        try:
            signal.setitimer(signal.ITIMER_REAL, rng.uniform(0.0001, 0.002))
            _refused_until(waiter, fired, wait)
            swallowed.append(fired[0])  # fired, yet acquire() returned
        except _Interrupted:
            pass
    signal.setitimer(signal.ITIMER_REAL, 0)
    return swallowed, waiter.depth


_SHOTS = 300


def _assert_lived(report: Report) -> None:
    """The child reported back, without raising, hanging or crashing."""
    assert report.outcome != "raised", report.value
    assert report.outcome != "silent", f"the child hung; its threads:\n{report.value}"
    assert report.exitcode == 0, (
        f"the child process ended with status {report.exitcode} "
        f"(-{int(signal.SIGSEGV)}: a segmentation fault)"
    )
    assert report.outcome == "done", report.outcome


@pytest.mark.parametrize("wait", [0.0, 0.03], ids=["refused-at-once", "waiting"])
def test_a_signal_handlers_exception_during_an_attempt_comes_out_of_acquire(
    redlock_settings: dict[str, Any], nodes: NodeSet, wait: float
) -> None:
    """A signal handler that raises an ordinary ``Exception`` (a Celery soft time
    limit raises SoftTimeLimitExceeded from SIGUSR1) while ``acquire()`` talks to
    the nodes must end that ``acquire()`` with the exception, wherever the signal
    lands: packing or writing the command, reading a reply, a signal receiver.
    Taken for a node's failure, it was swallowed, and a task past its soft time
    limit waited on for the lock; landing in hiredis's ``pack_command`` it
    crashed the process (a segmentation fault).

    Waiting (between attempts, for a wake-up), it may land inside the standard
    library's ``threading`` (``Condition.wait``, ``Thread.start``), which then
    raises a ``RuntimeError`` or ``KeyError`` of its own: the caller must still
    get the interruption itself.

    In a child process (a crash is seen as its exit status): timers aimed at
    random points of refused attempts on a held lock; every shot that fired must
    come out of ``acquire()``, as itself."""
    resource = "holds:interrupted-attempt"
    # The hold outlives the child's wait: a hung child is reported as a hang.
    with Redlock(resource, nodes=nodes.urls, ttl=90):
        report = in_forked_child(
            functools.partial(_interrupted_attempts, resource, nodes.urls, wait), 60
        )
    _assert_lived(report)
    swallowed, depth = report.value
    assert swallowed == [], (
        f"{len(swallowed)} of {_SHOTS} interruptions were swallowed; the first "
        f"landed in:\n{swallowed[0]}"
    )
    assert depth == 0
    assert held_on(nodes, resource) == 0


async def _arefused_until(waiter: Redlock, fired: list[str], wait: float) -> None:
    """Refused ``aacquire()`` attempts (each waiting up to ``wait`` s) until a
    shot fired."""
    while not fired:
        assert not await waiter.aacquire(blocking=wait > 0, timeout=wait or None)


def _interrupted_async_attempts(resource: str, urls: list[str], wait: float) -> Any:
    """In a forked child: a timer ticks every 50 us during refused ``aacquire()``
    attempts (``asyncio.run`` per round, as a Celery task running async code
    does); its handler raises only when it lands in a coroutine of the asyncio
    driver (``aio.py``). asyncio's own callbacks swallow an exception (and can
    hang); asyncio code is told to use ``loop.add_signal_handler``. Return the
    rounds where the raise did not come out of ``aacquire()``."""
    fired: list[str] = []
    driver = str(Path(aio.__file__))
    raise_interrupted = _shot_handler(fired)

    def raise_in_the_driver(signum: int, frame: Any) -> None:
        # One-shot, armed again as the handler ends (``_woken_grant_rounds``): an
        # interval timer starves the program once a handler outlasts its tick.
        if fired:
            return
        if _in_handler(frame, raise_in_the_driver):
            return
        try:
            if (
                frame is not None
                and frame.f_code.co_filename == driver
                and frame.f_code.co_flags & inspect.CO_COROUTINE
            ):
                raise_interrupted(signum, frame)
        finally:
            if _ticking and not fired:
                signal.setitimer(signal.ITIMER_REAL, 0.00005)

    signal.signal(signal.SIGALRM, raise_in_the_driver)
    gc.freeze()
    waiter = Redlock(resource, nodes=urls, reentrant=False)
    assert not asyncio.run(waiter.aacquire(blocking=False))
    swallowed: list[str] = []
    for _ in range(_ASYNC_ROUNDS):
        gc.collect()
        fired.clear()
        try:
            _ticking.append(True)
            signal.setitimer(signal.ITIMER_REAL, 0.00005)
            asyncio.run(_arefused_until(waiter, fired, wait))
            swallowed.append(fired[0])  # fired, yet aacquire() returned
        except _Interrupted:
            pass
        finally:
            _stop_ticks()
    return swallowed


_ASYNC_ROUNDS = 150


@pytest.mark.parametrize("wait", [0.0, 0.03], ids=["refused-at-once", "waiting"])
def test_a_signal_handlers_exception_in_the_async_driver_comes_out_of_aacquire(
    redlock_settings: dict[str, Any], nodes: NodeSet, wait: float
) -> None:
    """The asyncio driver runs each node's call as a task of its own; a signal
    handler's ordinary ``Exception`` (a Celery soft time limit in a task that runs
    async code with ``asyncio.run``) landing in one was taken for that node's
    failure, or ended a task nobody awaited, and the attempt went on. Wherever in
    the driver's coroutines it lands, it must come out of ``aacquire()``."""
    resource = "holds:interrupted-async-attempt"
    with Redlock(resource, nodes=nodes.urls, ttl=90):
        report = in_forked_child(
            functools.partial(_interrupted_async_attempts, resource, nodes.urls, wait),
            50,
        )
    _assert_lived(report)
    swallowed = report.value
    assert swallowed == [], (
        f"{len(swallowed)} of {_ASYNC_ROUNDS} interruptions were swallowed; the "
        f"first landed in:\n{swallowed[0]}"
    )


def _left_on(clients: list[redis.Redis], resource: str) -> list[redis.Redis]:
    """The nodes that still hold ``resource``'s key, given up to 2 s to drop it.

    A fan-out returns once a quorum decided it: on a loaded machine the last node
    may run the clean-up it was sent a moment later. A key left until its lease
    ends (30 s here) is still there after 2 s.
    """
    key = lock_key(resource)
    deadline = time.monotonic() + 2.0
    while True:
        left = [c for c in clients if c.exists(key)]
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.01)


def _interrupted_partial_attempts(resource: str, urls: list[str]) -> list[str]:
    """In a forked child: timers at random points of attempts that win two of
    five nodes (the other three hold another's lock) and so clean those two up;
    return where each shot landed that left our key on them."""
    fired: list[str] = []
    signal.signal(signal.SIGALRM, _shot_handler(fired))
    gc.freeze()
    rng = random.Random(14)
    waiter = Redlock(resource, nodes=urls, reentrant=False, ttl=30)
    assert not waiter.acquire(blocking=False)
    clients = [redis.Redis.from_url(url) for url in urls[3:]]
    left: list[str] = []
    for _ in range(_PARTIAL_SHOTS):
        gc.collect()
        fired.clear()
        try:
            signal.setitimer(signal.ITIMER_REAL, rng.uniform(0.0001, 0.002))
            _refused_until(waiter, fired, 0.0)
        except _Interrupted:
            pass
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
        if _left_on(clients, resource):
            left.append(fired[0])
            for client in clients:
                client.delete(lock_key(resource))
    return left


_PARTIAL_SHOTS = 300


def test_an_attempt_interrupted_between_its_steps_still_cleans_up_its_nodes(
    redlock_settings: dict[str, Any], nodes: NodeSet
) -> None:
    """A failed attempt that won a minority of the nodes deletes its key there
    before it raises or waits; a signal handler's exception landing anywhere in
    it (in a step, or between the attempt and its clean-up) must not leave the
    key on those nodes until its lease ends (another client could not lock them
    meanwhile)."""
    resource = "holds:interrupted-partial"
    with Redlock(resource, nodes=nodes.urls[:3], ttl=120):
        report = in_forked_child(
            functools.partial(_interrupted_partial_attempts, resource, nodes.urls), 90
        )
    _assert_lived(report)
    left = report.value
    assert left == [], (
        f"{len(left)} of {_PARTIAL_SHOTS} interrupted attempts left their key on "
        f"a node; the first was interrupted in:\n{left[0]}"
    )


def _hold_briefly(holder: Redlock, taken: threading.Event) -> None:
    """Hold ``holder`` for 4 ms, long enough that the waiter waits for it."""
    with holder:
        taken.set()
        time.sleep(0.004)


def _woken_grant_rounds(
    resource: str,
    urls: list[str],
    after_the_grant: Callable[[Any], bool],
    attempt: Callable[[Redlock], None],
    tick: float,
    check: Callable[[str], str] = lambda channel: "",
    hubs: int = 0,
) -> tuple[int, list[str]]:
    """In a forked child: acquisitions that wait out another thread's brief hold
    (no signal handler runs there), are woken by its release and granted, while a
    timer ticks every ``tick`` s; its handler raises once, and only where
    ``after_the_grant(frame)`` says. ``attempt(waiter)`` acquires, stops the
    timer and releases what it got. With ``hubs``, the waiter of round n has
    NODE_TIMEOUT 2 + (n % hubs + 1) ms: pools, a wake-up hub and a reader of its
    own, the reader ended (``wake.LINGER``) by the time its hub is used again.
    Return how many rounds a shot landed in, and where each landed that left the
    key on a node, did not come out, or left what ``check(wake-up channel)``
    complains of."""
    fired: list[str] = []
    raise_interrupted = _shot_handler(fired)

    def raise_after_the_grant(signum: int, frame: Any) -> None:
        # The timer is one-shot, armed again as the handler ends: ticks every
        # ``tick`` of an interval timer starved the program once the handler's
        # walk up the stack took longer than that (Python 3.13, a slower
        # machine: handlers nested in handlers, 300 rounds not done in 90 s).
        if fired:
            return
        if _in_handler(frame, raise_after_the_grant):
            return
        try:
            if after_the_grant(frame):
                raise_interrupted(signum, frame)
        finally:
            if _ticking and not fired:
                signal.setitimer(signal.ITIMER_REAL, tick)

    signal.signal(signal.SIGALRM, raise_after_the_grant)
    gc.freeze()
    # NODE_TIMEOUT 2 s: a node that answers late on a loaded machine is not
    # failed (a release that skipped it leaves its key for the TTL).
    waiter = Redlock(resource, nodes=urls, reentrant=False, ttl=30, node_timeout=2)
    holder = Redlock(resource, nodes=urls, reentrant=False, ttl=30, node_timeout=2)
    clients = [redis.Redis.from_url(url) for url in urls]
    landed, wrong = 0, []
    began = time.monotonic()
    for n in itertools.count():
        # On a loaded machine most rounds may not wait (the holder's 4 ms are over
        # before the waiter's first attempt lands): rounds go on while too few
        # shots landed, within the budget, which also bounds a slow machine's
        # rounds (the child is killed, unheard, after 90 s).
        if time.monotonic() - began >= _ROUNDS_BUDGET or (
            n >= _WOKEN_ROUNDS and landed >= _ENOUGH_LANDED
        ):
            break
        if hubs:
            timeout = 2 + (n % hubs + 1) / 1000
            waiter = Redlock(
                resource, nodes=urls, reentrant=False, ttl=30, node_timeout=timeout
            )
        gc.collect()
        fired.clear()
        taken = threading.Event()
        thread = threading.Thread(target=_hold_briefly, args=(holder, taken))
        thread.start()
        taken.wait(5)
        interrupted = False
        try:
            _ticking.append(True)
            signal.setitimer(signal.ITIMER_REAL, tick)
            attempt(waiter)
        except _Interrupted:
            interrupted = True
        finally:
            _stop_ticks()
        thread.join()
        if not fired:
            continue
        landed += 1
        left = _left_on(clients, resource)
        complaint = check(lock_key(resource))
        if left or not interrupted or complaint:
            wrong.append(
                f"left on {len(left)} nodes, raised: {interrupted} {complaint}\n"
                f"{fired[0]}"
            )
            for client in left:
                client.delete(lock_key(resource))
    return landed, wrong


#: Set while a sweep with a one-shot timer (``_woken_grant_rounds``,
#: ``_interrupted_async_attempts``) ticks: its handler arms the timer again only
#: then, so ``_stop_ticks`` ends the ticks even when one already delivered runs
#: its handler after the timer was disarmed.
_ticking: list[bool] = []


#: Seconds to the next tick after one that landed in its own handler.
_NESTED_TICK = 0.001


def _in_handler(frame: Any, handler: Callable[..., None]) -> bool:
    """Whether a tick landed in ``handler`` itself: its one-shot timer, armed
    again at its end, outlasted by what was left of it (3.13 on a slow machine).
    No shot is taken there (the code under test is not running); the next tick
    comes ``_NESTED_TICK`` later, or each handler nested in the last one walked a
    deeper stack, for longer, until Python's recursion limit."""
    if frame is None or frame.f_code is not handler.__code__:
        return False
    if _ticking:
        signal.setitimer(signal.ITIMER_REAL, _NESTED_TICK)
    return True


def _stop_ticks() -> None:
    """Stop the ticks of a one-shot sweep (in ``_woken_grant_rounds``, a round's
    attempt once it got its answer: no shot lands in its release)."""
    _ticking.clear()
    signal.setitimer(signal.ITIMER_REAL, 0)


_WOKEN_ROUNDS = 300
#: More rounds, up to ``_ROUNDS_BUDGET`` seconds in all, until this many landed.
_ENOUGH_LANDED = 10
_ROUNDS_BUDGET = 60.0


def _acquire_then_release(waiter: Redlock) -> None:
    """A round's attempt: acquire, stop the timer, release what was got."""
    acquired = waiter.acquire(timeout=5)
    _stop_ticks()
    if acquired:
        waiter.release()


def _interrupted_woken_grants(resource: str, urls: list[str]) -> Any:
    """``_woken_grant_rounds`` for ``acquire()``, a tick every 100 us: the
    handler raises once the flow returned the grant, while the blocking driver's
    ``run`` stops watching for wake-ups."""
    driver_run = sync.run.__code__

    def after_the_grant(frame: Any) -> bool:
        while frame is not None:
            if frame.f_code is driver_run:
                return bool(frame.f_locals["flow"].gi_frame is None)  # it returned
            frame = frame.f_back
        return False

    return _woken_grant_rounds(
        resource, urls, after_the_grant, _acquire_then_release, 0.0001
    )


def _interrupted_woken_async_grants(resource: str, urls: list[str]) -> Any:
    """``_woken_grant_rounds`` for ``aacquire()`` (``asyncio.run`` per round), a
    tick every 50 us: the handler raises once the flow returned the grant, while
    the asyncio driver's ``run`` ends (it stops watching for wake-ups) or before
    ``_aacquire`` made the hold of it."""
    driver_run = aio.run.__code__
    aacquire = Redlock._aacquire.__code__

    def after_the_grant(frame: Any) -> bool:
        while frame is not None:
            if frame.f_code is driver_run:
                return bool(frame.f_locals["flow"].gi_frame is None)
            if frame.f_code is aacquire:
                seen = frame.f_locals
                return "grant" in seen and "hold" not in seen
            frame = frame.f_back
        return False

    async def acquire_and_release(waiter: Redlock) -> None:
        acquired = await waiter.aacquire(timeout=5)
        _stop_ticks()
        if acquired:
            await waiter.arelease()

    def attempt(waiter: Redlock) -> None:
        asyncio.run(acquire_and_release(waiter))

    return _woken_grant_rounds(resource, urls, after_the_grant, attempt, 0.00005)


def _assert_grants_released(
    rounds: Callable[[str, list[str]], Any], resource: str, nodes: NodeSet
) -> None:
    """Run ``rounds`` in a forked child: some shot landed, none went wrong."""
    report = in_forked_child(functools.partial(rounds, resource, nodes.urls), 90)
    _assert_lived(report)
    landed, wrong = report.value
    assert landed > 0, "no shot landed where it was aimed: the test tried nothing"
    assert wrong == [], (
        f"{len(wrong)} of {landed} acquisitions interrupted there went wrong; the "
        f"first:\n{wrong[0]}"
    )


def test_an_aacquire_interrupted_as_its_wait_ends_releases_the_grant(
    redlock_settings: dict[str, Any], nodes: NodeSet
) -> None:
    """``test_an_acquire_interrupted_as_its_wait_ends_releases_the_grant`` for
    ``aacquire()``: a signal handler's exception landing after the asyncio
    driver's flow returned the grant, before ``aacquire()`` took it, must not
    drop the grant with its keys on the nodes for the TTL."""
    resource = "holds:interrupted-woken-async-grant"
    _assert_grants_released(_interrupted_woken_async_grants, resource, nodes)


def test_an_acquire_interrupted_as_its_wait_ends_releases_the_grant(
    redlock_settings: dict[str, Any], nodes: NodeSet
) -> None:
    """A waiter woken and granted stops watching for wake-ups before ``acquire()``
    takes the grant; a signal handler's exception landing there came out of
    ``acquire()`` with the grant dropped: its keys stayed on the nodes for the
    whole TTL (30 s here), no one could take the lock meanwhile. The grant must
    be released before the exception comes out."""
    resource = "holds:interrupted-woken-grant"
    _assert_grants_released(_interrupted_woken_grants, resource, nodes)


def _watchers_left(channel: str) -> str:
    """What this process's hubs still count or keep as waiters once none waits,
    and whether one holds its reader's slot for a thread that never started."""
    hubs = list(wake._hubs.values())
    kept = sum(hub.waiting(channel.encode()) for hub in hubs)
    counted = wake.watching()
    unstarted = sum(
        hub._reader is not None and hub._reader.ident is None for hub in hubs
    )
    if counted or kept or unstarted:
        return f"watchers counted {counted}, kept {kept}; readers unstarted {unstarted}"
    return ""


def _in_watch_or_unwatch(frame: Any) -> bool:
    """Whether ``frame`` runs in (or under) the hub's ``watch`` or ``unwatch``."""
    codes = (wake.Hub.watch.__code__, wake.Hub.unwatch.__code__)
    while frame is not None:
        if frame.f_code in codes:
            return True
        frame = frame.f_back
    return False


def _interrupted_watch_changes(resource: str, urls: list[str]) -> Any:
    """``_woken_grant_rounds`` for ``acquire()``, a tick every 20 us: the handler
    raises once the waiter starts or stops watching for wake-ups, inside the hub."""

    return _woken_grant_rounds(
        resource,
        urls,
        _in_watch_or_unwatch,
        _acquire_then_release,
        0.00002,
        _watchers_left,
    )


def _interrupted_async_watch_changes(resource: str, urls: list[str]) -> Any:
    """``_interrupted_watch_changes`` for ``aacquire()``, every round on one event
    loop (``asyncio.run`` per round spends most of it making the loop's clients,
    and the ticks then rarely land in the hub)."""

    async def acquire_and_release(waiter: Redlock) -> None:
        acquired = await waiter.aacquire(timeout=5)
        _stop_ticks()
        if acquired:
            await waiter.arelease()

    with asyncio.Runner() as runner:

        def attempt(waiter: Redlock) -> None:
            runner.run(acquire_and_release(waiter))

        return _woken_grant_rounds(
            resource, urls, _in_watch_or_unwatch, attempt, 0.00002, _watchers_left
        )


def _before_its_reader_starts(frame: Any) -> bool:
    """Whether ``frame`` runs in ``Hub.watch`` (or a generator of it) after the
    hub took its reader's slot, before ``Thread.start()`` was called."""
    code = wake.Hub.watch.__code__
    while frame is not None:
        if frame.f_code is code:
            reader = frame.f_locals.get("reader")
            return isinstance(reader, threading.Thread) and reader.ident is None
        if frame.f_code.co_filename == threading.__file__:
            return False  # in Thread.start(): its interruption was handled before
        frame = frame.f_back
    return False


def _pipes_open() -> int:
    """How many pipes this process has open (each wake-up reader owns one)."""
    count = 0
    for name in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):  # the listing's own descriptor, closed
            count += os.readlink(f"/proc/self/fd/{name}").startswith("pipe:")
    return count


def _interrupted_reader_starts(resource: str, urls: list[str]) -> Any:
    """``_woken_grant_rounds`` for ``acquire()`` with a new wake-up reader nearly
    every round, a tick every 20 us: the handler raises once the waiter's hub has
    taken the reader's slot, before it starts the reader's thread. Then, once
    every reader has ended, whether more pipes are open than before the rounds."""
    before = _pipes_open()
    landed, wrong = _woken_grant_rounds(
        resource,
        urls,
        _before_its_reader_starts,
        _acquire_then_release,
        0.00002,
        _watchers_left,
        hubs=100,
    )
    deadline = time.monotonic() + wake.LINGER + 10
    while time.monotonic() < deadline and any(
        t.name.startswith("redlock-wake-") and t.is_alive()
        for t in threading.enumerate()
    ):
        time.sleep(0.05)
    leaked = _pipes_open() - before
    if leaked:
        wrong.append(
            f"{leaked} more pipes open once every wake-up reader ended "
            f"(readers never started keep theirs)"
        )
    return landed, wrong


def test_an_acquire_interrupted_as_its_hub_starts_a_reader_frees_the_slot_and_its_pipe(
    redlock_settings: dict[str, Any], nodes: NodeSet
) -> None:
    """A process's first waiter on a set of nodes starts the wake-up reader; a
    signal handler's exception landing after its hub took the reader's slot,
    before the thread was started, left the slot to a thread that never runs: no
    release woke a waiter of that process on those nodes again. And the reader's
    pipe, made with it, stayed open: two descriptors per such interruption."""
    resource = "holds:interrupted-reader-start"
    _assert_grants_released(_interrupted_reader_starts, resource, nodes)


def test_an_acquire_interrupted_as_it_starts_or_stops_watching_leaves_no_watcher(
    redlock_settings: dict[str, Any], nodes: NodeSet
) -> None:
    """A signal handler's exception landing while a waiter registers with, or
    leaves, its process's wake-up hub must not leave it counted or registered
    there: a watch left registered kept its channel subscribed for good, and made
    every later release of the lock in this process defer the process's next
    acquire for a waiter that was not there; a count left off made every release
    do the lookups that a count of 0 spares it."""
    resource = "holds:interrupted-watch"
    _assert_grants_released(_interrupted_watch_changes, resource, nodes)


def test_an_aacquire_interrupted_as_it_starts_or_stops_watching_leaves_no_watcher(
    redlock_settings: dict[str, Any], nodes: NodeSet
) -> None:
    """``test_an_acquire_interrupted_as_it_starts_or_stops_watching_leaves_no_watcher``
    for ``aacquire()``."""
    resource = "holds:interrupted-async-watch"
    _assert_grants_released(_interrupted_async_watch_changes, resource, nodes)


def _interrupted_as_the_reader_thread_starts(resource: str, mode: str) -> str:
    """In a forked child: wait for ``resource`` (held elsewhere) while a signal
    handler raises the moment the wake-up reader's thread has started, before
    ``Thread.start()`` returns. CPython's ``start()`` then tries to take the
    thread back out of ``threading._limbo``, where the running thread already
    took itself out, and raises ``KeyError`` from that interruption (seen once
    in CI, by the timing loop above). Return what the acquisition raised."""
    names = ("_start_new_thread", "_start_joinable_thread")
    originals = {n: getattr(threading, n) for n in names if hasattr(threading, n)}

    def late_signal(name: str) -> Callable[..., Any]:
        def start(function: Any, *args: Any, **kwargs: Any) -> Any:
            started = originals[name](function, *args, **kwargs)
            thread = getattr(function, "__self__", None)
            if isinstance(thread, Reader):
                deadline = time.monotonic() + 5
                while thread in threading._limbo and time.monotonic() < deadline:  # type: ignore[attr-defined]
                    time.sleep(0.001)
                signal.raise_signal(signal.SIGUSR1)  # its handler raises here
            return started

        return start

    def raise_interrupted(signum: int, frame: Any) -> None:
        raise _Interrupted("interrupted by a signal handler")

    signal.signal(signal.SIGUSR1, raise_interrupted)
    for name in originals:
        setattr(threading, name, late_signal(name))
    waiter = Redlock(resource)
    try:
        if mode == "sync":
            waiter.acquire(timeout=2)
        else:
            asyncio.run(waiter.aacquire(timeout=2))
    except BaseException as exc:
        return type(exc).__name__
    return "nothing"


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_an_interruption_as_the_wake_up_reader_starts_comes_out_as_itself(
    redlock_settings: dict[str, Any],
    nodes: NodeSet,
    hold: Callable[..., Redlock],
    mode: str,
) -> None:
    """A signal handler's exception that lands as the hub's reader thread starts
    reaches the waiter's caller as itself, not as the ``KeyError`` CPython's
    ``Thread.start()`` raises from it."""
    resource = f"holds:reader-start-{mode}"
    hold(resource)
    report = in_forked_child(
        functools.partial(_interrupted_as_the_reader_thread_starts, resource, mode),
        wait=30,
    )
    assert report.outcome == "done", report
    assert report.value == "_Interrupted", report
