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

The signals cache their receivers per sender, so sending one (with or without
receivers) costs about a dictionary lookup: they are always sent. They are sent
with ``send()`` below: a receiver that raises is logged (ERROR, on Django's
``django.dispatch`` logger) and never interrupts the lock, whose state must not
depend on a receiver (a lock granted but never returned to its caller would
stay held). What a signal handler raises while a receiver runs (a Celery soft
time limit) is the caller's interruption, and is raised.
"""

from __future__ import annotations

from typing import Any

from django.dispatch import Signal

from .interrupts import reraise_interruption

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


def send(signal: Signal, sender: type, **named: Any) -> None:
    """Send ``signal`` to every receiver; what a receiver raises is logged by
    Django (ERROR, on the ``django.dispatch`` logger), never raised here.

    Except what a signal handler raised while a receiver ran (a Celery soft time
    limit): it is the caller's interruption, not the receiver's failure, and is
    raised once every receiver ran.
    """
    if not signal.receivers:
        return  # nobody listens: skip Django's lookups
    for _receiver, result in signal.send_robust(sender, **named):
        if isinstance(result, BaseException):
            reraise_interruption(result)
