"""Wake waiters when a lock is released, instead of letting them sleep out a retry.

A release publishes on the lock's key, used as a pub/sub channel, on every node
where it deleted the key. Each process keeps one subscriber connection per node,
and multiplexes every channel its waiters need over it: a thousand waiting
resources cost five connections, not five thousand. One thread reads all of them
(``readers.py``). Blocking waiters are woken through a ``threading.Event``,
asyncio waiters through their loop, so one reader serves both APIs.

A release of a lock that is not fair names the first waiter on the lock's
waiting list (``scripts._WAITING``: the waiters the nodes refused, by arrival),
on the lock's channel: every waiting process hears it, and only that waiter is
woken, whatever process it is in. One that names nobody (the list is empty: an
older client's waiters, a forced release) wakes one waiter of each process:
the first of the process's waiters on that lock that is not already woken. Woken
all, each would make an attempt on every node, and one at most can win: with
tens of waiting threads or tasks in a process, the attempts would crowd out the
holder. The woken waiter's attempt keeps the others going, won or failed: its
release wakes the next, its failure leaves it first for the next release; one
that stops before its attempt was answered passes the wake-up on
(``Hub.unwatch``).

A release of a fair lock names the next waiter, and publishes that name on a
channel of the waiter's process alone (``process_tag``; the waiter's queue id
carries the tag): the other processes waiting for the lock are not disturbed by
a release that is not for them.

A wake-up is a hint, never a grant: the woken waiter simply tries again at once.
The one exception is a fair lock's hand-off: a release that wrote the lock for the
waiter it names says so in its message, and a majority of such messages is the
waiter's grant (``protocol._handed``), delivered with the wake-up. The timed retry
stays as the fallback, so a missed message (a node down, a lock
that expired instead of being released) costs at most one retry delay. A channel
stays subscribed for ``LINGER`` seconds after its last waiter left, so a lock under
steady contention is not re-subscribed on every wait, and the reader thread ends
when nothing is left to watch.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import secrets
import threading
import time
from collections.abc import Sequence
from typing import Any

import redis
from django.core.signals import setting_changed

from .address import NodeSpec
from .interrupts import reraise_interruption
from .nodes import sync_pools
from .protocol import LockSpec
from .readers import Reader

__all__ = [
    "AsyncWatch",
    "Hub",
    "SyncWatch",
    "handoff_defer",
    "hub",
    "note_handoff",
    "process_tag",
    "reset",
]

logger = logging.getLogger(__name__)

#: Seconds a channel stays subscribed after its last waiter stopped waiting.
LINGER = 2.0
#: Release ids remembered per channel: one release publishes on every node, and
#: waking a waiter once per node would only send it retries that cannot win. A
#: process's own channel carries the releases of every fair lock it waits for,
#: many of them in flight at once: one forgotten before a majority reported it
#: would wake nobody.
SEEN = 512
#: How long a waiter named by fewer than a majority of a release's messages waits
#: for the rest before it is woken all the same. A release's messages may reach
#: this process tens of milliseconds apart (a slow link to some nodes, a holder
#: descheduled mid-release, many releases in flight at once, a busy reader), and
#: an attempt made before the rest arrived is refused by the nodes still held:
#: the hand-off is lost and the attempt wasted. Only when the nodes name different
#: next waiters (their queues differ for a moment while two ticket draws race;
#: each node tells only the process of the one it names) does no process hear a
#: majority, and the lock waits this long for an attempt.
GRACE = 0.1
#: Shortest pause before re-acquiring a lock this process just released to waiters.
HANDOFF_GRACE = 0.002


class _Watch:
    """One waiter's interest in a channel (``waiter``: its id in a fair queue)."""

    def __init__(self, channel: bytes, waiter: str | None = None) -> None:
        self.channel = channel
        self.waiter = waiter.encode() if waiter else None
        #: Set until the subscription is confirmed: the waiter's last attempt ran
        #: before it could hear a release, so the confirmation wakes it once
        #: (``Hub.confirmed``).
        self.fresh = True
        #: Set until every node confirmed it: a release that reached a node
        #: before the node took the subscription told nobody there, and the
        #: majority of reports it needs may never come. The confirmation that
        #: completes the set wakes it (again, if ``GRACE`` ran out before): its
        #: attempt finds the lock free on each node where that release was lost.
        self.partial = True
        #: A release's hand-off to this waiter: node index -> the message's
        #: details, set before the wake-up that delivers it.
        self.handed: dict[int, str] | None = None
        #: Set when a release naming nobody woke this waiter alone of its
        #: process, until the attempt that follows the wake-up is answered
        #: (``Hub.attempted``): one that stops watching before then passes the
        #: wake-up on (``Hub.unwatch``), and later releases wake another (with
        #: none left, this one again once its wait has returned: ``given``).
        self.pending = False
        #: How many such wake-ups it was given, and how many of them its last
        #: wait had seen: one given since then is not used up by that attempt.
        self.given = 0
        self.seen = 0

    def _woken(self, woken: bool) -> Any:
        """What a wait returns: the hand-off if one came with the wake-up.

        A watch ``pending`` (woken alone) or given a hand-off was woken, though
        its wait timed out and cleared the event (the wake-up landing between
        the wait's last look and the clearing): the attempt that follows uses a
        pending wake-up up, and a hand-off is the waiter's grant.
        """
        self.seen = self.given
        woken = woken or self.pending or self.handed is not None
        handed, self.handed = self.handed, None
        return handed if woken and handed else woken

    def fire(self) -> None:
        raise NotImplementedError


