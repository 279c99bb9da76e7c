"""The subscriber connections that bring wake-ups, and the one thread that reads them.

A process keeps one subscriber connection per node for each set of nodes its locks
use (one ``Link`` each), read by one ``Reader`` thread: a release arrives as one
message per node, and a thread per node would wake once each. A connection is made
in a short-lived thread of its own, so a node whose connect hangs (a partitioned
host) does not hold up the others' messages; a pipe interrupts the reader's poll
when it is ready. What the messages mean, and whom they wake, is ``wake.Hub``'s.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import select
import threading
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import redis

from .interrupts import reraise_interruption
from .nodes import describe
from .wire import pending_replies

if TYPE_CHECKING:
    from .wake import Hub

__all__ = ["POLL", "Link", "Reader"]

logger = logging.getLogger("redlock_django.wake")

#: Longest the reader waits for messages before it looks for idle channels.
POLL = 0.2
#: How often a connection class without a socket to poll() is looked at.
BLIND_POLL = 0.005
#: Pause between attempts to reconnect to a node that is down.
RECONNECT = 0.5


class Link:
    """One node's subscriber connection, read by its hub's reader thread."""

    def __init__(self, hub: Hub, index: int, pool: redis.ConnectionPool) -> None:
        self.hub = hub
        self.index = index
        self.pool = pool
        #: Channels this node confirmed; read by the releasing side, written here.
        self.subscribed: set[bytes] = set()
        self._asked: set[bytes] = set()
        self._conn: Any = None
        self._send_lock = threading.Lock()
        self._warned = False
        #: Monotonic time before which no new connection is tried.
        self.retry_at = -math.inf
        #: A connection is being made (in a thread of its own).
        self.connecting = False
        #: The reader ended: a connection made now is closed at once.
        self.closed = False

    def ask(self, channels: Sequence[bytes]) -> None:
        """Subscribe to ``channels`` now if connected (else at the next connect)."""
        with self._send_lock:
            conn = self._conn
            # A generator, not a comprehension: on Python 3.13 a signal handler's
            # exception raised in one skipped the with block's exit, and the lock
            # stayed held (tests/test_back_edges.py).
            fresh = list(c for c in channels if c not in self._asked)
            if conn is None or not fresh:
                return
            self._asked.update(fresh)
            try:
                conn.send_command("SUBSCRIBE", *fresh)
            except Exception as exc:
                # The reader sees the broken socket on its next read and reconnects.
                self._asked.difference_update(fresh)
                reraise_interruption(exc)  # asked from the waiter's thread

    def connect(self) -> None:
        """Connect and subscribe to the wanted channels (in a thread of its own:
        a node that does not answer must not hold up the others' messages)."""
        conn = self.pool.connection_class(**self.pool.connection_kwargs)
        try:
            conn.connect()
        except Exception as exc:
            self.warn(f"cannot connect: {describe(exc)}")
            self.retry_at = time.monotonic() + RECONNECT
            return
        with self._send_lock:
            if self.closed:
                conn.disconnect()
                return
            self._conn = conn
            self._asked = set()
        self.ask(sorted(self.hub.wanted()))

    def close(self) -> None:
        with self._send_lock:
            self.closed = True
        self.drop()

    def warn(self, why: str) -> None:
        # Once per outage: a node that is down is normal operation; waiters fall
        # back to their timed retries meanwhile.
        if not self._warned:
            self._warned = True
            logger.info("redlock wake-ups from node %d paused: %s", self.index, why)

    def drop(self, why: str | None = None) -> None:
        if why is not None:
            self.warn(why)
            self.retry_at = time.monotonic() + RECONNECT
        with self._send_lock:
            conn, self._conn = self._conn, None
            self._asked = set()
        self.subscribed = set()
        if conn is not None:
            conn.disconnect()

    def prune(self, wanted: set[bytes]) -> None:
        stale = sorted((self._asked | self.subscribed) - wanted)
        if not stale:
            return
        with self._send_lock:
            self._asked.difference_update(stale)
            conn = self._conn
            if conn is not None:
                conn.send_command("UNSUBSCRIBE", *stale)

    def fileno(self) -> int | None:
        sock = getattr(self._conn, "_sock", None)
        try:
            return sock.fileno() if sock is not None else None
        except Exception:
            return None

    def drain(self) -> None:
        """Read every reply that has arrived (the socket's and the buffers')."""
        conn = self._conn
        if conn is None:
            return
        for reply in pending_replies(conn):
            self.on_reply(reply)
            self._warned = False

    def on_reply(self, reply: Any) -> None:
        if not isinstance(reply, list) or len(reply) < 3:
            return
        kind, channel = reply[0], reply[1]
        if kind == b"message":
            self.hub.deliver(channel, reply[2], self.index)
        elif kind == b"subscribe":
            self.subscribed.add(channel)
            self.hub.confirmed(channel)
        elif kind == b"unsubscribe":
            self.subscribed.discard(channel)


class Reader(threading.Thread):
    """Reads every node's subscriber connection of one hub, in one thread.

    One thread for all the nodes, not one each: a release reaches a waiter as one
    message per node, and one poll() that sees several of them wakes one thread
    once, where a thread per node woke five, each taking the GIL in turn.
    """

    def __init__(self, hub: Hub) -> None:
        super().__init__(name=f"redlock-wake-{id(hub):x}", daemon=True)
        self.hub = hub
        #: One per node, this reader's own: a reader that is ending drops them
        #: while the next one (started by a new waiter) connects its own.
        self.links = [Link(hub, i, pool) for i, pool in enumerate(hub.pools)]
        # A connection made in its own thread interrupts the poll through a pipe,
        # made when the thread runs: a start that fails or is interrupted (a
        # signal handler's exception) leaves no descriptor behind.
        self._notify_r = self._notify_w = -1
        self._notify_lock = threading.Lock()
        self._alive = False
        self._poller = select.poll()
        #: The descriptors registered with the poller, and their links.
        self._polled: dict[int, Link] = {}

    def run(self) -> None:
        # Whether to go on, and which channels to drop, is looked at once per
        # POLL, not per message: under contention messages come thousands of
        # times a second, and each look builds the set of wanted channels.
        links = self.links
        looked = -POLL
        try:
            try:
                with self._notify_lock:
                    self._notify_r, self._notify_w = os.pipe()
                    self._alive = True
            except OSError as exc:
                # Out of descriptors (EMFILE): wake-ups are a hint, the waiters
                # sleep out their retries; the slot is freed below.
                logger.info("redlock wake-ups off for now: %s", exc)
                return
            os.set_blocking(self._notify_r, False)
            os.set_blocking(self._notify_w, False)
            self._poller.register(self._notify_r, select.POLLIN)
            while True:
                now = time.monotonic()
                if now - looked >= POLL:
                    if not self.hub.keep(self):
                        break
                    looked = now
                    wanted = self.hub.wanted()
                    for link in links:
                        if link._conn is None:
                            if now >= link.retry_at and not link.connecting:
                                link.connecting = True
                                threading.Thread(
                                    target=self._connect,
                                    args=(link,),
                                    name=f"{self.name}-connect-{link.index}",
                                    daemon=True,
                                ).start()
                            continue
                        try:
                            link.prune(wanted)
                        except Exception as exc:
                            link.drop(describe(exc))
                due = self.hub.overdue()
                wait = POLL if due is None else min(POLL, due - time.monotonic())
                for link in self._ready(links, max(0.0, wait)):
                    try:
                        link.drain()
                    except Exception as exc:
                        link.drop(describe(exc))
        finally:
            # However it ended (even by an unexpected error), the hub's slot is
            # freed: a dead reader must not leave its nodes without wake-ups.
            self.hub.forget(self)
            with self._notify_lock:
                if self._alive:
                    self._alive = False
                    os.close(self._notify_r)
                    os.close(self._notify_w)
            for link in links:
                link.close()

    def _ready(self, links: list[Link], wait: float) -> list[Link]:
        """Wait up to ``wait`` for replies; return the links that may have some."""
        fds: dict[int, Link] = {}
        ready: list[Link] = []  # connected, but without a descriptor to poll
        for link in links:
            if link._conn is not None:
                fd = link.fileno()
                if fd is None:
                    ready.append(link)
                else:
                    fds[fd] = link
        # The poller is kept while the descriptors stay the same (nearly always):
        # after a wake-up this thread goes back to poll(), letting go of the GIL
        # for the waiter it woke, without building one anew.
        polled = self._polled
        if fds != polled:
            poller = self._poller
            for fd in polled.keys() - fds.keys():
                poller.unregister(fd)
            for fd in fds.keys() - polled.keys():
                poller.register(fd, select.POLLIN)
            self._polled = fds
        wait = min(wait, BLIND_POLL) if ready else wait
        for fd, _ in self._poller.poll(math.ceil(wait * 1000)):
            if fd == self._notify_r:
                with contextlib.suppress(OSError):
                    os.read(fd, 64)
            elif (found := fds.get(fd)) is not None:
                ready.append(found)
        return ready

    def _connect(self, link: Link) -> None:
        try:
            link.connect()
        finally:
            link.connecting = False
            # Interrupt the poll, so that the new connection is read at once.
            with self._notify_lock:
                if self._alive:
                    with contextlib.suppress(OSError):
                        os.write(self._notify_w, b"!")
