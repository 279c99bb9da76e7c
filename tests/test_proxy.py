"""The fault-injection proxy (``harness/proxy.py``) does what the tests rely on."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
import redis
import redis.connection
from redis.backoff import NoBackoff
from redis.retry import Retry

from harness.nodes import NodeSet
from harness.proxy import FaultProxy, FaultProxyError

pytestmark = pytest.mark.timeout(30)

# No CLIENT SETINFO on connect, so one command is one request: driver_info in
# redis-py >= 7.1, lib_name/lib_version before it (as redlock_django.nodes does).
NO_SETINFO: dict[str, Any] = (
    {"driver_info": None}
    if hasattr(redis.connection, "DriverInfo")
    else {"lib_name": None, "lib_version": None}
)


@pytest.fixture
def proxy(nodes: NodeSet) -> Iterator[FaultProxy]:
    """A proxy in front of node 0, closed at teardown."""
    with FaultProxy(nodes[0].port) as fault_proxy:
        yield fault_proxy


def through(proxy: FaultProxy, timeout: float = 2.0) -> redis.Redis:
    """A plain client that talks to the node through ``proxy``, never retrying."""
    return redis.Redis(
        host="127.0.0.1",
        port=proxy.port,
        socket_timeout=timeout,
        socket_connect_timeout=timeout,
        retry=Retry(NoBackoff(), 0),
        protocol=2,
        **NO_SETINFO,
    )


def round_trip(client: redis.Redis) -> float:
    start = time.monotonic()
    assert client.ping() is True
    return time.monotonic() - start


def test_pass_through_relays_commands_to_the_node(
    proxy: FaultProxy, nodes: NodeSet
) -> None:
    """PING and SET go through to the node, and the counters see them."""
    assert proxy.url == f"redis://127.0.0.1:{proxy.port}/0"
    assert proxy.port != nodes[0].port
    with through(proxy) as client:
        assert client.ping() is True
        assert client.set("k", b"v") is True
    with nodes[0].client() as direct:
        assert direct.get("k") == b"v"
    assert proxy.connections == 1
    assert proxy.requests == 2
    assert proxy.request_bytes == proxy.received_bytes > 0
    replies = len(b"+PONG\r\n+OK\r\n")
    assert proxy.wait_for_reply_bytes(replies), proxy.reply_bytes
    assert proxy.reply_bytes == replies


def test_delay_adds_at_least_the_delay_to_each_round_trip(proxy: FaultProxy) -> None:
    """Replies come ``seconds`` late under ``delay``, and on time again after it."""
    with through(proxy) as client:
        client.ping()  # connect first: only the round trip is timed
        proxy.delay(0.15)
        assert round_trip(client) >= 0.15
        proxy.delay(0.0, requests=0.1)
        assert round_trip(client) >= 0.1
        proxy.pass_through()
        assert round_trip(client) < 0.1


def test_delay_keeps_replies_in_order(proxy: FaultProxy) -> None:
    """Pipelined commands under a delay get their own replies, in order."""
    with through(proxy) as client:
        proxy.delay(0.05)
        pipe = client.pipeline(transaction=False)
        for i in range(50):
            pipe.set(f"k{i}", i)
            pipe.get(f"k{i}")
        results = pipe.execute()
    assert results == [x for i in range(50) for x in (True, str(i).encode())]


def test_blackhole_makes_the_client_time_out_and_spares_the_node(
    proxy: FaultProxy, nodes: NodeSet
) -> None:
    """Under ``blackhole`` a SET is read by the proxy but never reaches the node."""
    proxy.blackhole()
    with through(proxy, timeout=0.2) as client, pytest.raises(redis.TimeoutError):
        client.set("k", b"v")
    assert proxy.received_bytes > 0
    assert proxy.requests == 0
    assert not proxy.wait_for_request(0.05)
    with nodes[0].client() as direct:
        assert direct.exists("k") == 0
    # Negative control: the same command through pass-through lands.
    proxy.pass_through()
    with through(proxy) as client:
        assert client.set("k", b"v") is True


def test_held_replies_wait_for_release_while_the_command_already_ran(
    proxy: FaultProxy, nodes: NodeSet
) -> None:
    """``hold_replies`` forwards the SET at once and keeps its reply until released."""
    proxy.hold_replies()
    outcome: list[Any] = []
    before = proxy.requests
    with through(proxy, timeout=5.0) as client:
        worker = threading.Thread(target=lambda: outcome.append(client.set("k", b"v")))
        worker.start()
        try:
            assert proxy.wait_for_request(5.0, since=before)
            with nodes[0].client() as direct:
                assert direct.get("k") == b"v"
            worker.join(0.3)
            assert worker.is_alive(), "the reply was not held"
            assert outcome == []
            proxy.release_replies()
            worker.join(2.0)
        finally:
            proxy.release_replies()
            worker.join(5.0)
    assert outcome == [True]
    assert proxy.mode == "pass"


def test_dropped_reply_times_out_although_the_set_landed(
    proxy: FaultProxy, nodes: NodeSet
) -> None:
    """``drop_reply_after_forward``: the client times out, yet the node has the key."""
    proxy.drop_reply_after_forward()
    with through(proxy, timeout=0.3) as client, pytest.raises(redis.TimeoutError):
        client.set("k", b"v")
    with nodes[0].client() as direct:
        assert direct.get("k") == b"v"
    assert proxy.requests == 1
    assert proxy.reply_bytes == 0
    assert proxy.swallowed_bytes == len(b"+OK\r\n")


def test_reset_aborts_open_connections_with_a_tcp_reset(proxy: FaultProxy) -> None:
    """``reset`` sends an RST (not a FIN) and fails a command waiting for its reply."""
    raw = socket.create_connection(("127.0.0.1", proxy.port), timeout=2.0)
    with raw, through(proxy) as client:
        raw.sendall(b"PING\r\n")
        assert raw.recv(100) == b"+PONG\r\n"
        assert client.ping() is True
        proxy.hold_replies()
        errors: list[BaseException] = []

        def ping() -> None:
            try:
                client.ping()
            except BaseException as exc:
                errors.append(exc)

        before = proxy.requests
        worker = threading.Thread(target=ping)
        worker.start()
        assert proxy.wait_for_request(5.0, since=before)
        proxy.reset()
        worker.join(5.0)
        with pytest.raises(ConnectionResetError):
            raw.recv(100)
        assert len(errors) == 1
        assert isinstance(errors[0], redis.ConnectionError)
        assert "reset" in str(errors[0]).lower()
        # The proxy keeps listening: redis-py reconnects on the next command.
        proxy.pass_through()
        assert client.ping() is True


def test_close_stops_listening_and_ends_the_thread(nodes: NodeSet) -> None:
    """After ``close`` the port refuses connections and the proxy's thread is gone."""
    proxy = FaultProxy(nodes[0].port).start()
    port = proxy.port
    thread = proxy._thread
    assert thread is not None
    with through(proxy) as client:
        assert client.ping() is True
        proxy.hold_replies()
        proxy.close()
        with pytest.raises(redis.ConnectionError):
            client.ping()
    assert not thread.is_alive()
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(("127.0.0.1", port), timeout=1.0).close()
    with pytest.raises(FaultProxyError):
        proxy.pass_through()
    proxy.close()  # closing twice is harmless


