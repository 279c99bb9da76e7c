"""Per-node redis-py connection pools, built once and cached until settings change.

The pools are built from ``address.connection_params()`` and closed by this
module's own ``setting_changed`` receiver when ``REDLOCK`` or ``CACHES`` changes.

Every pool gets the lock's own network rules, whatever the URL or cache it came from:
socket and connect timeouts of NODE_TIMEOUT and no automatic retries (redis-py 8
defaults to 5 s timeouts and 10 retries, so one hung node would cost a minute, and
a retried SET NX is not idempotent). RESP2 and no CLIENT SETINFO, so a new
connection costs no extra round trip. asyncio pools belong to one event loop, so
they are cached per loop; their connections refer to the loop, so a closed loop's
are closed by hand when the next loop starts (``asyncio.run()`` per call would
otherwise keep every loop and one socket per node).

Blocking connections pack redis-py's commands with ``wire.TextPacker`` (hiredis,
numbers written out first): hiredis formats a number with an unchecked ``repr()``,
which runs pending signal handlers, so a Ctrl-C landing there crashed the process.

Blocking TLS connections use redis-py's pure-Python reply parser, even when hiredis
is installed. With TLS 1.3 the server sends its session tickets just after the
handshake; with nothing sent on connect, they are still unread when the pool checks
the fresh connection for leftover data. The hiredis parser only asks the socket
whether it is readable, takes the tickets for a stray reply, and the pool reconnects,
or fails with "Connection not ready" (about one new TLS connection in six on
loopback). The Python parser reads through the TLS layer, which consumes them.

Building an ``ssl.SSLContext`` loads the system CA store: 30-60 ms of CPU. redis-py
builds one per asyncio connection, inside the node call, and on the event loop, so
the first fan-out to N TLS nodes spent N times that under one NODE_TIMEOUT and the
last nodes timed out. An asyncio pool here builds its context once, when the pool
is made (before any timed call), and every connection of the pool shares it.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import socket
import threading
import weakref
from collections.abc import Sequence
from typing import Any

import redis
import redis.asyncio
import redis.asyncio.connection
import redis.connection
from django.core.signals import setting_changed
from redis.backoff import NoBackoff
from redis.retry import Retry

from .address import NodeSpec, connection_params
from .protocol import TIMED_OUT
from .sockets import shut_down
from .wire import TextPacker

try:  # private: a redis-py without it leaves TLS connections their default parser
    from redis._parsers import _RESP2Parser
except ImportError:  # pragma: no cover - another redis-py layout
    _RESP2Parser = None  # type: ignore[assignment,misc]

__all__ = ["async_clients", "describe", "reset", "sync_pools"]

_lock = threading.Lock()
_sync: dict[tuple[Any, ...], tuple[redis.ConnectionPool, ...]] = {}
_async: weakref.WeakKeyDictionary[
    asyncio.AbstractEventLoop,
    dict[tuple[Any, ...], tuple[redis.asyncio.Redis, ...]],
] = weakref.WeakKeyDictionary()

# Connection kwargs that select no CLIENT SETINFO: driver_info in redis-py >= 7.1,
# lib_name/lib_version before it.
_NO_SETINFO: dict[str, Any] = (
    {"driver_info": None}
    if hasattr(redis.connection, "DriverInfo")
    else {"lib_name": None, "lib_version": None}
)


_ACL_USER = re.compile(r"\bUser \S+ has\b")


def describe(exc: BaseException) -> str:
    """Say why a node failed, in a line with no credentials in it."""
    if isinstance(exc, redis.TimeoutError | TimeoutError):
        return TIMED_OUT
    text = str(exc).splitlines()[0] if str(exc) else ""
    # Valkey and Redis 7.2+ name the ACL user in NOPERM errors.
    text = _ACL_USER.sub("this user has", text)
    return f"{type(exc).__name__}: {text}"[:200] if text else type(exc).__name__


class _SharedContextSSLConnection(redis.asyncio.connection.SSLConnection):
    """An asyncio TLS connection that uses its pool's ready-made SSL context."""

    def __init__(self, *, shared_context: Any = None, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        if shared_context is not None:
            self.ssl_context = shared_context


def _kwargs(node: NodeSpec, timeout: float) -> tuple[type[Any], dict[str, Any]]:
    connection_class, kwargs = connection_params(node)
    kwargs.update(
        socket_timeout=timeout,
        socket_connect_timeout=timeout,
        retry=Retry(NoBackoff(), 0),
        retry_on_timeout=False,
        retry_on_error=[],
        health_check_interval=0,
        decode_responses=False,
        **_NO_SETINFO,
    )
    if kwargs.get("protocol") is None:
        kwargs["protocol"] = 2
    for unused in ("connection_pool_class", "max_connections_per_node"):
        kwargs.pop(unused, None)
    # A cache's pool may name its parser: only the blocking pools get one here.
    kwargs.pop("parser_class", None)
    return connection_class, kwargs


def _key(nodes: Sequence[NodeSpec], timeout: float) -> tuple[Any, ...]:
    global _last_key
    last_nodes, last_timeout, key = _last_key
    # Every lock under one settings object (or one cached ``nodes=[...]`` list)
    # passes the same tuple: its key is made once, not at every acquire and release.
    if nodes is last_nodes and timeout == last_timeout and type(nodes) is tuple:
        return key
    key = (tuple((n.entry, n.identity) for n in nodes), timeout)
    _last_key = (nodes, timeout, key)
    return key


#: The last node list ``_key`` was given, its timeout and its key (one tuple,
#: replaced whole, so threads never see half of one).
_last_key: tuple[Any, float, tuple[Any, ...]] = ((), 0.0, ((), 0.0))


def sync_pools(
    nodes: Sequence[NodeSpec], timeout: float
) -> tuple[redis.ConnectionPool, ...]:
    """Return one blocking connection pool per node, shared by every lock."""
    key = _key(nodes, timeout)
    pools = _sync.get(key)
    if pools is None:
        with _lock:
            pools = _sync.get(key)
            if pools is None:
                made = []
                for node in nodes:
                    connection_class, kwargs = _kwargs(node, timeout)
                    if TextPacker.usable():
                        kwargs["command_packer"] = TextPacker()
                    if _RESP2Parser is not None and issubclass(
                        connection_class, redis.connection.SSLConnection
                    ):
                        kwargs["parser_class"] = _RESP2Parser
                    made.append(
                        redis.ConnectionPool(
                            connection_class=connection_class, **kwargs
                        )
                    )
                pools = _sync[key] = tuple(made)
    return pools


#: Connections per node and event loop: one per call in flight, as many as the
#: loop runs. redis-py 6 and later cap a pool at 100 by default, and a call refused
#: by that cap (``MaxConnectionsError``) would read as the node failing: 101 tasks
#: locking at once would see an outage. redis-py 5 had no cap either.
ASYNC_MAX_CONNECTIONS = 2**31


def async_clients(
    nodes: Sequence[NodeSpec], timeout: float
) -> tuple[redis.asyncio.Redis, ...]:
    """Return one asyncio client (and pool) per node for the running event loop."""
    loop = asyncio.get_running_loop()
    key = _key(nodes, timeout)
    closed: list[dict[tuple[Any, ...], tuple[redis.asyncio.Redis, ...]]] = []
    with _lock:
        per_loop = _async.get(loop)
        if per_loop is None:
            # A loop's connections refer to it, so the loop outlives its weak key
            # here: those of the loops closed since the last new one (one per
            # asyncio.run(), per async_to_sync() call) go now, or every loop and
            # its sockets would stay for good.
            # A generator: see tests/test_back_edges.py.
            closed = list(_async.pop(old) for old in list(_async) if old.is_closed())
            per_loop = _async[loop] = {}
        pools = per_loop.get(key)
        if pools is None:
            made = []
            for node in nodes:
                connection_class, kwargs = _kwargs(node, timeout)
                async_class = getattr(
                    redis.asyncio.connection, connection_class.__name__, None
                )
                if async_class is None:
                    async_class = redis.asyncio.connection.Connection
                elif issubclass(async_class, redis.asyncio.connection.SSLConnection):
                    async_class = _SharedContextSSLConnection
                    context = async_class(**kwargs).ssl_context
                    context.get()  # built now, outside every node timeout
                    kwargs["shared_context"] = context
                kwargs.pop("max_connections", None)
                pool = redis.asyncio.ConnectionPool(
                    connection_class=async_class,
                    max_connections=ASYNC_MAX_CONNECTIONS,
                    **kwargs,
                )
                made.append(redis.asyncio.Redis(connection_pool=pool))
            pools = per_loop[key] = tuple(made)
    for clients in closed:
        _close_without_loop(clients)
    return pools


def _close_without_loop(
    per_loop: dict[tuple[Any, ...], tuple[redis.asyncio.Redis, ...]],
) -> None:
    """Close the connections of an event loop that is closed, without it.

    The node sees the connection end at once (a shutdown); the descriptor is
    closed with its transport, when that is collected. The connection forgets its
    streams first: redis-py 5.0's ``__del__`` would close them through the closed
    loop and print "Exception ignored ... Event loop is closed".
    """
    for clients in per_loop.values():
        for client in clients:
            pool = client.connection_pool
            conns = [
                *getattr(pool, "_available_connections", ()),
                *getattr(pool, "_in_use_connections", ()),
            ]
            for conn in conns:
                writer = getattr(conn, "_writer", None)
                if writer is None:
                    continue
                sock = writer.get_extra_info("socket")
                if sock is not None:
                    shut_down(sock)
                conn._writer = conn._reader = None


#: In a forked child, the parent's pools and clients: kept, never used, never
#: collected. Collecting an asyncio connection closes its transport, which
#: removes its socket from the event loop's epoll set, and that set is shared
#: with the parent across fork(): the parent's loop would stop hearing replies.
_inherited: list[object] = []


def _forget_parent_clients() -> None:
    """In a forked child: build new pools rather than share the parent's sockets.

    The lock is made anew, as a parent thread may have held it at the fork.
    """
    global _lock, _sync, _async
    inherited = dict(_async)
    _inherited.append((_sync, inherited))
    _lock = threading.Lock()
    _sync = {}
    _async = weakref.WeakKeyDictionary()
    _silence(inherited)


def _silence(
    inherited: dict[Any, dict[tuple[Any, ...], tuple[redis.asyncio.Redis, ...]]],
) -> None:
    """In a forked child: point the parent's asyncio connections at a dead socket.

    A child that runs the event loop it inherited shares the parent's epoll
    instance and sockets: its copy of a task caught mid fan-out (a watchdog's
    extension) would read replies owed to the parent, which then misses them, and
    closing its copy of a transport would remove the parent's registration. With
    its descriptors on a socket whose peer is closed, the child reads an end of
    file instead; the parent's sockets are untouched.
    """
    fds: list[int] = []
    for per_loop in inherited.values():
        for clients in per_loop.values():
            for client in clients:
                pool = client.connection_pool
                conns = (
                    *getattr(pool, "_available_connections", ()),
                    *getattr(pool, "_in_use_connections", ()),
                )
                for conn in conns:
                    writer = getattr(conn, "_writer", None)
                    sock = None if writer is None else writer.get_extra_info("socket")
                    with contextlib.suppress(OSError, ValueError, AttributeError):
                        if sock is not None and sock.fileno() >= 0:
                            fds.append(sock.fileno())
    if not fds:
        return
    with contextlib.suppress(OSError):
        dead, peer = socket.socketpair()
        peer.close()
        with dead:
            for fd in fds:
                with contextlib.suppress(OSError):
                    os.dup2(dead.fileno(), fd)


os.register_at_fork(after_in_child=_forget_parent_clients)


def reset() -> None:
    """Close every cached pool; the next lock operation builds new ones."""
    with _lock:
        old = list(_sync.values())
        _sync.clear()
        loops = list(_async.items())
        _async.clear()
    for pools in old:
        for pool in pools:
            pool.disconnect()
    for loop, per_loop in loops:
        if loop.is_closed():
            _close_without_loop(per_loop)
        else:  # closed on their own loop, at its next turn (from any thread)
            with contextlib.suppress(RuntimeError):  # closed since
                loop.call_soon_threadsafe(_close_on_loop, per_loop)


#: Closings under way on live loops, kept from being garbage-collected.
_closing: set[asyncio.Future[None]] = set()


def _close_on_loop(
    per_loop: dict[tuple[Any, ...], tuple[redis.asyncio.Redis, ...]],
) -> None:
    """Close the idle connections of a live loop's forgotten clients.

    Connections in use finish their call; they go back to a pool nobody takes
    from and close when collected.
    """

    async def close() -> None:
        for clients in per_loop.values():
            for client in clients:
                with contextlib.suppress(Exception):
                    await client.connection_pool.disconnect(inuse_connections=False)

    task = asyncio.ensure_future(close())
    _closing.add(task)
    task.add_done_callback(_closing.discard)


def _on_setting_changed(*, setting: str, **kwargs: object) -> None:
    if setting in ("REDLOCK", "CACHES"):
        reset()


# Connected at import rather than in AppConfig.ready(), so the clients are closed
# even in a project that does not list the app in INSTALLED_APPS.
setting_changed.connect(_on_setting_changed, dispatch_uid="redlock_django.nodes.reset")
