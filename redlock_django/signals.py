"""Django signals sent by every ``Redlock``; ``sender`` is the ``Redlock`` class.

Each sends ``lock`` (the ``Redlock``) and ``resource``, plus:

- ``lock_acquired``: ``waited`` (seconds spent acquiring), ``fencing_token``,
  ``attempts`` (tries on the nodes) and ``wakeups`` (waits between tries that a
  release announcement cut short, see ``wake.py``).
- ``lock_contended``: ``waited``, ``error`` (the ``LockContentionError``); the
  wait ran out while others held it.
- ``lock_unavailable``: ``waited``, ``error``; too few nodes answered.
- ``lock_extended``: ``validity`` (seconds the new lease guarantees); sent for
  ``extend()`` and for every watchdog extension (from the watchdog's thread or task).
- ``lock_released``: ``held`` (seconds between grant and release).
- ``lock_lost``: ``held``, ``reason``; once per hold, when a watchdog gives up or a
  release finds the lease ran out.

The signals cache their receivers per sender, so sending one (with or without
receivers) costs about a dictionary lookup: they are always sent.
"""

from __future__ import annotations

from django.dispatch import Signal

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
