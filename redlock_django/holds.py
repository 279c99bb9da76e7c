"""Who holds what, per thread or task: the holds of every owner in this process.

An *owner* is the current thread for the blocking API and the current asyncio task
for the ``a``-prefixed one. Each owner's holds are keyed by lock identity (same
nodes, same key), so any ``Redlock`` object on that lock finds them; a forked child
starts with none. Also here: the ``lock_lost`` signal, sent once per hold.
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
import time
import weakref
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from . import signals
from .protocol import Lease

if TYPE_CHECKING:
    from .lock import Redlock
    from .options import Config
    from .watchdog import Watchdog

__all__ = [
    "Hold",
    "async_owner",
    "current_owner",
    "drop",
    "find",
    "pop_replaced",
    "put",
    "reenter",
    "replace",
    "replaced",
    "report_lost",
    "sync_owner",
]

# The messages keep the logger they always had, so logging settings still apply.
logger = logging.getLogger("redlock_django.lock")

_clock = time.monotonic


@dataclass(eq=False)
class Hold:
    """One owner's hold of one lock."""

    lease: Lease
    config: Config
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
    #: A handed-over hold waiting to be extended to its TTL (``confirm.py``),
    #: and the task that will, for a hold taken by a task.
    confirming: bool = False
    confirm_task: Any = None

    def aextending(self) -> asyncio.Lock:
        """The asyncio twin of ``extending``, for holds taken by a task."""
        if self._aextending is None:
            self._aextending = asyncio.Lock()
        return self._aextending


def report_lost(hold: Hold, reason: str, sender: type) -> None:
    """Send ``lock_lost`` once per hold, from ``sender`` (the ``Redlock`` class)."""
    if hold.lost_reported:
        return
    hold.lost_reported = True
    signals.send(
        signals.lock_lost,
        sender,
        lock=hold.lock,
        resource=hold.config.spec.resource,
        held=_clock() - hold.lease.acquired,
        reason=reason,
        fencing_token=hold.lease.fencing_token,
    )


# Owners.


def sync_owner(method: str) -> object:
    """Return the owner of a blocking call: the current thread, outside any loop."""
    # _get_running_loop(): None outside a loop, where get_running_loop() raises
    # (and catching that cost every blocking call a raised exception).
    if asyncio._get_running_loop() is None:
        return threading.current_thread()
    raise RuntimeError(
        f"Redlock.{method}() blocks and cannot run inside an event loop; "
        f"use 'await lock.a{method}()' or 'async with lock'"
    )


def async_owner(method: str) -> object:
    """Return the owner of an ``a``-prefixed call: the current asyncio task."""
    task = asyncio.current_task()
    if task is None:
        raise RuntimeError(f"Redlock.a{method}() must run inside an asyncio task")
    return task


def current_owner() -> object:
    """Return the current task if one runs, else the current thread."""
    try:
        task = asyncio.current_task()
    except RuntimeError:
        task = None
    return task if task is not None else threading.current_thread()


# The registry.

# owner (a Thread or an asyncio Task) -> lock identity -> hold. Weak keys, so the
# holds of an owner that ended without releasing do not outlive it.
_holds: weakref.WeakKeyDictionary[object, dict[tuple[Any, ...], Hold]] = (
    weakref.WeakKeyDictionary()
)
# owner -> lock identity -> (levels, why): a hold found lost and replaced by a new
# acquisition while ``levels`` outer ``with`` blocks were still open on it; their
# releases raise LockLostError instead of finding nothing (see ``replace``).
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


def find(owner: object, identity: tuple[Any, ...]) -> Hold | None:
    """Return ``owner``'s hold of the lock ``identity``, or None."""
    with _holds_lock:
        return _holds.get(owner, {}).get(identity)


def held_count() -> int:
    """How many locks this process's running threads and tasks hold.

    An owner that ended holding a lock (a thread that returned, a task done) holds
    nothing: its lease runs out on the nodes, and it never sends ``lock_released``.
    """
    with _holds_lock:
        owned = [(owner, len(held)) for owner, held in _holds.items()]
    return sum(n for owner, n in owned if _running(owner))


def _running(owner: object) -> bool:
    if isinstance(owner, threading.Thread):
        return owner.is_alive()
    if isinstance(owner, asyncio.Task):
        return not owner.done()
    return True


def put(owner: object, identity: tuple[Any, ...], hold: Hold) -> None:
    with _holds_lock:
        _holds.setdefault(owner, {})[identity] = hold


def drop(owner: object, identity: tuple[Any, ...]) -> None:
    with _holds_lock:
        held = _holds.get(owner)
        if held is not None:
            held.pop(identity, None)
            if not held:
                del _holds[owner]


def _note_replaced(owner: object, identity: tuple[Any, ...], hold: Hold) -> None:
    """Remember the open levels of a lost hold that a new acquisition replaces."""
    why = hold.lease.lost or "its lease ran out"
    with _holds_lock:
        _replaced.setdefault(owner, {})[identity] = [hold.depth, why]


def replaced(owner: object, identity: tuple[Any, ...]) -> bool:
    """Whether levels of a lost hold that a later acquisition replaced are open."""
    with _holds_lock:
        return identity in _replaced.get(owner, {})


def pop_replaced(owner: object, identity: tuple[Any, ...]) -> str | None:
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


# Re-entering a hold, and replacing one found lost.


def _conflict(held: Config, wanted: Config) -> tuple[str, Any, Any] | None:
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


def reenter(hold: Hold, wanted: Config) -> None:
    """Nest one more level in ``hold``, if the ``wanted`` options agree with it."""
    conflict = _conflict(hold.config, wanted)
    if conflict is not None:
        name, held_value, value = conflict
        raise ValueError(
            f"cannot re-enter {wanted.spec.resource!r} with {name}={value!r}: this "
            f"owner holds it through {hold.lock!r} with {name}={held_value!r}; "
            f"re-enter with the same options, or pass reentrant=False for a "
            f"separate hold"
        )
    hold.depth += 1


def replace(owner: object, hold: Hold, resource: str, sender: type) -> None:
    """Drop a hold found lost or run out, so the owner can acquire afresh.

    Its watchdog is stopped, ``lock_lost`` sent (once per hold), then
    ``lock_released`` (nothing released, ``lost`` saying why) and a warning
    logged; ``with`` blocks still open on it raise ``LockLostError`` at exit.
    """
    lease = hold.lease
    why = lease.lost or (
        f"its lease ran out {_clock() - lease.valid_until:.3f}s ago, unreleased"
    )
    if hold.watchdog is not None:
        hold.watchdog.halt()
    drop(owner, hold.config.identity)
    _note_replaced(owner, hold.config.identity, hold)
    logger.warning(
        "redlock %r: this owner's earlier hold was lost (%s); it is dropped and "
        "the lock acquired afresh",
        resource,
        why,
    )
    report_lost(hold, why, sender)
    # The hold ends here, released nowhere: receivers that pair acquisitions
    # with releases (the redlock_held gauge, spans) see it end.
    signals.send(
        signals.lock_released,
        sender,
        lock=hold.lock,
        resource=hold.config.spec.resource,
        held=_clock() - lease.acquired,
        elapsed=0.0,
        released=0,
        lost=why,
        fencing_token=lease.fencing_token,
    )
