"""``Redlock``: the public lock object, used with ``with`` or ``async with``.

One object describes a lock (its resource and options); who holds it is tracked per
*owner*: the current thread for the blocking API, the current asyncio task for the
``a``-prefixed API. So one object can be shared, an owner can re-acquire what it
holds (only its outermost release frees it), and nobody can release another
owner's hold. Settings are read at first use, never at import time.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import json
import logging
import os
import random
import secrets
import socket
import threading
import time
import weakref
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from types import TracebackType
from typing import Any, ParamSpec, TypeVar, cast

from asgiref.sync import iscoroutinefunction

from . import aio, nodes, signals, sync, wake
from .address import NodeSpec, parse_node
from .conf import RedlockSettings, check_seconds, get_settings
from .exceptions import (
    LockContentionError,
    LockError,
    LockLostError,
    LockNotOwnedError,
    QuorumUnavailableError,
)
from .keys import MAX_NAME_LENGTH, check_resource, fence_key, lock_key
from .protocol import (
    Extension,
    Grant,
    Lease,
    LockSpec,
    Release,
    acquire_flow,
    drift,
    extend_flow,
    locked_flow,
    release_flow,
    validity,
)
from .watchdog import Watchdog

__all__ = ["Redlock"]

logger = logging.getLogger(__name__)

P = ParamSpec("P")
R = TypeVar("R")

#: Bytes of randomness in a token (the Redlock spec assumes 20).
TOKEN_BYTES = 20

_clock = time.monotonic
_jitter = random.random


@dataclass(frozen=True)
class _Config:
    """A lock's options resolved against the settings of the moment."""

    spec: LockSpec
    nodes: tuple[NodeSpec, ...]
    node_timeout: float
    wait_timeout: float | None
    auto_extend: bool
    max_hold: float | None
    wake_ups: bool
    #: Identifies the lock across ``Redlock`` objects: same nodes, same key.
    identity: tuple[Any, ...]


@dataclass(eq=False)
class _Hold:
    """One owner's hold of one lock."""

    lease: Lease
    config: _Config
    #: The object that acquired it, sent with the signals.
    lock: Redlock
    depth: int = 1
    watchdog: Watchdog | None = None
    lost_reported: bool = False
    #: Release fan-outs started; a retry finds the keys its first try deleted.
    releases: int = 0
    #: Held through every extension of this hold (manual or by the watchdog), so
    #: they never overlap: the lease is always the one the nodes applied last.
    extending: threading.Lock = field(default_factory=threading.Lock)
    _aextending: asyncio.Lock | None = None

    def aextending(self) -> asyncio.Lock:
        """The asyncio twin of ``extending``, for holds taken by a task."""
        if self._aextending is None:
            self._aextending = asyncio.Lock()
        return self._aextending


def _report_lost(hold: _Hold, reason: str) -> None:
    """Send ``lock_lost`` once per hold."""
    if hold.lost_reported:
        return
    hold.lost_reported = True
    signals.lock_lost.send(
        sender=Redlock,
        lock=hold.lock,
        resource=hold.config.spec.resource,
        held=_clock() - hold.lease.acquired,
        reason=reason,
    )


# owner (a Thread or an asyncio Task) -> lock identity -> hold. Weak keys, so the
# holds of an owner that ended without releasing do not outlive it.
_holds: weakref.WeakKeyDictionary[object, dict[tuple[Any, ...], _Hold]] = (
    weakref.WeakKeyDictionary()
)
# owner -> lock identity -> (levels, why): a hold found lost and replaced by a new
# acquisition while ``levels`` outer ``with`` blocks were still open on it; their
# releases raise LockLostError instead of finding nothing (see ``_replace``).
_replaced: weakref.WeakKeyDictionary[object, dict[tuple[Any, ...], list[Any]]] = (
    weakref.WeakKeyDictionary()
)
_holds_lock = threading.Lock()


_inherited: list[object] = []


def _forget_parent_holds() -> None:
    """In a forked child: start with no holds or locks of the parent.

    Holds are keyed by the Thread object, which survives fork(): without this a
    child's acquire would re-enter its parent's hold with no network call. The
    lock is made anew, as a parent thread may have held it at the fork.
    """
    global _holds, _replaced, _holds_lock
    # The parent's holds are kept, never collected: collecting a watchdog task
    # would run its clean-up code in the child, on the parent's connections.
    _inherited.append((_holds, _replaced))
    _holds = weakref.WeakKeyDictionary()
    _replaced = weakref.WeakKeyDictionary()
    _holds_lock = threading.Lock()


