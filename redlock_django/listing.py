"""The listing: a read-only view of the lock nodes, for the admin and the command.

It owns node health (``node_status()``), the held locks merged across the nodes
(``lock_resources()``, ``describe()``, ``held_locks()``, as ``ListedLock`` rows) and
the operator's forced release (``force_release()``); named ``listing``, not
``inspect``, so that it never shadows the standard library module.

Listing comes in two steps, so that a page of 10,000 held locks stays cheap:
``lock_resources()`` SCANs key names only (never KEYS, which blocks a node while it
walks every key), and ``describe()`` fetches the details (HGETALL + PTTL, one
pipeline per node) of just the resources on the page shown. ``force_release()`` is
the one write: a compare-and-delete against the token digest an operator saw.

Every node is asked at once, one thread each, so a hung node costs one timeout per
call rather than one per node. Node errors never raise out of this module: an
unreachable node shows up in ``node_status()``, is skipped (and logged) by the
listings, and is named in ``ForceRelease.failed``.

Inspection uses its own pools, with a timeout of ``max(NODE_TIMEOUT,
INSPECT_TIMEOUT)``. NODE_TIMEOUT is small because every millisecond a lock waits
for a node comes out of its validity window; a listing holds no lease and has no
such budget, while a SCAN batch of 1,000 keys or a pipeline of 200 commands on a
busy node can take longer than 50 ms. With NODE_TIMEOUT a loaded node would be
shown as unreachable and its locks silently dropped from the page. Half a second
still bounds a page load when a node hangs, because the nodes are asked in
parallel; ``INSPECT_DEADLINE`` bounds a whole SCAN walk of one node.

Tokens are capabilities (whoever knows one can release or extend the lock), so only
``token_digest`` (a 12 hex digit prefix of the token's SHA1) ever leaves this
module; node addresses are ``NodeSpec.display``, which never holds a password.
"""

from __future__ import annotations

import hashlib
import logging
import math
import re
import secrets
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, TypeVar

import redis
from redis.exceptions import ResponseError

from . import meta
from . import nodes as node_pools
from .address import NodeSpec
from .conf import RedlockSettings, get_settings
from .interrupts import reraise_interruption
from .keys import (
    MAX_NAME_LENGTH,
    check_resource,
    lock_head,
    lock_key,
    lock_pattern,
    queue_keys,
    wake_head,
)
from .protocol import has_quorum, quorum, release_id, unanswered_may_hold
from .scripts import FORCE_RELEASE_SCRIPT

__all__ = [
    "DIGEST_LENGTH",
    "INSPECT_DEADLINE",
    "INSPECT_TIMEOUT",
    "SCAN_CAP",
    "SCAN_COUNT",
    "ForceRelease",
    "ListedLock",
    "NodeStatus",
    "describe",
    "force_release",
    "held_locks",
    "lock_resources",
    "node_status",
    "token_digest",
]

logger = logging.getLogger(__name__)

T = TypeVar("T")

#: Seconds each inspection command may take on one node (at least NODE_TIMEOUT).
INSPECT_TIMEOUT = 0.5
#: Seconds a whole SCAN walk of one node may take before it is abandoned.
INSPECT_DEADLINE = 5.0
#: The COUNT hint of each SCAN call: keys the node examines per round trip.
SCAN_COUNT = 1000
#: Most lock keys read from one node; ``NodeStatus.lock_keys == SCAN_CAP`` means
#: "at least this many", and ``lock_resources()`` lists no more than this per node.
SCAN_CAP = 100_000
#: Hex digits of the token's SHA1 shown in place of the token.
DIGEST_LENGTH = 12
#: Resources per pipeline in ``describe()``: bounds one round trip's size.
_DESCRIBE_BATCH = 1000

_DIGEST = re.compile(rf"[0-9a-f]{{{DIGEST_LENGTH},40}}")