class SyncWatch(_Watch):
    """A blocking waiter: ``wait()`` returns early when the lock may be free."""

    def __init__(self, channel: bytes, waiter: str | None = None) -> None:
        super().__init__(channel, waiter)
        self._event = threading.Event()

    def fire(self) -> None:
        self._event.set()

    def wait(self, seconds: float) -> Any:
        """Wait up to ``seconds``; return whether a wake-up ended the wait (or
        the hand-off it brought: ``_Watch.handed``)."""
        # A set() that races the timeout still counts: wait() can return False
        # with the event set.
        woken = self._event.wait(seconds) or self._event.is_set()
        # Cleared before the next attempt: a release during that attempt sets it
        # again, so the wait after a failed attempt does not miss it.
        self._event.clear()
        return self._woken(woken)


class AsyncWatch(_Watch):
    """An asyncio waiter, woken from a reader thread through its event loop."""

    def __init__(self, channel: bytes, waiter: str | None = None) -> None:
        super().__init__(channel, waiter)
        self._loop = asyncio.get_running_loop()
        self._event = asyncio.Event()

    def fire(self) -> None:
        # A closed loop has nobody waiting any more.
        with contextlib.suppress(RuntimeError):
            self._loop.call_soon_threadsafe(self._event.set)

    async def wait(self, seconds: float) -> Any:
        """Wait up to ``seconds``; return whether a wake-up ended the wait (or
        the hand-off it brought: ``_Watch.handed``)."""
        try:
            async with asyncio.timeout(seconds):
                await self._event.wait()
            woken = True
        except TimeoutError:
            # A wake-up delivered while the loop was busy (the timeout expired by
            # then too) is still a wake-up, with its hand-off.
            woken = self._event.is_set()
        self._event.clear()
        return self._woken(woken)