os.register_at_fork(after_in_child=_forget_parent_holds)


def _sync_owner(method: str) -> object:
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return threading.current_thread()
    raise RuntimeError(
        f"Redlock.{method}() blocks and cannot run inside an event loop; "
        f"use 'await lock.a{method}()' or 'async with lock'"
    )


def _async_owner(method: str) -> object:
    task = asyncio.current_task()
    if task is None:
        raise RuntimeError(f"Redlock.a{method}() must run inside an asyncio task")
    return task


def _current_owner() -> object:
    try:
        task = asyncio.current_task()
    except RuntimeError:
        task = None
    return task if task is not None else threading.current_thread()


def _get_hold(owner: object, identity: tuple[Any, ...]) -> _Hold | None:
    with _holds_lock:
        return _holds.get(owner, {}).get(identity)


def _put_hold(owner: object, identity: tuple[Any, ...], hold: _Hold) -> None:
    with _holds_lock:
        _holds.setdefault(owner, {})[identity] = hold


def _drop_hold(owner: object, identity: tuple[Any, ...]) -> None:
    with _holds_lock:
        held = _holds.get(owner)
        if held is not None:
            held.pop(identity, None)
            if not held:
                del _holds[owner]


def _note_replaced(owner: object, identity: tuple[Any, ...], hold: _Hold) -> None:
    """Remember the open levels of a lost hold that a new acquisition replaces."""
    why = hold.lease.lost or "its lease ran out"
    with _holds_lock:
        _replaced.setdefault(owner, {})[identity] = [hold.depth, why]


def _pop_replaced(owner: object, identity: tuple[Any, ...]) -> str | None:
    """Close one level of a replaced hold: why it was lost, or None if none is open."""
    with _holds_lock:
        entries = _replaced.get(owner)
        entry = None if entries is None else entries.get(identity)
        if entry is None:
            return None
        entry[0] -= 1
        if entry[0] <= 0:
            del entries[identity]  # type: ignore[union-attr]
            if not entries:
                del _replaced[owner]
        return str(entry[1])


@functools.cache
def _hostname() -> str:
    return socket.gethostname()


@functools.lru_cache(maxsize=1024)
def _meta_head(pid: int, holder: str, ttl: float, label: str) -> str:
    """The holder metadata JSON without its closing brace and acquisition time."""
    fields = {"host": _hostname(), "pid": pid, "holder": holder, "ttl": ttl}
    return json.dumps({**fields, "label": label}, separators=(",", ":"))[:-1]


def _conflict(held: _Config, wanted: _Config) -> tuple[str, Any, Any] | None:
    """Name the first option in which a re-entry differs from the hold it enters."""
    pairs: list[tuple[str, Any, Any]] = [
        ("ttl", held.spec.ttl, wanted.spec.ttl),
        ("fencing", held.spec.fence_key is not None, wanted.spec.fence_key is not None),
        ("auto_extend", held.auto_extend, wanted.auto_extend),
    ]
    if held.auto_extend:
        pairs.append(("max_hold", held.max_hold, wanted.max_hold))
    for name, held_value, wanted_value in pairs:
        if held_value != wanted_value:
            return name, held_value, wanted_value
    return None


