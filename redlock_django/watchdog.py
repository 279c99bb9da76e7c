"""The watchdog: extends one hold's lease in the background until stopped.

A daemon thread for holds taken by a thread, an asyncio task for holds taken by
a task. It runs ``protocol.watchdog_flow`` and holds the hold's extension lock
from the end of each sleep to the next, so it never overlaps a manual extend().
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
import os
import random
import threading
import time
import weakref
from typing import Any, cast

from . import aio, nodes, signals, sync
from .holds import Hold, report_lost
from .protocol import watchdog_flow

__all__ = ["Watchdog"]

# The messages keep the logger they always had, so logging settings still apply.
logger = logging.getLogger("redlock_django.lock")

_clock = time.monotonic
_jitter = random.random


class Watchdog:
    """Extends one hold's lease in the background until stopped."""

    def __init__(self, hold: Hold, owner: object, sender: type) -> None:
        self.hold = hold
        #: The ``sender`` of the signals (``Redlock``): passed in, as lock.py
        #: imports this module.
        self._sender = sender
        # Weak, so an owner that ended without releasing stops the extensions
        # instead of keeping its lock alive until max_hold (or forever).
        self._owner = weakref.ref(owner)
        self._stop = threading.Event()
        #: A forked child inherits a running watchdog task (not thread) with the
        #: event loop: it must never extend its parent's lease.
        self._pid = os.getpid()
        self._valid_until = hold.lease.valid_until
        self._thread: threading.Thread | None = None
        self._task: asyncio.Task[None] | None = None
        #: Whether this watchdog holds its hold's ``extending`` lock (it does from
        #: the end of each sleep until the next one: around its extensions).
        self._extending = False

    def _flow(self) -> Any:
        config = self.hold.config
        return watchdog_flow(
            config.spec, self.hold.lease, config.max_hold, _clock, _jitter
        )

    def _forked(self) -> bool:
        """Whether this runs in a forked child (its copy of a watchdog task that
        was mid-extension at the fork): the hold is the parent's, so the child
        says nothing about it."""
        return os.getpid() != self._pid

    def _report(self) -> None:
        if self._forked():
            return
        lease = self.hold.lease
        if lease.lost is not None:
            logger.error(
                "redlock %r lost: %s",
                self.hold.config.spec.resource,
                lease.lost,
            )
            report_lost(self.hold, lease.lost, self._sender)
        elif not self._stop.is_set():
            logger.warning(
                "redlock %r: auto-extension stopped at max_hold=%ss",
                self.hold.config.spec.resource,
                self.hold.config.max_hold,
            )

    def _crashed(self) -> None:
        """An unexpected error ended the extensions: the lease can no longer be
        trusted, so the holder learns it lost the lock."""
        if self._forked():
            return
        logger.exception("redlock %r watchdog failed", self.hold.config.spec.resource)
        self.hold.lease.lost = "the watchdog failed"
        report_lost(self.hold, self.hold.lease.lost, self._sender)

    # Blocking: a daemon thread whose sleeps end early when stopped.

    def start_thread(self) -> None:
        # In a copy of the acquirer's context, as the asyncio task runs (and as
        # asyncio.to_thread does): signal receivers see the acquirer's trace.
        context = contextvars.copy_context()
        self._thread = threading.Thread(
            target=context.run,
            args=(self._run_thread,),
            name=f"redlock-watchdog:{self.hold.config.spec.resource}",
            daemon=True,
        )
        self._thread.start()

    def _owner_gone(self) -> bool:
        if self._forked():
            return True
        owner = self._owner()
        if owner is None:
            return True
        if isinstance(owner, threading.Thread):
            return not owner.is_alive()
        return cast(asyncio.Task[Any], owner).done()

    def _note_extension(self) -> None:
        """Signal the watchdog's own extensions: the lease grew since the end of
        its last sleep (an owner's extend() or a confirmation meanwhile signalled
        itself, and is not counted: ``_baseline``)."""
        if self._forked():
            return
        lease = self.hold.lease
        grown = lease.valid_until > self._valid_until
        self._valid_until = lease.valid_until
        if grown:
            signals.send(
                signals.lock_extended,
                self._sender,
                lock=self.hold.lock,
                resource=self.hold.config.spec.resource,
                validity=lease.valid_until - _clock(),
            )

    def _baseline(self) -> None:
        """Note the lease as the watchdog finds it, holding the extension lock."""
        self._valid_until = self.hold.lease.valid_until

    def _let_go(self) -> None:
        """Let manual extensions run again (the watchdog is about to sleep)."""
        if self._extending:
            self._extending = False
            if self._task is not None:
                self.hold.aextending().release()
            else:
                self.hold.extending.release()

    def _sleep(self, seconds: float) -> None:
        # The wait was reckoned before the lock_extended receivers ran: a slow one
        # must not push the next extension past the lease.
        began = _clock()
        self._note_extension()
        self._let_go()
        seconds = max(0.0, seconds - (_clock() - began))
        if self._stop.wait(seconds) or self._owner_gone():
            raise _Stopped
        # A manual extend() under way finishes first; the flow then reads the
        # lease it left.
        self.hold.extending.acquire()
        self._extending = True
        self._baseline()
        if self._stop.is_set():
            raise _Stopped

    async def _asleep(self, seconds: float) -> None:
        began = _clock()
        self._note_extension()
        self._let_go()
        await asyncio.sleep(max(0.0, seconds - (_clock() - began)))
        if self._stop.is_set() or self._owner_gone():
            raise _Stopped
        await self.hold.aextending().acquire()
        self._extending = True
        self._baseline()
        if self._stop.is_set():
            raise _Stopped

    def _run_thread(self) -> None:
        config = self.hold.config
        pools = nodes.sync_pools(config.nodes, config.node_timeout)
        try:
            sync.run(self._flow(), pools, config.node_timeout, sleep=self._sleep)
            self._note_extension()  # the last one, at max_hold
        except _Stopped:
            return
        except Exception:
            self._crashed()
            return
        finally:
            self._let_go()
        self._report()

    # asyncio: a task, cancelled when stopped.

    def start_task(self) -> None:
        self._task = asyncio.ensure_future(self._run_task())

    async def _run_task(self) -> None:
        config = self.hold.config
        clients = nodes.async_clients(config.nodes, config.node_timeout)
        try:
            await aio.run(self._flow(), clients, config.node_timeout, self._asleep)
            self._note_extension()  # the last one, at max_hold
        except _Stopped:
            return
        except asyncio.CancelledError:
            if self._stop.is_set():
                return
            raise
        except Exception:
            self._crashed()
            return
        finally:
            self._let_go()
        self._report()

    def halt(self) -> None:
        """Stop extending without waiting: the thread or task ends on its own."""
        self._stop.set()
        if self._task is not None and not self._task.done():
            self._task.cancel()

    def stop(self) -> None:
        """Stop extending, and wait for an extension under way to end."""
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join()

    async def astop(self) -> None:
        self._stop.set()
        task = self._task
        if task is not None and not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        elif self._thread is not None:
            await asyncio.to_thread(self.stop)


class _Stopped(Exception):
    """Raised in the watchdog thread's sleep when the hold was released."""
