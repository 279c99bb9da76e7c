"""What the drivers do with a connection whose reply comes late, or breaks (issue 10).

- A node that answers a little after the quorum decided (a proxy adds 3 ms to its
  replies) keeps its connection: the late reply is read and thrown away before
  the connection is used again, instead of a new connection (a TLS handshake)
  per operation. Every call still gets its own reply, never the one owed.
- A node that answers NOSCRIPT, and whose connection breaks before the driver
  resent the script's source, counts as that node failing: the raw redis
  ``ConnectionError`` never reaches the caller.
- The asyncio driver's call left behind once the quorum decided writes nothing
  more: neither its command, when it was still connecting, nor the source after
  a late NOSCRIPT. Either would run after the holder's release and leave a key
  nobody owns on that node until its TTL.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from harness.held import fence_key, lock_key
from harness.nodes import NodeSet
from harness.processes import process_state
from harness.proxy import FaultProxy
from redlock_django import Redlock, aio, sync, wire
from redlock_django import nodes as node_pools
from redlock_django.conf import get_settings
from redlock_django.protocol import Fanout, NodeReply
from redlock_django.scripts import Script

pytestmark = pytest.mark.timeout(60)

ROOT = Path(__file__).resolve().parents[1]
NODE_TIMEOUT = 0.1
#: Fan-outs run against the nodes, one node 3 ms slower than the others.
FANOUTS = 400
#: Every this many fan-outs waits for all nodes, the slow one included: its
#: reply must be its own, not the one owed from an earlier fan-out.
WAIT_ALL_EVERY = 10
#: Connections the slow node may see for all FANOUTS: a few in rotation while
#: replies are owed, with room for a loaded host. Dropping the connection of
#: every late reply opens about one per fan-out.
MAX_CONNECTIONS = 40
#: Fan-outs that must leave the slow node behind for the connection count to
#: mean anything: more than dropping each late reply's connection would open.
#: How many do depends on the host: a fan-out waits a grace of twice its own
#: time for stragglers, and on a host slow at round trips that grace often
#: covers the slow node's 3 ms (192 of 400 fan-outs left it behind on one).
LEFT_BEHIND = 2 * MAX_CONNECTIONS
#: The deadline of a fan-out that waits for every node: what it checks is whose
#: reply comes, not how fast, so a stall of the test host (CI once saw the slow
#: node's reply come more than NODE_TIMEOUT after its write) is no failure.
WAIT_ALL_TIMEOUT = 2.0
# KEYS[1] unused; ARGV[1] a word; returns the word: each call's own reply.
ECHO_SCRIPT = Script("echo", "return ARGV[1]")


def echo(n: int, critical: bool = False) -> Fanout:
    need = 0 if n % WAIT_ALL_EVERY == WAIT_ALL_EVERY - 1 else 3
    return Fanout(
        ECHO_SCRIPT, ("echo",), (f"call-{n}",), need=need, wins=bool, critical=critical
    )


def deadline(n: int) -> float:
    return WAIT_ALL_TIMEOUT if echo(n).need == 0 else NODE_TIMEOUT


def check(n: int, replies: list[NodeReply]) -> None:
    """Every reply that came is this call's own, never one owed from before."""
    word = f"call-{n}".encode()
    assert all(r.value in (None, word) for r in replies), (n, replies)
    if echo(n).need == 0:  # every node awaited, the slow one included
        assert replies == [NodeReply(word)] * 5, (n, replies)
    else:
        assert sum(r.value == word for r in replies) >= 3, (n, replies)


@pytest.fixture
def slow_fifth(settings: Any, nodes: NodeSet) -> Any:
    """Point REDLOCK at four nodes and a fifth behind a proxy 3 ms away."""
    with FaultProxy(nodes.ports[4]) as proxy:
        proxy.delay(0.003)
        settings.REDLOCK = {
            "NODES": [*nodes.urls[:4], proxy.url],
            "NODE_TIMEOUT": NODE_TIMEOUT,
            "TTL": 10.0,
        }
        yield proxy