class Redlock:
    """A distributed lock on ``resource``, held on a majority of Redis nodes.

    ``ttl`` is the lease in seconds: a holder that dies frees the lock after it.
    ``auto_extend`` keeps extending the lease while held (up to ``max_hold``
    seconds in all); ``fencing`` gives every acquisition a ``fencing_token``
    greater than that of every earlier holder, for storage to reject stale
    writers. ``nodes`` overrides ``REDLOCK["NODES"]``; ``label`` is shown with
    the holder's host, pid and thread in the admin. Unset options come from
    ``settings.REDLOCK``. ``reentrant=False`` makes a second acquire by the same
    owner wait like anyone else's.
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
    ) -> None:
        self.resource = check_resource(resource, MAX_NAME_LENGTH)
        check_seconds("ttl", ttl, allow_none=True)
        check_seconds("max_hold", max_hold, allow_none=True)
        check_seconds("node_timeout", node_timeout, allow_none=True)
        check_seconds("retry_delay", retry_delay, allow_none=True, allow_zero=True)
        check_seconds("retry_jitter", retry_jitter, allow_none=True, allow_zero=True)
        if drift_factor is not None and not 0 <= drift_factor < 0.5:
            raise ValueError(f"drift_factor must be in [0, 0.5), not {drift_factor!r}")
        if nodes is not None:
            if isinstance(nodes, str) or not nodes:
                raise ValueError(
                    "nodes must be a non-empty list of Redis URLs or aliases"
                )
            self._nodes: tuple[NodeSpec, ...] | None = tuple(
                parse_node(entry, i) for i, entry in enumerate(nodes)
            )
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
        self._config: _Config | None = None
        self._config_from: RedlockSettings | None = None

    def __repr__(self) -> str:
        return f"<Redlock {self.resource!r}>"

    # Configuration, resolved at first use and again when settings change.

    def _resolve(self) -> _Config:
        settings = get_settings()
        config = self._config
        if config is not None and self._config_from is settings:
            return config
        # This object's options, where given, over the settings of the moment.
        given: dict[str, Any] = {
            "nodes": self._nodes,
            "ttl": self.ttl,
            "node_timeout": self.node_timeout,
            "drift_factor": self.drift_factor,
            "retry_delay": self.retry_delay,
            "retry_jitter": self.retry_jitter,
            "auto_extend": self.auto_extend,
            "max_hold": self.max_hold,
        }
        merged = dataclasses.replace(
            settings, **{name: v for name, v in given.items() if v is not None}
        )
        ttl, node_timeout = merged.ttl, merged.node_timeout
        drift_factor = merged.drift_factor
        if validity(ttl, node_timeout, drift_factor) <= 0:
            # Even a reply at the node timeout would leave no validity: every
            # attempt would be refused as too slow. Say so before sending anything.
            raise ValueError(
                f"ttl ({ttl}s) leaves no validity after node_timeout ({node_timeout}s) "
                f"and the clock drift allowance ({drift(ttl, drift_factor):.3f}s)"
            )
        prefix = merged.key_prefix
        spec = LockSpec(
            resource=self.resource,
            key=lock_key(self.resource, prefix),
            node_names=tuple(n.display for n in merged.nodes),
            ttl=ttl,
            drift_factor=drift_factor,
            retry_delay=merged.retry_delay,
            retry_jitter=merged.retry_jitter,
            fence_key=fence_key(self.resource, prefix) if self.fencing else None,
        )
        config = _Config(
            spec=spec,
            nodes=merged.nodes,
            node_timeout=node_timeout,
            wait_timeout=merged.wait_timeout,
            auto_extend=merged.auto_extend,
            max_hold=merged.max_hold,
            wake_ups=merged.wake_ups,
            identity=(tuple(n.identity for n in merged.nodes), spec.key),
        )
        self._config, self._config_from = config, settings
        return config

    def _wait(
        self, config: _Config, blocking: bool, timeout: float | None
    ) -> float | None:
        if not blocking:
            if timeout is not None:
                raise ValueError("can't specify a timeout for a non-blocking call")
            return 0.0
        if timeout is None:
            return config.wait_timeout
        return check_seconds("timeout", timeout, wait=True)

    def _meta(self, config: _Config, holder: str) -> str:
        # The same JSON object as json.dumps of all six fields, with the fixed
        # part encoded once per (pid, holder, ttl, label): only the time changes.
        head = _meta_head(os.getpid(), holder, config.spec.ttl, self.label)
        now = datetime.now(UTC).isoformat(timespec="milliseconds")
        return f'{head},"acquired_at":"{now}"}}'

    def _reenter(self, hold: _Hold, config: _Config) -> None:
        """Nest one more level in ``hold``, if this object's options agree with it."""
        conflict = _conflict(hold.config, config)
        if conflict is not None:
            name, held_value, wanted = conflict
            raise ValueError(
                f"cannot re-enter {self.resource!r} with {name}={wanted!r}: this "
                f"owner holds it through {hold.lock!r} with {name}={held_value!r}; "
                f"re-enter with the same options, or pass reentrant=False for a "
                f"separate hold"
            )
        hold.depth += 1

    def _replace(self, owner: object, hold: _Hold) -> None:
        """Drop a hold found lost or run out, so the owner can acquire afresh.

        Its watchdog is stopped, ``lock_lost`` sent (once per hold) and a warning
        logged; ``with`` blocks still open on it raise ``LockLostError`` at exit.
        """
        lease = hold.lease
        why = lease.lost or (
            f"its lease ran out {_clock() - lease.valid_until:.3f}s ago, unreleased"
        )
        if hold.watchdog is not None:
            hold.watchdog.halt()
        _drop_hold(owner, hold.config.identity)
        _note_replaced(owner, hold.config.identity, hold)
        logger.warning(
            "redlock %r: this owner's earlier hold was lost (%s); it is dropped and "
            "the lock acquired afresh",
            self.resource,
            why,
        )
        _report_lost(hold, why)

    def _grant(
        self, owner: object, config: _Config, grant: Grant, since: float
    ) -> _Hold:
        lease = Lease(
            token=grant.token,
            acquired=grant.started,
            valid_until=grant.valid_until,
            fencing_token=grant.fencing_token,
        )
        hold = _Hold(lease=lease, config=config, lock=self)
        _put_hold(owner, config.identity, hold)
        if config.auto_extend:
            hold.watchdog = Watchdog(hold, owner, Redlock, _report_lost)
        signals.lock_acquired.send(
            sender=Redlock,
            lock=self,
            resource=self.resource,
            waited=_clock() - since,
            fencing_token=grant.fencing_token,
            attempts=grant.attempts,
            wakeups=grant.wakeups,
        )
        return hold

    def _not_acquired(self, exc: LockError, since: float, raise_all: bool) -> bool:
        """Signal a failed acquisition: False on contention, else re-raise.

        With ``raise_all`` contention is raised too: the protocol's own error,
        with the nodes that granted and failed.
        """
        waited = _clock() - since
        if isinstance(exc, LockContentionError):
            signals.lock_contended.send(
                sender=Redlock, lock=self, resource=self.resource, waited=waited
            )
            if not raise_all:
                return False
        signals.lock_unavailable.send(
            sender=Redlock, lock=self, resource=self.resource, waited=waited, error=exc
        )
        raise exc

    def _owned(self, owner: object, verb: str) -> _Hold:
        hold = _get_hold(owner, self._resolve().identity)
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
        self, owner: object, hold: _Hold, outcome: Release, elapsed: float
    ) -> None:
        _drop_hold(owner, hold.config.identity)
        if outcome.released:
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
        signals.lock_released.send(
            sender=Redlock, lock=self, resource=self.resource, held=held_for
        )
        if outcome.lost is not None:
            _report_lost(hold, outcome.lost)
            raise LockLostError(
                f"lock {self.resource!r} was lost while held ({held_for:.3f}s): "
                f"{outcome.lost}",
                resource=self.resource,
                granted=released,
                nodes=spec.node_count,
                quorum=spec.quorum,
                failed=outcome.failed,
            )
        if released < spec.quorum:
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
    ) -> tuple[_Config, Any] | None:
        """Return the config and flow to drive, or None if the owner re-entered."""
        config = self._resolve()
        wait = self._wait(config, blocking, timeout)
        hold = _get_hold(owner, config.identity)
        if hold is not None:
            if hold.lease.lost is not None or _clock() >= hold.lease.valid_until:
                self._replace(owner, hold)
            elif self.reentrant:
                self._reenter(hold, config)
                return None
        token = secrets.token_urlsafe(TOKEN_BYTES)
        meta = self._meta(config, holder)
        defer = wake.handoff_defer(config.identity)
        flow = acquire_flow(config.spec, token, meta, wait, _clock, _jitter, defer)
        return config, flow

    def _start_release(self, owner: object) -> _Hold | None:
        """Return the hold to release on the nodes, or None if still re-entered."""
        config = self._resolve()
        if _get_hold(owner, config.identity) is None:
            why = _pop_replaced(owner, config.identity)
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

    def _release_flow(self, hold: _Hold) -> Any:
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
        owner = _sync_owner("acquire")
        holder = threading.current_thread().name
        started = self._start_acquire(owner, blocking, timeout, holder)
        if started is None:
            return True
        config, flow = started
        pools = nodes.sync_pools(config.nodes, config.node_timeout)
        since = _clock()
        try:
            hub = wake.hub(pools) if config.wake_ups else None
            grant = sync.run(flow, pools, config.node_timeout, hub=hub)
        except (LockContentionError, QuorumUnavailableError) as exc:
            return self._not_acquired(exc, since, raise_on_contention)
        hold = self._grant(owner, config, grant, since)
        if hold.watchdog is not None:
            hold.watchdog.start_thread()
        return True

    def release(self) -> None:
        """Release the lock; only the owner's outermost release frees it.

        Raises ``LockNotOwnedError`` if the current owner does not hold it, and
        ``LockLostError`` (after releasing) if its lease ran out while held.
        """
        owner = _sync_owner("release")
        hold = self._start_release(owner)
        if hold is None:
            return
        if hold.watchdog is not None:
            hold.watchdog.stop()
        hold.releases += 1
        config = hold.config
        pools = nodes.sync_pools(config.nodes, config.node_timeout)
        start = _clock()
        flow = self._release_flow(hold)
        outcome = sync.run(flow, pools, config.node_timeout)
        self._finish_release(owner, hold, outcome, _clock() - start)

    def extend(self, ttl: float | None = None) -> bool:
        """Reset the lease to ``ttl`` seconds (default: the lock's TTL).

        Returns whether a quorum confirmed it in time. Raises ``LockLostError`` when
        the lease has already run out: an expired lock is never revived.
        """
        owner = _sync_owner("extend")
        hold = self._owned(owner, "extend")
        config = hold.config
        check_seconds("ttl", ttl, allow_none=True)
        pools = nodes.sync_pools(config.nodes, config.node_timeout)
        with hold.extending:  # one extension of a hold at a time
            flow = self._extend_flow(hold, ttl)
            return self._extended(hold, sync.run(flow, pools, config.node_timeout))

    def locked(self) -> bool:
        """Return whether anyone holds the lock on a quorum of nodes."""
        _sync_owner("locked")
        config = self._resolve()
        pools = nodes.sync_pools(config.nodes, config.node_timeout)
        return bool(sync.run(locked_flow(config.spec), pools, config.node_timeout))

    def _extend_flow(self, hold: _Hold, ttl: float | None) -> Any:
        config = hold.config
        if hold.lease.lost is not None:
            raise LockLostError(
                f"cannot extend {self.resource!r}: {hold.lease.lost}",
                resource=self.resource,
                nodes=config.spec.node_count,
                quorum=config.spec.quorum,
            )
        return extend_flow(
            config.spec, hold.lease, config.spec.ttl if ttl is None else ttl, _clock
        )

    def _extended(self, hold: _Hold, extension: Extension) -> bool:
        if extension.valid_until is None:
            return False
        signals.lock_extended.send(
            sender=Redlock,
            lock=self,
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
        owner = _async_owner("acquire")
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
        try:
            grant = await aio.run(flow, clients, config.node_timeout, hub=hub)
        except (LockContentionError, QuorumUnavailableError) as exc:
            return self._not_acquired(exc, since, raise_on_contention)
        hold = self._grant(owner, config, grant, since)
        if hold.watchdog is not None:
            hold.watchdog.start_task()
        return True

    async def arelease(self) -> None:
        """Release the lock from a coroutine; see ``release()``.

        The clean-up (stopping the watchdog, the release on every node) runs in a
        task of its own: cancelling the caller, once or many times, never cuts it
        short; the cancellation is raised once the clean-up has ended.
        """
        owner = _async_owner("release")
        hold = self._start_release(owner)
        if hold is None:
            return
        await aio.complete(self._arelease_hold(owner, hold))

    async def _arelease_hold(self, owner: object, hold: _Hold) -> None:
        if hold.watchdog is not None:
            await hold.watchdog.astop()
        hold.releases += 1
        config = hold.config
        clients = nodes.async_clients(config.nodes, config.node_timeout)
        start = _clock()
        flow = self._release_flow(hold)
        outcome = await aio.run(flow, clients, config.node_timeout)
        self._finish_release(owner, hold, outcome, _clock() - start)

    async def aextend(self, ttl: float | None = None) -> bool:
        """Extend the lease from a coroutine; see ``extend()``."""
        owner = _async_owner("extend")
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
        return bool(
            await aio.run(locked_flow(config.spec), clients, config.node_timeout)
        )

    async def __aenter__(self) -> Redlock:
        await self._aacquire(raise_on_contention=True)
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        try:
            await self.arelease()
        except LockLostError as lost:
            self._exit(exc, lost)

    # The current owner's view of its hold: local, no network.

    def _current(self) -> _Hold | None:
        return _get_hold(_current_owner(), self._resolve().identity)

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
        """Whether the current owner's lease was lost or ran out while held."""
        hold = self._current()
        return hold is not None and (
            hold.lease.lost is not None or _clock() >= hold.lease.valid_until
        )

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
