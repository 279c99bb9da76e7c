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
timed out) is kept aside owing that reply, not dropped: before it is reused
the owed reply is read and thrown away, and a connection whose reply does not come
within NODE_TIMEOUT is dropped. A late reply can then never reach the next caller,
and a node a little slower than the others does not cost a new connection (a TLS
handshake) on every operation. A connection given up on is dropped with a reset
(``sockets``), and one whose command the node's host has not even acknowledged is
dropped at once, not kept: a command written into a partition never runs after
the partition heals. A clean-up's connection given up on is closed in order
instead: the clean-up still runs when a frozen node resumes or a partition heals
(``_drop``). Every command goes by EVALSHA; a clean-up a node has not answered
gets the script's source (EVAL) written behind it, so that a node lacking the
script still runs it, with nobody left to answer its NOSCRIPT (``_behind``).

How bytes move on one connection is ``wire.py``'s: the fast path reads redis-py
internals (the socket, to poll() every node at once; the hiredis reader), the
portable path only redis-py's public connection API; each connection class is
probed once. A round with any portable connection waits the portable way.

One idea, read top to bottom (the connection bookkeeping, one fan-out round, the
flow runner), hence about 500 lines.
"""

from __future__ import annotations

import collections
import contextlib
import math
import os
import select
import socket
import time
from collections.abc import Callable, Sequence
from typing import Any

import redis
from redis.exceptions import NoScriptError

from .interrupts import interruption, reraise_interruption
from .nodes import describe
from .protocol import (
    LATE,
    LATE_SLACK,
    TIMED_OUT,
    UNAWAITED,
    Fanout,
    NodeReply,
    Sleep,
    Step,
    grace,
)
from .wake import Hub, SyncWatch
from .wire import (
    INCOMPLETE,
    NOT_READ,
    PORTABLE,
    SLICE,
    abort,
    in_flight,
    path_of,
    wait_one,
)
from .wire import MIN_WAIT as _MIN_WAIT
from .wire import arrived as _arrived
from .wire import clean as _clean
from .wire import closed_while_idle as _closed_while_idle
from .wire import pack as _pack
from .wire import read as _read
from .wire import read_arrived as _read_arrived
from .wire import read_response as _read_response
from .wire import send as _send

__all__ = ["fanout", "run"]

#: After connecting to a node timed out, seconds during which fan-outs do not try
#: again (the node just counts as failed). A frozen server whose listen backlog is
#: full, or a partitioned host, would otherwise cost every fan-out a whole
#: NODE_TIMEOUT in connect(), before any other node's reply is read.
STALL_HOLD = 1.0
#: Idle connections kept per node; more (a burst of threads) are closed on return.
MAX_IDLE = 32
#: A node whose connection broke after the command went out, and whose second
#: answer did not win: the first may have run (the second says nothing).
_UNSURE = "connection broke after the command was sent; no answer to trust"


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
        #: Connections owing replies (one, or two: a clean-up's EVAL written
        #: behind its EVALSHA), with the time after which they are given up and
        #: whether their commands may still run after that (``_drop``).
        self.owed: collections.deque[tuple[Any, float, bool, int]] = collections.deque()
        #: When a new connection to this node last timed out while connecting.
        self.stalled_at = -math.inf


#: Where a pool keeps this driver's idle connections (an attribute: a weak
#: dictionary's lookup made a weak reference on every fan-out).
_IDLE = "_redlock_idle"

#: This process's id, kept current across forks: ``os.getpid()`` is a system
#: call, and every fan-out checks it (a child must not reuse its parent's sockets).
_pid = os.getpid()


def _forked() -> None:
    global _pid
    _pid = os.getpid()


os.register_at_fork(after_in_child=_forked)


def _take(pool: redis.ConnectionPool, pid: int) -> tuple[_Idle, Any, bool]:
    """Return an idle connection (reused True) or a new, unconnected one."""
    idle: _Idle | None = getattr(pool, _IDLE, None)
    if idle is None or idle.pid != pid:
        idle = _Idle()
        setattr(pool, _IDLE, idle)
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
    if not _clean(conn):  # a reply nobody asked for would answer the next command
        abort(conn)
    elif len(idle.conns) < MAX_IDLE:
        idle.conns.append(conn)
    else:
        conn.disconnect()


def _owe(idle: _Idle, conn: Any, until: float, late_ok: bool, due: int) -> None:
    """Keep aside a connection that still owes ``due`` replies, until ``until``."""
    if len(idle.owed) < MAX_IDLE:
        idle.owed.append((conn, until, late_ok, due))
    else:
        _drop(conn, late_ok)


def _drop(conn: Any, late_ok: bool) -> None:
    """Drop a connection given up on while its reply is due.

    A command that takes a lock must never run later: reset (``abort``). A
    clean-up (``Fanout.critical``: a release, undoing an attempt, leaving a queue)
    should: it is closed in order, after what it sent. A node frozen when it was
    sent on a new connection has not accepted that connection yet, and a reset
    makes its kernel discard it, clean-up and all, while the command it undoes,
    sent earlier on an accepted connection, still runs when the node resumes.
    """
    if late_ok:
        conn.disconnect()
    else:
        abort(conn)


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
            conn, until, late_ok, due = owed.popleft()
        except IndexError:
            return
        try:
            # ``while True`` with a guard: Python 3.13 leaves a ``while`` condition's
            # back-edge outside this ``try`` (tests/test_back_edges.py).
            while True:
                if not due or not _arrived(conn):
                    break
                # An error reply (NOSCRIPT, ...) is an owed reply too.
                with contextlib.suppress(redis.ResponseError):
                    _read_response(conn, _MIN_WAIT)
                due -= 1
        except Exception as exc:
            abort(conn)  # read_response() dropped it already, on most errors
            reraise_interruption(exc)
            continue
        except BaseException:
            abort(conn)
            raise
        if not due:
            _give(idle, conn)
        elif now < until:
            owed.append((conn, until, late_ok, due))
        else:
            _drop(conn, late_ok)


def _is_tls(conn: Any) -> bool:
    return isinstance(conn, redis.SSLConnection)


#: Connection classes seen on the fast path, reading straight into hiredis, over a
#: plain socket (no TLS layer): their usual fan-outs take ``_Round._send_quick``.
_QUICK: set[type] = set()


def _put_back(calls: list[_Call]) -> None:
    """Return unwritten connections to their idle lists, last taken first."""
    for call in reversed(calls):
        call.idle.conns.append(call.conn)


def _command(step: Fanout, by_sha: bool) -> tuple[Any, ...]:
    head = ("EVALSHA", step.script.sha) if by_sha else ("EVAL", step.script.source)
    return (*head, len(step.keys), *step.keys, *step.args)


class _Call:
    """One node's call in a fan-out: its connection and what was tried on it."""

    __slots__ = ("conn", "direct", "idle", "index", "resent", "reused", "unsure")

    def __init__(self, index: int, idle: _Idle, conn: Any, reused: bool) -> None:
        self.index = index
        self.idle = idle
        self.conn = conn
        #: An idle connection: if writing to it fails, the command is sent again
        #: on a new one (it cannot have run).
        self.reused = reused
        #: NOSCRIPT was already answered by resending the script's source.
        self.resent = False
        #: Its replies are read straight into the hiredis reader (``wire.read``).
        self.direct = False
        #: Sent again after the connection broke once the command was written: it
        #: may have run the first time, so only a winning reply counts.
        self.unsure = False


