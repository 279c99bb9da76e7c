"""One redis-py connection for the blocking driver: the fast path or the portable one.

The fast path reads redis-py internals: the connection's socket (``conn._sock``),
so that one poll() waits on every node of a fan-out and one ``sendall()`` writes a
command, and with redis-py's hiredis parser that parser's reader
(``conn._parser._reader``, fed straight from the socket, with
``redis._parsers.hiredis.NOT_ENOUGH_DATA`` as its "incomplete" answer). None of
this is redis-py's public API, and a release may move it, as may a connection class
of one's own. So each connection class is probed once, at its first connection
(``path_of``), and a class whose internals are missing or answer otherwise takes
the portable path: redis-py's public connection API only (``pack_command``,
``send_packed_command``, ``can_read(timeout)``, ``read_response()``; its
``timeout=`` where the class declares it: redis-py 8 does, 5.0 and 6.4 do not).

The portable path keeps the driver's rules (every node written before any reply
is read, one NODE_TIMEOUT deadline, late replies read and thrown away before a
connection is reused); it only waits less cleverly: with no socket to poll(), it
asks each waiting connection ``can_read(0)`` and, when none has a reply yet,
waits on one of them in turn for at most ``SLICE``.

``REDLOCK_SYNC_DRIVER=portable`` in the environment, read once at import, forces
the portable path for every connection: a testing and diagnostic aid (``make
test-portable`` runs the lock suite on it). ``PATHS`` says which path each
connection class took and why; the choice is also logged once per class at DEBUG.
"""

from __future__ import annotations

import inspect
import logging
import os
import select
import socket
from collections.abc import Iterator, Sequence
from typing import Any, NamedTuple

import redis

from . import sockets
from .interrupts import reraise_interruption

try:
    import hiredis as _hiredis
except ImportError:  # pragma: no cover - redis-py without hiredis
    _hiredis = None  # type: ignore[assignment]

try:  # redis-py's hiredis parser, read directly by read() when it is in use
    from redis._parsers.hiredis import NOT_ENOUGH_DATA as _NOT_ENOUGH_DATA
    from redis._parsers.hiredis import _HiredisParser
except ImportError:  # pragma: no cover - another redis-py layout
    _HiredisParser = None  # type: ignore[assignment,misc]
    _NOT_ENOUGH_DATA = object()

__all__ = [
    "FAST",
    "FORCED",
    "INCOMPLETE",
    "NOT_READ",
    "PATHS",
    "PORTABLE",
    "SLICE",
    "Path",
    "TextPacker",
    "abort",
    "arrived",
    "clean",
    "closed_while_idle",
    "in_flight",
    "pack",
    "path_of",
    "pending_replies",
    "read",
    "read_arrived",
    "read_response",
    "send",
    "texts",
    "wait_one",
]

logger = logging.getLogger(__name__)

FAST = "fast"
PORTABLE = "portable"
ENV = "REDLOCK_SYNC_DRIVER"
#: The longest the portable path waits on one connection before it looks at the
#: others again: the most a reply can wait unseen while another node is watched.
SLICE = 0.0005
#: The shortest read timeout: a zero timeout would make the socket non-blocking.
MIN_WAIT = 0.0001
#: ``read()``'s answer when a reply has started but not all of it is there yet.
INCOMPLETE: Any = object()
#: ``read_arrived()``'s answer when it read nothing: the caller reads as usual.
NOT_READ: Any = object()


def _forced(environ: Any = os.environ) -> bool:
    value = environ.get(ENV, "").strip().lower()
    if value in ("", "auto"):
        return False
    if value == PORTABLE:
        return True
    raise ValueError(
        f"{ENV} must be 'auto' (the default: redis-py's internals where they are "
        f"as expected) or 'portable' (redis-py's public API only), not {value!r}"
    )


#: ``REDLOCK_SYNC_DRIVER=portable``: every connection takes the portable path.
FORCED = _forced()


class Path(NamedTuple):
    """The path a connection class takes, and why."""

    name: str  # FAST or PORTABLE
    #: Replies are read straight into the hiredis parser's reader (fast only).
    direct: bool
    why: str


#: The path each connection class took, decided at its first connection.
PATHS: dict[type, Path] = {}

_MISSING = object()


