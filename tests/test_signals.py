"""Signals sent by locks, and the Prometheus metrics fed by them."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import threading
import time
from collections.abc import Iterator
from threading import current_thread
from typing import Any

import pytest
from prometheus_client import REGISTRY

from harness.held import held_on, lock_key, tokens
from harness.nodes import NodeSet
from redlock_django import (
    LockContentionError,
    LockError,
    LockLostError,
    QuorumUnavailableError,
    Redlock,
    metrics,
    signals,
)


@pytest.fixture
def sent() -> Iterator[list[tuple[str, dict[str, Any]]]]:
    """Record every lock signal as (name, kwargs)."""
    log: list[tuple[str, dict[str, Any]]] = []
    receivers = []
    for name in signals.__all__:
        signal = getattr(signals, name)

        def receiver(name: str = name, **kwargs: Any) -> None:
            kwargs.pop("signal")
            log.append((name, kwargs))

        signal.connect(receiver, weak=False)
        receivers.append((signal, receiver))
    yield log
    for signal, receiver in receivers:
        signal.disconnect(receiver)


def names(log: list[tuple[str, dict[str, Any]]]) -> list[str]:
    return [name for name, _ in log]


def test_acquire_and_release_send_their_timings(
    sent: list[Any], redlock_settings: dict[str, Any]
) -> None:
    lock = Redlock("signalled", fencing=True)
    with lock:
        time.sleep(0.05)
    assert names(sent) == ["lock_acquired", "lock_released"]
    acquired, released = sent[0][1], sent[1][1]
    assert acquired["sender"] is Redlock and acquired["lock"] is lock
    assert acquired["resource"] == "signalled"
    assert 0 <= acquired["waited"] < 1 and acquired["fencing_token"] == 1
    assert released["held"] >= 0.05


def test_contention_and_quorum_failure_are_signalled(
    sent: list[Any], nodes: Any, redlock_settings: dict[str, Any]
) -> None:
    nodes[0].clog(lock_key("busy"))
    nodes[1].clog(lock_key("busy"))
    nodes[2].clog(lock_key("busy"))
    assert not Redlock("busy").acquire(blocking=False)
    for node in nodes[:3]:
        node.stop()
    with pytest.raises(QuorumUnavailableError):
        Redlock("down").acquire()
    assert names(sent) == ["lock_contended", "lock_unavailable"]
    assert isinstance(sent[1][1]["error"], QuorumUnavailableError)


def test_extensions_are_signalled_for_extend_and_for_the_watchdog(
    sent: list[Any], redlock_settings: dict[str, Any]
) -> None:
    lock = Redlock("stretched", ttl=0.3)
    with lock:
        assert lock.extend(1.0)
    assert names(sent) == ["lock_acquired", "lock_extended", "lock_released"]
    assert 0.9 < sent[1][1]["validity"] <= 1.0
    sent.clear()
    with Redlock("watched", ttl=0.3, auto_extend=True):
        time.sleep(0.5)
    assert names(sent).count("lock_extended") >= 1


def _extended(log: list[tuple[str, dict[str, Any]]]) -> list[tuple[str, float]]:
    """The ``lock_extended`` signals sent: (sending thread, validity)."""
    return [
        (kw["thread"], round(kw["validity"], 2))
        for name, kw in log
        if name == "lock_extended"
    ]


@pytest.fixture
def extended() -> Iterator[list[tuple[str, dict[str, Any]]]]:
    """Record ``lock_extended`` with the name of the thread that sent it."""
    log: list[tuple[str, dict[str, Any]]] = []

    def receiver(**kwargs: Any) -> None:
        log.append(("lock_extended", {**kwargs, "thread": current_thread().name}))

    signals.lock_extended.connect(receiver, weak=False)
    yield log
    signals.lock_extended.disconnect(receiver)


def test_the_watchdogs_last_extension_at_max_hold_is_signalled(
    extended: list[Any], redlock_settings: dict[str, Any], nodes: NodeSet
) -> None:
    """TTL 0.9 s, max_hold 1.45 s: the watchdog extends at ~0.3 s (a full TTL)
    and at ~0.6 s (its last one, to the cap). Each is signalled; the last one
    was not (the signal went out at the watchdog's next sleep, and there was
    none)."""
    lock = Redlock("last-extension", ttl=0.9, auto_extend=True, max_hold=1.45)
    assert lock.acquire()
    try:
        time.sleep(1.32)
        assert lock.owned(), "the capped extension did not happen"
        time.sleep(0.1)
        assert len(_extended(extended)) == 2, _extended(extended)
    finally:
        with contextlib.suppress(LockLostError):
            lock.release()


async def test_the_async_watchdogs_last_extension_at_max_hold_is_signalled(
    extended: list[Any], redlock_settings: dict[str, Any], nodes: NodeSet
) -> None:
    lock = Redlock("last-extension", ttl=0.9, auto_extend=True, max_hold=1.45)
    assert await lock.aacquire()
    try:
        await asyncio.sleep(1.32)
        assert lock.owned(), "the capped extension did not happen"
        await asyncio.sleep(0.1)
        assert len(_extended(extended)) == 2, _extended(extended)
    finally:
        with contextlib.suppress(LockLostError):
            await lock.arelease()


def test_an_owners_extension_is_signalled_once_not_again_by_the_watchdog(
    extended: list[Any], redlock_settings: dict[str, Any], nodes: NodeSet
) -> None:
    """``extend(3.0)`` on an auto-extended lock sends ``lock_extended`` once; the
    watchdog, waking at a third of the first lease to find the longer one,
    extends nothing and sent the signal again from its thread."""
    lock = Redlock("owner-extension", ttl=1.5, auto_extend=True, max_hold=None)
    assert lock.acquire()
    try:
        assert lock.extend(3.0)
        time.sleep(1.0)  # the watchdog woke at ~0.5 s; its own turn is ~2 s
        assert len(_extended(extended)) == 1, _extended(extended)
    finally:
        lock.release()


async def test_an_owners_aextend_is_signalled_once_not_again_by_the_watchdog(
    extended: list[Any], redlock_settings: dict[str, Any], nodes: NodeSet
) -> None:
    lock = Redlock("owner-extension", ttl=1.5, auto_extend=True, max_hold=None)
    assert await lock.aacquire()
    try:
        assert await lock.aextend(3.0)
        await asyncio.sleep(1.0)
        assert len(_extended(extended)) == 1, _extended(extended)
    finally:
        await lock.arelease()


def test_a_lost_lease_is_signalled_once(
    sent: list[Any], nodes: Any, redlock_settings: dict[str, Any]
) -> None:
    lock = Redlock("lost", ttl=0.3, auto_extend=True)
    lock.acquire()
    for node in nodes[:3]:
        node.pause()
    try:
        time.sleep(0.5)
    finally:
        for node in nodes[:3]:
            node.resume()
    with pytest.raises(Exception, match="lost"):
        lock.release()
    assert names(sent).count("lock_lost") == 1
    assert names(sent)[-1] == "lock_released"


def sample(name: str, labels: dict[str, str] | None = None) -> float:
    return REGISTRY.get_sample_value(name, labels or {}) or 0.0


def test_metrics_count_acquisitions_contention_and_holds(
    nodes: Any, redlock_settings: dict[str, Any]
) -> None:
    assert metrics.installed()
    acquired = sample("redlock_acquire_seconds_count", {"outcome": "acquired"})
    contended = sample("redlock_contended_total")
    holds = sample("redlock_hold_seconds_count")
    held = sample("redlock_held")
    lock = Redlock("metered")
    lock.acquire()
    assert sample("redlock_held") == held + 1
    nodes[0].clog(lock_key("other"))
    nodes[1].clog(lock_key("other"))
    nodes[2].clog(lock_key("other"))
    Redlock("other").acquire(blocking=False)
    lock.release()
    assert sample("redlock_acquire_seconds_count", {"outcome": "acquired"}) == (
        acquired + 1
    )
    assert sample("redlock_contended_total") == contended + 1
    assert sample("redlock_hold_seconds_count") == holds + 1
    assert sample("redlock_held") == held


def test_the_held_gauge_forgets_a_thread_that_ended_holding_its_lock(
    nodes: Any, redlock_settings: dict[str, Any]
) -> None:
    """A thread that took a lock and ended without releasing it holds nothing any
    more (its lease runs out on the nodes): ``redlock_held`` stops counting it
    (old code: no ``lock_released``, so the gauge stayed one too high for good).
    An asyncio task that ended holding its lock, likewise."""
    held = sample("redlock_held")
    thread = threading.Thread(target=lambda: Redlock("gauge:thread").acquire())
    thread.start()
    thread.join()
    assert held_on(nodes, "gauge:thread") == len(nodes)  # still held on the nodes

    async def forget() -> None:
        await Redlock("gauge:task").aacquire()

    async def main() -> None:
        task = asyncio.create_task(forget())
        await task
        assert sample("redlock_held") == held

    asyncio.run(main())
    lock = Redlock("gauge:kept")
    lock.acquire()
    assert sample("redlock_held") == held + 1
    lock.release()
    assert sample("redlock_held") == held


def test_contention_in_a_with_block_is_not_signalled_as_unavailable(
    sent: list[Any], nodes: Any, redlock_settings: dict[str, Any]
) -> None:
    """A busy lock raises LockContentionError from ``with`` and is signalled once,
    as contention: it is not a quorum failure (nor counted as one)."""
    for node in nodes[:3]:
        node.clog(lock_key("busy"))
    with pytest.raises(LockContentionError), Redlock("busy"):
        pass
    assert names(sent) == ["lock_contended"]
    assert isinstance(sent[0][1]["error"], LockContentionError)


def test_a_lost_hold_dropped_at_the_next_acquire_is_signalled_released(
    redlock_settings: dict[str, Any], nodes: NodeSet
) -> None:
    """An ``acquire()`` whose lease ran out unreleased is dropped by the next
    acquire: it got a ``lock_acquired`` and now gets its ``lock_released`` (lost,
    nothing released), so ``redlock_held`` ("Locks currently held by this
    process") is back where it was (it stayed one too high for good)."""
    assert metrics.installed()
    before = sample("redlock_held")
    forgotten = Redlock("gauge", ttl=0.3)
    assert forgotten.acquire(blocking=False)
    time.sleep(0.45)
    with Redlock("gauge", ttl=5):
        pass
    assert tokens(nodes, "gauge") == [None] * 5  # nothing is held
    assert sample("redlock_held") == before


def test_a_receiver_that_raises_is_logged_and_the_lock_goes_on(
    redlock_settings: dict[str, Any], nodes: Any, caplog: pytest.LogCaptureFixture
) -> None:
    """A ``lock_acquired`` receiver that raised escaped ``__enter__`` with the lock
    granted on every node and registered to the thread, so nobody released it.
    Receivers now get ``send_robust``: the error is logged, the lock works."""

    def broken(**kwargs: Any) -> None:
        raise RuntimeError("receiver bug")

    signals.lock_acquired.connect(broken, weak=False)
    signals.lock_released.connect(broken, weak=False)
    lock = Redlock("leak", ttl=5)
    try:
        with lock:
            assert lock.owned()
    finally:
        signals.lock_acquired.disconnect(broken)
        signals.lock_released.disconnect(broken)
    assert lock.depth == 0 and tokens(nodes, "leak") == [None] * 5
    errors = [r for r in caplog.records if "receiver bug" in str(r.exc_info)]
    assert len(errors) == 2, caplog.records  # acquired, released
    assert all(r.name == "django.dispatch" for r in errors)


def test_an_instrument_that_raises_is_logged_and_the_receivers_still_hear(
    sent: list[Any],
    redlock_settings: dict[str, Any],
    nodes: Any,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The library's own instruments (metrics, spans) are called where a signal is
    sent, before its receivers and outside Django's dispatch: one that raises is
    logged on ``redlock_django.signals``, the lock works, and every receiver still
    gets the signal."""

    def broken(named: dict[str, Any]) -> None:
        raise RuntimeError("instrument bug")

    signals.attach(signals.lock_acquired, broken)
    signals.attach(signals.lock_released, broken)
    lock = Redlock("instrument-leak", ttl=5)
    try:
        with lock:
            assert lock.owned()
    finally:
        signals.detach(signals.lock_acquired, broken)
        signals.detach(signals.lock_released, broken)
    assert broken not in signals.instruments(signals.lock_acquired)
    assert lock.depth == 0 and tokens(nodes, "instrument-leak") == [None] * 5
    assert names(sent) == ["lock_acquired", "lock_released"]
    errors = [r for r in caplog.records if "instrument bug" in str(r.exc_info)]
    assert len(errors) == 2, caplog.records  # acquired, released
    assert all(r.name == "redlock_django.signals" for r in errors)


@pytest.mark.parametrize(
    ("signal_", "instrument", "why"),
    [
        (signals.lock_acquired, "redlock.acquired", "must be callable"),
        (signals.lock_acquired, None, "must be callable"),
        ("lock_acquired", print, "a django.dispatch.Signal"),
    ],
    ids=["a-name", "none", "a-signal-by-name"],
)
def test_attach_refuses_what_it_could_never_call(
    signal_: Any, instrument: Any, why: str
) -> None:
    """A mistake in ``attach()`` is a TypeError there and then, not a logged
    error at every acquisition; nothing is attached."""
    before = signals.instruments(signals.lock_acquired)
    with pytest.raises(TypeError, match=why):
        signals.attach(signal_, instrument)
    assert signals.instruments(signals.lock_acquired) == before


class SoftLimit(Exception):
    """An ordinary ``Exception`` a signal handler raises (a Celery soft time limit)."""


def test_a_soft_limit_landing_in_an_instrument_comes_out_of_acquire(
    sent: list[Any], redlock_settings: dict[str, Any], nodes: NodeSet
) -> None:
    """A signal handler's ``Exception`` raised while an instrument runs is the
    caller's interruption, not the instrument's failure: once the receivers heard
    ``lock_acquired`` it comes out of ``acquire()``, which undoes the grant."""

    def handler(signum: int, frame: Any) -> None:
        raise SoftLimit("soft time limit")

    def interrupted_instrument(named: dict[str, Any]) -> None:
        os.kill(os.getpid(), signal.SIGUSR1)
        time.sleep(1)  # the handler runs before this ends

    previous = signal.signal(signal.SIGUSR1, handler)
    signals.attach(signals.lock_acquired, interrupted_instrument)
    try:
        with pytest.raises(SoftLimit):
            Redlock("instrument-interrupted", ttl=5).acquire()
    finally:
        signals.detach(signals.lock_acquired, interrupted_instrument)
        signal.signal(signal.SIGUSR1, previous)
    assert tokens(nodes, "instrument-interrupted") == [None] * 5
    assert names(sent) == ["lock_acquired", "lock_released"]


# Found by an adversarial review (each failed on the code before its fix): a
# lock_acquired never paired with lock_released after an interrupted acquisition;
# a forked child's redlock_held counting its parent's holds; lock_released naming
# another object than lock_acquired; slow receivers running off an unextended
# lease.


class Interrupted(BaseException):
    """What a signal handler raises (as KeyboardInterrupt or a time limit does)."""


@pytest.fixture
def sigusr1_interrupts() -> Iterator[None]:
    def handler(signum: int, frame: Any) -> None:
        raise Interrupted("interrupted by SIGUSR1")

    previous = signal.signal(signal.SIGUSR1, handler)
    yield
    signal.signal(signal.SIGUSR1, previous)


def test_an_acquisition_interrupted_in_a_receiver_is_followed_by_lock_released(
    sent: list[Any],
    redlock_settings: dict[str, Any],
    nodes: NodeSet,
    sigusr1_interrupts: None,
) -> None:
    """A signal (Ctrl-C, a time limit) interrupts a ``lock_acquired`` receiver:
    the acquisition is undone and released on the nodes (``_forget_grant``), but
    the ``lock_acquired`` already sent is never followed by its ``lock_released``,
    so ``redlock_held`` stays one too high for good."""
    assert metrics.installed()
    before = sample("redlock_held")

    def interrupted_receiver(**kwargs: Any) -> None:
        os.kill(os.getpid(), signal.SIGUSR1)
        time.sleep(1)  # the handler runs before this ends

    signals.lock_acquired.connect(interrupted_receiver, weak=False)
    try:
        with pytest.raises(Interrupted):
            Redlock("interrupted", ttl=5).acquire()
    finally:
        signals.lock_acquired.disconnect(interrupted_receiver)
    assert tokens(nodes, "interrupted") == [None] * 5  # undone on the nodes
    assert names(sent).count("lock_acquired") == 1
    assert names(sent).count("lock_released") == 1, names(sent)
    assert sample("redlock_held") == before


@pytest.mark.timeout(30)
def test_a_forked_child_does_not_report_its_parents_holds_in_redlock_held(
    redlock_settings: dict[str, Any], nodes: NodeSet
) -> None:
    """A child forked inside a hold starts with none of its parent's holds
    (README), and will never release them, yet its ``redlock_held`` ("Locks
    currently held by this process") starts at the parent's count and stays
    there for the child's whole life."""
    assert metrics.installed()
    before = sample("redlock_held")
    lock = Redlock("forked", ttl=5)
    assert lock.acquire(blocking=False)
    try:
        assert sample("redlock_held") == before + 1
        read, write = os.pipe()
        pid = os.fork()
        if pid == 0:  # the child
            try:
                os.close(read)
                value = f"{sample('redlock_held')} {lock.depth}"
                os.write(write, value.encode())
            finally:
                os._exit(0)
        os.close(write)
        with os.fdopen(read) as reader:
            child_held, child_depth = reader.read().split()
        os.waitpid(pid, 0)
    finally:
        lock.release()
    assert int(child_depth) == 0  # the child holds nothing...
    assert float(child_held) == 0  # ...and its gauge says so


def test_lock_released_names_the_same_lock_object_as_its_lock_acquired(
    sent: list[Any], redlock_settings: dict[str, Any], nodes: NodeSet
) -> None:
    """One hold, re-entered through a second ``Redlock`` object on the same lock
    and left last through that object: ``lock_acquired`` names the object that
    acquired it, ``lock_released`` the one whose release was outermost. Every
    other signal of a hold (``lock_lost``, the watchdog's ``lock_extended``, the
    ``lock_released`` of a replaced hold) sends ``hold.lock``, documented as
    "the object that acquired it, sent with the signals"; a receiver that pairs
    acquisitions with releases by ``lock`` never sees this hold end."""
    first = Redlock("shared", ttl=5)
    second = Redlock("shared", ttl=5)
    first.acquire()
    second.acquire()  # re-entered: depth 2
    first.release()
    second.release()  # the outermost release
    assert tokens(nodes, "shared") == [None] * 5
    assert names(sent) == ["lock_acquired", "lock_released"]
    assert sent[1][1]["lock"] is sent[0][1]["lock"]


def test_a_slow_lock_acquired_receiver_does_not_lose_an_auto_extended_lock(
    redlock_settings: dict[str, Any], nodes: NodeSet
) -> None:
    """``acquire()`` sends ``lock_acquired`` before it starts the watchdog
    thread (``_acquire``: ``_grant`` sends, then ``start_thread()``), so the
    time a receiver takes (a synchronous push to a metrics gateway, a log
    shipper) runs off an ``auto_extend`` lease with nobody extending it: a
    receiver slower than the TTL hands the caller a lock already lost."""
    lock = Redlock("slow-acquired", ttl=1.0, auto_extend=True)

    def slow(**kwargs: Any) -> None:
        time.sleep(1.5)

    signals.lock_acquired.connect(slow, weak=False)
    try:
        assert lock.acquire()
    finally:
        signals.lock_acquired.disconnect(slow)
    try:
        time.sleep(0.3)
        assert not lock.lost
        assert lock.owned()
    finally:
        with contextlib.suppress(LockError):
            lock.release()


def test_a_slow_lock_extended_receiver_does_not_lose_an_auto_extended_lock(
    redlock_settings: dict[str, Any], nodes: NodeSet
) -> None:
    """The watchdog sends ``lock_extended`` at the start of its next sleep
    (``Watchdog._sleep`` -> ``_note_extension``), then sleeps the full delay
    ``watchdog_flow`` computed before the receivers ran: time spent in a
    receiver is added to the gap between extensions. With a 1.5 s TTL the
    watchdog extends every ~0.5 s; a 1.2 s receiver pushes the next extension
    past the end of the lease, and the lock is lost while held."""
    lock = Redlock("slow-extended", ttl=1.5, auto_extend=True)

    def slow(**kwargs: Any) -> None:
        time.sleep(1.2)

    signals.lock_extended.connect(slow, weak=False)
    try:
        assert lock.acquire()
        time.sleep(2.5)
        assert not lock.lost
    finally:
        signals.lock_extended.disconnect(slow)
        with contextlib.suppress(LockError):
            lock.release()
