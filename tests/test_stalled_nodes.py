"""A node whose connects time out is left alone for a while (sync driver).

A frozen server whose listen backlog is full, or a partitioned host, accepts no
new connection: each connect() waits NODE_TIMEOUT, before the fan-out reads any
other node's reply. After one such timeout the driver counts the node as failed
without connecting for ``STALL_HOLD`` seconds, then tries it again.

The stalled "nodes" here are real listening sockets that never accept, with
their backlog filled by idle connections: the kernel drops further SYNs.

A node frozen with room in its backlog does complete new connections, unaccepted:
a release sent on one still runs when the node resumes (both drivers).
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import time
from collections.abc import Iterator
from typing import Any

import pytest

from harness.held import lock_key
from harness.nodes import NodeSet
from harness.proxy import FaultProxy
from redlock_django import QuorumUnavailableError, Redlock, sync
from redlock_django.scripts import ACQUIRE_SCRIPT, RELEASE_SCRIPT

NODE_TIMEOUT = 0.1


@contextlib.contextmanager
def stalled_listener() -> Iterator[str]:
    """Yield the URL of a port that listens but never completes a connection."""
    server = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    server.bind(("127.0.0.1", 0))
    server.listen(0)
    port = server.getsockname()[1]
    fillers = []
    try:
        for _ in range(8):  # more than the backlog: later SYNs are dropped
            filler = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            filler.setblocking(False)
            with contextlib.suppress(BlockingIOError):
                filler.connect(("127.0.0.1", port))
            fillers.append(filler)
        time.sleep(0.05)
        yield f"redis://127.0.0.1:{port}/0"
    finally:
        for filler in fillers:
            filler.close()
        server.close()


@pytest.fixture(autouse=True)
def scripts_loaded(nodes: NodeSet) -> None:
    """Cache the scripts on the real nodes: a NOSCRIPT resend needs one more round
    trip, which a fan-out whose deadline connect() used up no longer has."""
    for node in nodes:
        with node.client() as client:
            for script in (ACQUIRE_SCRIPT, RELEASE_SCRIPT):
                client.script_load(script.source)


def reasons(error: QuorumUnavailableError) -> list[str]:
    return list(error.failed.values())


def test_a_node_whose_connect_timed_out_is_skipped_then_tried_again(
    settings: Any, nodes: NodeSet, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(sync, "STALL_HOLD", 0.6)
    with stalled_listener() as a, stalled_listener() as b, stalled_listener() as c:
        settings.REDLOCK = {
            "NODES": [*nodes.urls[:2], a, b, c],
            "NODE_TIMEOUT": NODE_TIMEOUT,
            "TTL": 10.0,
        }
        lock = Redlock("stalled")
        # First: three connects time out (the quorum cannot be reached).
        with pytest.raises(QuorumUnavailableError) as first:
            lock.acquire(blocking=False)
        assert sorted(reasons(first.value)) == ["timed out"] * 3
        # Within the hold the stalled nodes are not connected to again: they fail
        # at once, and say why.
        with pytest.raises(QuorumUnavailableError) as second:
            lock.acquire(blocking=False)
        assert all(
            r.startswith("skipped: connecting timed out") for r in reasons(second.value)
        )
        # After the hold they are tried again (and time out again).
        time.sleep(0.6)
        with pytest.raises(QuorumUnavailableError) as third:
            lock.acquire(blocking=False)
        assert sorted(reasons(third.value)) == ["timed out"] * 3


def test_nodes_written_after_a_stalled_connect_still_get_their_whole_timeout(
    settings: Any, nodes: NodeSet
) -> None:
    """The first node's connect() stalls for all of NODE_TIMEOUT before the four
    healthy nodes (5 ms away, behind proxies) are written to. That wait is the
    client's own: they still get a whole NODE_TIMEOUT to answer, the lock is
    granted by four, and only the stalled node is reported."""
    with contextlib.ExitStack() as stack:
        stalled = stack.enter_context(stalled_listener())
        proxies = [stack.enter_context(FaultProxy(port)) for port in nodes.ports[:4]]
        for proxy in proxies:
            proxy.delay(0.005)
        settings.REDLOCK = {
            "NODES": [stalled, *(proxy.url for proxy in proxies)],
            "NODE_TIMEOUT": NODE_TIMEOUT,
            "TTL": 10.0,
        }
        lock = Redlock("stalled-first")
        assert lock.acquire(blocking=False)
        lock.release()


def _gone_from(node: Any, key: str, within: float = 2.0) -> bool:
    """Whether ``key`` is gone from ``node`` now or within ``within`` s."""
    deadline = time.monotonic() + within
    with node.client() as client:
        while client.exists(key):
            if time.monotonic() > deadline:
                return False
            time.sleep(0.02)
    return True


def test_a_release_sent_on_a_new_connection_to_a_frozen_node_runs_when_it_resumes(
    nodes: NodeSet,
) -> None:
    """A node frozen (SIGSTOP, a paused VM) while a lock is taken and released:
    its acquire waits in the node's socket, its idle connection owing the reply,
    so the release goes on a new connection, which the frozen server has not
    accepted yet. Once the driver gives up on that connection (the next fan-out
    to the node, NODE_TIMEOUT later), the release must still run when the node
    resumes: a reset would make the kernel discard the unaccepted connection with
    the release, and the acquire, which does run, would hold the lock on that
    node for the whole TTL for nobody."""
    frozen = nodes[4]
    name = "stalled:late-release"
    lock = Redlock(name, nodes=nodes.urls, node_timeout=NODE_TIMEOUT, ttl=30)
    other = Redlock("stalled:other", nodes=nodes.urls, node_timeout=NODE_TIMEOUT)
    assert lock.acquire(blocking=False)  # every node's connection is open
    lock.release()
    with frozen.paused():
        assert lock.acquire(blocking=False)  # four of five
        lock.release()
        time.sleep(2 * NODE_TIMEOUT)
        assert other.acquire(blocking=False)  # its fan-out gives up the owed ones
        other.release()
    assert _gone_from(frozen, lock_key(name)), (
        "the lock's key stayed on the resumed node: its release never ran"
    )


def test_an_async_release_sent_to_a_frozen_node_runs_when_it_resumes(
    nodes: NodeSet,
) -> None:
    """The same with ``aacquire()`` and ``arelease()`` (the asyncio driver)."""
    frozen = nodes[4]
    name = "stalled:late-async-release"
    lock = Redlock(name, nodes=nodes.urls, node_timeout=NODE_TIMEOUT, ttl=30)
    other = Redlock("stalled:other", nodes=nodes.urls, node_timeout=NODE_TIMEOUT)

    async def take_and_release(taken: Redlock) -> None:
        assert await taken.aacquire(blocking=False)
        await taken.arelease()

    async def run() -> None:
        await take_and_release(lock)  # every node's connection is open
        with frozen.paused():
            await take_and_release(lock)  # four of five
            await asyncio.sleep(2 * NODE_TIMEOUT)
            await take_and_release(other)
        await asyncio.sleep(0.5)  # what the nodes answer now is read

    asyncio.run(run())
    assert _gone_from(frozen, lock_key(name)), (
        "the lock's key stayed on the resumed node: its release never ran"
    )