def path_of(conn: Any) -> Path:
    """Return the path for ``conn``'s class, probing it on its first connection.

    ``conn`` must be connected (a command was just sent on it).
    """
    klass = type(conn)
    path = PATHS.get(klass)
    if path is None:
        # Two threads may probe the same class at once: they find the same answer.
        path = PATHS[klass] = _probe(conn)
        logger.debug(
            "%s.%s connections take the %s path (%s)",
            klass.__module__,
            klass.__qualname__,
            path.name,
            path.why,
        )
    return path


def _probe(conn: Any) -> Path:
    if FORCED:
        return Path(PORTABLE, False, f"{ENV}=portable")
    name = type(conn).__name__
    sock: Any = getattr(conn, "_sock", _MISSING)
    if sock is _MISSING:
        return Path(PORTABLE, False, f"{name} has no _sock")
    try:
        fd = sock.fileno()
    except Exception:
        fd = None
    writable = callable(getattr(sock, "sendall", None))
    if not isinstance(fd, int) or fd < 0 or not writable:
        return Path(PORTABLE, False, f"{name}._sock is not a connected socket")
    direct, why = _direct(conn, sock)
    return Path(FAST, direct, why)


def _direct(conn: Any, sock: Any) -> tuple[bool, str]:
    """Say whether replies on ``conn`` can be read into its hiredis reader, and why."""
    if _HiredisParser is None:
        return False, "poll() on _sock; no redis._parsers.hiredis: read_response()"
    parser = getattr(conn, "_parser", None)
    if type(parser) is not _HiredisParser:
        kind = type(parser).__name__
        return False, f"poll() on _sock; parser {kind}: read_response()"
    reader = getattr(parser, "_reader", None)
    if reader is None or getattr(parser, "_sock", None) is not sock:
        return False, "poll() on _sock; the hiredis parser's _reader or _sock differ"
    # Nothing is buffered after connecting: the reader must say "not enough data"
    # with redis-py's own sentinel, or read() would take its answer for a reply.
    if reader.gets() is not _NOT_ENOUGH_DATA:
        return False, "poll() on _sock; the hiredis reader's 'incomplete' differs"
    return True, "poll() on _sock; replies read into the hiredis reader"


def arrived(conn: Any) -> bool:
    """Say whether a reply has started to arrive on ``conn``, without waiting.

    redis-py's ``can_read`` also sees bytes a TLS layer or the parser already
    buffered, which poll() cannot; a broken connection counts as arrived, so that
    reading it reports the error.
    """
    try:
        return bool(conn.can_read(0))
    except Exception as exc:
        reraise_interruption(exc)
        return True


def texts(command: tuple[Any, ...]) -> tuple[Any, ...]:
    """``command`` with its numbers written out, ready for hiredis to pack.

    hiredis's ``pack_command`` (3.x, and redis-py's packer when hiredis is there)
    formats a number with ``repr()`` and never checks that it failed: ``repr()`` of
    an int runs pending signal handlers, so one that raises there (a Celery soft
    time limit, Ctrl-C) crashes the process. ``str()`` here raises it cleanly.
    """
    return tuple([str(a) if type(a) is int or type(a) is float else a for a in command])


class TextPacker:
    """redis-py's hiredis command packer, given commands with numbers written out.

    The blocking pools pack every redis-py command (a listing's SCAN COUNT, a
    force release's EVAL numkeys) with this, so a signal handler that raises
    while one is packed comes out as itself instead of crashing hiredis (see
    ``texts``). ``usable()`` says whether this redis-py and hiredis have it.
    """

    def __init__(self) -> None:
        self._packer = redis.connection.HiredisRespSerializer()

    @staticmethod
    def usable() -> bool:
        """Whether redis-py packs with hiredis here (and has its packer class)."""
        return _hiredis is not None and hasattr(
            redis.connection, "HiredisRespSerializer"
        )

    def pack(self, *args: Any) -> list[bytes]:
        """Pack one command as redis-py's hiredis packer does, numbers as text."""
        packed: list[bytes] = self._packer.pack(*texts(args))
        return packed


def pack(conn: Any, command: tuple[Any, ...]) -> Any:
    """Encode ``command`` as RESP once for every node of a fan-out.

    On the fast path, our commands (a name then str arguments, see ``texts``) go
    to hiredis as they are, without redis-py's per-argument checks; otherwise the
    connection packs them.
    """
    command = texts(command)
    path = PATHS.get(type(conn))
    if _hiredis is not None and path is not None and path.name == FAST:
        try:
            return [_hiredis.pack_command(command)]
        except TypeError:
            pass
    return conn.pack_command(*command)


