"""Redlock distributed locks for Django: a majority of independent Redis masters.

See ``Redlock`` for the lock itself and ``exceptions`` for what it raises.
"""

from .decorators import DistributedLockMixin, distributed_lock
from .exceptions import (
    LockContentionError,
    LockError,
    LockLostError,
    LockNotOwnedError,
    MissingFencingTokenError,
    QuorumUnavailableError,
    StaleFencingTokenError,
)
from .functions import current_lock, locked
from .lock import Redlock
from .orm import (
    FencedQuerySet,
    FencingTokenField,
    afenced_update,
    fenced_update,
    model_lock,
    model_resource,
)

__version__ = "0.1.0"

__all__ = [
    "DistributedLockMixin",
    "FencedQuerySet",
    "FencingTokenField",
    "LockContentionError",
    "LockError",
    "LockLostError",
    "LockNotOwnedError",
    "MissingFencingTokenError",
    "QuorumUnavailableError",
    "Redlock",
    "StaleFencingTokenError",
    "__version__",
    "afenced_update",
    "current_lock",
    "distributed_lock",
    "fenced_update",
    "locked",
    "model_lock",
    "model_resource",
]