@pytest.mark.parametrize("critical", [False, True], ids=["step", "clean-up"])
def test_sync_driver_keeps_the_connection_of_a_node_slower_than_the_quorum(
    slow_fifth: FaultProxy, critical: bool
) -> None:
    """400 fan-outs decided without the slow node open a few connections to it,
    not one each, and every call reads its own reply. A clean-up's connection owes
    two: the source is written behind the EVALSHA the slow node had not answered."""
    config = get_settings()
    pools = node_pools.sync_pools(config.nodes, config.node_timeout)
    unawaited = 0
    for n in range(FANOUTS):
        replies = sync.fanout(pools, echo(n, critical), deadline(n))
        check(n, replies)
        unawaited += replies[4].value is None
    assert unawaited > LEFT_BEHIND  # the slow node really was left behind
    assert slow_fifth.connections <= MAX_CONNECTIONS, slow_fifth.connections


def test_async_driver_keeps_the_connection_of_a_node_slower_than_the_quorum(
    slow_fifth: FaultProxy,
) -> None:
    """The same with the asyncio driver: the late reply is read in the background
    and the connection goes back to the pool."""
    config = get_settings()
    unawaited = 0

    async def run() -> None:
        nonlocal unawaited
        clients = node_pools.async_clients(config.nodes, config.node_timeout)
        for n in range(FANOUTS):
            replies = await aio.fanout(clients, echo(n), deadline(n))
            check(n, replies)
            unawaited += replies[4].value is None

    asyncio.run(run())
    assert unawaited > LEFT_BEHIND
    assert slow_fifth.connections <= MAX_CONNECTIONS, slow_fifth.connections


# A client in its own process, so that it can be stopped between a reply reaching
# its socket and the connection being reset: one fan-out to one node, its outcome
# printed as JSON.
RESEND_CLIENT = """
import json, sys
from redlock_django import sync
from redlock_django.address import parse_node
from redlock_django.nodes import sync_pools
from redlock_django.protocol import Fanout
from redlock_django.scripts import PTTL_SCRIPT

# The lock's own pool: nothing is sent on connect, the first bytes are the script.
pools = sync_pools([parse_node(sys.argv[1], 0)], 5.0)
try:
    replies = sync.fanout(pools, Fanout(PTTL_SCRIPT, ("resend",), ()), 5.0)
except Exception as exc:
    print(json.dumps({"raised": f"{type(exc).__module__}.{type(exc).__name__}"}))
else:
    print(json.dumps({"replies": [list(reply) for reply in replies]}))
"""


def wait_for_state(pid: int, state: str) -> None:
    deadline = time.monotonic() + 5.0
    while process_state(pid) != state:
        assert time.monotonic() < deadline, f"process {pid} never reached {state}"
        time.sleep(0.005)