def send(conn: Any, packed: list[bytes], done: int = 0) -> None:
    """Write a packed command; a new connection connects (and authenticates) first.

    Only a connection of a class already probed fast is written to directly, and
    only there can ``done`` (bytes the caller wrote already) be more than 0.
    """
    path = PATHS.get(type(conn))
    sock = conn._sock if path is not None and path.name == FAST else None
    if sock is None or len(packed) != 1:
        conn.send_packed_command(packed, check_health=False)
        return
    data = packed[0]
    try:
        if type(sock) is socket.socket:
            # The socket has a timeout, so its descriptor is non-blocking:
            # write(2) at once, where sendall() would poll(2) first. Whatever
            # the kernel did not take goes through sendall(), with its timeout.
            sent = done
            if not sent:
                try:
                    sent = os.write(sock.fileno(), data)
                except BlockingIOError:
                    sent = 0
            if sent < len(data):
                sock.sendall(memoryview(data)[sent:])
        else:  # TLS: the socket's own sendall() encrypts
            sock.sendall(data)
    except OSError as exc:
        abort(conn)
        if isinstance(exc, TimeoutError):
            raise redis.TimeoutError("Timeout writing to socket") from None
        raise redis.ConnectionError(f"Error while writing: {exc}") from None


def abort(conn: Any) -> None:
    """Drop a connection whose command may still be on its way: with a reset, so
    that the kernel never delivers it later (``sockets``)."""
    sockets.reset_on_close(getattr(conn, "_sock", None))
    conn.disconnect()


def in_flight(conn: Any) -> bool:
    """Whether the node's host has not yet acknowledged what was written on ``conn``."""
    return sockets.unacknowledged(getattr(conn, "_sock", None))


def read(conn: Any, timeout: float, direct: bool) -> Any:
    """Read one reply from a connection whose reply has started to arrive.

    With ``direct`` and redis-py's hiredis parser on a plain socket, the reply is
    read straight into that parser's own reader: the same objects and errors as
    ``read_response()``, without its per-call timeout juggling and bookkeeping (a
    third of a fan-out's Python time). What the socket holds is read without
    waiting: a reply not whole yet returns ``INCOMPLETE``, its start kept in the
    reader, and the caller waits for the rest beside the other nodes' replies (a
    node sending its reply a byte at a time, each within the socket timeout, would
    otherwise hold the fan-out far past its deadline). Anything else goes through
    ``read_response()``.
    """
    if not direct:
        return read_response(conn, timeout)
    parser = conn._parser
    if type(parser) is not _HiredisParser:
        return read_response(conn, timeout)
    reader, sock = parser._reader, parser._sock
    if reader is None or sock is None:
        return read_response(conn, timeout)
    reply = reader.gets()
    while reply is _NOT_ENOUGH_DATA:
        data = _read_now(sock)
        if data is None:
            return INCOMPLETE
        reader.feed(data)
        reply = reader.gets()
    if isinstance(reply, redis.ConnectionError | redis.ResponseError):
        raise reply
    return reply


def read_arrived(conn: Any) -> Any:
    """Read, in one read(2) into its hiredis reader, the reply poll() saw arrive on
    a plain socket; the caller has waited on nothing else of it.

    Returns the reply (an error reply as its exception object, not raised), or
    ``INCOMPLETE``, or ``NOT_READ`` (reading nothing) for any other case: another
    parser or socket, a reply already started, or a read that failed or found the
    connection closed, which ``read()`` then finds again and raises. The usual
    reply of a fan-out costs one call here, where ``read()`` takes several.
    """
    parser = conn._parser
    if type(parser) is not _HiredisParser:
        return NOT_READ
    reader, sock = parser._reader, parser._sock
    if reader is None or type(sock) is not socket.socket or sock.gettimeout() is None:
        return NOT_READ  # a blocking descriptor: read() asks not to wait
    has_data = getattr(reader, "has_data", None)
    if has_data is None or has_data():
        return NOT_READ
    try:
        data = os.read(sock.fileno(), 65536)
    except OSError:
        return NOT_READ
    if not data:
        return NOT_READ
    reader.feed(data)
    reply = reader.gets()
    return INCOMPLETE if reply is _NOT_ENOUGH_DATA else reply


