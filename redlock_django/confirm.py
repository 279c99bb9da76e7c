"""Extend a handed-over hold to its TTL halfway through its handed lease.

A fair lock's release may hand the lock to the next waiter with its wake-up
(``protocol._handed``): the lease it gets is what was left of the waiter's queue
entry (at most ``QUEUE_LIFE``), often shorter than the TTL it asked for. Most holds
of a hot lock end long before half of it; those that do not are extended to their
TTL then, and an extension that fails (nodes silent for a moment, the client
late) is tried again while the handed lease lasts, as the watchdog's are
(``protocol.confirm_retry_delay``). Holds taken by threads share one timer thread
per process (a release before the time costs a heap entry skipped, not a
wake-up); holds taken by tasks get a task on their own event loop, cancelled by
the release. An extension by the owner itself (``extend()``) ends the need.
"""

from __future__ import annotations

import asyncio
import contextlib
import heapq
import itertools
import logging
import os
import random
import threading
import time
from typing import TYPE_CHECKING, Any

from . import aio, nodes, signals, sync
from .exceptions import LockLostError
from .holds import report_lost
from .protocol import confirm_retry_delay, extend_flow

if TYPE_CHECKING:
    from .holds import Hold

__all__ = ["cancel", "schedule", "schedule_task"]

logger = logging.getLogger("redlock_django.lock")

_clock = time.monotonic
_jitter = random.random

#: Holds due within this many seconds of each other are extended in one wake-up of
#: the timer thread: a little early, never late, and at most a few wake-ups a
#: second however many holds a hot lock hands over.
BATCH = 0.05
#: Seconds the timer thread waits with nothing to do before it ends.
IDLE = 5.0


def _due(hold: Hold) -> float:
    """When to extend: halfway through what is left of the handed lease."""
    now = _clock()
    return now + max(0.0, hold.lease.valid_until - now) / 2


class _Timer:
    """One thread that extends the threads' handed holds when they fall due."""

    def __init__(self) -> None:
        self._heap: list[tuple[float, int, Hold]] = []
        self._cond = threading.Condition()
        self._order = itertools.count()
        self._thread: threading.Thread | None = None
        #: When the thread wakes next (inf: waiting for work).
        self._wakes_at = float("inf")

    def schedule(self, hold: Hold, at: float | None = None) -> None:
        """Extend ``hold`` at monotonic time ``at`` (default: when it falls due)."""
        if at is None:
            at = _due(hold)
        with self._cond:
            heapq.heappush(self._heap, (at, next(self._order), hold))
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._run, name="redlock-confirm", daemon=True
                )
                self._thread.start()
            elif at < self._wakes_at:
                self._cond.notify()

    def _next(self) -> list[Hold] | None:
        """Wait for the holds that fall due; None when idle long enough to end."""
        with self._cond:
            while True:
                now = _clock()
                if not self._heap:
                    self._wakes_at = float("inf")
                    if not self._cond.wait(IDLE) and not self._heap:
                        self._thread = None
                        return None
                    continue
                at = self._heap[0][0]
                if at <= now + BATCH:
                    due = []
                    while self._heap and self._heap[0][0] <= now + BATCH:
                        due.append(heapq.heappop(self._heap)[2])
                    return due
                self._wakes_at = at
                self._cond.wait(at - now)

    def _run(self) -> None:
        while (due := self._next()) is not None:
            for hold in due:
                if hold.confirming:
                    try:
                        _extend(hold)
                    except Exception:
                        logger.exception(
                            "redlock %r: extending a handed-over hold failed",
                            hold.config.spec.resource,
                        )


def _flow(hold: Hold) -> Any:
    """One extension of ``hold`` to its TTL."""
    spec = hold.config.spec
    return extend_flow(spec, hold.lease, spec.ttl, _clock)


def _extend(hold: Hold) -> None:
    """Extend ``hold`` to its TTL, unless released or extended already; a try that
    fails, or that meets a manual extend() under way, is scheduled again."""
    if not hold.extending.acquire(blocking=False):
        _again(hold, None)
        return
    try:
        if not hold.confirming:
            return
        config = hold.config
        pools = nodes.sync_pools(config.nodes, config.node_timeout)
        try:
            extension = sync.run(_flow(hold), pools, config.node_timeout)
        except LockLostError as exc:
            hold.confirming = False
            report_lost(hold, str(exc), type(hold.lock))
            return
    finally:
        hold.extending.release()
    _again(hold, extension.valid_until)


def _again(hold: Hold, valid_until: float | None) -> None:
    """After a try: schedule the next one on the timer thread, if one is due."""
    delay = _next_try(hold, valid_until)
    if delay is not None:
        _timer.schedule(hold, _clock() + delay)


def _next_try(hold: Hold, valid_until: float | None) -> float | None:
    """Seconds until ``hold``'s next try, or None when it is done: extended to
    ``valid_until``, released, extended by its owner, or out of time."""
    if not hold.confirming:
        return None
    if valid_until is not None:
        hold.confirming = False
        signals.send(
            signals.lock_extended,
            type(hold.lock),
            lock=hold.lock,
            resource=hold.config.spec.resource,
            validity=valid_until - _clock(),
        )
        return None
    delay = confirm_retry_delay(hold.config.spec, hold.lease, _clock(), _jitter)
    if delay is None:
        hold.confirming = False
        logger.warning(
            "redlock %r: a handed-over hold could not be extended to its TTL; its "
            "lease ends in %.3fs",
            hold.config.spec.resource,
            max(0.0, hold.lease.valid_until - _clock()),
        )
    return delay


_timer = _Timer()


def schedule(hold: Hold) -> None:
    """Extend a thread's handed-over ``hold`` halfway through its lease."""
    hold.confirming = True
    _timer.schedule(hold)


def schedule_task(hold: Hold) -> None:
    """Extend a task's handed-over ``hold`` halfway through its lease, from a
    task on the running loop (tried again while the handed lease lasts)."""
    hold.confirming = True
    delay: float | None = _due(hold) - _clock()
    pid = os.getpid()

    async def confirm() -> None:
        nonlocal delay
        while delay is not None:
            await asyncio.sleep(delay)
            async with hold.aextending():
                # A forked child running the loop it inherited: the hold is the
                # parent's, which may have extended it since (not seen here).
                if not hold.confirming or os.getpid() != pid:
                    return
                config = hold.config
                clients = nodes.async_clients(config.nodes, config.node_timeout)
                try:
                    extension = await aio.run(_flow(hold), clients, config.node_timeout)
                except LockLostError as exc:
                    hold.confirming = False
                    report_lost(hold, str(exc), type(hold.lock))
                    return
            delay = _next_try(hold, extension.valid_until)

    hold.confirm_task = asyncio.ensure_future(confirm())


def cancel(hold: Hold) -> None:
    """The hold is being released: no extension is due any more."""
    hold.confirming = False
    task: Any = hold.confirm_task
    if task is not None:
        hold.confirm_task = None
        with contextlib.suppress(RuntimeError):  # its loop closed
            task.cancel()


def _forget_parent_timer() -> None:
    """In a forked child: the parent's thread and holds are not the child's."""
    global _timer
    _timer = _Timer()


os.register_at_fork(after_in_child=_forget_parent_timer)