def test_connection_to_a_stopped_node_is_closed(nodes: NodeSet) -> None:
    """A client of a proxy whose node is down sees its connection closed."""
    node = nodes[4]
    with FaultProxy(node.port) as proxy:
        node.stop()
        with through(proxy) as client, pytest.raises(redis.ConnectionError):
            client.ping()


def test_held_request_reaches_the_node_on_demand_after_the_client_left(
    proxy: FaultProxy, nodes: NodeSet
) -> None:
    """``hold_request`` keeps the first matching command (and what follows it)
    from the node, even after the client timed out and closed its connection;
    ``deliver_held`` sends it on and returns the node's reply. Later matches pass."""
    proxy.hold_request(b"held-key")
    with through(proxy, timeout=0.2) as client:
        assert client.ping() is True
        with pytest.raises(redis.TimeoutError):
            client.set("held-key", b"late")
    assert proxy.wait_for_held(1.0)
    assert proxy.held == 1
    held = proxy._held_pipe
    assert held is not None
    deadline = time.monotonic() + 2.0
    while not held.eof:  # the client's close reached the proxy
        assert time.monotonic() < deadline, "the client's close never arrived"
        time.sleep(0.005)
    with nodes[0].client() as direct:
        assert direct.exists("held-key") == 0
        assert proxy.deliver_held() == b"+OK\r\n"
        assert direct.get("held-key") == b"late"
    assert proxy.held == 0
    # Negative control: only one command was caught; the next match goes through.
    with through(proxy, timeout=0.2) as client:
        assert client.set("held-key", b"again") is True


def test_held_request_keeps_the_order_of_its_connection(
    proxy: FaultProxy, nodes: NodeSet
) -> None:
    """A command sent after a held one on the same connection waits behind it."""
    proxy.hold_request(b"first")
    raw = socket.create_connection(("127.0.0.1", proxy.port), timeout=2.0)
    with raw:
        raw.sendall(b"SET first 1\r\n")
        assert proxy.wait_for_held(1.0)
        raw.sendall(b"SET second 2\r\n")
        time.sleep(0.1)
        with nodes[0].client() as direct:
            assert direct.exists("first", "second") == 0
            assert proxy.deliver_held().startswith(b"+OK\r\n")
            deadline = time.monotonic() + 2.0
            while direct.exists("second") == 0:
                assert time.monotonic() < deadline, "the second command never ran"
                time.sleep(0.005)
            assert direct.get("first") == b"1"
        assert raw.recv(100).startswith(b"+OK\r\n")
