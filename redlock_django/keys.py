"""Resource names and the Redis keys they live under, spelled in one place.

A lock on ``resource`` is the hash ``<prefix>:lock:<name>`` on every node and its
fencing counter the string ``<prefix>:fence:<name>``, where ``<name>`` is the
resource itself, or for a very long resource a readable head and a hash of the whole
(:func:`key_name`). The lock, the listing, the admin page, the command and the tests
all build keys here.
"""

from __future__ import annotations

import hashlib
import re

__all__ = [
    "MAX_NAME_LENGTH",
    "MAX_RESOURCE_LENGTH",
    "check_not_hashed",
    "check_resource",
    "fence_key",
    "handoff_key",
    "key_name",
    "lock_key",
    "lock_pattern",
    "queue_keys",
    "waiting_key",
    "wake_head",
]

#: Longest resource name kept whole in keys; longer names are hashed (key_name).
MAX_RESOURCE_LENGTH = 200
#: Longest resource a ``Redlock`` accepts at all.
MAX_NAME_LENGTH = 1000

_GLOB = re.compile(r"([*?\[\]\\])")


def check_resource(resource: object, limit: int = MAX_RESOURCE_LENGTH) -> str:
    """Return ``resource`` if it is a valid lock name, else raise ``ValueError``.

    A name is a non-empty string of at most ``limit`` printable characters:
    control, format (bidi overrides, zero-width) and line-separator characters
    would break or disguise logs, pages and keys.
    """
    if not isinstance(resource, str) or not resource:
        raise ValueError(f"resource must be a non-empty string, not {resource!r}")
    if len(resource) > limit:
        raise ValueError(
            f"resource is {len(resource)} characters long; the limit is {limit}"
        )
    if not resource.isprintable():
        raise ValueError(f"resource {resource!r} contains control characters")
    return resource


#: The form a long name takes in keys (``key_name``): a name written that way
#: would share another resource's keys.
_HASHED = re.compile(r".{160}~[0-9a-f]{32}", re.DOTALL)


def check_not_hashed(resource: str) -> str:
    """Return ``resource`` unless it has the form a hashed long name takes in
    keys (160 characters, ``~``, 32 hex digits): it would lock that long name's
    resource, not its own. ``ValueError`` otherwise."""
    if len(resource) <= MAX_RESOURCE_LENGTH and _HASHED.fullmatch(resource):
        raise ValueError(
            f"resource {resource[:40]!r}... has the form of a hashed long name (160 "
            "characters, '~', 32 hex digits): it would name another resource's "
            "lock; change it"
        )
    return resource


def key_name(resource: str) -> str:
    """The resource as it appears in keys, at most ``MAX_RESOURCE_LENGTH`` long.

    A longer name (say one built from user input) keeps its first 160 characters,
    for people reading the keys, and a hash of the whole name, so names that
    differ only in their tail still get different locks.
    """
    if len(resource) <= MAX_RESOURCE_LENGTH:
        return resource
    digest = hashlib.sha256(resource.encode()).hexdigest()[:32]
    return f"{resource[:160]}~{digest}"


def lock_key(resource: str, prefix: str) -> str:
    """The key of the lock hash for ``resource`` under ``prefix`` (``KEY_PREFIX``)."""
    return f"{prefix}:lock:{key_name(resource)}"


def fence_key(resource: str, prefix: str) -> str:
    """The key of the fencing counter for ``resource`` under ``prefix``."""
    return f"{prefix}:fence:{key_name(resource)}"


def queue_keys(resource: str, prefix: str) -> tuple[str, str, str]:
    """The keys of a fair lock's wait queue: entries, their expiries, the tickets."""
    name = key_name(resource)
    return (
        f"{prefix}:queue:{name}",
        f"{prefix}:waiters:{name}",
        f"{prefix}:ticket:{name}",
    )


def waiting_key(resource: str, prefix: str) -> str:
    """The waiting list of a lock that is not fair: the waiters a release may
    wake by name (``scripts._WAITING``)."""
    return f"{prefix}:waiting:{key_name(resource)}"


def handoff_key(resource: str, prefix: str) -> str:
    """A fair lock's hand-off records: what a release needs to hand the lock to
    each waiter (``scripts.FAIR_ACQUIRE_SCRIPT``), by waiter id."""
    return f"{prefix}:handoff:{key_name(resource)}"


def wake_head(prefix: str) -> str:
    """The start of the channel a process's fair waiters are woken on (the
    process's tag follows). Under the lock keys' name, so the documented ACL
    channel pattern covers it; the control character keeps it apart from every
    lock's own channel (its key), since resource names are printable."""
    return f"{prefix}:lock:\x1fwake:"


def lock_head(prefix: str) -> str:
    """What every lock key under ``prefix`` starts with; the rest is the key name."""
    return f"{prefix}:lock:"


def lock_pattern(prefix: str, search: str = "") -> str:
    """A SCAN pattern for the lock keys under ``prefix`` whose name contains ``search``.

    ``KEY_PREFIX`` is validated free of glob characters; ``search`` is escaped, so
    it matches literally.
    """
    escaped = _GLOB.sub(r"\\\1", search)
    return f"{lock_head(prefix)}*" + (f"{escaped}*" if escaped else "")
