"""A node whose connects time out is left alone for a while (sync driver).

A frozen server whose listen backlog is full, or a partitioned host, accepts no
new connection: each connect() waits NODE_TIMEOUT, before the fan-out reads any
other node's reply. After one such timeout the driver counts the node as failed
without connecting for ``STALL_HOLD`` seconds, then tries it again.

The stalled "nodes" here are real listening sockets that never accept, with
their backlog filled by idle connections: the kernel drops further SYNs.
"""

from __future__ import annotations

import contextlib
import socket
import time
from collections.abc import Iterator
from typing import Any

import pytest

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