class _Round:
    """One fan-out under way: the calls still waiting, the replies and the deadline."""

    __slots__ = (
        "any_tls",
        "began",
        "deadline",
        "looked",
        "packed",
        "poller",
        "pools",
        "portable",
        "replies",
        "sent",
        "step",
        "timeout",
        "waiting",
        "why",
    )

    def __init__(
        self, pools: Sequence[redis.ConnectionPool], step: Fanout, timeout: float
    ) -> None:
        self.pools = pools
        self.step = step
        self.timeout = timeout
        self.began = time.monotonic()
        self.deadline = math.inf
        self.replies: dict[int, NodeReply] = {}
        #: By file descriptor on the fast path, by node index on the portable one.
        self.waiting: dict[int, _Call] = {}
        self.poller = select.poll()
        #: Some connection has no socket to poll(): wait through can_read() only.
        self.portable = False
        self.any_tls = False
        self.packed: Any = None
        self.why = TIMED_OUT
        #: When the last look at the replies, past the deadline, was taken.
        self.looked = math.inf
        #: Calls written to but not yet waited on (dropped if interrupted then).
        self.sent: list[_Call] = []

    def send(self, targets: Sequence[int]) -> None:
        """Write the command to every node before any reply is read."""
        if not self._send_quick(targets):
            self._send_general(targets)
        # Each node gets a whole NODE_TIMEOUT after its command went out, however
        # long the writes took this thread (connects, other threads holding the GIL).
        self.deadline = time.monotonic() + self.timeout

    def _send_quick(self, targets: Sequence[int]) -> bool:
        """The usual fan-out in fewer steps: every node has an idle connection of a
        class already seen on the fast path (``_QUICK``), and none of them was
        closed while idle. Anything else, found before the first write, puts the
        connections back and returns False for ``_send_general``."""
        pools, pid = self.pools, _pid
        calls: list[_Call] = []
        try:
            for i in targets:
                idle: _Idle | None = getattr(pools[i], _IDLE, None)
                if idle is None or idle.pid != pid or idle.owed:
                    break
                conn = idle.conns.pop()  # IndexError: none idle
                calls.append(_Call(i, idle, conn, True))
                if type(conn) not in _QUICK or conn._sock is None:
                    break
            else:
                fds = self._quiet(calls)
                if fds is not None:
                    self._write_all(calls, fds)
                    return True
        except IndexError:
            pass
        except BaseException:
            _put_back(calls)
            raise
        _put_back(calls)
        return False

    def _quiet(self, calls: list[_Call]) -> list[int] | None:
        """Register the idle connections on the round's poller and look, with one
        poll(0), whether any can be read: closed by the server while idle, or
        holding what nobody asked for (the general path looks the same way, see
        ``wire.closed_while_idle``). Return their descriptors, or None (nothing
        left registered) when one is readable or has no descriptor."""
        poller = self.poller
        fds: list[int] = []
        try:
            for call in calls:
                fd = call.conn._sock.fileno()
                poller.register(fd, select.POLLIN)
                fds.append(fd)
            if not poller.poll(0):
                return fds
        except (OSError, ValueError):
            pass
        for fd in fds:
            poller.unregister(fd)
        return None

    def _write_all(self, calls: list[_Call], fds: list[int]) -> None:
        """Write to the quick path's connections (registered by ``_quiet``), then
        wait on those written; a connection replaced by ``_write`` is waited on by
        its new descriptor."""
        command = _command(self.step, by_sha=True)
        packed = self.packed = _pack(calls[0].conn, command)
        # One write(2) per node here (the descriptors are non-blocking: see
        # ``wire.send``); what it did not finish, or could not start, ``_write`` does.
        data = packed[0] if len(packed) == 1 else b""
        size = len(data)
        poller, waiting = self.poller, self.waiting
        sent = self.sent
        fresh: list[_Call] = []
        for call, fd in zip(calls, fds, strict=True):
            conn = call.conn
            done = 0
            if size:
                try:
                    done = os.write(fd, data)
                except OSError:
                    done = 0  # nothing written: _write finds out why
                except BaseException:
                    abort(conn)  # interrupted: the command may be out
                    raise
                if done == size:
                    sent.append(call)
                    continue
            written = self._write(call, done)
            if written and call.conn is conn:
                sent.append(call)
                continue
            poller.unregister(fd)
            if written:  # sent again on a new connection (``_again``)
                sent.append(call)
                fresh.append(call)
        for call in fresh:
            poller.register(call.conn._sock.fileno(), select.POLLIN)
        for call in sent:
            call.direct = True
            waiting[call.conn._sock.fileno()] = call
        self.sent = []

    def _send_general(self, targets: Sequence[int]) -> None:
        """Any fan-out: new connections, ones closed while idle, the portable path."""
        began, pools, replies = self.began, self.pools, self.replies
        step = self.step
        # Every step goes by EVALSHA (a clean-up a node leaves unanswered gets its
        # source written behind: ``_behind``).
        command = _command(step, by_sha=True)
        pid = _pid
        sent = self.sent
        taken = [(i, *_take(pools[i], pid)) for i in targets]
        # An idle connection the server closed is replaced before it carries the
        # command: one that breaks after the write fails its node (_answer).
        closed = _closed_while_idle([conn for _, _, conn, reused in taken if reused])
        if any(closed):
            old = iter(closed)
            for n, (i, idle, conn, reused) in enumerate(taken):
                if reused and next(old):
                    abort(conn)
                    fresh = pools[i].connection_class(**pools[i].connection_kwargs)
                    taken[n] = (i, idle, fresh, False)
        for i, idle, conn, reused in taken:
            if not reused and began - idle.stalled_at < STALL_HOLD:
                ago = began - idle.stalled_at
                replies[i] = NodeReply(
                    error=f"skipped: connecting timed out {ago:.2f}s ago"
                )
                continue
            if self.packed is None:  # every connection packs alike: pack once
                self.packed = _pack(conn, command)
            call = _Call(i, idle, conn, reused)
            if self._write(call):
                sent.append(call)
        # Connected now: each class's path is known (probed at its first connection).
        for call in sent:
            path = path_of(call.conn)
            call.direct = path.direct
            self.portable = self.portable or path.name == PORTABLE
            if path.direct and type(call.conn._sock) is socket.socket:
                _QUICK.add(type(call.conn))
        for call in sent:
            self._wait(call)
            self.any_tls = self.any_tls or _is_tls(call.conn)
        self.sent = []

    def _write(self, call: _Call, done: int = 0) -> bool:
        """Write the packed command on ``call``'s connection, whose first ``done``
        bytes went out already; say whether it went out (if not, the node's reply
        says why)."""
        conn = call.conn
        try:
            _send(conn, self.packed, done)
        except Exception as exc:
            abort(conn)
            reraise_interruption(exc)
            if not call.reused:
                _stalled(call.idle, exc)
                self.replies[call.index] = NodeReply(error=describe(exc))
                return False
            # An idle connection the server closed (a restart) is only found
            # out when used; the command did not run, so send it on a new one.
            return self._again(call, stalled=True)
        except BaseException:
            abort(conn)
            raise
        return True

    def _again(self, call: _Call, stalled: bool) -> bool:
        """Send the command once more on a new connection; say whether it went out.

        With ``stalled``, a new connection that timed out holds the node off.
        """
        pool = self.pools[call.index]
        conn = pool.connection_class(**pool.connection_kwargs)
        try:
            conn.send_packed_command(self.packed, check_health=False)
        except Exception as exc:
            abort(conn)
            reraise_interruption(exc)
            if stalled:
                _stalled(call.idle, exc)
            self.replies[call.index] = NodeReply(error=describe(exc))
            return False
        except BaseException:
            abort(conn)
            raise
        call.conn, call.reused = conn, False
        return True

    def _wait(self, call: _Call) -> None:
        if self.portable:
            self.waiting[call.index] = call
            return
        fd = call.conn._sock.fileno()
        self.poller.register(fd, select.POLLIN)
        self.waiting[fd] = call

    def _ready(self, left: float) -> list[int]:
        """Wait up to ``left`` for replies; return the keys of the calls that have one.

        Fast: one poll() on every socket. Portable (no socket to poll): every
        connection is asked ``can_read(0)``, then one of them, in turn, is waited
        on for at most ``SLICE``.
        """
        waiting = self.waiting
        if self.portable:
            ready = [key for key, c in waiting.items() if _arrived(c.conn)]
            if ready:
                return ready
            key, call = next(iter(waiting.items()))
            del waiting[key]  # to the back of the line: the next wait is another's
            waiting[key] = call
            return [key] if wait_one(call.conn, min(SLICE, left)) else []
        # poll() cannot see bytes a TLS layer already decrypted: those connections
        # are read in turn, blocking up to the deadline.
        if self.any_tls:
            tls = next((fd for fd, c in waiting.items() if _is_tls(c.conn)), None)
            if tls is not None:
                return [tls]
        return [fd for fd, _ in self.poller.poll(max(1, math.ceil(left * 1000)))]

    def read(self) -> None:
        """Read the replies as they arrive until the step is decided.

        That is: every node answered, the deadline passed, or the step's outcome is
        known (``need`` winning replies). A slow node first in the list does not
        hold up the rest.
        """
        waiting, poller = self.waiting, self.poller
        polled = not self.portable
        need = self.step.need
        wins = 0
        final = False
        while waiting:
            if need and wins >= need and self.why != UNAWAITED:
                # Known outcome: only a slow or hung node is left behind (and its
                # connection kept aside until its reply comes).
                now = time.monotonic()
                self.deadline = min(self.deadline, now + grace(now - self.began))
                self.why = UNAWAITED
            now = time.monotonic()
            left = self.deadline - now
            if left <= 0:
                if final:
                    break
                # One last look, without waiting: replies that arrived while this
                # thread was elsewhere (reading others, waiting for the GIL or a
                # CPU), or that sit decrypted in a TLS buffer, count.
                final = True
                self.looked = now
                ready = [key for key, c in waiting.items() if _arrived(c.conn)]
                if not ready:
                    break
            else:
                ready = self._ready(left)
            for key in ready:
                call = waiting.pop(key)
                if polled:
                    poller.unregister(key)
                won = None if final or not call.direct else self._quick(call)
                if won is None:
                    won = self._answer(call, final, left)
                if won:
                    wins += 1

    def _quick(self, call: _Call) -> bool | None:
        """The usual reply, in fewer steps: read whole in one go
        (``wire.read_arrived``), not an error. Say whether it wins; anything else
        goes to ``_answer`` (None: nothing was read)."""
        conn = call.conn
        try:
            value = _read_arrived(conn)
        except Exception as exc:  # a reply hiredis cannot parse, as in _answer
            abort(conn)
            reraise_interruption(exc)
            self.replies[call.index] = NodeReply(error=describe(exc))
            return False
        except BaseException:
            abort(conn)  # interrupted: what was read is lost with it
            raise
        if value is NOT_READ:
            return None
        if value is INCOMPLETE or call.unsure or isinstance(value, Exception):
            return self._answer(call, False, 0.0, value)
        _give(call.idle, conn)  # dropped if a reply nobody asked for follows
        self.replies[call.index] = NodeReply(value)
        winning = self.step.wins
        return winning is not None and bool(winning(value))

    def _answer(
        self, call: _Call, final: bool, left: float, read: Any = NOT_READ
    ) -> bool:
        """Read one node's reply (unless ``_quick`` did: ``read``); say whether it
        is a winning one.

        A node that answers NOSCRIPT (restarted, or SCRIPT FLUSH) gets the source
        once, and a reply not whole yet is waited for again. Idle connections the
        server closed are mostly found before they are used; one that breaks once
        its command went out is retried once on a new one, whose answer counts
        only if it wins: the command may have run the first time.
        """
        i, conn = call.index, call.conn
        replies = self.replies
        try:
            if read is not NOT_READ:
                value = read
                if isinstance(value, redis.ConnectionError | redis.ResponseError):
                    raise value  # as ``wire.read`` raises it
            elif final:
                value = _read_response(conn, _MIN_WAIT)
            else:
                value = _read(conn, max(left, _MIN_WAIT), call.direct)
        except NoScriptError:
            if call.resent:
                replies[i] = NodeReply(error="NoScriptError")
                _give(call.idle, conn)
                return False
            try:
                conn.send_command(*_command(self.step, by_sha=False))
            except Exception as exc:
                # The connection broke between the NOSCRIPT and the resend: this
                # node failed, like any other.
                abort(conn)
                reraise_interruption(exc)
                replies[i] = NodeReply(error=describe(exc))
                return False
            call.reused, call.resent = False, True
        except redis.ConnectionError as exc:
            abort(conn)
            reraise_interruption(exc)  # redis-py rewraps what broke its read
            if not call.reused or time.monotonic() >= self.deadline:
                replies[i] = NodeReply(error=describe(exc))
                return False
            # Broke on a reused connection (a server restarted, a reset the poll
            # at take time did not see yet): sent once more on a new one. The
            # command may have run the first time, so the second reply counts only
            # if it wins (a release that ran answers 0 when sent again: not "not
            # held"). A timeout is not retried.
            call.unsure = True
            if not self._again(call, stalled=False):
                return False
        except Exception as exc:
            abort(conn)
            reraise_interruption(exc)
            late = final and isinstance(exc, redis.TimeoutError)
            replies[i] = NodeReply(error=self.why if late else describe(exc))
            return False
        except BaseException:
            abort(conn)
            raise
        else:
            if value is INCOMPLETE:  # the rest of it is waited for with the others
                self._wait(call)
                return False
            _give(call.idle, conn)
            winning = self.step.wins
            won = winning is not None and bool(winning(value))
            if call.unsure and not won:
                replies[i] = NodeReply(error=_UNSURE)
                return False
            replies[i] = NodeReply(value)
            return won
        self._wait(call)
        return False

    def give_up(self, finished: bool) -> None:
        """Fail the nodes still silent; keep their connections aside owing a reply.

        An interrupted fan-out (``finished`` False) drops them instead: never reused.
        """
        for call in self.sent:  # interrupted while writing: none is waited on
            abort(call.conn)
        self.sent = []
        if not self.waiting:
            return
        why = self.why
        # A last look long after the deadline says nothing about the nodes still
        # silent: the thread itself was late.
        lag = self.looked - self.deadline
        if finished and why != UNAWAITED and lag > LATE_SLACK * self.timeout:
            why = f"{LATE}: looked {lag * 1000:.0f} ms after its deadline"
        until = time.monotonic() + self.timeout
        critical = self.step.critical
        for call in self.waiting.values():
            self.replies.setdefault(call.index, NodeReply(error=why))
            # A command the node's host never acknowledged may still be in the
            # kernel's queue, retransmitted: reset the connection now, so that it
            # cannot run after this attempt's clean-up (a partition that heals).
            # A slow node's acknowledgement may be delayed: it keeps its connection.
            # A clean-up should run late: closed in order, the kernel delivers it
            # when the partition heals (``_drop``), as the asyncio driver does.
            owes = finished and (why == UNAWAITED or not in_flight(call.conn))
            due = 1
            if finished and critical and not call.resent:
                if not self._behind(call):
                    owes = False  # what it holds is unknown: closed in order
                due = 2
            if owes:
                _owe(call.idle, call.conn, until, critical, due)
            else:
                _drop(call.conn, finished and critical)

    def _behind(self, call: _Call) -> bool:
        """Write a clean-up's source (EVAL) behind the EVALSHA a silent node has
        not answered, and say whether it went out whole.

        The node may run them long after this fan-out gave up (frozen, then
        resumed), with nobody left to answer a NOSCRIPT: one lacking the script
        answers the EVALSHA NOSCRIPT, to nobody, and runs the EVAL; one that ran
        the EVALSHA has nothing left for the EVAL to undo. (Clean-ups undo their
        own token only, so each is harmless after the other.) A clean-up whose
        NOSCRIPT was answered in time went out as EVAL already (``_answer``).
        """
        conn = call.conn
        try:
            packed = _pack(conn, _command(self.step, by_sha=False))
            conn.send_packed_command(packed, check_health=False)
        except Exception as exc:
            reraise_interruption(exc)
            return False
        return True


