"""The asyncio driver: runs the same protocol flows with redis.asyncio.

A fan-out starts one call per node and waits for them against one deadline
(NODE_TIMEOUT), not with a timer inside each call: a timer that fires while the
loop is busy cancels a call whose reply already sits in its socket buffer, and
a busy loop (many tasks, a CPU hog) would then report healthy nodes as timed out.
So the client's own delays do not count against the nodes:

- each node gets a whole NODE_TIMEOUT from the moment its command was written,
  however late the loop got to write it;
- at the deadline the loop is let run a few turns (its ready callbacks and a
  poll of its sockets) before any node is given up: replies that had arrived are
  read;
- when that look ended long after the deadline (more than ``LATE_SLACK`` of
  NODE_TIMEOUT: the timer was served late, or each turn of a crowded loop took
  long), a missing reply is no evidence: the node is marked ``LATE``, which the
  protocol never counts as an outage.

Connects and replies run with no redis-py timer at all (those timers measure loop
time too, and fired on healthy nodes); a call given up is cancelled, and
redis-py drops the connection of a cancelled read, so a late reply never reaches
the next caller. A node that answers just after the quorum decided is not
cancelled: its call goes on in the background (for at most NODE_TIMEOUT) and
returns the connection to the pool once the owed reply was read, so a node a
little slower than the others does not cost a new connection every time. Such a
call never writes again once the fan-out returned: not its command, if it was
still connecting, nor a resend (after NOSCRIPT, or on a new connection), which
would run after whatever the caller did next (a release, a clean-up) and leave a
key nobody owns. A call given up drops its connection with a reset
(``sockets``): a command written into a partition never runs after the
partition heals; a clean-up's is closed in order, so that the clean-up still
runs when a frozen node resumes (``sync._drop``).
Clean-up steps (``Fanout.critical``) are shielded: cancelling the caller does not
leave a partial lock behind, the cancellation propagates once they end.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Awaitable, Callable, Iterable, Sequence
from typing import Any, TypeVar

import redis
import redis.asyncio
from redis.exceptions import NoScriptError

from .interrupts import interruption
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
from .sockets import reset_on_close
from .wake import AsyncWatch, Hub
from .wire import texts

__all__ = ["complete", "fanout", "run"]

T = TypeVar("T")

#: Loop turns run at the deadline before giving up on a node: one for the
#: selector to report a socket, one for its callback to feed the reply to the
#: reader, one for the call to parse it, one spare.
_SETTLE_TURNS = 4

#: Calls left to finish on their own: a reply still owed after the quorum
#: decided, or only the connection's return to the pool left. Referenced here so
#: that they are not garbage-collected while they run.
_background: set[asyncio.Future[None]] = set()


class _Ended(Exception):
    """The fan-out returned before this call wrote its command: it never will."""


class _NotSent(redis.ConnectionError):
    """The connection was closed before the command was written to it."""


#: A node whose connection broke after the command went out, and whose second
#: answer did not win: the first may have run (the second says nothing).
_UNSURE = "connection broke after the command was sent; no answer to trust"


async def _roundtrip(
    conn: Any,
    command: tuple[Any, ...],
    k: int,
    marks: list[float],
    over: list[bool],
    late_ok: bool,
) -> Any:
    """Write ``command`` and read its reply, with no timer: the fan-out bounds it.

    Nothing is written once the fan-out is ``over``: the check and the write run in
    one step of the loop, so no later step of the caller comes between them. Given
    up, the connection is reset, unless the command may still run late (``late_ok``:
    a clean-up, as ``sync._drop`` says).
    """
    if over[0]:
        raise _Ended("not sent: the fan-out had returned")
    writer = conn._writer
    if writer is None:
        raise _NotSent("Connection closed.")
    # A direct write: redis-py's send_packed_command() wraps it in wait_for(), one
    # more task and one more timer that a busy loop could serve late.
    writer.writelines(conn.pack_command(*texts(command)))
    marks[k] = asyncio.get_running_loop().time()
    sock = writer.get_extra_info("socket")
    try:
        return await conn.read_response(timeout=math.inf)
    except asyncio.CancelledError:
        # Given up: redis-py closes the connection, and what the kernel still
        # holds of the command (a partition) must not reach the node later.
        if not late_ok:
            reset_on_close(sock)
            writer.transport.abort()
        raise


async def _connection(pool: redis.asyncio.ConnectionPool) -> Any:
    """Take a connection from ``pool``, connected, with no redis-py connect timer.

    That timer measures the connect in loop time: on a busy loop a connect takes
    several long turns, and the timer fired on healthy nodes (40 tasks starting at
    once). The fan-out's deadline bounds the connect instead, and judges it by the
    loop's own lateness. The pool's bookkeeping is kept (``get_connection()`` minus
    its metrics); its lock is not needed, the take being synchronous.
    """
    conn = pool.get_available_connection()
    # Restored once connected: redis-py also bounds closing a connection with it.
    bound, conn.socket_connect_timeout = conn.socket_connect_timeout, None
    try:
        await pool.ensure_connection(conn)
    except BaseException:
        await pool.release(conn)
        raise
    finally:
        conn.socket_connect_timeout = bound
    return conn


async def _call(
    pool: redis.asyncio.ConnectionPool,
    step: Fanout,
    k: int,
    marks: list[float],
    got: list[NodeReply | None],
    over: list[bool],
    interrupted: list[BaseException],
) -> None:
    """Run ``step`` on one node; put its reply in ``got[k]`` (before the
    connection goes back to the pool, so a fan-out that stops waiting still sees
    it). Once ``over[0]`` (the fan-out returned) it writes nothing more. A signal
    handler's exception that lands here goes to ``interrupted``, for the fan-out
    to raise: it is not the node's failure."""
    loop = asyncio.get_running_loop()
    tail = (len(step.keys), *step.keys, *step.args)
    # Clean-ups go as EVAL: a frozen node may run them after the caller stopped
    # waiting, when no one would resend the source after NOSCRIPT, and a call
    # never writes once its fan-out returned (sync.py writes the source behind an
    # unanswered EVALSHA instead: ``_Round._behind``).
    by_sha = not step.critical
    #: Sent again after the connection broke once the command was written.
    unsure = False
    try:
        for attempt in (1, 2):
            marks[k] = loop.time()
            conn = await _connection(pool)
            try:
                if by_sha:
                    try:
                        value = await _roundtrip(
                            conn,
                            ("EVALSHA", step.script.sha, *tail),
                            k,
                            marks,
                            over,
                            step.critical,
                        )
                    except NoScriptError:
                        by_sha = False
                if not by_sha:
                    value = await _roundtrip(
                        conn,
                        ("EVAL", step.script.source, *tail),
                        k,
                        marks,
                        over,
                        step.critical,
                    )
                if unsure and not (step.wins is not None and step.wins(value)):
                    # The first may have run: a release that did answers 0 when
                    # sent again, which would read as "not held".
                    got[k] = NodeReply(error=_UNSURE)
                else:
                    got[k] = NodeReply(value)
                return
            except redis.ConnectionError as exc:
                # A pooled connection the server closed (a restart) is mostly found
                # when taken (the pool's check), else when used: one more try on a
                # new connection. If the command was written, it may have run: the
                # second answer then counts only if it wins.
                if attempt == 2:
                    raise
                unsure = not isinstance(exc, _NotSent)
            finally:
                await pool.release(conn)
    except _Ended:
        pass  # the fan-out already answered for this node
    except Exception as exc:
        found = interruption(exc)
        if found is not None:
            interrupted.append(found)
        got[k] = NodeReply(error=describe(exc))