class Hub:
    """The waiters of one process on one set of nodes, and their readers."""

    def __init__(self, pools: Sequence[redis.ConnectionPool]) -> None:
        self.pools = tuple(pools)
        self._lock = threading.Lock()
        #: channel -> its watches, in the order they started (a dict as an
        #: ordered set): a release naming nobody wakes the first one free
        self._watches: dict[bytes, dict[_Watch, None]] = {}
        #: channel -> monotonic time its last waiter left
        self._idle: dict[bytes, float] = {}
        #: channel -> release id -> per waiter named (b"" for none), the nodes
        #: that reported it; None once the release woke its waiter(s)
        self._seen: dict[bytes, dict[bytes, dict[bytes, set[int]] | None]] = {}
        #: channel -> (monotonic time, waiter named) of its last release that woke
        self._last: dict[bytes, tuple[float, bytes]] = {}
        #: waiter -> monotonic time a release last woke it by name (a process's
        #: channel names many waiters, so its last release says little of one)
        self._called: dict[bytes, float] = {}
        #: (channel, release id) -> monotonic time by which a release heard from
        #: fewer than a majority wakes the waiters it named anyway (``GRACE``)
        self._partial: dict[tuple[bytes, bytes], float] = {}
        #: Channels confirmed by some nodes, not all: when their fresh waiters
        #: are woken all the same (``confirmed``).
        self._confirming: dict[bytes, float] = {}
        #: (channel, release id, waiter) -> node index -> the hand-off details
        #: of a release not yet heard from a majority (see ``deliver``)
        self._handed: dict[tuple[bytes, bytes, bytes], dict[int, str]] = {}
        self._quorum = len(self.pools) // 2 + 1
        self._reader: Reader | None = None
        self._closed = False

    def close(self) -> None:
        """Stop the reader (within ``readers.POLL``); waiters fall back to their
        timers."""
        with self._lock:
            self._closed = True

    def watch(self, watch: _Watch, since: float | None = None) -> _Watch:
        """Start delivering wake-ups for ``watch.channel`` to ``watch``.

        A release for it heard after monotonic time ``since`` wakes it at once:
        the waiter's last attempt could not see it, and it was not yet listening.
        An exception raised in here (a signal handler's) leaves the watch for the
        caller's ``unwatch`` and no reader slot taken by a thread never started.
        """
        channel = watch.channel
        missed = False
        new = False
        reader: Reader | None = None
        try:
            with self._lock:
                self._watches.setdefault(channel, {})[watch] = None
                self._idle.pop(channel, None)
                last = self._last.get(channel)
                if since is not None and last is not None and last[0] > since:
                    missed = last[1] == b""
                if since is not None and watch.waiter is not None:
                    missed = missed or self._called.get(watch.waiter, since) > since
                if self._closed:
                    if missed:
                        watch.fire()
                    return watch
                reader = self._reader
                if reader is None:
                    new = True
                    reader = self._reader = Reader(self)
                heard = [channel in link.subscribed for link in reader.links]
                watch.fresh = not any(heard)
                watch.partial = not all(heard)
            if new:
                reader.start()
        except BaseException as exc:
            if not new:
                raise
            # No thread now (a pids limit, a burst of threads), or a signal
            # handler's exception (Ctrl-C, a soft time limit) ended start() or
            # came before it: the slot is freed, so the next waiter starts a
            # reader. A thread that did start is then not the hub's, and ends
            # (``keep``); one that never runs opened nothing (its pipe is made
            # when it runs).
            with self._lock:
                if self._reader is reader:
                    self._reader = None
            # Landing as the thread started, the handler's exception comes out of
            # start() as a KeyError (CPython takes the running thread out of
            # threading._limbo a second time): the caller gets the interruption.
            reraise_interruption(exc)
            if not isinstance(exc, RuntimeError):
                raise
            # Wake-ups are a hint: this waiter sleeps out its retry.
            logger.info("redlock wake-ups off for now: %s", exc)
        if not new and reader is not None:
            for link in reader.links:
                link.ask([channel])
        if missed:
            watch.fire()
        return watch

    def idle(self) -> bool:
        """Whether nothing is watched and no reader runs: nothing worth keeping."""
        with self._lock:
            return not self._watches and self._reader is None

    def forget(self, reader: Reader) -> None:
        """Free the slot of a reader that ended, so the next waiter starts another."""
        with self._lock:
            if self._reader is reader:
                self._reader = None

    def unwatch(self, watch: _Watch) -> None:
        """Stop waking ``watch``; its channel lingers subscribed for a while.

        A watch woken alone for a release that names nobody, that stops before
        the attempt that follows was answered (cancelled or interrupted while it
        waited or attempted, or granted by an attempt already under way), passes
        the wake-up on to the next waiter of the channel, which would otherwise
        sleep out its retry delay with the lock maybe free. A second call does
        nothing: a caller interrupted in here (a signal handler's exception)
        calls it again, or the watch would stay a waiter this process counts
        for good.
        """
        channel = watch.channel
        passed: _Watch | None = None
        with self._lock:
            watches = self._watches.get(channel)
            if watches is None or watch not in watches:
                if watches is not None and not watches:
                    del self._watches[channel]  # a watch() interrupted before add
                return
            if len(watches) > 1:
                del watches[watch]
                if watch.pending:
                    watch.pending = False
                    passed = _first_free(watches)
                    if passed is not None:
                        passed.pending = True
                        passed.given += 1
            else:
                del self._watches[channel]  # the watch and its channel in one step
                self._idle[channel] = time.monotonic()
        if passed is not None:
            passed.fire()

    def attempted(self, watch: _Watch) -> None:
        """An attempt of ``watch``'s waiter was answered: the wake-up it was
        given alone, if any, is used up, unless another came since its wait."""
        if watch.pending:
            with self._lock:
                if watch.given == watch.seen:
                    watch.pending = False

    def waiting(self, channel: bytes) -> int:
        """How many waiters of this process watch ``channel``."""
        with self._lock:
            return len(self._watches.get(channel, ()))

    def listening(self, index: int, channel: bytes) -> bool:
        """Whether this process's reader on node ``index`` is subscribed."""
        reader = self._reader
        return reader is not None and channel in reader.links[index].subscribed

    def wanted(self) -> set[bytes]:
        """Channels with waiters, or whose last waiter left less than LINGER ago."""
        now = time.monotonic()
        with self._lock:
            for channel, since in list(self._idle.items()):
                if now - since >= LINGER:
                    del self._idle[channel]
                    self._seen.pop(channel, None)
                    self._last.pop(channel, None)
            for waiter, at in list(self._called.items()):
                if now - at >= LINGER:
                    del self._called[waiter]
            return set(self._watches) | set(self._idle)

    def keep(self, reader: Reader) -> bool:
        """Whether ``reader`` still has work; a reader told no is forgotten.

        A reader that is not the hub's (its start was interrupted, and another
        took the slot, or none yet) is told no: one reader per hub.
        """
        wanted = self.wanted()
        with self._lock:
            if self._reader is not reader:
                return False
            if not self._closed and (wanted or self._watches):
                return True
            if self._reader is reader:
                self._reader = None
            return False

    def confirmed(self, channel: bytes) -> None:
        """A node confirmed ``channel``: once every node has, wake its waiters
        that could not hear them all yet; until then, wake those that could hear
        none ``GRACE`` after the first confirmation (``overdue``: a node that is
        down never confirms). One wake-up, not one per node, in the common case."""
        reader = self._reader
        complete = reader is not None and all(
            channel in link.subscribed for link in reader.links
        )
        woken = []
        with self._lock:
            watches = self._watches.get(channel, ())
            if complete:
                self._confirming.pop(channel, None)
                woken = [w for w in watches if w.fresh or w.partial]
                for watch in woken:
                    watch.fresh = watch.partial = False
            elif any(w.fresh for w in watches):
                self._confirming.setdefault(channel, time.monotonic() + GRACE)
        for watch in woken:
            watch.fire()

    def deliver(self, channel: bytes, message: bytes, index: int) -> None:
        """Node ``index`` published ``message``: wake waiters once per release.

        The message is ``<release id>`` (then the first waiter of this process
        not yet woken is woken, the others keep sleeping) or ``<release id>
        <waiter>`` (a fair lock's, or a lock with a waiting list): then only that
        waiter is woken. A
        release that handed the lock to the waiter adds the details
        (``protocol._handed``), which reach the waiter with its wake-up.
        Once, when a majority of the nodes reported it (or every node subscribed,
        if fewer are): a release reaches the nodes one by one, and a waiter woken
        by the first message would try while most nodes still hold the key, fail,
        and then sleep out its retry delay, deaf to the release's later messages.
        Nodes that name different waiters (a queue entry missing on some) wake
        each waiter named once all subscribed nodes reported.
        """
        release, _, named = message.partition(b" ")
        named, _, details = named.partition(b" ")
        reader = self._reader
        links = reader.links if reader is not None else ()
        subscribed = sum(1 for link in links if channel in link.subscribed)
        need = max(1, min(self._quorum, subscribed))
        with self._lock:
            if channel not in self._watches and channel not in self._idle:
                # Dropped (its last waiter left LINGER ago), heard before the node
                # took the UNSUBSCRIBE: no state is kept for it again.
                return
            seen = self._seen.setdefault(channel, {})
            if release not in seen:
                if len(seen) >= SEEN:
                    del seen[next(iter(seen))]
                seen[release] = {}
            reports = seen[release]
            if reports is None:
                return
            reports.setdefault(named, set()).add(index)
            if details:
                key = (channel, release, named)
                if key not in self._handed and len(self._handed) >= SEEN:
                    del self._handed[next(iter(self._handed))]
                self._handed.setdefault(key, {})[index] = details.decode()
            now = time.monotonic()
            handing = len(self._handed.get((channel, release, named), ()))
            if len(reports[named]) >= need and (
                # Some nodes handed the lock over: the others, whose messages
                # came first without a hand-off (a node that lost the waiter's
                # record), cannot make it one; those still to come may.
                not 0 < handing < self._quorum or len(reports[named]) >= subscribed
            ):
                names = {named}
            elif len(reports[named]) >= need:
                self._partial.setdefault((channel, release), now + GRACE)
                return
            else:
                everyone = set().union(*reports.values())
                if len(everyone) < max(need, subscribed):
                    if named:
                        self._partial.setdefault((channel, release), now + GRACE)
                    return
                names = set(reports)
            seen[release] = None
            self._partial.pop((channel, release), None)
            if b"" in names:
                self._last[channel] = (now, b"")
            for name in names - {b""}:
                self._called[name] = now
            # A release naming nobody (a barging lock's) wakes one waiter of
            # this process, the first to start waiting that is not woken yet:
            # each would make an attempt on every node, and one at most can
            # win. Its failed attempt leaves it first for the next release.
            channel_watches = self._watches.get(channel, {})
            watches = [
                w for w in channel_watches if w.waiter is not None and w.waiter in names
            ]
            if b"" in names:
                first = _first_free(channel_watches)
                if first is not None and first not in watches:
                    first.pending = True
                    first.given += 1
                    watches.append(first)
            for name in names:
                handed = self._handed.pop((channel, release, name), None)
                for watch in watches:
                    if handed and watch.waiter == name:
                        watch.handed = handed
        for watch in watches:
            watch.fire()

    def overdue(self) -> float | None:
        """Wake the waiters named by releases heard from too few nodes for
        ``GRACE``, and the fresh waiters of channels some node has not confirmed
        for as long (``confirmed``); return when the next such wake-up is due.

        The release stays open: should its majority still come, it wakes them
        again (one attempt too many, where a missed wake-up would cost a wait).
        """
        if not self._partial and not self._confirming:
            return None
        now = time.monotonic()
        woken = []
        with self._lock:
            for channel, due in list(self._confirming.items()):
                if due > now:
                    continue
                # Some node still has not confirmed: wake the waiters that heard
                # none yet; the confirmation that completes the set wakes them again.
                del self._confirming[channel]
                fresh = [w for w in self._watches.get(channel, ()) if w.fresh]
                for watch in fresh:
                    watch.fresh = False
                woken += fresh
            for key, due in list(self._partial.items()):
                if due > now:
                    continue
                del self._partial[key]
                channel, release = key
                reports = self._seen.get(channel, {}).get(release)
                names = set(reports or ()) - {b""}
                for name in names:
                    # Too few nodes handed it over: the attempt the wake-up
                    # starts takes their keys over (a later attempt of its own).
                    self._handed.pop((channel, release, name), None)
                for name in names:
                    self._called[name] = now
                woken += [
                    w for w in self._watches.get(channel, ()) if w.waiter in names
                ]
            left = min(
                [*self._partial.values(), *self._confirming.values()], default=None
            )
        for watch in woken:
            watch.fire()
        return left


