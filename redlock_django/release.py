"""When a decorated view's lock is released: after the commit, exactly once.

The lock is released when the view returns or raises; a failed release
is logged and never masks the view's exception. When the view returns inside a
database transaction (``ATOMIC_REQUESTS`` or an outer ``atomic()``), the release
waits for the commit (``transaction.on_commit``): released earlier, the next
holder would read data this one has not committed yet. A rollback drops
on-commit callbacks, so the response also carries a closer that releases when
the response is closed (after the handler's transaction has ended). A COMMIT
that fails (a deferred constraint, a serialization failure) drops that response
for a 500: then ``request_finished``, sent on the view's thread when the 500
closes, releases, unless the transaction the lock waits for is still open.
Whichever comes first releases, exactly once. When the view raises outside any
transaction, or outside a request (a view called directly), the lock is released
at once. Raising inside a request's transaction, it waits for that transaction's
commit as well: a layer inside the transaction may turn the exception into a
response (an error-handling decorator or mixin, Django's own 404) and the
transaction then commits what the view wrote. It is released at that commit, or
after a rollback at the first of: the next decorated view this thread runs
(a retry loop around ``atomic()`` takes the same lock again),
``got_request_exception`` (sent before a handler re-raises under
``DEBUG_PROPAGATE_EXCEPTIONS``, when no ``request_finished`` follows),
``request_finished``, or the next ``request_started`` on this thread. A hold
whose transaction may still commit is not released early by the first, second
and fourth (``request_finished`` releases a raised view's hold whatever is still
open: a test's own transaction). Under ASGI, ``got_request_exception`` is sent on
another thread and releases nothing. The response's closer pickles to
nothing, so a cached response (``cache_page``) is stored without it. The lock
covers the view call, not
the streaming of a ``StreamingHttpResponse``'s content after it. A blocking lock
is owned by the view's thread, which is where Django's WSGI and ASGI handlers
close responses; a response closed on another thread (Django's test
``AsyncClient`` does that) cannot release: its watchdog is stopped and a
WARNING says the lock is left to its lease. Async views release when they
return, raise, or are cancelled (Django cancels the view's task when an ASGI
client disconnects); a cancelled view, or one that raised, first waits (one
TTL at most) for the work it left running in the request's thread-sensitive
executor (``sync_to_async``, Django's async ORM, given up on by ``wait_for``),
which its cancellation does not stop and the lock must cover. Django refuses
them under ``ATOMIC_REQUESTS``, but an ``atomic()`` opened by a sync middleware
around an async view is not waited for (the lock is owned by the view's task,
which ends before that transaction does): keep such views out of transactions.

A lease lost while the view ran (it outlived ``ttl``) is logged at ERROR with the
resource, the time held and the TTL, and the response is still returned: by then
the view's work is done and committed, so a 500 would tell the client it failed
when it did not, and undo nothing. A view that must not commit after losing its
lease checks ``request.redlock.owned()`` (or uses fencing tokens) before writing.
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from django.core.signals import (
    got_request_exception,
    request_finished,
    request_started,
)
from django.db import connections, transaction

from . import holds
from .exceptions import LockLostError, LockNotOwnedError
from .interrupts import reraise_interruption
from .lock import Redlock

__all__ = ["Held"]

# These records are about the decorated view, and LOGGING configurations name the
# decorator's logger: keep logging under it.
logger = logging.getLogger("redlock_django.decorators")


# This thread's holds waiting for a commit: released at the latest when the
# request finishes. A thread-local, not one receiver per hold: a weakly connected
# receiver would die with the hold (nothing else refers to it once the response is
# dropped), and a strong one would stay connected when the signal never comes.
_waiting_holds = threading.local()


def _thread_holds() -> list[Held]:
    holds: list[Held] | None = getattr(_waiting_holds, "holds", None)
    if holds is None:
        holds = _waiting_holds.holds = []
    return holds


def _in_request() -> bool:
    """Whether this thread runs a request Django's handler will finish
    (``request_started`` sent, ``request_finished`` not yet)."""
    return bool(getattr(_waiting_holds, "requests", 0))


def release_rolled_back() -> None:
    """Release this thread's holds whose transactions ended without committing.

    A rollback drops the on-commit callbacks the holds wait for, and nothing else
    may come to release them soon: the request goes on (a retry loop takes the
    same lock again), or its handler re-raises (``DEBUG_PROPAGATE_EXCEPTIONS``)
    and never sends ``request_finished``. A hold whose transaction may still
    commit is left alone. Called before each decorated view takes its lock, at
    ``got_request_exception`` and at ``request_started``.
    """
    waiting = getattr(_waiting_holds, "holds", None)
    if not waiting:
        return
    for held in list(waiting):
        if not held.may_still_commit():
            held.release(raised=held.raised)


def _started(sender: object, **kwargs: Any) -> None:
    release_rolled_back()
    _waiting_holds.requests = getattr(_waiting_holds, "requests", 0) + 1


def _raised(sender: object, **kwargs: Any) -> None:
    release_rolled_back()


def _release_when_finished(sender: object, **kwargs: Any) -> None:
    """Release this thread's holds whose transactions ended without committing.

    A failed COMMIT (a deferred constraint, a serialization failure) makes Django
    drop the view's response, closer included, and serve a 500; a rollback drops
    the on-commit callbacks. Django's handlers send ``request_finished`` on the
    view's thread when the response that was served closes. A hold whose view
    raised has no closer: the request's end releases it whatever is still open
    (a test's own transaction).
    """
    _waiting_holds.requests = max(0, getattr(_waiting_holds, "requests", 0) - 1)
    holds = getattr(_waiting_holds, "holds", None)
    if not holds:
        return
    for held in list(holds):
        if held.raised or not held.may_still_commit():
            held.release(raised=held.raised)


request_started.connect(_started, dispatch_uid=f"{__name__}._started")
request_finished.connect(
    _release_when_finished, dispatch_uid=f"{__name__}._release_when_finished"
)
got_request_exception.connect(_raised, dispatch_uid=f"{__name__}._raised")


def _noop() -> None:
    """What a release closer is once pickled: the copy has nothing to release."""


class _Closer:
    """The release put on a response's closers; pickles to ``_noop``, so a cached
    response (``cache_page``, the per-site cache) is stored without the hold."""

    __slots__ = ("_held",)

    def __init__(self, held: Held) -> None:
        self._held = held

    def __call__(self) -> None:
        self._held.release()

    def __reduce__(self) -> tuple[Callable[[], None], tuple[()]]:
        return (_noop, ())


class Held:
    """One request's hold: released exactly once, after the commit if any."""

    def __init__(self, lock: Redlock, ttl: float, view_name: str) -> None:
        self.lock = lock
        self.ttl = ttl
        self.view_name = view_name
        self.started = time.monotonic()
        #: The blocking API's owner is the thread that acquired.
        self.thread = threading.current_thread()
        #: The hold's key in the registry, as acquired (settings may change).
        self.identity = lock._resolve().identity
        self._done = False
        self._mutex = threading.Lock()
        self._waiting: set[str] = set()
        #: The on-commit callback registered on each database alias.
        self._callbacks: dict[str, Callable[[], None]] = {}
        #: The view raised: released at its transaction's commit or the request's
        #: end, whichever comes first.
        self.raised = False

    def _claim(self) -> bool:
        with self._mutex:
            if self._done:
                return False
            self._done = True
            return True

    def _log_failure(self, exc: Exception, raised: bool) -> None:
        resource = self.lock.resource
        outcome = (
            "the view's exception propagates"
            if raised
            else "the response is returned anyway"
        )
        if isinstance(exc, LockLostError):
            logger.error(
                "redlock %r lost while view %s held it: held %.3fs with a ttl of "
                "%.3fs (%s); %s",
                resource,
                self.view_name,
                time.monotonic() - self.started,
                self.ttl,
                exc,
                outcome,
            )
        elif isinstance(exc, LockNotOwnedError):
            logger.warning(
                "redlock %r was already released when view %s finished: %s",
                resource,
                self.view_name,
                exc,
            )
        else:
            logger.error(
                "redlock %r: release after view %s failed; its lease ends within "
                "%.3fs; %s",
                resource,
                self.view_name,
                self.ttl,
                outcome,
                exc_info=exc,
            )

    def release(self, *, raised: bool = False) -> None:
        """Release now, on the acquiring thread; log, never raise."""
        holds = getattr(_waiting_holds, "holds", None)
        if holds and self in holds:
            holds.remove(self)
        if not self._claim():
            return
        if threading.current_thread() is not self.thread:
            # Only the owner can release. Django's handlers close responses on
            # the view's thread; its test AsyncClient does not.
            # Its watchdog stops, or the lease would be extended up to MAX_HOLD.
            self._stop_extending()
            logger.warning(
                "redlock %r of view %s: the response was closed on another thread "
                "than the view's, so the lock is left to expire within %.3fs",
                self.lock.resource,
                self.view_name,
                self.ttl,
            )
            return
        try:
            self.lock.release()
        except Exception as exc:
            reraise_interruption(exc)
            self._log_failure(exc, raised)

    def _stop_extending(self) -> None:
        """Halt the watchdog of the view thread's hold, from any thread."""
        hold = holds.find(self.thread, self.identity)
        if hold is not None and hold.watchdog is not None:
            hold.watchdog.halt()

    async def arelease(self, *, raised: bool = False) -> None:
        """Release now from the acquiring task; log, never raise."""
        if not self._claim():
            return
        try:
            await self.lock.arelease()
        except Exception as exc:
            reraise_interruption(exc)
            self._log_failure(exc, raised)

    def _wait_for_commit(self) -> bool:
        """Release when the open transactions commit; say whether any is open."""
        aliases = [
            connection.alias
            for connection in connections.all(initialized_only=True)
            if connection.in_atomic_block
        ]
        if not aliases:
            return False
        self._waiting = set(aliases)
        for alias in aliases:
            callback = functools.partial(self._committed, alias)
            self._callbacks[alias] = callback
            transaction.on_commit(callback, using=alias)
        return True

    def release_after_raise(self) -> None:
        """The view raised: release now, unless a request's transaction is open
        (a layer inside it may answer for the exception and commit the view's
        writes): then at its commit, or at the request's end."""
        if not _in_request() or not self._wait_for_commit():
            self.release(raised=True)
            return
        self.raised = True
        _thread_holds().append(self)

    def release_after_commit(self, response: object) -> None:
        """Release after the open transactions commit, or when ``response`` closes."""
        if not self._wait_for_commit():
            self.release()
            return
        # On rollback the on-commit callbacks are dropped; the handler closes the
        # response after its transaction has ended, whichever way it ended. When
        # the COMMIT itself fails, that response is dropped for a 500, whose
        # request_finished releases (_release_when_finished).
        _thread_holds().append(self)
        closers = getattr(response, "_resource_closers", None)
        if isinstance(closers, list):
            closers.append(_Closer(self))
        else:
            logger.warning(
                "redlock %r: view %s returned %r, which has no closer; after a "
                "rollback the lock is held until the request finishes or its "
                "lease ends",
                self.lock.resource,
                self.view_name,
                type(response).__name__,
            )

    def may_still_commit(self) -> bool:
        """Tell whether a transaction this hold waits for is still open.

        Its on-commit callback is still queued until the transaction commits (and
        runs it) or rolls back (and drops it), so a ``request_finished`` of some
        other request sent meanwhile on this thread does not release early.
        """
        for alias, callback in self._callbacks.items():
            queued = getattr(connections[alias], "run_on_commit", ())
            if any(callback in entry for entry in queued):
                return True
        return False

    def _committed(self, alias: str) -> None:
        with self._mutex:
            self._waiting.discard(alias)
            ready = not self._waiting
        if ready:
            self.release(raised=self.raised)