def clean(conn: Any) -> bool:
    """Whether ``conn`` holds nothing unread: no reply nobody asked for (a server
    misbehaving, a proxy) that the next command would take for its own."""
    reader = getattr(getattr(conn, "_parser", None), "_reader", None)
    has_data = getattr(reader, "has_data", None)
    return has_data is None or not has_data()


def closed_while_idle(conns: Sequence[Any]) -> list[bool]:
    """Say, for each idle connection, whether it can be read without waiting: the
    server closed it (a restart, its idle timeout) or sent what nobody asked for.
    Either way it must not carry a command: one that breaks after its command was
    written may have run, and cannot be sent again. One poll() for them all."""
    poller = select.poll()
    polled: dict[int, int] = {}
    closed = [False] * len(conns)
    for position, conn in enumerate(conns):
        sock = getattr(conn, "_sock", None)
        if sock is None:
            continue  # not connected: it connects when written to
        try:
            fd = sock.fileno()
            poller.register(fd, select.POLLIN)
        except (OSError, ValueError):
            closed[position] = True
            continue
        polled[fd] = position
    if polled:
        for fd, _ in poller.poll(0):
            closed[polled[fd]] = True
    return closed


def _read_now(sock: Any) -> bytes | None:
    """What ``sock`` holds, in one read that never waits; None when it holds nothing.

    A closed connection or a socket error raises redis-py's ``ConnectionError``.
    """
    try:
        data: bytes
        if sock.gettimeout() is None:  # a blocking descriptor: ask not to wait
            data = sock.recv(65536, socket.MSG_DONTWAIT)
        else:  # non-blocking: read(2) at once, where recv() would poll(2) first
            data = os.read(sock.fileno(), 65536)
    except BlockingIOError:
        return None
    except OSError as exc:
        raise redis.ConnectionError(f"Error while reading: {exc}") from None
    if not data:
        raise redis.ConnectionError("Connection closed by server.")
    return data


def pending_replies(conn: Any) -> Iterator[Any]:
    """Yield every whole reply that has arrived on a connection poll() saw readable.

    For the wake-up reader, whose messages come unasked. With ``direct`` (see
    ``read``): one read of what the socket holds, parsed in the hiredis reader; a
    message split across packets waits there for the rest. Otherwise redis-py's
    ``can_read(0)`` and ``read_response()``, reply by reply: a poll() per reply
    and one more to find none is left.
    """
    parser = getattr(conn, "_parser", None)
    if not path_of(conn).direct or type(parser) is not _HiredisParser:
        while conn.can_read(timeout=0):
            yield conn.read_response()
        return
    reader, sock = parser._reader, parser._sock
    if reader is None or sock is None:
        raise redis.ConnectionError("Connection closed.")
    data = _read_now(sock)
    if data is not None:  # else nothing after all: what is parsed is still read
        reader.feed(data)
    while (reply := reader.gets()) is not _NOT_ENOUGH_DATA:
        if isinstance(reply, redis.ConnectionError | redis.ResponseError):
            raise reply
        yield reply


#: Whether each connection class's ``read_response`` declares ``timeout=``.
_TAKES_TIMEOUT: dict[type, bool] = {}


def read_response(conn: Any, timeout: float) -> Any:
    """Read one reply on ``conn``, waiting at most ``timeout`` for it to start.

    ``read_response(timeout=...)`` where the connection class declares it. Where it
    does not (redis-py 5.0 and 6.4; a class forwarding ``**kwargs``), ``can_read``
    waits and a reply that has started is read with the socket's own timeout
    (NODE_TIMEOUT on the lock's pools).
    """
    klass = type(conn)
    takes = _TAKES_TIMEOUT.get(klass)
    if takes is None:
        try:
            takes = "timeout" in inspect.signature(klass.read_response).parameters
        except (TypeError, ValueError):
            takes = False
        _TAKES_TIMEOUT[klass] = takes
    if takes:
        return conn.read_response(timeout=timeout)
    if not conn.can_read(timeout):
        raise redis.TimeoutError("Timeout reading from socket")
    return conn.read_response()


def wait_one(conn: Any, timeout: float) -> bool:
    """Wait up to ``timeout`` for a reply on ``conn``; say whether one came."""
    try:
        return bool(conn.can_read(timeout))
    except Exception as exc:
        reraise_interruption(exc)
        return True
