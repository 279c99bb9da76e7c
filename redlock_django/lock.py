"""``Redlock``: the public lock object, used with ``with`` or ``async with``.

One object describes a lock (its resource and options); who holds it is tracked per
*owner*: the current thread for the blocking API, the current asyncio task for the
``a``-prefixed API. So one object can be shared, an owner can re-acquire what it
holds (only its outermost release frees it), and nobody can release another
owner's hold (the holds themselves live in ``holds.py``). The options are merged
over the settings at first use (``options.py``), never at import time.

One idea, read top to bottom, so a little over 500 lines: the options, the steps
both APIs share, the blocking API, its asyncio twin, the owner's view of its hold.
The algorithm itself (quorum, validity, retries) is in ``protocol.py``.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import math
import random
import secrets
import threading
import time
import weakref
from collections.abc import Awaitable, Callable
from types import TracebackType
from typing import Any, ParamSpec, TypeVar, cast

from asgiref.sync import iscoroutinefunction
from django.dispatch import Signal

from . import aio, confirm, holds, meta, nodes, signals, sync, wake
from .address import NodeSpec
from .conf import RedlockSettings, check_seconds, get_settings, parse_nodes
from .exceptions import (
    LockContentionError,
    LockError,
    LockLostError,
    LockNotOwnedError,
    QuorumUnavailableError,
)
from .holds import Hold
from .keys import MAX_NAME_LENGTH, check_not_hashed, check_resource
from .options import Config, resolve
from .protocol import (
    Extension,
    Grant,
    Lease,
    Release,
    acquire_flow,
    extend_flow,
    locked_flow,
    release_flow,
    released_on_quorum,
)
from .watchdog import Watchdog

__all__ = ["Redlock"]

logger = logging.getLogger(__name__)
#: Guards every Redlock's record of open ``async with`` blocks (``_entered``): one
#: object may be used from several threads' event loops.
_entered_lock = threading.Lock()

P = ParamSpec("P")
R = TypeVar("R")

#: Bytes of randomness in a token (the Redlock spec assumes 20).
TOKEN_BYTES = 20

_clock = time.monotonic
_jitter = random.random


class Redlock:
    """A distributed lock on ``resource``, held on a majority of Redis nodes.

    ``ttl`` is the lease in seconds: a holder that dies frees the lock after it.
    ``auto_extend`` keeps extending the lease while held (up to ``max_hold``
    seconds in all; ``math.inf``: no cap, whatever ``MAX_HOLD`` says);
    ``fencing`` gives every acquisition a ``fencing_token`` greater than that of
    every earlier holder, for storage to reject stale writers. ``nodes``
    overrides ``REDLOCK["NODES"]``; ``label`` is shown with the holder's host,
    pid and thread in the admin. Unset options come from
    ``settings.REDLOCK``. ``reentrant=False`` makes a second acquire by the same
    owner wait like anyone else's. ``fair`` (``REDLOCK["FAIR"]``) grants the lock
    to waiters in the order they queued, across processes and servers, and a
    release wakes only the next of them (``docs/fairness.md``).
    """

    def __init__(
        self,
        resource: str,
        *,
        ttl: float | None = None,
        auto_extend: bool | None = None,
        fencing: bool = False,
        nodes: list[str] | tuple[str, ...] | None = None,
        label: str = "",
        max_hold: float | None = None,
        reentrant: bool = True,
        retry_delay: float | None = None,
        retry_jitter: float | None = None,
        node_timeout: float | None = None,
        drift_factor: float | None = None,
        fair: bool | None = None,
    ) -> None:
        self.resource = check_not_hashed(check_resource(resource, MAX_NAME_LENGTH))
        check_seconds("ttl", ttl, allow_none=True)
        if max_hold != math.inf:
            check_seconds("max_hold", max_hold, allow_none=True)
        check_seconds("node_timeout", node_timeout, allow_none=True)
        check_seconds("retry_delay", retry_delay, allow_none=True, allow_zero=True)
        check_seconds("retry_jitter", retry_jitter, allow_none=True, allow_zero=True)
        if fair is not None and not isinstance(fair, bool):
            raise ValueError(f"fair must be True or False, not {fair!r}")
        if drift_factor is not None and not 0 <= drift_factor < 0.5:
            raise ValueError(f"drift_factor must be in [0, 0.5), not {drift_factor!r}")
        if nodes is not None:
            if isinstance(nodes, str) or not nodes:
                raise ValueError(
                    "nodes must be a non-empty list of Redis URLs or aliases"
                )
            self._nodes: tuple[NodeSpec, ...] | None = parse_nodes(nodes)
        else:
            self._nodes = None
        self.ttl = ttl
        self.auto_extend = auto_extend
        self.fencing = fencing
        self.label = str(label)
        self.max_hold = max_hold
        self.reentrant = reentrant
        self.retry_delay = retry_delay
        self.retry_jitter = retry_jitter
        self.node_timeout = node_timeout
        self.drift_factor = drift_factor
        self.fair = fair
        #: The tasks that entered ``async with`` on this object and have not
        #: exited it yet, in order (see ``__aexit__``).
        self._entered: list[weakref.ref[asyncio.Task[Any]]] = []
        self._config: Config | None = None
        self._config_from: RedlockSettings | None = None

    def __repr__(self) -> str:
        return f"<Redlock {self.resource!r}>"

    # Configuration, resolved at first use and again when settings change.

    def _resolve(self) -> Config:
        """This object's options, where given, over the settings of the moment."""
        settings = get_settings()
        config = self._config
        if config is not None and self._config_from is settings:
            return config
        given: dict[str, Any] = {
            "nodes": self._nodes,
            "ttl": self.ttl,
            "node_timeout": self.node_timeout,
            "drift_factor": self.drift_factor,
            "retry_delay": self.retry_delay,
            "retry_jitter": self.retry_jitter,
            "auto_extend": self.auto_extend,
            "max_hold": self.max_hold,
            "fair": self.fair,
        }
        config = resolve(settings, self.resource, self.fencing, given)
        self._config, self._config_from = config, settings
        return config

    def _wait(
        self, config: Config, blocking: bool, timeout: float | None
    ) -> float | None:
        if not blocking:
            if timeout is not None:
                raise ValueError("can't specify a timeout for a non-blocking call")
            return 0.0
        if timeout is None:
            return config.wait_timeout
        return check_seconds("timeout", timeout, wait=True)

    def _send(self, signal: Signal, **details: Any) -> None:
        """Send ``signal`` about this lock, with the ``details`` it carries."""
        signals.send(signal, Redlock, lock=self, resource=self.resource, **details)

    def _grant(self, owner: object, config: Config, grant: Grant, since: float) -> Hold:
        lease = Lease(
            token=grant.token,
            acquired=grant.started,
            valid_until=grant.valid_until,
            fencing_token=grant.fencing_token,
        )
        hold = Hold(lease=lease, config=config, lock=self)
        earlier = holds.find(owner, config.identity)
        if earlier is not None:
            # A non-reentrant acquisition won over this owner's own hold: the nodes
            # no longer held it, so it was lost. Its release then says so.
            if earlier.lease.lost is None:
                earlier.lease.lost = "a later acquisition by its owner won the nodes"
            holds.replace(owner, earlier, self.resource, Redlock)
        holds.put(owner, config.identity, hold)
        if config.auto_extend:
            hold.watchdog = Watchdog(hold, owner, Redlock)
        return hold

    def _announce(self, config: Config, grant: Grant, since: float) -> None:
        """Send ``lock_acquired``: last, once the watchdog runs (a slow receiver
        must not outlast an unextended lease)."""
        signals.send(
            signals.lock_acquired,
            Redlock,
            lock=self,
            resource=self.resource,
            waited=_clock() - since,
            fencing_token=grant.fencing_token,
            attempts=grant.attempts,
            wakeups=grant.wakeups,
            granted=len(grant.granted),
            quorum=config.spec.quorum,
            nodes=config.spec.node_count,
            handed=grant.handed,
        )

    def _let_go_of_grant(
        self, hold: Hold, outcome: Release | None, elapsed: float, announced: bool
    ) -> None:
        """After an interrupted acquisition's own release: ``lock_released`` pairs
        the ``lock_acquired`` already sent (receivers count holds by them)."""
        if announced:
            self._send(
                signals.lock_released,
                held=_clock() - hold.lease.acquired,
                elapsed=elapsed,
                released=0 if outcome is None else outcome.released,
                lost=None,
                fencing_token=hold.lease.fencing_token,
            )

    def _not_acquired(self, exc: LockError, since: float, raise_all: bool) -> bool:
        """Signal a failed acquisition: False on contention, else re-raise.

        With ``raise_all`` contention is raised too: the protocol's own error,
        with the nodes that granted and failed.
        """
        waited = _clock() - since
        if isinstance(exc, LockContentionError):
            self._send(signals.lock_contended, waited=waited, error=exc)
            if not raise_all:
                return False
        else:
            self._send(signals.lock_unavailable, waited=waited, error=exc)
        raise exc

    def _owned(self, owner: object, verb: str) -> Hold:
        hold = holds.find(owner, self._resolve().identity)
        if hold is None:
            config = self._resolve()
            raise LockNotOwnedError(
                f"cannot {verb} {self.resource!r}: it is not held by this owner",
                resource=self.resource,
                nodes=config.spec.node_count,
                quorum=config.spec.quorum,
            )
        return hold

    def _finish_release(
        self, owner: object, hold: Hold, outcome: Release, elapsed: float
    ) -> None:
        holds.drop(owner, hold.config.identity)
        # A fair lock's queue already keeps this owner behind those waiting, and
        # its acquisitions never defer (acquire_flow): nothing to note for it.
        if outcome.released and hold.config.spec.queue is None:
            config = hold.config
            wake.note_handoff(
                config.identity,
                config.spec,
                config.nodes,
                config.node_timeout,
                outcome.listeners,
                elapsed,
            )
        spec = hold.config.spec
        held_for = _clock() - hold.lease.acquired
        released, failed = outcome.released, len(outcome.failed)
        # The object that acquired it, as lock_acquired named: a re-entry through
        # another object may make the outermost release.
        signals.send(
            signals.lock_released,
            Redlock,
            lock=hold.lock,
            resource=self.resource,
            held=held_for,
            elapsed=elapsed,
            released=released,
            lost=outcome.lost,
            fencing_token=hold.lease.fencing_token,
        )
        if outcome.lost is not None:
            holds.report_lost(hold, outcome.lost, Redlock)
            raise LockLostError(
                f"lock {self.resource!r} was lost while held ({held_for:.3f}s): "
                f"{outcome.lost}",
                resource=self.resource,
                granted=released,
                nodes=spec.node_count,
                quorum=spec.quorum,
                failed=outcome.failed,
            )
        if not released_on_quorum(spec, outcome):
            logger.warning(
                "redlock %r released on %d/%d nodes; %d did not answer and expire "
                "with the lease",
                self.resource,
                released,
                spec.node_count,
                failed,
            )

    def _start_acquire(
        self, owner: object, blocking: bool, timeout: float | None, holder: str
    ) -> tuple[Config, Any] | None:
        """Return the config and flow to drive, or None if the owner re-entered."""
        config = self._resolve()
        wait = self._wait(config, blocking, timeout)
        hold = holds.find(owner, config.identity)
        if hold is not None:
            if hold.lease.lost is not None or _clock() >= hold.lease.valid_until:
                holds.replace(owner, hold, self.resource, Redlock)
            elif self.reentrant:
                holds.reenter(hold, config)
                return None
        token = secrets.token_urlsafe(TOKEN_BYTES)
        if config.spec.queue is not None and config.wake_ups:
            # A fair waiter is woken on its process's channel (wake.process_tag).
            token = f"{token}~{wake.process_tag()}"
        about = meta.encode(holder, config.spec.ttl, self.label)
        defer = wake.handoff_defer(config.identity)
        flow = acquire_flow(config.spec, token, about, wait, _clock, _jitter, defer)
        return config, flow

    def _start_release(self, owner: object) -> Hold | None:
        """Return the hold to release on the nodes, or None if still re-entered."""
        config = self._resolve()
        if holds.find(owner, config.identity) is None:
            why = holds.pop_replaced(owner, config.identity)
            if why is not None:
                raise LockLostError(
                    f"lock {self.resource!r} was lost while held ({why}); a later "
                    f"acquisition by this owner replaced the hold",
                    resource=self.resource,
                    nodes=config.spec.node_count,
                    quorum=config.spec.quorum,
                )
        hold = self._owned(owner, "release")
        if hold.depth > 1:
            hold.depth -= 1
            return None
        return hold

    def _release_flow(self, hold: Hold) -> Any:
        """Start one more release fan-out of ``hold``: its flow."""
        hold.releases += 1
        lease = hold.lease
        retry = hold.releases > 1
        return release_flow(
            hold.config.spec, lease.token, lease=lease, clock=_clock, retry=retry
        )

    def _exit(self, exc: BaseException | None, lost: LockLostError) -> None:
        if exc is None:
            raise lost
        # The block's own exception matters more; do not mask it.
        logger.error("redlock %r lost while its block raised: %s", self.resource, lost)

    # Blocking API.

    def acquire(self, blocking: bool = True, timeout: float | None = None) -> bool:
        """Acquire the lock; return False if others still hold it when the wait ends.

        ``timeout`` is how long to wait (seconds): None means ``WAIT_TIMEOUT`` from
        the settings, a negative number waits without limit. Raises
        ``QuorumUnavailableError`` when too few nodes answer: an outage, not a busy
        lock.
        """
        return self._acquire(blocking, timeout)

    def _acquire(
        self,
        blocking: bool = True,
        timeout: float | None = None,
        *,
        raise_on_contention: bool = False,
    ) -> bool:
        """``acquire()``; with ``raise_on_contention`` a lock still held when the
        wait ends raises the protocol's ``LockContentionError`` instead of False."""
        owner = holds.sync_owner("acquire")
        holder = threading.current_thread().name
        started = self._start_acquire(owner, blocking, timeout, holder)
        if started is None:
            return True
        config, flow = started
        pools = nodes.sync_pools(config.nodes, config.node_timeout)
        since = _clock()
        # The grant, the moment the flow returns it: an interruption from then on
        # (while run() stops watching for wake-ups, or in the bookkeeping below)
        # releases it, or its keys would stay for the TTL with no one to free them.
        ended: list[Grant] = []
        announced = False
        try:
            try:
                hub = wake.hub(pools) if config.wake_ups else None
                grant = sync.run(flow, pools, config.node_timeout, hub=hub, ended=ended)
            except (LockContentionError, QuorumUnavailableError) as exc:
                return self._not_acquired(exc, since, raise_on_contention)
            hold = self._grant(owner, config, grant, since)
            if hold.watchdog is not None:
                hold.watchdog.start_thread()
            elif grant.handed:
                confirm.schedule(hold)
            announced = True  # a receiver interrupted midway was told already
            self._announce(config, grant, since)
        except BaseException:
            if not ended:
                raise
            hold = self._forget_grant(owner, config, ended[0])
            outcome, start = None, _clock()
            try:
                with contextlib.suppress(Exception):
                    flow = self._release_flow(hold)
                    outcome = sync.run(flow, pools, config.node_timeout)
            finally:  # interrupted again meanwhile: still paired
                self._let_go_of_grant(hold, outcome, _clock() - start, announced)
            raise
        return True

    def _forget_grant(self, owner: object, config: Config, grant: Grant) -> Hold:
        """An acquisition interrupted once the nodes granted it (a signal handler
        raised in a ``lock_acquired`` receiver): its caller is told it did not
        acquire and will not release, so the hold is dropped and its watchdog
        stopped. Returns the hold, whose release the caller tries at once
        (otherwise the keys stay for the TTL)."""
        hold = holds.find(owner, config.identity)
        if hold is not None and hold.lease.token == grant.token:
            holds.drop(owner, config.identity)
            confirm.cancel(hold)
            if hold.watchdog is not None:
                hold.watchdog.halt()
            return hold
        lease = Lease(
            token=grant.token,
            acquired=grant.started,
            valid_until=grant.valid_until,
            fencing_token=grant.fencing_token,
        )
        return Hold(lease=lease, config=config, lock=self)

    def release(self) -> None:
        """Release the lock; only the owner's outermost release frees it.

        Raises ``LockNotOwnedError`` if the current owner does not hold it, and
        ``LockLostError`` (after releasing) if its lease ran out while held.
        """
        owner = holds.sync_owner("release")
        hold = self._start_release(owner)
        if hold is None:
            return
        config = hold.config
        pools = nodes.sync_pools(config.nodes, config.node_timeout)
        try:
            confirm.cancel(hold)
            if hold.watchdog is not None:
                hold.watchdog.stop()
            start = _clock()
            outcome = sync.run(self._release_flow(hold), pools, config.node_timeout)
        except BaseException:
            # Interrupted (a signal handler raised: a Celery soft time limit,
            # KeyboardInterrupt) once the watchdog was told to stop, or while the
            # release may already have run on the nodes: the hold is no longer
            # trusted, so the owner's next acquisition asks the nodes instead of
            # re-entering it. A release called again still releases what is left
            # (LockLostError after).
            if hold.lease.lost is None:
                hold.lease.lost = "its release was interrupted"
            raise
        self._finish_release(owner, hold, outcome, _clock() - start)

    def extend(self, ttl: float | None = None) -> bool:
        """Reset the lease to ``ttl`` seconds (default: the lock's TTL).

        Returns whether a quorum confirmed it in time. Raises ``LockLostError`` when
        the lease has already run out: an expired lock is never revived.
        """
        owner = holds.sync_owner("extend")
        hold = self._owned(owner, "extend")
        config = hold.config
        check_seconds("ttl", ttl, allow_none=True)
        pools = nodes.sync_pools(config.nodes, config.node_timeout)
        with hold.extending:  # one extension of a hold at a time
            flow = self._extend_flow(hold, ttl)
            return self._extended(hold, sync.run(flow, pools, config.node_timeout))

    def locked(self) -> bool:
        """Return whether anyone holds the lock on a quorum of nodes."""
        holds.sync_owner("locked")
        config = self._resolve()
        pools = nodes.sync_pools(config.nodes, config.node_timeout)
        flow = self._locked_flow(config)
        return bool(sync.run(flow, pools, config.node_timeout))

    def _locked_flow(self, config: Config) -> Any:
        # A check the client's own lateness left undecided is made again while the
        # configured wait lasts, as an acquisition's attempt would be.
        wait = self._wait(config, True, None)
        return locked_flow(config.spec, wait, _clock, _jitter)

    def _extend_flow(self, hold: Hold, ttl: float | None) -> Any:
        # A lease lost or run out raises LockLostError in the flow, before any
        # network call: an expired lock is never revived.
        spec = hold.config.spec
        return extend_flow(spec, hold.lease, spec.ttl if ttl is None else ttl, _clock)

    def _extended(self, hold: Hold, extension: Extension) -> bool:
        if extension.valid_until is None:
            return False
        # Extended by its owner: a handed-over hold's own extension to the TTL is
        # no longer needed, and would shorten a longer lease asked for here.
        hold.confirming = False
        signals.send(
            signals.lock_extended,
            Redlock,
            lock=hold.lock,
            resource=self.resource,
            validity=extension.valid_until - _clock(),
        )
        return True

    def __enter__(self) -> Redlock:
        self._acquire(raise_on_contention=True)
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        try:
            self.release()
        except LockLostError as lost:
            self._exit(exc, lost)

    # asyncio API: the same flows, driven by aio.py.

    async def aacquire(
        self, blocking: bool = True, timeout: float | None = None
    ) -> bool:
        """Acquire the lock from a coroutine; see ``acquire()``."""
        return await self._aacquire(blocking, timeout)

    async def _aacquire(
        self,
        blocking: bool = True,
        timeout: float | None = None,
        *,
        raise_on_contention: bool = False,
    ) -> bool:
        """``aacquire()``; see ``_acquire()`` for ``raise_on_contention``."""
        owner = holds.async_owner("acquire")
        holder = cast(asyncio.Task[Any], owner).get_name()
        started = self._start_acquire(owner, blocking, timeout, holder)
        if started is None:
            return True
        config, flow = started
        clients = nodes.async_clients(config.nodes, config.node_timeout)
        hub = (
            wake.hub(nodes.sync_pools(config.nodes, config.node_timeout))
            if config.wake_ups
            else None
        )
        since = _clock()
        ended: list[Grant] = []  # as in _acquire()
        announced = False
        try:
            try:
                grant = await aio.run(
                    flow, clients, config.node_timeout, hub=hub, ended=ended
                )
            except (LockContentionError, QuorumUnavailableError) as exc:
                return self._not_acquired(exc, since, raise_on_contention)
            hold = self._grant(owner, config, grant, since)
            if hold.watchdog is not None:
                hold.watchdog.start_task()
            elif grant.handed:
                confirm.schedule_task(hold)
            announced = True  # a receiver interrupted midway was told already
            self._announce(config, grant, since)
        except BaseException:
            if not ended:
                raise
            hold = self._forget_grant(owner, config, ended[0])
            outcome, start = None, _clock()
            try:
                with contextlib.suppress(Exception):
                    flow = self._release_flow(hold)
                    run = aio.run(flow, clients, config.node_timeout)
                    outcome = await aio.complete(run)
            finally:  # cancelled meanwhile (complete() ran it to its end): paired
                self._let_go_of_grant(hold, outcome, _clock() - start, announced)
            raise
        return True

    async def arelease(self) -> None:
        """Release the lock from a coroutine; see ``release()``.

        The clean-up (stopping the watchdog, the release on every node) runs in a
        task of its own: cancelling the caller, once or many times, never cuts it
        short; the cancellation is raised once the clean-up has ended.
        """
        await self._arelease_as(holds.async_owner("release"))

    async def _arelease_as(self, owner: object) -> None:
        """``arelease()`` of ``owner``'s hold."""
        hold = self._start_release(owner)
        if hold is None:
            return
        try:
            await aio.complete(self._arelease_hold(owner, hold))
        except BaseException:
            # The release's own task ended early (cancelled by a sweep of every
            # task, as asyncio.Runner's close does) or failed: it may have run on
            # the nodes, so the hold is no longer trusted, as in release().
            if hold.lease.lost is None and holds.find(owner, hold.config.identity):
                hold.lease.lost = "its release was interrupted"
            raise

    async def _arelease_hold(self, owner: object, hold: Hold) -> None:
        confirm.cancel(hold)
        if hold.watchdog is not None:
            await hold.watchdog.astop()
        flow = self._release_flow(hold)
        config = hold.config
        clients = nodes.async_clients(config.nodes, config.node_timeout)
        start = _clock()
        outcome = await aio.run(flow, clients, config.node_timeout)
        self._finish_release(owner, hold, outcome, _clock() - start)

    async def aextend(self, ttl: float | None = None) -> bool:
        """Extend the lease from a coroutine; see ``extend()``."""
        owner = holds.async_owner("extend")
        hold = self._owned(owner, "extend")
        config = hold.config
        check_seconds("ttl", ttl, allow_none=True)
        clients = nodes.async_clients(config.nodes, config.node_timeout)
        async with hold.aextending():  # one extension of a hold at a time
            flow = self._extend_flow(hold, ttl)
            extension = await aio.run(flow, clients, config.node_timeout)
        return self._extended(hold, extension)

    async def alocked(self) -> bool:
        """Return whether anyone holds the lock; see ``locked()``."""
        config = self._resolve()
        clients = nodes.async_clients(config.nodes, config.node_timeout)
        flow = self._locked_flow(config)
        return bool(await aio.run(flow, clients, config.node_timeout))

    async def __aenter__(self) -> Redlock:
        await self._aacquire(raise_on_contention=True)
        task = holds.async_owner("acquire")
        with _entered_lock:
            self._entered.append(weakref.ref(cast("asyncio.Task[Any]", task)))
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        owner = holds.async_owner("release")
        entered = self._exited_by(owner)
        try:
            if entered is owner:
                await self.arelease()
            else:
                # The block ends in another task than the one that entered it:
                # an async generator closed by the loop's finalizer, or by a task
                # that took it over. Its hold is released as its entry's.
                await self._arelease_as(entered)
        except LockLostError as lost:
            self._exit(exc, lost)

    def _exited_by(self, owner: object) -> object:
        """The task whose ``async with`` on this object the exit in ``owner``
        ends: ``owner`` if it entered one; else the only other task with an open
        block here; else ``owner`` (ambiguous: nothing is released for another).
        A block whose task is gone (its hold went with it) may be the one ending:
        then no other task's hold is released either."""
        # No loop ending in an ``if`` in this block: on Python 3.13 a signal
        # handler's exception raised at its jump back skips the block's exit, and
        # the lock stays held (tests/test_back_edges.py).
        with _entered_lock:
            entered = self._entered
            tasks = [ref() for ref in entered]
            last = {id(task): i for i, task in enumerate(tasks)}  # each one's last
            mine = last.get(id(owner), last.get(id(None)))  # else a dead one's
            if mine is not None:
                del entered[mine]
                return owner
            if len(last) != 1:
                return owner
            (i,) = last.values()
            chosen = tasks[i]
            del entered[i]
            return chosen

    # The current owner's view of its hold: local, no network.

    def _current(self) -> Hold | None:
        return holds.find(holds.current_owner(), self._resolve().identity)

    def owned(self) -> bool:
        """Return whether the current owner holds the lock with validity left."""
        hold = self._current()
        return (
            hold is not None
            and hold.lease.lost is None
            and _clock() < hold.lease.valid_until
        )

    @property
    def validity(self) -> float:
        """Seconds the current owner's lease still guarantees (0.0 if none)."""
        hold = self._current()
        if hold is None or hold.lease.lost is not None:
            return 0.0
        return max(0.0, hold.lease.valid_until - _clock())

    @property
    def fencing_token(self) -> int | None:
        """The current owner's fencing token, when the lock was made with fencing."""
        hold = self._current()
        return None if hold is None else hold.lease.fencing_token

    @property
    def lost(self) -> bool:
        """Whether the current owner's lease was lost or ran out while held.

        Also True while a ``with`` block (or locked call) of a lost hold that a
        later acquisition by this owner replaced is still open: that block's
        lease is gone, whatever the replacement did since.
        """
        owner = holds.current_owner()
        identity = self._resolve().identity
        hold = holds.find(owner, identity)
        if hold is None:
            return holds.replaced(owner, identity)
        return hold.lease.lost is not None or _clock() >= hold.lease.valid_until

    @property
    def depth(self) -> int:
        """How many times the current owner holds the lock (0 if not at all)."""
        hold = self._current()
        return 0 if hold is None else hold.depth

    # Decorating a function holds the lock for each call.

    def __call__(self, func: Callable[P, R]) -> Callable[P, R]:
        """Hold the lock around every call of ``func`` (sync or async)."""
        if iscoroutinefunction(func):
            async_func = cast(Callable[P, Awaitable[Any]], func)

            @functools.wraps(func)
            async def async_wrapper(*args: P.args, **kwargs: P.kwargs) -> Any:
                async with self:
                    return await async_func(*args, **kwargs)

            return cast(Callable[P, R], async_wrapper)

        @functools.wraps(func)
        def wrapper(*args: P.args, **kwargs: P.kwargs) -> R:
            with self:
                return func(*args, **kwargs)

        return wrapper