def fanout(
    pools: Sequence[redis.ConnectionPool], step: Fanout, timeout: float
) -> list[NodeReply]:
    """Run ``step`` on its nodes at once; return one reply per targeted node."""
    targets = range(len(pools)) if step.nodes is None else step.nodes
    round_ = _Round(pools, step, timeout)
    finished = False
    try:
        round_.send(targets)
        round_.read()
        finished = True
    finally:
        round_.give_up(finished)
    replies = round_.replies
    return [replies[i] for i in targets]


def run(
    flow: Any,
    pools: Sequence[redis.ConnectionPool],
    timeout: float,
    sleep: Callable[[float], None] = time.sleep,
    hub: Hub | None = None,
    ended: list[Any] | None = None,
) -> Any:
    """Drive a protocol flow to its end and return its result.

    With a ``hub``, a wait that names a lock key ends early when that lock is
    released. An interruption (KeyboardInterrupt) during a step is thrown into the
    flow, so its clean-up steps still run before the interruption propagates.
    ``ended``, if given, gets the result the moment the flow returns it: an
    interruption that comes out of ``run`` after that (while it stops watching
    for wake-ups) leaves the caller the result to undo (a grant's keys).
    """
    pending: BaseException | None = None
    watching: list[SyncWatch] = []
    try:
        while True:
            try:
                return _steps(
                    flow, pending, pools, timeout, sleep, hub, watching, ended
                )
            except BaseException as exc:
                if flow.gi_frame is None:
                    raise  # the flow's own outcome, or it ended with the exception
                # Raised in a step, or between two (a signal handler's exception
                # where the flow just yielded): it is thrown in at the step, so
                # the flow's clean-up runs. One landing inside the standard
                # library's threading (Condition.wait, Thread.start) makes it
                # raise an error of its own: the flow is told of the interruption.
                pending = interruption(exc) or exc
    finally:
        if watching and hub is not None:
            try:
                hub.unwatch(watching[0])
            except BaseException:
                hub.unwatch(watching[0])  # interrupted (a signal handler): again
                raise


def _steps(
    flow: Any,
    pending: BaseException | None,
    pools: Sequence[redis.ConnectionPool],
    timeout: float,
    sleep: Callable[[float], None],
    hub: Hub | None,
    watching: list[SyncWatch],
    ended: list[Any] | None,
) -> Any:
    """Run ``flow``'s steps (after throwing ``pending`` in, if any) to its end.

    A loop of its own frame: CPython can miss the ``try`` around a loop when a
    signal handler raises at the loop's backward jump (python/cpython#108214);
    an exception leaving a frame always reaches the caller's ``try``.
    """
    reply: Any = None
    while True:
        try:
            step: Step = flow.throw(pending) if pending else flow.send(reply)
        except StopIteration as stop:
            if ended is not None:
                ended.append(stop.value)
            return stop.value
        pending = None
        if not isinstance(step, Sleep):
            reply = fanout(pools, step, timeout)
            if watching and hub is not None and not step.critical:
                hub.attempted(watching[0])
            continue
        reply = None
        if step.wake is None or hub is None:
            sleep(step.seconds)
            continue
        if not watching:
            watching.append(SyncWatch(step.wake.encode(), step.waiter))
            hub.watch(watching[0], step.since)
        reply = watching[0].wait(step.seconds)