@dataclass(frozen=True)
class NodeStatus:
    """Health of one node: reachable or not, latency, server, lock keys.

    ``address`` is ``NodeSpec.display`` (never a password). ``latency_ms`` is a
    PING round trip on an open connection; ``server`` is ``"redis"`` or
    ``"valkey"`` and ``version`` that server's own version (Valkey reports
    ``valkey_version`` beside a fixed ``redis_version``); ``lock_keys`` counts
    the keys under ``<prefix>:lock:`` (``SCAN_CAP`` means at least that many; None
    when the count failed). ``error`` says briefly why the node is unreachable,
    without credentials.
    """

    index: int
    address: str
    reachable: bool
    latency_ms: float | None
    version: str | None
    lock_keys: int | None
    error: str | None
    server: str | None = None

    @property
    def server_version(self) -> str | None:
        """The server and its version in one word, e.g. ``valkey-9.1.2``."""
        if self.version is None:
            return None
        return f"{self.server or 'redis'}-{self.version}"


@dataclass(frozen=True)
class ListedLock:
    """One lock as the nodes hold it right now, merged across the nodes.

    The token held on most nodes is *the* lock: ``token_digest`` (a prefix of its
    SHA1, never the token), ``nodes`` (the indices holding it) and the holder
    metadata come from it; ``other_tokens`` counts nodes holding anything else
    under the same key (leftovers of another owner's failed attempt). A lock held
    on fewer than ``quorum`` nodes is still listed: ``below_quorum`` flags it.
    ``time_left`` is the smallest lease left among ``nodes``, in seconds
    (``math.inf`` for a key without expiry, which the library never writes).
    Not to be confused with ``models.HeldLock``, the model behind the admin page's
    permissions.
    """

    resource: str
    token_digest: str
    nodes: tuple[int, ...]
    node_count: int
    quorum: int
    host: str | None
    pid: int | None
    holder: str | None
    label: str
    acquired_at: datetime | None
    ttl: float | None
    time_left: float
    fencing_token: int | None
    other_tokens: int
    #: The holder's pid namespace (``meta.pid_namespace()``), None if unknown.
    ns: str | None = None

    @property
    def held_on(self) -> int:
        """Return on how many nodes the lock's token is held."""
        return len(self.nodes)

    @property
    def below_quorum(self) -> bool:
        """Return whether the token is held on fewer nodes than a quorum."""
        return not has_quorum(self.held_on, self.node_count)


@dataclass(frozen=True)
class ForceRelease:
    """Outcome of ``force_release()`` on every node.

    ``released``: indices of the nodes where the key with that token was deleted;
    ``failed``: node address -> why the node could not be asked; ``changed``:
    nothing was released, and the nodes that answered are enough to say why (the
    others could not be a quorum): none held that token any more (the lock
    expired, was released, or changed hands since it was shown).
    """

    released: tuple[int, ...]
    failed: dict[str, str] = field(default_factory=dict)
    changed: bool = False


def token_digest(token: bytes | str) -> str:
    """Return the digest shown for ``token``: the first hex digits of its SHA1."""
    if isinstance(token, str):
        token = token.encode()
    return hashlib.sha1(token, usedforsecurity=False).hexdigest()[:DIGEST_LENGTH]


# --- running on every node ------------------------------------------------------


#: The clients of the last pools listed: the pools are cached until the settings
#: change, and a client built per call costs its construction and, when dropped,
#: a finalizer (where a Ctrl-C landing is lost: Python ignores it there).
_last_clients: tuple[tuple[redis.ConnectionPool, ...], list[redis.Redis]] | None = None


def _clients(conf: RedlockSettings) -> list[redis.Redis]:
    global _last_clients
    timeout = max(conf.node_timeout, INSPECT_TIMEOUT)
    pools = node_pools.sync_pools(conf.nodes, timeout)
    last = _last_clients
    if last is not None and last[0] is pools:
        return last[1]
    clients = [redis.Redis(connection_pool=pool) for pool in pools]
    _last_clients = (pools, clients)
    return clients