def _raise_interruption(
    calls: Iterable[asyncio.Future[None]], interrupted: list[BaseException]
) -> None:
    """Raise what interrupted a node call: a signal handler's exception it caught,
    or one that ended it (one landing before its ``try``, where nothing catches)."""
    if interrupted:
        raise interrupted[0]
    for call in calls:
        if call.done() and not call.cancelled() and call.exception() is not None:
            raise call.exception()  # type: ignore[misc]


def _abandon(call: asyncio.Future[None], got: list[NodeReply | None], k: int) -> None:
    """Stop a background call whose owed reply never came (its connection drops)."""
    if got[k] is None:
        call.cancel()


def _leave(call: asyncio.Future[None]) -> None:
    _background.add(call)
    call.add_done_callback(_background.discard)


async def fanout(
    clients: Sequence[redis.asyncio.Redis], step: Fanout, timeout: float
) -> list[NodeReply]:
    """Run ``step`` on its nodes concurrently; return one reply per targeted node."""
    targets = list(range(len(clients)) if step.nodes is None else step.nodes)
    loop = asyncio.get_running_loop()
    began = loop.time()
    count = len(targets)
    #: When each call's command was written (or its connect began).
    marks = [began] * count
    got: list[NodeReply | None] = [None] * count
    #: Set when this fan-out stops waiting: calls left behind write nothing more.
    over = [False]
    #: Signal handlers' exceptions raised in the calls, raised here.
    interrupted: list[BaseException] = []
    calls = [
        asyncio.ensure_future(
            _call(clients[i].connection_pool, step, k, marks, got, over, interrupted)
        )
        for k, i in enumerate(targets)
    ]
    index: dict[asyncio.Future[None], int] = {c: k for k, c in enumerate(calls)}
    pending: set[asyncio.Future[None]] = set(calls)
    need, winning = step.need, step.wins
    why = TIMED_OUT
    deadline = began + timeout
    try:
        wins = 0
        while True:
            # Loops shaped for Python 3.13's signal checks: ``while True`` with a
            # ``break``, ``continue`` guards, generators (tests/test_back_edges.py).
            while True:
                if not pending or (need and wins >= need):
                    break
                now = loop.time()
                if now >= deadline:
                    # Each node gets a whole NODE_TIMEOUT from its command's write,
                    # however late the loop got to it.
                    later = max(marks[index[call]] for call in pending) + timeout
                    if later <= now:
                        break
                    deadline = later
                done, pending = await asyncio.wait(
                    pending, timeout=deadline - now, return_when=asyncio.FIRST_COMPLETED
                )
                _raise_interruption(done, interrupted)
                for call in done:
                    reply = got[index[call]]
                    if winning is None or reply is None or not reply.ok:
                        continue
                    wins += winning(reply.value)
            if pending and need and wins >= need:
                # Known outcome: give the other nodes a few round trips (as sync.py
                # does), then stop waiting for a slow or hung one; never past their
                # NODE_TIMEOUT.
                now = loop.time()
                limit = max(marks[index[call]] for call in pending) + timeout
                _, pending = await asyncio.wait(
                    pending, timeout=max(0.0, min(grace(now - began), limit - now))
                )
                why = UNAWAITED
            # Replies that sit in socket buffers are read before any node is given
            # up: the loop runs its ready callbacks and polls its sockets.
            for _ in range(_SETTLE_TURNS):
                if all(got[index[call]] is not None for call in pending):
                    break
                await asyncio.sleep(0)
            # Those turns may have finished a connect and written the command only
            # now (a crowded loop): that node has not had its NODE_TIMEOUT yet. Wait
            # on; marks move at most twice per connection, so this ends.
            silent = list(call for call in pending if got[index[call]] is None)
            if why == UNAWAITED or not silent:
                break
            later = max(marks[index[call]] for call in silent) + timeout
            if later <= loop.time():
                break
            deadline = later
        # Done long after the deadline (the timer served late, or each turn of a
        # crowded loop long), the look says nothing about the nodes still silent.
        lag = loop.time() - deadline
        if why != UNAWAITED and lag > LATE_SLACK * timeout:
            why = f"{LATE}: the loop got to it {lag * 1000:.0f} ms after its deadline"
        _raise_interruption(calls, interrupted)
        over[0] = True
        given_up = []
        for call in pending:
            k = index[call]
            if got[k] is not None:
                _leave(call)  # answered; only the connection's return is left
            elif why == UNAWAITED:
                # Its reply is owed on the connection: read it in the background
                # rather than drop the connection.
                _leave(call)
                loop.call_later(timeout, _abandon, call, got, k)
            else:
                call.cancel()
                given_up.append(call)
        pending = set()
    finally:
        over[0] = True
        # Interrupted: calls still waiting are cancelled (their connections drop);
        # answered ones only return their connection.
        for call in pending:
            if got[index[call]] is None:
                call.cancel()
            else:
                _leave(call)
    if given_up:
        await asyncio.gather(*given_up, return_exceptions=True)
        _raise_interruption(calls, interrupted)
    return [NodeReply(error=why) if reply is None else reply for reply in got]


