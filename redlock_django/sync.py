"""The blocking driver: runs protocol flows with redis-py connections.

A fan-out writes the command to every node before it reads any reply, so N nodes
cost about one round trip and no thread. Replies are read as they arrive, against
one deadline NODE_TIMEOUT after the last command went out, and once a quorum has
decided the step the other nodes get only a short grace: a hung node costs at most
that much. A node whose connect() timed out is not connected to again for
``STALL_HOLD``.

The thread's own delays are not the nodes' fault. Writing to N nodes may itself be
slow (connecting, other threads holding the GIL), so the deadline counts from the
last write. At the deadline every reply that has arrived is read before a node is
called timed out; and when that look came long after the deadline (a starved
thread, more than ``LATE_SLACK`` of NODE_TIMEOUT late), a missing reply is no
evidence: the node is marked ``LATE``, which the protocol never counts as an
outage.

A connection whose reply is still due (a node slower than the quorum, or one that
timed out) is kept aside owing that one reply, not dropped: before it is reused
the owed reply is read and thrown away, and a connection whose reply does not come
within NODE_TIMEOUT is dropped. A late reply can then never reach the next caller,
and a node a little slower than the others does not cost a new connection (a TLS
handshake) on every operation.
"""

from __future__ import annotations

import collections
import math
import os
import select
import time
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import redis
from redis.exceptions import NoScriptError

try:
    import hiredis as _hiredis
except ImportError:  # pragma: no cover - redis-py without hiredis
    _hiredis = None  # type: ignore[assignment]

try:  # redis-py's hiredis parser, read directly by _read() when it is in use
    from redis._parsers.hiredis import NOT_ENOUGH_DATA as _NOT_ENOUGH_DATA
    from redis._parsers.hiredis import _HiredisParser
except ImportError:  # pragma: no cover - another redis-py layout
    _HiredisParser = None  # type: ignore[assignment,misc]
    _NOT_ENOUGH_DATA = object()

from .nodes import describe
from .protocol import LATE, UNAWAITED, Fanout, NodeReply, Sleep, Step
from .wake import Hub, SyncWatch

__all__ = ["fanout", "run"]

#: The shortest read timeout: a zero timeout would make the socket non-blocking.
_MIN_WAIT = 0.0001
#: Least time given to the other nodes once a quorum decided a fan-out.
_GRACE = 0.001
#: After connecting to a node timed out, seconds during which fan-outs do not try
#: again (the node just counts as failed). A frozen server whose listen backlog is
#: full, or a partitioned host, would otherwise cost every fan-out a whole
#: NODE_TIMEOUT in connect(), before any other node's reply is read.
STALL_HOLD = 1.0
#: Idle connections kept per node; more (a burst of threads) are closed on return.
MAX_IDLE = 32
#: A look at the replies more than this share of NODE_TIMEOUT after the deadline
#: means the client itself was late: the nodes it did not hear are marked ``LATE``.
#: Half a timeout: far above the scheduling noise of a loaded host (a few ms), far
#: below the stalls (a blocked loop, a starved thread) that made healthy nodes look
#: dead. The asyncio driver uses it too.
LATE_SLACK = 0.5


class _Idle:
    """The driver's own idle connections to one node, taken and returned LIFO.

    The pool's ``get_connection()`` polls every connection for stray data and
    records metrics on each call: a fifth of a fan-out's time. This driver never
    returns a connection with a reply still due to ``conns``: such a connection
    waits in ``owed`` until that reply was read (``_settle``), so a deque is
    enough; a forked child starts with empty ones.
    """

    __slots__ = ("conns", "owed", "pid", "stalled_at")

    def __init__(self) -> None:
        self.pid = os.getpid()
        self.conns: collections.deque[Any] = collections.deque()
        #: Connections owing one reply, with the time after which it is given up.
        self.owed: collections.deque[tuple[Any, float]] = collections.deque()
        #: When a new connection to this node last timed out while connecting.
        self.stalled_at = -math.inf


_idle: weakref.WeakKeyDictionary[redis.ConnectionPool, _Idle] = (
    weakref.WeakKeyDictionary()
)