def _on_every_node(
    conf: RedlockSettings, work: Callable[[redis.Redis], T]
) -> list[T | Exception]:
    """Run ``work`` on every node at once; return its result or error per node."""
    clients = _clients(conf)

    def run(client: redis.Redis) -> T | Exception:
        try:
            return work(client)
        except Exception as exc:
            reraise_interruption(exc)  # inline, on the caller's thread
            return exc

    if len(clients) == 1:
        return [run(clients[0])]
    with ThreadPoolExecutor(
        max_workers=len(clients), thread_name_prefix="redlock-inspect"
    ) as executor:
        return list(executor.map(run, clients))


class _DeadlineError(Exception):
    """A SCAN walk of one node took longer than ``INSPECT_DEADLINE``."""

    def __str__(self) -> str:
        return f"scan took longer than {INSPECT_DEADLINE:g}s"


def _reason(exc: Exception) -> str:
    """Say why a node failed, in a line with no credentials in it."""
    return str(exc) if isinstance(exc, _DeadlineError) else node_pools.describe(exc)


def _scan(client: redis.Redis, pattern: str) -> Iterable[bytes]:
    """Yield the keys matching ``pattern``, up to ``SCAN_CAP`` of them."""
    deadline = time.monotonic() + INSPECT_DEADLINE
    cursor = 0
    found = 0
    while True:
        cursor, keys = client.scan(cursor, match=pattern, count=SCAN_COUNT)
        for key in keys:
            # decode_responses is off in the pools: keys come back as bytes.
            yield key if isinstance(key, bytes) else key.encode()
            found += 1
            if found >= SCAN_CAP:
                return
        if cursor == 0:
            return
        if time.monotonic() > deadline:
            raise _DeadlineError


# --- node health ----------------------------------------------------------------


def server_of(info: Mapping[str, Any]) -> tuple[str, str | None]:
    """Return the server kind and its own version from ``INFO server``.

    Valkey keeps ``redis_version`` at 7.2.4 for clients that test it, and gives
    its own version as ``valkey_version`` (and ``server_name:valkey`` from 8.0).
    """
    valkey = info.get("valkey_version")
    if valkey is not None or info.get("server_name") in ("valkey", b"valkey"):
        return "valkey", None if valkey is None else _text(valkey)
    redis_version = info.get("redis_version")
    return "redis", None if redis_version is None else _text(redis_version)


def _text(value: object) -> str:
    return value.decode(errors="replace") if isinstance(value, bytes) else str(value)


def node_status() -> list[NodeStatus]:
    """Return the health of every configured node, in ``NODES`` order.

    Never raises for a node: an unreachable one has ``reachable=False`` and a short
    ``error``. A node that answers PING but refuses INFO or SCAN (an ACL without
    them) is reachable with ``version`` or ``lock_keys`` None.
    """
    conf = get_settings()
    pattern = lock_pattern(conf.key_prefix)

    def probe(client: redis.Redis) -> tuple[float, str | None, str | None, int | None]:
        # The first PING may open the connection; time the second, a pure round trip.
        client.ping()
        started = time.monotonic()
        client.ping()
        latency_ms = (time.monotonic() - started) * 1000
        server: str | None
        version: str | None
        try:
            server, version = server_of(client.info("server"))
        except redis.ConnectionError:
            raise
        except redis.RedisError:
            server = version = None
        lock_keys: int | None
        try:
            lock_keys = sum(1 for _ in _scan(client, pattern))
        except (redis.ConnectionError, redis.TimeoutError):
            raise
        except (redis.RedisError, _DeadlineError):
            lock_keys = None
        return latency_ms, server, version, lock_keys

    statuses = []
    for node, outcome in zip(conf.nodes, _on_every_node(conf, probe), strict=True):
        if isinstance(outcome, Exception):
            statuses.append(
                NodeStatus(
                    node.index,
                    node.display,
                    False,
                    None,
                    None,
                    None,
                    _reason(outcome),
                )
            )
        else:
            latency_ms, server, version, lock_keys = outcome
            statuses.append(
                NodeStatus(
                    node.index,
                    node.display,
                    True,
                    latency_ms,
                    version,
                    lock_keys,
                    None,
                    server,
                )
            )
    return statuses


# --- listing --------------------------------------------------------------------


