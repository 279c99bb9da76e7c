"""Telling an exception a signal handler raised from the failure it interrupted.

A Celery soft time limit raises ``SoftTimeLimitExceeded``, an ordinary
``Exception``, from its SIGUSR1 handler, in whatever the main thread was running:
a node's reply being read, a signal receiver. Where the lock takes any
``Exception`` there for a node's failure (or a receiver's), it must give such an
interruption back to its caller instead, or a task past its limit waits on.

An exception is an interruption when a Python signal handler installed now is
among the frames it was raised through, in itself or in an exception it was
raised while handling (redis-py rewraps what breaks a socket read as a
``ConnectionError``). Handlers run in the main thread only; the check runs only
on the way out of a failure, never on a fast path.
"""

from __future__ import annotations

import signal
import threading
from types import CodeType, TracebackType

__all__ = ["interruption", "reraise_interruption"]


def _handler_codes() -> set[CodeType]:
    codes: set[CodeType] = set()
    for signum in signal.valid_signals():
        try:
            handler = signal.getsignal(signum)
        except (OSError, ValueError):  # pragma: no cover - a platform's oddity
            continue
        if not callable(handler):
            continue
        func = getattr(handler, "__func__", handler)  # a bound method
        code = getattr(func, "__code__", None)
        if code is None:  # an object with __call__
            code = getattr(type(handler).__call__, "__code__", None)
        if isinstance(code, CodeType):
            codes.add(code)
    return codes


def _through(tb: TracebackType | None, codes: set[CodeType]) -> bool:
    while tb is not None:
        if tb.tb_frame.f_code in codes:
            return True
        tb = tb.tb_next
    return False


def interruption(exc: BaseException) -> BaseException | None:
    """Return the exception a signal handler raised that ``exc`` is or wraps, if any."""
    if threading.current_thread() is not threading.main_thread():
        return None
    codes = _handler_codes()
    if not codes:
        return None
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if _through(current.__traceback__, codes):
            return current
        current = current.__cause__ or current.__context__
    return None


def reraise_interruption(exc: BaseException) -> None:
    """Raise the signal handler's exception ``exc`` is or wraps; else return."""
    found = interruption(exc)
    if found is not None:
        raise found