def _take(pool: redis.ConnectionPool, pid: int) -> tuple[_Idle, Any, bool]:
    """Return an idle connection (reused True) or a new, unconnected one."""
    idle = _idle.get(pool)
    if idle is None or idle.pid != pid:
        idle = _idle[pool] = _Idle()
    if idle.owed:
        _settle(idle)
    try:
        return idle, idle.conns.pop(), True
    except IndexError:
        return idle, pool.connection_class(**pool.connection_kwargs), False


def _stalled(idle: _Idle, exc: BaseException) -> None:
    """Note a new connection that timed out (connecting: it had sent nothing)."""
    if isinstance(exc, redis.TimeoutError | TimeoutError):
        idle.stalled_at = time.monotonic()


def _give(idle: _Idle, conn: Any) -> None:
    if len(idle.conns) < MAX_IDLE:
        idle.conns.append(conn)
    else:
        conn.disconnect()


def _owe(idle: _Idle, conn: Any, until: float) -> None:
    """Keep aside a connection that still owes one reply, until ``until``."""
    if len(idle.owed) < MAX_IDLE:
        idle.owed.append((conn, until))
    else:
        conn.disconnect()


def _arrived(conn: Any) -> bool:
    """Say whether a reply has started to arrive on ``conn``, without waiting.

    redis-py's ``can_read`` also sees bytes a TLS layer or the parser already
    buffered, which poll() cannot; a broken connection counts as arrived, so that
    reading it reports the error.
    """
    try:
        return bool(conn.can_read(0))
    except Exception:
        return True


def _settle(idle: _Idle) -> None:
    """Read and discard the replies owed on kept-aside connections that arrived.

    A settled connection becomes idle again; one whose reply did not come in time,
    or broke, is dropped. Each entry is popped before it is looked at, so two
    threads never read the same connection.
    """
    owed = idle.owed
    now = time.monotonic()
    for _ in range(len(owed)):
        try:
            conn, until = owed.popleft()
        except IndexError:
            return
        if not _arrived(conn):
            if now < until:
                owed.append((conn, until))
            else:
                conn.disconnect()
            continue
        try:
            conn.read_response(timeout=_MIN_WAIT)
        except redis.ResponseError:
            pass  # an error reply (NOSCRIPT, ...) is the owed reply too
        except Exception:
            conn.disconnect()  # read_response() dropped it already, on most errors
            continue
        _give(idle, conn)


def _pack(conn: Any, command: tuple[Any, ...]) -> Any:
    """Encode ``command`` as RESP once for every node of a fan-out.

    Our commands are a name then str/int arguments, so hiredis can take them as
    they are, without redis-py's per-argument checks; otherwise the connection
    packs them.
    """
    if _hiredis is not None:
        try:
            return [_hiredis.pack_command(command)]
        except TypeError:
            pass
    return conn.pack_command(*command)


def _send(conn: Any, packed: list[bytes]) -> None:
    """Write a packed command; a new connection connects (and authenticates) first."""
    sock = conn._sock
    if sock is None or len(packed) != 1:
        conn.send_packed_command(packed, check_health=False)
        return
    try:
        sock.sendall(packed[0])
    except OSError as exc:
        conn.disconnect()
        if isinstance(exc, TimeoutError):
            raise redis.TimeoutError("Timeout writing to socket") from None
        raise redis.ConnectionError(f"Error while writing: {exc}") from None


def _is_tls(conn: Any) -> bool:
    return isinstance(conn, redis.SSLConnection)


def _read(conn: Any, timeout: float) -> Any:
    """Read one reply from a connection that poll() found readable.

    With redis-py's hiredis parser on a plain socket, the reply is read straight
    into that parser's own reader: the same objects and errors as
    ``read_response()``, without its per-call timeout juggling and bookkeeping
    (a third of a fan-out's Python time). Anything else goes through
    ``read_response()``.
    """
    parser = conn._parser
    if type(parser) is not _HiredisParser:
        return conn.read_response(timeout=timeout)
    reader, sock = parser._reader, parser._sock
    if reader is None or sock is None:
        return conn.read_response(timeout=timeout)
    reply = reader.gets()
    while reply is _NOT_ENOUGH_DATA:
        # The socket is readable: one read(2) on its (non-blocking) descriptor,
        # where sock.recv() would poll once more first. A reply split across
        # packets waits for the rest with recv(), at most the socket timeout.
        try:
            data = os.read(sock.fileno(), 65536)
        except BlockingIOError:
            try:
                data = sock.recv(65536)
            except TimeoutError:
                raise redis.TimeoutError("Timeout reading from socket") from None
            except OSError as exc:
                raise redis.ConnectionError(f"Error while reading: {exc}") from None
        except OSError as exc:
            raise redis.ConnectionError(f"Error while reading: {exc}") from None
        if not data:
            raise redis.ConnectionError("Connection closed by server.")
        reader.feed(data)
        reply = reader.gets()
    if isinstance(reply, redis.ConnectionError | redis.ResponseError):
        raise reply
    return reply