def lock_resources(
    search: str = "",
    *,
    descending: bool = False,
    failed: dict[str, str] | None = None,
) -> list[str]:
    """Return the resources with a lock key on any node whose name contains ``search``.

    SCAN MATCH ``<prefix>:lock:*<search>*`` (glob characters in ``search``
    escaped, so it matches literally and case-sensitively) with COUNT on every
    node, never KEYS; the union, sorted (``descending`` reverses it). Only names
    are read, so this stays cheap with many locks; ``describe()`` the page shown.
    A node that fails is skipped (and logged, and recorded as address -> reason in
    ``failed`` when a dict is given); at most ``SCAN_CAP`` keys are read per node.
    """
    conf = get_settings()
    pattern = lock_pattern(conf.key_prefix, search)
    head = lock_head(conf.key_prefix).encode()

    def scan(client: redis.Redis) -> list[bytes]:
        return list(_scan(client, pattern))

    resources: set[str] = set()
    for node, outcome in zip(conf.nodes, _on_every_node(conf, scan), strict=True):
        if isinstance(outcome, Exception):
            _skipped(node, outcome, failed)
            continue
        if len(outcome) >= SCAN_CAP:
            logger.warning(
                "redlock inspection read only the first %d lock keys of %s",
                SCAN_CAP,
                node.display,
            )
        for key in outcome:
            if not key.startswith(head):
                continue
            try:
                resources.add(key[len(head) :].decode())
            except UnicodeDecodeError:
                # Not written by this library, which encodes str resources.
                continue
    return sorted(resources, reverse=descending)


def _skipped(node: NodeSpec, exc: Exception, failed: dict[str, str] | None) -> None:
    reason = _reason(exc)
    logger.info("redlock inspection skipped %s: %s", node.display, reason)
    if failed is not None:
        failed[node.display] = reason


@dataclass
class _Seen:
    """What one node holds under one resource's key."""

    node: int
    fields: dict[bytes, bytes]
    pttl: int


def describe(
    resources: Sequence[str], *, failed: dict[str, str] | None = None
) -> list[ListedLock]:
    """Return the held locks of ``resources``, in the order given.

    One pipeline per node (HGETALL and PTTL for each resource), all nodes at
    once. A resource that no node holds with a token (gone meanwhile, or only a
    value of another kind) is omitted; a failed node is skipped (and logged, and
    recorded as address -> reason in ``failed`` when a dict is given).
    """
    conf = get_settings()
    resources = list(dict.fromkeys(resources))
    keys = [lock_key(resource, conf.key_prefix) for resource in resources]

    def fetch(client: redis.Redis) -> list[Any]:
        replies: list[Any] = []
        for start in range(0, len(keys), _DESCRIBE_BATCH):
            pipe = client.pipeline(transaction=False)
            for key in keys[start : start + _DESCRIBE_BATCH]:
                pipe.hgetall(key)
                pipe.pttl(key)
            replies.extend(pipe.execute(raise_on_error=False))
        return replies

    if not keys:
        return []
    per_node = _on_every_node(conf, fetch)
    seen: list[list[_Seen]] = [[] for _ in resources]
    foreign = [0] * len(resources)
    for node, outcome in zip(conf.nodes, per_node, strict=True):
        if isinstance(outcome, Exception):
            _skipped(node, outcome, failed)
            continue
        for position in range(len(resources)):
            fields, pttl = outcome[2 * position], outcome[2 * position + 1]
            if isinstance(fields, ResponseError) or isinstance(pttl, ResponseError):
                # WRONGTYPE: a value of another kind blocks the key on this node.
                foreign[position] += 1
            elif not fields or pttl == -2:
                continue
            elif b"token" not in fields:
                foreign[position] += 1
            else:
                seen[position].append(_Seen(node.index, fields, pttl))

    held = []
    for resource, entries, others in zip(resources, seen, foreign, strict=True):
        merged = _merge(resource, entries, others, len(conf.nodes))
        if merged is not None:
            held.append(merged)
    return held


def held_locks(
    search: str = "", *, failed: dict[str, str] | None = None
) -> list[ListedLock]:
    """Return every held lock whose resource contains ``search``; for small sets."""
    return describe(lock_resources(search, failed=failed), failed=failed)