def test_a_resend_after_noscript_that_fails_counts_as_that_node_failing(
    nodes: NodeSet,
) -> None:
    """The node lost its scripts (SCRIPT FLUSH) and answers NOSCRIPT; the
    connection is reset after that reply reached the client and before the client
    resent the source. The failing resend is that node's failure, reported in its
    reply; fanout() raises nothing."""
    node = nodes[0]
    with node.client() as client:
        client.script_flush()
    with FaultProxy(node.port) as proxy:
        proxy.hold_replies()
        since = proxy.requests
        child = subprocess.Popen(
            [sys.executable, "-c", RESEND_CLIENT, proxy.url],
            cwd=ROOT,
            env={**os.environ, "PYTHONPATH": str(ROOT)},
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        try:
            # The EVALSHA reached the node; its NOSCRIPT waits in the proxy.
            assert proxy.wait_for_request(10.0, since=since)
            time.sleep(0.2)
            os.kill(child.pid, signal.SIGSTOP)
            wait_for_state(child.pid, "T")
            proxy.release_replies()  # NOSCRIPT is in the stopped client's socket
            proxy.reset()  # then a TCP RST: the resend will fail
        finally:
            os.kill(child.pid, signal.SIGCONT)
        out, err = child.communicate(timeout=20)
    assert child.returncode == 0, err
    outcome = json.loads(out)
    assert "raised" not in outcome, outcome
    [[value, error]] = outcome["replies"]
    assert value is None and error.startswith("ConnectionError"), error


def _left_on(nodes: NodeSet, key: str, password: str | None = None) -> list[dict]:
    """The lock hash ``key`` on each node (empty: no key)."""
    found = []
    for i, node in enumerate(nodes):
        with node.client(password=password if i == 3 else None) as client:
            found.append(client.hgetall(key))
    return found


async def test_an_async_call_still_connecting_when_the_quorum_decided_never_writes(
    settings: Any, redlock_settings: dict[str, Any], make_nodes: Any
) -> None:
    """Node 3 answers 0.3 s late (a proxy) and needs a password, so a new
    connection to it takes one late round trip (AUTH) before the command is
    written (as a TLS handshake to a distant node would). An acquisition wins on
    the four other nodes while its call to node 3 is still connecting; the holder
    then releases at once, its RELEASE to node 3 on the pooled connection. The
    ACQUIRE is never written after it: no key is left that nobody owns (node 3
    kept the released holder's key for its whole TTL before)."""
    extra = make_nodes(5)
    with extra[3].client() as client:
        client.config_set("requirepass", "pw")
    with FaultProxy(extra[3].port) as proxy:
        urls = list(extra.urls)
        urls[3] = f"redis://:pw@127.0.0.1:{proxy.port}/0"
        settings.REDLOCK = {
            **redlock_settings,
            "NODES": urls,
            "NODE_TIMEOUT": 0.6,
            "WAKE_UPS": False,
            "AUTO_EXTEND": False,
        }
        lock = Redlock("left-behind", ttl=10)
        proxy.delay(0.3)
        # One pooled connection to node 3 (AUTH done), then kept busy 0.3 s.
        assert not await lock.alocked()
        looking = asyncio.ensure_future(Redlock("left-behind").alocked())
        await asyncio.sleep(0.1)
        # So the acquire's call to node 3 connects anew (AUTH: 0.3 s).
        assert await lock.aacquire(blocking=False)
        await looking  # the pooled connection is free again
        await lock.arelease()
        await asyncio.sleep(1.2)  # every call's reply came or was given up
        left = _left_on(extra, lock_key("left-behind"), password="pw")
    assert left == [{}] * 5, f"keys nobody owns: {left!r}"


async def test_an_async_call_left_behind_does_not_resend_after_a_late_noscript(
    settings: Any, redlock_settings: dict[str, Any], make_nodes: Any
) -> None:
    """Node 3 lost its scripts and answers 0.3 s late (a proxy): its NOSCRIPT to
    the acquisition's EVALSHA comes after the four other nodes decided and the
    holder released. The call left behind does not send the script's source then
    (it would take the lock on node 3 for a holder that is gone)."""
    extra = make_nodes(5)
    with FaultProxy(extra[3].port) as proxy:
        urls = list(extra.urls)
        urls[3] = proxy.url
        settings.REDLOCK = {
            **redlock_settings,
            "NODES": urls,
            "NODE_TIMEOUT": 0.6,
            "WAKE_UPS": False,
            "AUTO_EXTEND": False,
        }
        lock = Redlock("noscript-behind", ttl=10)
        assert not await lock.alocked()  # connections made, scripts loaded
        with extra[3].client() as client:
            client.script_flush()
        proxy.delay(0.3)
        assert await lock.aacquire(blocking=False)
        await lock.arelease()
        await asyncio.sleep(1.2)  # every call's reply came or was given up
        left = _left_on(extra, lock_key("noscript-behind"))
    assert left == [{}] * 5, f"keys nobody owns: {left!r}"


# A reply that is slow to arrive, cut by a reset, or followed by one nobody asked
# for (an adversarial review of the driver; each test failed on the code before
# its fix): a node trickling its reply a byte at a time held the fan-out far past
# its deadline (and failed an acquisition a quorum granted at once); a release
# whose reply was cut by a reset was sent again, answered 0 and read as a lost
# lock; an extra reply left in the reader answered the next command.


#: The portable path (no socket to poll: redis-py's public API only) still reads a
#: started reply with redis-py's per-recv timeout: a trickling node holds it past
#: NODE_TIMEOUT. Known and left (the closing note of 2026-11-27, third session).
trickle_needs_the_fast_path = pytest.mark.skipif(
    wire.FORCED,
    reason="the portable path still reads a started reply with "
    "redis-py's per-recv timeout (known, left): the fast path is what is tested",
)


def echo_word(word: str, need: int = 0) -> Fanout:
    return Fanout(ECHO_SCRIPT, ("echo",), (word,), need=need, wins=bool)


def pools_for(settings: Any, urls: list[str], timeout: float = NODE_TIMEOUT) -> Any:
    settings.REDLOCK = {"NODES": urls, "NODE_TIMEOUT": timeout, "TTL": 10.0}
    config = get_settings()
    return node_pools.sync_pools(config.nodes, config.node_timeout)


@trickle_needs_the_fast_path
def test_a_reply_trickled_byte_by_byte_cannot_hold_a_fanout_past_node_timeout(
    settings: Any, nodes: NodeSet
) -> None:
    """A node that sends its reply one byte every 60 ms (each byte inside the
    socket timeout) must not keep the fan-out beyond its NODE_TIMEOUT deadline."""
    with FaultProxy(nodes.ports[0]) as proxy:
        pools = pools_for(settings, [proxy.url, *nodes.urls[1:3]])
        word = "w" * 40
        # Warm up: connections open and the script cached everywhere.
        assert (
            sync.fanout(pools, echo_word(word), 2.0) == [NodeReply(word.encode())] * 3
        )
        proxy.trickle(0.06)
        began = time.monotonic()
        replies = sync.fanout(pools, echo_word(word), NODE_TIMEOUT)
        took = time.monotonic() - began
        assert replies[1:] == [NodeReply(word.encode())] * 2
        assert took < 5 * NODE_TIMEOUT, (took, replies[0])


@pytest.mark.parametrize("driver", ["sync", "async"])
def test_a_release_whose_reply_is_cut_by_a_reset_is_not_reported_as_a_lost_lock(
    nodes: NodeSet, redlock_settings: Any, driver: str
) -> None:
    """Two of three nodes run our RELEASE, then their connections are reset before
    the reply reaches us (a middlebox, a crashed proxy). Both drivers took the
    broken reused connection for one the server closed while idle and sent the
    release again on a new one: it found the key gone and answered 0, and the
    release read as "only 1/3 nodes still held it" (LockLostError), although our
    token held every node until our own release."""
    import threading

    from redlock_django import LockError, Redlock
    from redlock_django.scripts import RELEASE_SCRIPT

    # The sync driver releases by EVALSHA, the asyncio driver by EVAL.
    release = RELEASE_SCRIPT.sha.encode() if driver == "sync" else b"$4\r\nEVAL\r\n"
    with FaultProxy(nodes.ports[0]) as p0, FaultProxy(nodes.ports[1]) as p1:
        lock = Redlock(
            f"driver:release-reset-{driver}",
            nodes=[p0.url, p1.url, nodes.urls[2]],
            node_timeout=1.0,
            ttl=30.0,
        )

        def cut() -> None:
            for proxy in (p0, p1):
                assert proxy.wait_for_held_replies(1)
            for proxy in (p0, p1):
                proxy.reset()

        async def in_a_task() -> None:
            assert await lock.aacquire(blocking=False)
            for proxy in (p0, p1):
                proxy.hold_reply_to(release, count=1)
            cutter.start()
            await lock.arelease()

        cutter = threading.Thread(target=cut)
        try:
            if driver == "sync":
                assert lock.acquire(blocking=False)
                for proxy in (p0, p1):
                    proxy.hold_reply_to(release, count=1)
                cutter.start()
                lock.release()
            else:
                asyncio.run(in_a_task())
            error = None
        except LockError as exc:
            error = exc
        cutter.join()
        # Our release did delete the key on every node...
        for node in nodes:
            with node.client() as client:
                assert client.exists(lock_key(f"driver:release-reset-{driver}")) == 0
        # ...so it must not be reported as a lock lost while held.
        assert error is None, repr(error)


@trickle_needs_the_fast_path
def test_two_trickling_nodes_of_five_cannot_make_a_quorum_granted_acquire_fail(
    nodes: NodeSet, redlock_settings: Any
) -> None:
    """Three of five nodes grant a fenced lock at once. Two others answer too, but
    send their 19-byte reply (":1000000000000001\\r\\n") one byte every 90 ms, each
    byte inside the 100 ms socket timeout (NODE_TIMEOUT). The slow nodes should
    cost at most about one NODE_TIMEOUT; the driver instead reads them to the end
    (about 1.7 s), the validity window (TTL 1.5 s) is gone, and an acquisition a
    quorum granted within a millisecond fails."""
    from redlock_django import LockError, Redlock

    resource = "driver:trickle-fenced"
    with FaultProxy(nodes.ports[0]) as p0, FaultProxy(nodes.ports[1]) as p1:
        lock = Redlock(
            resource,
            nodes=[p0.url, p1.url, *nodes.urls[2:5]],
            node_timeout=NODE_TIMEOUT,
            ttl=1.5,
            fencing=True,
        )
        assert lock.acquire(blocking=False)  # warm: connections, scripts
        lock.release()
        for node in nodes[:2]:
            with node.client() as client:
                client.set(fence_key(resource), 10**15)
        p0.trickle(0.09)
        p1.trickle(0.09)
        began = time.monotonic()
        try:
            granted = lock.acquire(blocking=False)
        except LockError as exc:
            granted = exc  # type: ignore[assignment]
        took = time.monotonic() - began
        p0.pass_through()
        p1.pass_through()
        if granted is True:
            lock.release()
        assert granted is True, (granted, took)
        assert took < 3 * NODE_TIMEOUT, took


@contextlib.contextmanager
def _answering_server(
    answer: Any,
) -> Iterator[tuple[int, list[object]]]:
    """A (non-Redis) server on a free port that answers each command with
    ``answer(its last argument)``, raw bytes, whatever they are; yields its port
    and the list of connections it accepted."""
    import socket
    import threading

    import hiredis

    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(8)
    accepted: list[object] = []

    def handle(conn: socket.socket) -> None:
        reader = hiredis.Reader()
        with conn:
            while data := conn.recv(65536):
                reader.feed(data)
                while (command := reader.gets()) is not False:
                    conn.sendall(answer(command[-1]))

    def serve() -> None:
        with contextlib.suppress(OSError):
            while True:
                conn, _ = server.accept()
                accepted.append(conn)
                threading.Thread(target=handle, args=(conn,), daemon=True).start()

    threading.Thread(target=serve, daemon=True).start()
    try:
        yield server.getsockname()[1], accepted
    finally:
        server.close()


def test_an_unsolicited_extra_reply_is_never_taken_for_the_next_commands_reply(
    settings: Any,
) -> None:
    """A (non-Redis) server answers the first command with its reply followed by
    one more it was never asked for. The driver reads the whole segment into the
    hiredis reader, hands the connection back with the extra reply still buffered,
    and every later command on that connection then gets the PREVIOUS command's
    reply: the off-by-one a pooled connection must never have (redis-py's own pool
    drops a connection that holds unread data when it is checked out)."""
    answered = 0

    def answer(word: bytes) -> bytes:
        nonlocal answered
        answered += 1
        out = b"$%d\r\n%s\r\n" % (len(word), word)
        return out + b"$5\r\nstale\r\n" if answered == 1 else out

    with _answering_server(answer) as (port, _):
        pools = pools_for(settings, [f"redis://127.0.0.1:{port}/0"])
        got = [sync.fanout(pools, echo_word(f"w{n}"), 1.0)[0] for n in range(3)]
    assert got[0] == NodeReply(b"w0")
    for n in (1, 2):  # its own reply, or the node counted as failed: never another's
        assert got[n].value in (None, f"w{n}".encode()), got


def test_a_reply_the_parser_cannot_read_fails_that_node_and_its_connection_alone(
    settings: Any,
) -> None:
    """A (non-Redis) server answers one command with bytes no RESP reply starts
    with. On the sync driver's usual path (an idle connection, its reply read in
    one step: ``wire.read_arrived``) hiredis raises a protocol error: that node's
    reply is the error, nothing is raised to the caller, and the connection is
    dropped, so the next fan-out gets its own reply on a new one."""

    def answer(word: bytes) -> bytes:
        if word == b"garble":
            return b"?garbled\r\n"
        return b"$%d\r\n%s\r\n" % (len(word), word)

    with _answering_server(answer) as (port, accepted):
        pools = pools_for(settings, [f"redis://127.0.0.1:{port}/0"])
        words = ("w0", "garble", "w2")
        got = [sync.fanout(pools, echo_word(word), 1.0)[0] for word in words]
    assert got[0] == NodeReply(b"w0")
    assert got[1].value is None and "Protocol error" in (got[1].error or ""), got
    assert got[2] == NodeReply(b"w2")
    assert len(accepted) == 2  # the garbled connection was not used again
