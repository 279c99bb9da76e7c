"""The blocking driver: runs protocol flows with redis-py connections.

A fan-out writes the command to every node before it reads any reply, so N nodes
cost about one round trip and no thread. Each reply is read against one deadline,
NODE_TIMEOUT after the fan-out began: a hung node costs that much and no more, and
its connection is dropped rather than returned to the pool with a reply still due.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import redis
from redis.exceptions import NoScriptError

from .nodes import describe
from .protocol import Fanout, NodeReply, Sleep, Step
from .wake import Hub, SyncWatch

__all__ = ["fanout", "run"]

T = TypeVar("T")

#: The shortest read timeout: a zero timeout would make the socket non-blocking.
_MIN_WAIT = 0.0001


def _command(step: Fanout, by_sha: bool) -> tuple[Any, ...]:
    head = ("EVALSHA", step.script.sha) if by_sha else ("EVAL", step.script.source)
    return (*head, len(step.keys), *step.keys, *step.args)


def _drop(pool: redis.ConnectionPool, conn: Any) -> None:
    conn.disconnect()
    pool.release(conn)


def fanout(
    pools: Sequence[redis.ConnectionPool], step: Fanout, timeout: float
) -> list[NodeReply]:
    """Run ``step`` on its nodes at once; return one reply per targeted node."""
    targets = range(len(pools)) if step.nodes is None else step.nodes
    deadline = time.monotonic() + timeout
    replies: dict[int, NodeReply] = {}
    sent: list[tuple[int, Any]] = []
    # Clean-ups go as EVAL: a node that never answers (frozen, then resumed) may
    # run them long after this call gave up, with nobody left to resend the source
    # after a NOSCRIPT. Redis caches the script either way.
    command = _command(step, by_sha=not step.critical)
    for i in targets:
        pool = pools[i]
        try:
            conn = pool.get_connection()
        except Exception as exc:
            replies[i] = NodeReply(error=describe(exc))
            continue
        try:
            conn.send_command(*command)
        except Exception as exc:
            _drop(pool, conn)
            replies[i] = NodeReply(error=describe(exc))
            continue
        sent.append((i, conn))
    # Read every reply. A node that answers NOSCRIPT (restarted, or SCRIPT FLUSH)
    # gets the source once, which caches the script again, and is read once more.
    queue = [(i, conn, False) for i, conn in sent]
    try:
        while queue:
            i, conn, resent = queue[0]
            try:
                wait = max(deadline - time.monotonic(), _MIN_WAIT)
                replies[i] = NodeReply(conn.read_response(timeout=wait))
            except NoScriptError:
                if not resent:
                    conn.send_command(*_command(step, by_sha=False))
                    queue[0] = (i, conn, True)
                    continue
                replies[i] = NodeReply(error="NoScriptError")
            except Exception as exc:
                conn.disconnect()
                replies[i] = NodeReply(error=describe(exc))
            queue.pop(0)
            pools[i].release(conn)
    finally:
        for i, conn, _ in queue:
            _drop(pools[i], conn)
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