def _merge(
    resource: str, entries: list[_Seen], foreign: int, node_count: int
) -> ListedLock | None:
    by_token: dict[bytes, list[_Seen]] = {}
    for entry in entries:
        by_token.setdefault(entry.fields[b"token"], []).append(entry)
    if not by_token:
        return None

    def lease_ms(entry: _Seen) -> float:
        return math.inf if entry.pttl == -1 else entry.pttl

    # Most nodes wins; on a tie, the longer lease (the later attempt), then the
    # digest, so the choice is the same on every refresh.
    token, holding = max(
        by_token.items(),
        key=lambda item: (
            len(item[1]),
            min(lease_ms(entry) for entry in item[1]),
            token_digest(item[0]),
        ),
    )
    holder = meta.decode(holding[0].fields.get(b"meta"))
    fences = [meta.as_int(entry.fields.get(b"fence")) for entry in holding]
    known_fences = [fence for fence in fences if fence is not None]
    left_ms = min(lease_ms(entry) for entry in holding)
    return ListedLock(
        resource=resource,
        token_digest=token_digest(token),
        nodes=tuple(sorted(entry.node for entry in holding)),
        node_count=node_count,
        quorum=quorum(node_count),
        host=holder.host,
        pid=holder.pid,
        holder=holder.holder,
        label=holder.label,
        acquired_at=holder.acquired_at,
        ttl=holder.ttl,
        time_left=left_ms / 1000,
        fencing_token=max(known_fences) if known_fences else None,
        other_tokens=len(entries) - len(holding) + foreign,
        ns=holder.ns,
    )


# --- force release --------------------------------------------------------------


def force_release(resource: str, token_digest: str) -> ForceRelease:
    """Delete ``resource``'s lock on every node where its token matches the digest.

    A compare-and-delete (``FORCE_RELEASE_SCRIPT``), never a generic DEL: a node
    deletes the key only if the SHA1 of the token it holds starts with
    ``token_digest``, so a lock that changed hands since it was shown is left
    alone (``changed``). Only keys under the configured prefix can be reached.
    A node that deletes it wakes the lock's waiters as a release does: a fair
    lock's first live waiter by name (expired queue entries ahead of it dropped,
    as a release drops them), the others on the lock's channel.
    Raise ``ValueError`` for an invalid resource name or a digest that is not
    12 to 40 hex digits; node errors are reported in ``failed``, never raised.
    The caller logs who asked for it.
    """
    check_resource(resource, MAX_NAME_LENGTH)
    digest = token_digest.lower() if isinstance(token_digest, str) else ""
    if not _DIGEST.fullmatch(digest):
        raise ValueError(
            f"token_digest must be {DIGEST_LENGTH} to 40 hex digits, "
            f"not {token_digest!r}"
        )
    conf = get_settings()
    key = lock_key(resource, conf.key_prefix)
    queue, waiters, _ = queue_keys(resource, conf.key_prefix)
    head = wake_head(conf.key_prefix)
    script = FORCE_RELEASE_SCRIPT

    # One wake-up for every node's publish: its waiters are woken once a
    # majority of the nodes reported it, as after a release (a fair lock's first
    # waiter by name, on its process's channel).
    wake = release_id(f"forced {secrets.token_hex(8)}")

    def run(client: redis.Redis) -> int:
        return int(
            client.eval(script.source, 3, key, queue, waiters, digest, wake, head)
        )

    released: list[int] = []
    failed: dict[str, str] = {}
    for node, outcome in zip(conf.nodes, _on_every_node(conf, run), strict=True):
        if isinstance(outcome, Exception):
            failed[node.display] = _reason(outcome)
        elif outcome:
            released.append(node.index)
    # Nothing released, and the nodes that did not answer could not hold a
    # quorum on their own: the lock with that token is gone or changed hands.
    unsure = unanswered_may_hold(len(failed), len(conf.nodes))
    return ForceRelease(
        released=tuple(released),
        failed=failed,
        changed=not released and not unsure,
    )
