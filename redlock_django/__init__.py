"""Redlock distributed locks for Django: a majority of independent Redis masters.

See ``Redlock`` for the lock itself and ``exceptions`` for what it raises.
"""

from .exceptions import (
    LockContentionError,
    LockError,
    LockLostError,
    LockNotOwnedError,
    QuorumUnavailableError,
)
from .lock import Redlock

__version__ = "0.1.0"

__all__ = [
    "LockContentionError",
    "LockError",
    "LockLostError",
    "LockNotOwnedError",
    "QuorumUnavailableError",
    "Redlock",
    "__version__",
]