def watching() -> int:
    """How many waiters of this process are watching a channel right now.

    Counted from the hubs' watches, not kept as a tally: a signal handler's
    exception between a tally and a watch could set them apart for good.
    Releases skip their hand-off checks when it is 0 and nobody elsewhere heard
    them (``note_handoff``).
    """
    return sum(
        len(watches)
        for found in list(_hubs.values())
        for watches in list(found._watches.values())
    )


def _first_free(watches: dict[_Watch, None]) -> _Watch | None:
    """The first of ``watches`` not already woken alone (``_Watch.pending``), else
    the first whose wait already returned with its wake-up: its attempt may have
    been refused before this release, so it must hear of it too."""
    attempting = None
    for watch in watches:
        if not watch.pending:
            return watch
        if attempting is None and watch.seen == watch.given:
            attempting = watch
    return attempting


#: By the id of the pools (a forked child starts with none: _forget_parent_hubs).
_hubs: dict[int, Hub] = {}
_hubs_lock = threading.Lock()


def hub(pools: Sequence[redis.ConnectionPool]) -> Hub:
    """Return this process's hub for ``pools`` (one per node set and process)."""
    key = id(pools)
    found = _hubs.get(key)
    # The pools' own tuple (nodes.sync_pools) is the hub's: no comparison.
    if found is None or (found.pools is not pools and found.pools != tuple(pools)):
        with _hubs_lock:
            found = _hubs.get(key)
            if found is None or found.pools != tuple(pools):
                if len(_hubs) > 64:  # pools replaced by settings changes, or forks
                    for stale, old in list(_hubs.items()):
                        if not old.idle():
                            continue  # a guard, for Python 3.13 (test_back_edges)
                        del _hubs[stale]
                found = _hubs[key] = Hub(pools)
    return found


