"""Exceptions raised by redlock_django.

One base class, and one subclass for each situation a caller handles differently::

    LockError                   base; always has .resource
    ├── LockContentionError     someone else holds it and the wait ran out (HTTP 423)
    ├── QuorumUnavailableError  fewer than a majority of nodes answered in time: an
    │                           outage, not contention (HTTP 503)
    ├── LockNotOwnedError       release/extend of a lock this owner does not hold
    ├── LockLostError           the lease ran out (or an extension failed) while held:
    │                           the protected work may have overlapped another holder
    └── StaleFencingTokenError  a fenced write (orm.py) was refused: the row holds
                                this lock's fencing token or a newer one, or was
                                written since the instance was read

    MissingFencingTokenError    a ValueError, not a LockError: a fenced write (orm.py)
                                was given a lock that has no token (made without
                                ``fencing=True``, or not held by this owner)

Raw ``redis.exceptions`` never escape the public API: per-node failures are reported
as text in ``.failed`` (node display name -> reason), never with credentials.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

__all__ = [
    "LockContentionError",
    "LockError",
    "LockLostError",
    "LockNotOwnedError",
    "MissingFencingTokenError",
    "QuorumUnavailableError",
    "StaleFencingTokenError",
]


def _rebuild(cls: type[Exception], args: tuple[Any, ...], state: dict[str, Any]) -> Any:
    """Recreate a pickled error without calling its keyword-only ``__init__``."""
    error = cls.__new__(cls, *args)
    error.args = args
    error.__dict__.update(state)
    return error


class _Picklable:
    """Pickle with the context fields: the default would call ``cls(message)``,
    which fails for keyword-only fields (multiprocessing, Celery results)."""

    args: tuple[Any, ...]

    def __reduce__(self) -> tuple[Any, ...]:
        return (_rebuild, (type(self), self.args, dict(self.__dict__)))


class LockError(_Picklable, Exception):
    """Base class of every error about a Redlock lock."""

    def __init__(
        self,
        message: str,
        *,
        resource: str,
        granted: int = 0,
        nodes: int = 0,
        quorum: int = 0,
        failed: Mapping[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.resource = resource
        #: How many nodes granted (or confirmed) the operation.
        self.granted = granted
        #: How many nodes the lock runs on.
        self.nodes = nodes
        #: How many nodes must agree: ``nodes // 2 + 1``.
        self.quorum = quorum
        #: Nodes that did not answer or answered with an error: display name -> reason.
        self.failed: dict[str, str] = dict(failed or {})


class LockContentionError(LockError):
    """Someone else holds the lock and the wait for it ran out."""


class QuorumUnavailableError(LockError):
    """Fewer than a quorum of nodes answered in time; waiting longer will not help."""


class LockNotOwnedError(LockError):
    """The current owner does not hold the lock it tried to release or extend."""


class LockLostError(LockError):
    """The lease ran out, or could not be extended, while the lock was held."""


class MissingFencingTokenError(_Picklable, ValueError):
    """A fenced write was given a lock that has no fencing token for this owner.

    A ``ValueError`` (a bad argument, a bug to fix), deliberately not a
    ``LockError``: code that turns lock failures into 423/503 responses must not
    hide it.
    """

    def __init__(self, message: str, *, resource: str) -> None:
        super().__init__(message)
        self.resource = resource


class StaleFencingTokenError(LockError):
    """A fenced write was refused: the row holds the lock's token or a newer one,
    or was written since the instance was read.

    A lease ran out while held and another holder wrote the row (or this token
    already wrote it once). ``token`` is the lock's, ``stored_token`` the row's,
    ``read_token`` the one the instance was read with (None for a queryset).
    """

    def __init__(
        self,
        message: str,
        *,
        resource: str,
        token: int,
        stored_token: int,
        read_token: int | None = None,
    ) -> None:
        super().__init__(message, resource=resource)
        self.token = token
        self.stored_token = stored_token
        self.read_token = read_token
