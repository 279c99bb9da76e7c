"""System checks for the ``REDLOCK`` setting (tag ``redlock``).

The findings come from ``conf.validate()``, the same function ``get_settings()``
runs, so ``manage.py check`` and the ``ImproperlyConfigured`` raised at runtime
always agree, word for word. The messages carry the offending value (URLs masked),
so they are built there; this module keeps the ids, one constant each.

These checks never touch the network: they run before almost every management
command.

Errors:

- E001 ``REDLOCK`` is not a dict, or has an unknown key (the closest known key is
  suggested).
- E002 ``NODES`` is empty, not a list or tuple, or holds a non-string.
- E003 a ``NODES`` entry is a malformed URL.
- E004 a ``NODES`` entry names a cache alias that is missing or not a Redis cache.
- E005 two ``NODES`` entries are the same server and database.
- E006 ``TTL`` is not a positive finite number, or is more than a day.
- E007 ``DRIFT_FACTOR`` is outside [0, 0.5).
- E008 ``NODE_TIMEOUT`` is not positive, is not below ``TTL``, or leaves no validity.
- E009 ``WAIT_TIMEOUT``, ``RETRY_DELAY``, ``RETRY_JITTER`` or ``MAX_HOLD`` is invalid.
- E010 ``KEY_PREFIX`` is invalid.
- E011 ``AUTO_EXTEND`` is not a bool.

Warnings:

- W001 an even number of nodes (more than one).
- W002 two nodes are different databases of one server.
- W003 ``NODE_TIMEOUT`` is more than 5% of ``TTL``.
- W004 a ``rediss://`` node does not verify the server certificate.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from django.apps import AppConfig
from django.core.checks import CheckMessage, Error, Warning

from . import conf

__all__ = [
    "E001",
    "E002",
    "E003",
    "E004",
    "E005",
    "E006",
    "E007",
    "E008",
    "E009",
    "E010",
    "E011",
    "TAG",
    "W001",
    "W002",
    "W003",
    "W004",
    "check_settings",
]

TAG = "redlock"

E001 = "redlock.E001"
E002 = "redlock.E002"
E003 = "redlock.E003"
E004 = "redlock.E004"
E005 = "redlock.E005"
E006 = "redlock.E006"
E007 = "redlock.E007"
E008 = "redlock.E008"
E009 = "redlock.E009"
E010 = "redlock.E010"
E011 = "redlock.E011"
W001 = "redlock.W001"
W002 = "redlock.W002"
W003 = "redlock.W003"
W004 = "redlock.W004"

_OBJ = "settings.REDLOCK"


def check_settings(
    app_configs: Sequence[AppConfig] | None = None, **kwargs: Any
) -> list[CheckMessage]:
    """Return an Error or Warning for every problem of ``settings.REDLOCK``.

    The setting is project-wide, so ``app_configs`` is ignored (as Django's own
    cache checks do).
    """
    messages: list[CheckMessage] = []
    for problem in conf.validate(conf.raw_settings()):
        level = Error if problem.level == conf.ERROR else Warning
        messages.append(level(problem.msg, hint=problem.hint, obj=_OBJ, id=problem.id))
    return messages