def _command(step: Fanout, by_sha: bool) -> tuple[Any, ...]:
    head = ("EVALSHA", step.script.sha) if by_sha else ("EVAL", step.script.source)
    return (*head, len(step.keys), *step.keys, *step.args)


def fanout(
    pools: Sequence[redis.ConnectionPool], step: Fanout, timeout: float
) -> list[NodeReply]:
    """Run ``step`` on its nodes at once; return one reply per targeted node."""
    targets = range(len(pools)) if step.nodes is None else step.nodes
    began = time.monotonic()
    replies: dict[int, NodeReply] = {}
    # Clean-ups go as EVAL: a node that never answers (frozen, then resumed) may
    # run them long after this call gave up, with nobody left to resend the source
    # after a NOSCRIPT. Redis caches the script either way.
    command = _command(step, by_sha=not step.critical)
    packed: Any = None
    # fd -> [node, its idle deque, connection, may retry on a new connection,
    # NOSCRIPT already answered by resending the source]
    waiting: dict[int, list[Any]] = {}
    poller = select.poll()
    any_tls = False
    pid = os.getpid()
    for i in targets:
        idle, conn, reused = _take(pools[i], pid)
        if not reused and began - idle.stalled_at < STALL_HOLD:
            ago = began - idle.stalled_at
            replies[i] = NodeReply(
                error=f"skipped: connecting timed out {ago:.2f}s ago"
            )
            continue
        if packed is None:  # every connection packs alike: pack once
            packed = _pack(conn, command)
        try:
            _send(conn, packed)
        except Exception as exc:
            conn.disconnect()
            if not reused:
                _stalled(idle, exc)
                replies[i] = NodeReply(error=describe(exc))
                continue
            # An idle connection the server closed (a restart) is only found out
            # when used; the command did not run, so send it on a new one.
            conn = pools[i].connection_class(**pools[i].connection_kwargs)
            try:
                conn.send_packed_command(packed, check_health=False)
            except Exception as exc:
                conn.disconnect()
                _stalled(idle, exc)
                replies[i] = NodeReply(error=describe(exc))
                continue
            reused = False
        fd = conn._sock.fileno()
        poller.register(fd, select.POLLIN)
        waiting[fd] = [i, idle, conn, reused, False]
        any_tls = any_tls or _is_tls(conn)
    # Each node gets a whole NODE_TIMEOUT after its command went out, however long
    # the writes took this thread (connects, other threads holding the GIL).
    deadline = time.monotonic() + timeout
    # Read the replies as they arrive (a slow node first in the list must not
    # hold up the rest), until every node answered, the deadline passed, or the
    # step's outcome is known (``need`` winning replies). A node that answers
    # NOSCRIPT (restarted, or SCRIPT FLUSH) gets the source once and is read again.
    wins = 0
    why = "timed out"
    final = False
    looked = math.inf
    need, winning = step.need, step.wins
    finished = False
    try:
        while waiting:
            if need and wins >= need and why != UNAWAITED:
                # Known outcome: healthy nodes answer within a few round trips of
                # each other; only a slow or hung node is left behind (and its
                # connection kept aside until its reply comes).
                now = time.monotonic()
                deadline = min(deadline, now + max(_GRACE, 2 * (now - began)))
                why = UNAWAITED
            now = time.monotonic()
            left = deadline - now
            if left <= 0:
                if final:
                    break
                # One last look, without waiting: replies that arrived while this
                # thread was elsewhere (reading others, waiting for the GIL or a
                # CPU), or that sit decrypted in a TLS buffer, count.
                final = True
                looked = now
                ready = [(fd, 0) for fd, it in waiting.items() if _arrived(it[2])]
                if not ready:
                    break
            else:
                # poll() cannot see bytes a TLS layer already decrypted: those
                # connections are read in turn, blocking up to the deadline.
                tls = (
                    next((fd for fd, it in waiting.items() if _is_tls(it[2])), None)
                    if any_tls
                    else None
                )
                if tls is not None:
                    ready = [(tls, 0)]
                else:
                    ready = poller.poll(max(1, math.ceil(left * 1000)))
            for fd, _ in ready:
                item = waiting.pop(fd)
                poller.unregister(fd)
                i, idle, conn, reused, resent = item
                try:
                    value = (
                        conn.read_response(timeout=_MIN_WAIT)
                        if final
                        else _read(conn, max(left, _MIN_WAIT))
                    )
                except NoScriptError:
                    if resent:
                        replies[i] = NodeReply(error="NoScriptError")
                        _give(idle, conn)
                        continue
                    try:
                        conn.send_command(*_command(step, by_sha=False))
                    except Exception as exc:
                        # The connection broke between the NOSCRIPT and the
                        # resend: this node failed, like any other.
                        conn.disconnect()
                        replies[i] = NodeReply(error=describe(exc))
                        continue
                    item[3:] = [False, True]
                except redis.ConnectionError as exc:
                    conn.disconnect()
                    if not reused or time.monotonic() >= deadline:
                        replies[i] = NodeReply(error=describe(exc))
                        continue
                    # Closed by the server while idle: retry once on a new
                    # connection. Every script is idempotent for one token, so a
                    # command that did run is safe to run again; a timeout is not
                    # retried.
                    pool = pools[i]
                    conn = pool.connection_class(**pool.connection_kwargs)
                    try:
                        conn.send_packed_command(packed, check_health=False)
                    except Exception as again:
                        conn.disconnect()
                        replies[i] = NodeReply(error=describe(again))
                        continue
                    item[2:] = [conn, False, resent]
                except Exception as exc:
                    conn.disconnect()
                    late = final and isinstance(exc, redis.TimeoutError)
                    replies[i] = NodeReply(error=why if late else describe(exc))
                    continue
                else:
                    replies[i] = NodeReply(value)
                    _give(idle, conn)
                    if winning is not None and winning(value):
                        wins += 1
                    continue
                fd = item[2]._sock.fileno()
                poller.register(fd, select.POLLIN)
                waiting[fd] = item
        finished = True
    finally:
        if waiting:
            # A last look long after the deadline says nothing about the nodes
            # still silent: the thread itself was late.
            lag = looked - deadline
            if finished and why != UNAWAITED and lag > LATE_SLACK * timeout:
                why = f"{LATE}: looked {lag * 1000:.0f} ms after its deadline"
            until = time.monotonic() + timeout
            for i, idle, conn, _, _ in waiting.values():
                replies.setdefault(i, NodeReply(error=why))
                if finished:
                    _owe(idle, conn, until)  # one reply still due on it
                else:
                    conn.disconnect()  # interrupted: dropped, never reused
    return [replies[i] for i in targets]


def run(
    flow: Any,
    pools: Sequence[redis.ConnectionPool],
    timeout: float,
    sleep: Callable[[float], None] = time.sleep,
    hub: Hub | None = None,
) -> Any:
    """Drive a protocol flow to its end and return its result.

    With a ``hub``, a wait that names a lock key ends early when that lock is
    released. An interruption (KeyboardInterrupt) during a step is thrown into the
    flow, so its clean-up steps still run before the interruption propagates.
    """
    reply: Any = None
    pending: BaseException | None = None
    watch: SyncWatch | None = None
    try:
        while True:
            try:
                step: Step = flow.throw(pending) if pending else flow.send(reply)
            except StopIteration as stop:
                return stop.value
            pending = None
            try:
                if not isinstance(step, Sleep):
                    reply = fanout(pools, step, timeout)
                    continue
                reply = None
                if step.wake is None or hub is None:
                    sleep(step.seconds)
                    continue
                if watch is None:
                    watch = SyncWatch(step.wake.encode())
                    hub.watch(watch)
                reply = watch.wait(step.seconds)
            except BaseException as exc:
                pending = exc
    finally:
        if watch is not None and hub is not None:
            hub.unwatch(watch)
