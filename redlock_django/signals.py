"""Django signals sent by every ``Redlock``; ``sender`` is the ``Redlock`` class.

Each sends ``lock`` (the ``Redlock``) and ``resource``, plus:

- ``lock_acquired``: ``waited`` (seconds spent acquiring), ``fencing_token``,
  ``attempts`` (tries on the nodes), ``wakeups`` (waits between tries that a
  release announcement cut short, see ``wake.py``), ``granted`` (nodes that
  granted the winning try), ``quorum`` and ``nodes`` (how many the lock runs on),
  ``handed`` (True when a fair lock's release handed it over with its wake-up,
  ``docs/fairness.md``: no try of its own won it, and its lease is the handed one
  until extended to the TTL).
- ``lock_contended``: ``waited``, ``error`` (the ``LockContentionError``); the
  wait ran out while others held it.
- ``lock_unavailable``: ``waited``, ``error``; too few nodes answered.
- ``lock_extended``: ``validity`` (seconds the new lease guarantees); sent for
  ``extend()`` and for every watchdog extension (from the watchdog's thread or task).
- ``lock_released``: ``held`` (seconds between grant and release), ``elapsed``
  (seconds the release on the nodes took), ``released`` (nodes that still had the
  lock and dropped it), ``lost`` (why the lease was lost while held, else None)
  and ``fencing_token``. Also sent, with ``released`` 0 and ``elapsed`` 0, for a
  lost hold dropped at its owner's next acquire: every ``lock_acquired`` is
  followed by one ``lock_released``.
- ``lock_lost``: ``held``, ``reason``, ``fencing_token``; once per hold, when a
  watchdog gives up or a release finds the lease ran out.

Extensions and losses seen by a watchdog are sent from its thread or task, which
runs in a copy of the acquiring owner's context (``contextvars``), so receivers
that read context (a trace's current span) see the acquirer's.

The library's own instruments (``metrics.py``, ``tracing.py``) are not receivers:
they are attached here (``attach()``) and called with the same arguments where
each signal is sent, before its receivers, without Django's dispatch (which cost
as much as both instruments' work: a twentieth of an uncontended lock cycle).
The signals cache their receivers per sender, so sending one with no receiver
costs about a dictionary lookup: they are always sent. They are sent
with ``send()`` below: a receiver that raises is logged (ERROR, on Django's
``django.dispatch`` logger) and never interrupts the lock, whose state must not
depend on a receiver (a lock granted but never returned to its caller would
stay held). What a signal handler raises while a receiver runs (a Celery soft
time limit) is the caller's interruption, and is raised.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any

from django.dispatch import Signal

from .interrupts import interruption

__all__ = [
    "lock_acquired",
    "lock_contended",
    "lock_extended",
    "lock_lost",
    "lock_released",
    "lock_unavailable",
]

lock_acquired = Signal(use_caching=True)
lock_contended = Signal(use_caching=True)
lock_unavailable = Signal(use_caching=True)
lock_extended = Signal(use_caching=True)
lock_released = Signal(use_caching=True)
lock_lost = Signal(use_caching=True)


logger = logging.getLogger(__name__)

#: The instruments attached to each signal, called in the order attached. Each
#: entry is a tuple, replaced whole under the lock: ``send`` reads without it.
_instruments: dict[Signal, tuple[Callable[[dict[str, Any]], None], ...]] = {}
_instruments_lock = threading.Lock()


def attach(signal: Signal, instrument: Callable[[dict[str, Any]], None]) -> None:
    """Call ``instrument(named)`` wherever ``signal`` is sent, before its
    receivers: ``named`` is the dict of the signal's arguments (``lock``,
    ``resource``, ...), the same for every instrument, which must not change it.
    Attaching it again changes nothing."""
    if not isinstance(signal, Signal):
        raise TypeError(
            f"attach() takes a django.dispatch.Signal (such as "
            f"redlock_django.signals.lock_acquired), not {signal!r}"
        )
    if not callable(instrument):
        raise TypeError(
            f"an instrument must be callable as instrument(named), not {instrument!r}"
        )
    with _instruments_lock:
        attached = _instruments.get(signal, ())
        if instrument not in attached:
            _instruments[signal] = (*attached, instrument)


def detach(signal: Signal, instrument: Callable[[dict[str, Any]], None]) -> None:
    """Stop calling ``instrument`` for ``signal``; not attached, nothing changes."""
    with _instruments_lock:
        left = tuple(i for i in _instruments.get(signal, ()) if i is not instrument)
        if left:
            _instruments[signal] = left
        else:
            _instruments.pop(signal, None)


def instruments(signal: Signal) -> tuple[Callable[[dict[str, Any]], None], ...]:
    """The instruments attached to ``signal``, in the order they are called."""
    return _instruments.get(signal, ())


def send(signal: Signal, sender: type, **named: Any) -> None:
    """Call the instruments attached to ``signal``, then send it to every
    receiver; what either raises is logged (an instrument's on this module's
    logger, a receiver's by Django, ERROR, on ``django.dispatch``), never raised.

    Except what a signal handler raised while one ran (a Celery soft time limit):
    it is the caller's interruption, not their failure, and is raised once every
    instrument and receiver ran.
    """
    interrupted: BaseException | None = None
    for instrument in _instruments.get(signal, ()):
        try:
            instrument(named)
        except Exception as exc:
            found = interruption(exc)
            if found is None:
                logger.exception("redlock instrument %s failed", instrument.__name__)
            elif interrupted is None:
                interrupted = found
    if signal.receivers:
        for _receiver, result in signal.send_robust(sender, **named):
            if isinstance(result, BaseException) and interrupted is None:
                interrupted = interruption(result)
    if interrupted is not None:
        raise interrupted