def reset() -> None:
    """Close every hub, as when the nodes change; the next waiter starts anew."""
    with _hubs_lock:
        old = list(_hubs.values())
        _hubs.clear()
    for found in old:
        found.close()


def _watched() -> bool:
    """Whether a waiter of this process watches a channel (``watching()`` > 0),
    at the cost of a look per hub: every release asks."""
    return any(found._watches for found in list(_hubs.values()))


# lock identity -> monotonic time until which this process lets waiters take the
# lock it just released before trying again itself (see ``note_handoff``).
_handoffs: dict[tuple[Any, ...], float] = {}


def note_handoff(
    identity: tuple[Any, ...],
    spec: LockSpec,
    node_specs: Sequence[NodeSpec],
    node_timeout: float,
    listeners: Sequence[int],
    elapsed: float,
) -> None:
    """Remember a release that others were waiting for.

    A process that releases and re-acquires at once (a loop) would nearly always
    beat the waiters it just woke, whose retries start a message later: it defers
    its next attempt by a few of its own round trips instead, so the lock changes
    hands. Waiters are known from the release's subscriber counts (``listeners``,
    per node), less this process's own subscriptions, and from this process's own
    waiting threads/tasks.
    """
    if not any(listeners) and not _watched():
        return  # nobody here or elsewhere was waiting: the common case, no lookups
    channel = spec.key.encode()
    found = hub(sync_pools(node_specs, node_timeout))
    others = found.waiting(channel) > 0 or any(
        heard - found.listening(i, channel) > 0 for i, heard in enumerate(listeners)
    )
    if not others:
        return
    grace = min(spec.retry_delay + spec.retry_jitter, max(HANDOFF_GRACE, 4 * elapsed))
    if len(_handoffs) > 1000:
        now = time.monotonic()
        for stale, until in list(_handoffs.items()):
            if until <= now:
                _handoffs.pop(stale, None)
    _handoffs[identity] = time.monotonic() + grace


