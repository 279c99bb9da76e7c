"""The asyncio driver: runs the same protocol flows with redis.asyncio.

Each node call is bounded by NODE_TIMEOUT with ``asyncio.wait_for``; redis-py drops
the connection of a cancelled command, so a late reply never reaches the next
caller. Clean-up steps (``Fanout.critical``) are shielded: cancelling the caller
does not leave a partial lock behind, the cancellation propagates once they end.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import redis
import redis.asyncio
from redis.exceptions import NoScriptError

from .nodes import describe
from .protocol import UNAWAITED, Fanout, NodeReply, Sleep, Step
from .wake import AsyncWatch, Hub

__all__ = ["fanout", "run"]

#: Least time given to the other nodes once a quorum decided a fan-out.
_GRACE = 0.001


async def _call(client: redis.asyncio.Redis, step: Fanout, timeout: float) -> NodeReply:
    tail = (len(step.keys), *step.keys, *step.args)
    # Clean-ups go as EVAL, as in sync.py: a frozen node may run them after the
    # caller stopped waiting, when no one would resend the source after NOSCRIPT.
    by_sha = not step.critical
    try:
        async with asyncio.timeout(timeout):
            for attempt in (1, 2):
                try:
                    if by_sha:
                        try:
                            value = await client.execute_command(
                                "EVALSHA", step.script.sha, *tail
                            )
                        except NoScriptError:
                            by_sha = False
                    if not by_sha:
                        value = await client.execute_command(
                            "EVAL", step.script.source, *tail
                        )
                    break
                except redis.ConnectionError:
                    # A pooled connection the server closed (a restart) is only
                    # seen when used. Every script is idempotent for one token, so
                    # one more try on a new connection is safe; a timeout is not
                    # retried.
                    if attempt == 2:
                        raise
    except Exception as exc:
        return NodeReply(error=describe(exc))
    return NodeReply(value)


async def fanout(
    clients: Sequence[redis.asyncio.Redis], step: Fanout, timeout: float
) -> list[NodeReply]:
    """Run ``step`` on its nodes concurrently; return one reply per targeted node."""
    targets = list(range(len(clients)) if step.nodes is None else step.nodes)
    calls = [asyncio.ensure_future(_call(clients[i], step, timeout)) for i in targets]
    if not step.need:
        return list(await asyncio.gather(*calls))
    loop = asyncio.get_running_loop()
    began = loop.time()
    pending: set[asyncio.Future[NodeReply]] = set(calls)
    try:
        wins = 0
        while pending and wins < step.need:
            done, pending = await asyncio.wait(
                pending, return_when=asyncio.FIRST_COMPLETED
            )
            for call in done:
                reply = call.result()
                if step.wins is not None and reply.ok and step.wins(reply.value):
                    wins += 1
        if pending:
            # Known outcome: give the other nodes a few round trips (as sync.py
            # does), then stop waiting for a slow or hung one.
            grace = max(_GRACE, 2 * (loop.time() - began))
            _, pending = await asyncio.wait(pending, timeout=grace)
    finally:
        for call in pending:
            call.cancel()
    if pending:
        await asyncio.gather(*pending, return_exceptions=True)
    return [
        NodeReply(error=UNAWAITED) if call.cancelled() else call.result()
        for call in calls
    ]


async def run(
    flow: Any,
    clients: Sequence[redis.asyncio.Redis],
    timeout: float,
    sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
    hub: Hub | None = None,
) -> Any:
    """Drive a protocol flow to its end and return its result.

    With a ``hub``, a wait that names a lock key ends early when that lock is
    released. A cancellation during a step is thrown into the flow, so its clean-up
    steps run (shielded) before the cancellation propagates.
    """
    reply: Any = None
    pending: BaseException | None = None
    watch: AsyncWatch | None = None
    try:
        while True:
            try:
                step: Step = flow.throw(pending) if pending else flow.send(reply)
            except StopIteration as stop:
                return stop.value
            pending = None
            try:
                if isinstance(step, Sleep):
                    reply = None
                    if step.wake is None or hub is None:
                        await sleep(step.seconds)
                        continue
                    if watch is None:
                        watch = AsyncWatch(step.wake.encode())
                        hub.watch(watch)
                    reply = await watch.wait(step.seconds)
                elif step.critical:
                    work = asyncio.ensure_future(fanout(clients, step, timeout))
                    try:
                        reply = await asyncio.shield(work)
                    except asyncio.CancelledError:
                        # Let the clean-up finish, then hand the cancellation on.
                        reply = await work
                        raise
                else:
                    reply = await fanout(clients, step, timeout)
            except BaseException as exc:
                pending = exc
    finally:
        if watch is not None and hub is not None:
            hub.unwatch(watch)