async def complete(awaitable: Awaitable[T]) -> T:
    """Run ``awaitable`` to its end through any number of cancellations of the
    caller, then raise the (last) cancellation, if any.

    For clean-ups (a failed attempt's, a release): cut short, they would leave a
    lock nobody holds on its nodes until its lease ends. A failure of the
    clean-up itself is chained to the cancellation it gives way to.
    """
    work = asyncio.ensure_future(awaitable)
    cancelled: asyncio.CancelledError | None = None
    while not work.done():
        try:
            await asyncio.wait((work,))
        except asyncio.CancelledError as exc:
            cancelled = exc
    if cancelled is not None:
        failure = None if work.cancelled() else work.exception()
        raise cancelled from failure
    return work.result()


async def run(
    flow: Any,
    clients: Sequence[redis.asyncio.Redis],
    timeout: float,
    sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
    hub: Hub | None = None,
    ended: list[Any] | None = None,
) -> Any:
    """Drive a protocol flow to its end and return its result.

    With a ``hub``, a wait that names a lock key ends early when that lock is
    released. A cancellation during a step is thrown into the flow, so its clean-up
    steps run (shielded) before the cancellation propagates. ``ended``: as in
    ``sync.run``, the result the moment the flow returns it.
    """
    reply: Any = None
    pending: BaseException | None = None
    watch: AsyncWatch | None = None
    try:
        while True:
            try:
                step: Step = flow.throw(pending) if pending else flow.send(reply)
            except StopIteration as stop:
                if ended is not None:
                    ended.append(stop.value)
                return stop.value
            pending = None
            try:
                if isinstance(step, Sleep):
                    reply = None
                    if step.wake is None or hub is None:
                        await sleep(step.seconds)
                        continue
                    if watch is None:
                        watch = AsyncWatch(step.wake.encode(), step.waiter)
                        hub.watch(watch, step.since)
                    reply = await watch.wait(step.seconds)
                elif step.critical:
                    reply = await complete(fanout(clients, step, timeout))
                else:
                    reply = await fanout(clients, step, timeout)
                    if watch is not None and hub is not None:
                        hub.attempted(watch)
            except BaseException as exc:
                # As in ``sync.run``: a signal handler's exception that landed in
                # the standard library (threading, asyncio) and made it raise an
                # error of its own is thrown into the flow as itself.
                pending = interruption(exc) or exc
    finally:
        if watch is not None and hub is not None:
            try:
                hub.unwatch(watch)
            except BaseException:
                hub.unwatch(watch)  # interrupted (a signal handler): again
                raise