def handoff_defer(identity: tuple[Any, ...]) -> float:
    """Seconds this process should still leave to the waiters of ``identity``."""
    if not _handoffs:
        return 0.0
    until = _handoffs.pop(identity, None)
    return 0.0 if until is None else max(0.0, until - time.monotonic())


_tag = secrets.token_hex(4)


def process_tag() -> str:
    """This process's tag: a fair waiter's queue id carries it, and a release
    that names the waiter publishes on ``<wake head><tag>``, which only this
    process's readers subscribe to. A forked child draws its own."""
    return _tag


_inherited: list[object] = []


def _forget_parent_hubs() -> None:
    """In a forked child: no hubs, waiters, hand-offs or locks of the parent.

    The parent's reader threads do not exist in the child, a parent thread may
    have held these locks at the fork, and its waiters are not the child's.
    """
    global _hubs, _hubs_lock, _tag
    # Kept, never collected: collecting them could close sockets the parent
    # still uses (see nodes._inherited).
    _inherited.append(_hubs)
    _hubs = {}
    _hubs_lock = threading.Lock()
    _handoffs.clear()
    _tag = secrets.token_hex(4)


os.register_at_fork(after_in_child=_forget_parent_hubs)


def _on_setting_changed(*, setting: str, **kwargs: object) -> None:
    # New settings mean new pools (nodes.py): the old hubs' readers would listen
    # to nodes no lock uses any more.
    if setting in ("REDLOCK", "CACHES"):
        reset()


setting_changed.connect(_on_setting_changed, dispatch_uid="redlock_django.wake.reset")
