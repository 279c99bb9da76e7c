"""A TCP proxy that injects network faults between a client and one Redis node.

:class:`FaultProxy` listens on a free loopback port and relays every connection to
``upstream_port``. Its *mode* decides what happens to the bytes, and can be switched
at any time from the test's thread; a switch applies at once to every open
connection and to the ones accepted later:

- ``pass_through()``: relay both ways (the initial mode);
- ``delay(seconds, requests=0.0)``: hold each chunk of replies (node to client)
  for ``seconds`` after it arrived, and each chunk of requests for ``requests``
  seconds; order is kept;
- ``trickle(pause)``: relay both ways, but write each reply chunk to the client a
  byte at a time, ``pause`` seconds apart: a reply split across many packets;
- ``blackhole()``: read what clients send, forward nothing, answer nothing;
- ``hold_replies()`` / ``release_replies()``: forward requests, buffer every reply
  until released (a gate), then deliver them in order;
- ``drop_reply_after_forward()``: forward requests, swallow the replies;
- ``reset()`` (an action, not a mode): abort every open client connection with a
  TCP RST (``SO_LINGER`` 0), as a crashed host or a middlebox would;
- ``hold_request(match)`` / ``deliver_held()`` (an action, beside any mode): hold
  back the next request chunk that contains ``match``, and what follows it on its
  connection, then deliver it on demand, even after the client closed that
  connection: a segment stuck in the network, retransmitted after the client
  gave up, still reaches the node. ``deliver_held`` returns the node's reply;
- ``hold_reply_to(match)`` / ``release_held_replies()`` (an action, beside any
  mode): forward every request at once, but hold back the reply to each request
  chunk that contains ``match`` (and what follows it on its connection) until
  released: that client's command has run on the node, its answer is late, and
  other connections are not slowed at all.

A chunk is whatever one read returned, so a "request" is one read from a client:
a redis-py command (or pipeline) is written at once and arrives as one chunk on
loopback, which is what the counters and :meth:`FaultProxy.wait_for_request` rely
on. The proxy runs its own asyncio event loop in a daemon thread; ``close()``
aborts every connection, stops the loop and joins the thread. Like the rest of
the test infrastructure, nothing in it is mocked: bytes go through real sockets.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import socket
import struct
import threading
import time
from collections.abc import Coroutine
from types import TracebackType
from typing import Any, TypeVar

HOST = "127.0.0.1"
#: How long a call from the test thread waits for the proxy's loop to act.
CALL_TIMEOUT = 5.0
READ_SIZE = 65536

T = TypeVar("T")

PASS = "pass"
DELAY = "delay"
BLACKHOLE = "blackhole"
HOLD = "hold"
DROP = "drop"
TRICKLE = "trickle"

_FORWARD = "forward"
_SWALLOW = "swallow"
_WAIT = "wait"


class FaultProxyError(RuntimeError):
    """The proxy could not start, or its loop did not answer in time."""


class _Pipe:
    """One direction of one connection: a reader feeding an ordered queue.

    The reader stamps each chunk with its arrival time; the writer delivers the
    chunks one by one, asking the proxy what to do with each when it is due.
    """

    def __init__(
        self,
        proxy: FaultProxy,
        conn: _Connection,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        *,
        replies: bool,
    ) -> None:
        self.proxy = proxy
        self.conn = conn
        self.reader = reader
        self.writer = writer
        self.replies = replies
        self.queue: collections.deque[tuple[float, bytes]] = collections.deque()
        self.arrived = asyncio.Event()
        #: Chunks read but not yet written (or swallowed).
        self.pending = 0
        self.eof = False
        #: Chunks read so far, and the last one (the node's latest reply).
        self.chunks = 0
        self.last = b""
        #: The queued chunk held back by ``hold_request``, until ``gate`` is set.
        self.held: tuple[float, bytes] | None = None
        self.gate = asyncio.Event()
        #: Chunks the node had replied when the held chunk was delivered.
        self.delivered_at: int | None = None
        #: Replies pipe: the next reply chunk is held (``hold_reply_to``), and the
        #: chunk held, until the proxy's reply gate opens.
        self.hold_next = False
        self.held_reply: tuple[float, bytes] | None = None

    async def read_loop(self) -> None:
        try:
            while data := await self.reader.read(READ_SIZE):
                self.proxy._received(data, replies=self.replies)
                chunk = (time.monotonic(), data)
                if not self.replies and self.proxy._claim_hold(self, data):
                    self.held = chunk
                if not self.replies and self.proxy._claim_reply_hold(data):
                    self.conn.replies.hold_next = True
                if self.replies and self.hold_next:
                    self.hold_next = False
                    self.held_reply = chunk
                self.queue.append(chunk)
                self.pending += 1
                self.chunks += 1
                self.last = data
                self.arrived.set()
        except (ConnectionError, OSError):
            pass
        self.eof = True
        self.arrived.set()

    async def write_loop(self) -> None:
        while True:
            while not self.queue:
                if self.eof:
                    if self.delivered_at is not None:
                        # A held chunk went out after the client left: keep the
                        # node's side open until it answered, so its reply is seen.
                        await self.proxy._reply_after(self.conn, self.delivered_at)
                    # Everything before the end was delivered: end the other side.
                    self.conn.close()
                    return
                self.arrived.clear()
                await self.arrived.wait()
            if self.queue[0] is self.held:
                # Held back, with everything behind it (TCP keeps order), until
                # deliver_held(); the client closing its side changes nothing.
                await self.gate.wait()
                self.held = None
                self.delivered_at = self.conn.replies.chunks
            if self.queue[0] is self.held_reply:
                await self.proxy._reply_gate_open()
                self.held_reply = None
            arrived, data = self.queue[0]
            action, due = self.proxy._policy(arrived, replies=self.replies)
            if action == _WAIT:
                await self.proxy._wait_for_change(due)
                continue
            self.queue.popleft()
            if action == _FORWARD:
                try:
                    pause = self.proxy._trickle_pause if self.replies else None
                    if pause is None:
                        self.writer.write(data)
                        await self.writer.drain()
                    else:
                        for i in range(len(data)):
                            self.writer.write(data[i : i + 1])
                            await self.writer.drain()
                            await asyncio.sleep(pause)
                except (ConnectionError, OSError):
                    self.conn.close()
                    return
            self.pending -= 1
            self.proxy._delivered(data, replies=self.replies, action=action)


class _Connection:
    """One client connection and its own connection to the upstream node."""

    def __init__(
        self,
        proxy: FaultProxy,
        client: tuple[asyncio.StreamReader, asyncio.StreamWriter],
        upstream: tuple[asyncio.StreamReader, asyncio.StreamWriter],
    ) -> None:
        self.proxy = proxy
        self.client_writer = client[1]
        self.upstream_writer = upstream[1]
        self.requests = _Pipe(proxy, self, client[0], upstream[1], replies=False)
        self.replies = _Pipe(proxy, self, upstream[0], client[1], replies=True)
        self.tasks = [
            asyncio.ensure_future(coro)
            for coro in (
                self.requests.read_loop(),
                self.requests.write_loop(),
                self.replies.read_loop(),
                self.replies.write_loop(),
            )
        ]
        self.closed = False

    def close(self, *, rst: bool = False) -> None:
        """Close both sockets; ``rst`` aborts the client's with a TCP reset."""
        if self.closed:
            return
        self.closed = True
        self.proxy._connections.discard(self)
        if rst:
            sock = self.client_writer.get_extra_info("socket")
            if sock is not None:
                with contextlib.suppress(OSError):
                    sock.setsockopt(
                        socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0)
                    )
            self.client_writer.transport.abort()
        else:
            self.client_writer.close()
        self.upstream_writer.transport.abort()
        current = asyncio.current_task()
        for task in self.tasks:
            if task is not current:
                task.cancel()


class FaultProxy:
    """A TCP proxy to ``127.0.0.1:upstream_port`` whose faults tests switch on.

    Use it as a context manager, or call :meth:`start` and :meth:`close`. ``url``
    is the ``redis://`` URL (database 0) a client should use instead of the node's.
    Counters (read them any time): ``connections`` accepted, ``requests`` and
    ``request_bytes`` forwarded to the node, ``received_bytes`` read from clients
    (forwarded or not), ``reply_bytes`` delivered to clients, ``swallowed_bytes``
    of replies never delivered.
    """

    def __init__(self, upstream_port: int, host: str = HOST) -> None:
        self.upstream_port = upstream_port
        self.host = host
        self._port: int | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._server: asyncio.Server | None = None
        self._connections: set[_Connection] = set()
        # Mode state: written only on the loop's thread, read there too.
        self._mode = PASS
        self._reply_delay = 0.0
        self._request_delay = 0.0
        #: In TRICKLE mode, the pause after each byte of a reply; else None.
        self._trickle_pause: float | None = None
        self._changed: asyncio.Event | None = None
        # Counters, shared with the test's thread under this condition.
        self._stats = threading.Condition()
        self.connections = 0
        self.requests = 0
        self.request_bytes = 0
        self.received_bytes = 0
        self.reply_bytes = 0
        self.swallowed_bytes = 0
        #: Request chunks held back by hold_request() and not yet delivered.
        self.held = 0
        #: Replies held back by hold_reply_to() and not yet released.
        self.held_replies = 0
        self._reply_match: bytes | None = None
        #: How many more matching replies to hold; None: every one.
        self._reply_left: int | None = None
        self._reply_gate: asyncio.Event | None = None
        # The hold_request() pattern, armed until a request chunk matches it.
        self._hold_match: bytes | None = None
        self._held_pipe: _Pipe | None = None

    def __repr__(self) -> str:
        return f"<FaultProxy {self._port or '?'} -> {self.upstream_port} {self._mode}>"

    # Lifecycle.

    @property
    def port(self) -> int:
        """Return the port the proxy listens on."""
        if self._port is None:
            raise FaultProxyError("the proxy has not been started")
        return self._port

    @property
    def url(self) -> str:
        """Return the ``redis://`` URL of database 0 through the proxy."""
        return f"redis://{HOST}:{self.port}/0"

    @property
    def mode(self) -> str:
        """Return the current mode: pass, delay, blackhole, hold or drop."""
        return self._mode

    def start(self) -> FaultProxy:
        """Start listening on a free loopback port; return the proxy."""
        if self._thread is not None:
            return self
        loop = asyncio.new_event_loop()
        ready = threading.Event()
        failure: list[BaseException] = []

        def run() -> None:
            asyncio.set_event_loop(loop)
            try:
                loop.run_until_complete(self._listen())
            except BaseException as exc:  # reported to start()'s caller
                failure.append(exc)
                ready.set()
                loop.close()
                return
            ready.set()
            try:
                loop.run_forever()
            finally:
                loop.run_until_complete(loop.shutdown_asyncgens())
                loop.close()

        self._loop = loop
        self._thread = threading.Thread(
            target=run, name=f"fault-proxy->{self.upstream_port}", daemon=True
        )
        self._thread.start()
        if not ready.wait(CALL_TIMEOUT) or failure:
            self._thread.join(CALL_TIMEOUT)
            self._thread = self._loop = None
            raise FaultProxyError(f"the proxy did not start: {failure[:1]}")
        return self

    def close(self) -> None:
        """Abort every connection, stop listening, stop the loop and its thread."""
        loop, thread = self._loop, self._thread
        if loop is None or thread is None:
            return
        if thread.is_alive() and not loop.is_closed():
            with contextlib.suppress(FaultProxyError, RuntimeError):
                self._call(self._shutdown())
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(loop.stop)
            thread.join(CALL_TIMEOUT)
        self._loop = self._thread = None

    def __enter__(self) -> FaultProxy:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    # Modes and actions, called from the test's thread. Each returns once the
    # loop applied it, so the next byte already sees the new mode.

    def pass_through(self) -> None:
        """Relay both ways without delay; buffered replies are delivered now."""
        self._set_mode(PASS)

    def delay(self, seconds: float, requests: float = 0.0) -> None:
        """Deliver reply chunks ``seconds`` and request chunks ``requests`` late.

        Each chunk waits from its own arrival, so shortening the delay releases
        waiting chunks sooner; order is kept on each connection.
        """
        if seconds < 0 or requests < 0:
            raise ValueError("delays must be >= 0")
        self._set_mode(DELAY, reply_delay=seconds, request_delay=requests)

    def trickle(self, pause: float) -> None:
        """Relay both ways; write replies to clients a byte at a time, ``pause``
        seconds apart (each byte its own packet: asyncio sets TCP_NODELAY)."""
        if pause < 0:
            raise ValueError("the pause must be >= 0")
        self._set_mode(TRICKLE, trickle_pause=pause)

    def blackhole(self) -> None:
        """Read from clients but forward nothing and answer nothing."""
        self._set_mode(BLACKHOLE)

    def hold_replies(self) -> None:
        """Forward requests; keep every reply until :meth:`release_replies`."""
        self._set_mode(HOLD)

    def release_replies(self) -> None:
        """Go back to pass-through and return once held replies were written.

        When it returns, the replies are in the clients' socket buffers, even if
        the client process is stopped.
        """
        self._set_mode(PASS)
        self._call(self._flushed())

    def drop_reply_after_forward(self) -> None:
        """Forward requests; swallow every reply not yet delivered."""
        self._set_mode(DROP)

    def reset(self) -> None:
        """Abort every open client connection with a TCP RST; the mode stays."""
        self._call(self._reset())

    def hold_request(self, match: bytes) -> None:
        """Hold back the next request chunk containing ``match``, until delivered.

        Only that one chunk is caught (later matches pass), with whatever its
        client sends after it on the same connection. The node's side of that
        connection stays open even when the client closes its own, as a
        retransmitted segment still arrives after the sender gave up.
        """
        if not match:
            raise ValueError("match must not be empty")

        async def arm() -> None:
            if self._held_pipe is not None:
                raise FaultProxyError("a request is already held")
            self._hold_match = match

        self._call(arm())

    def hold_reply_to(self, match: bytes, count: int | None = None) -> None:
        """Hold back the reply to every request chunk containing ``match``, or to
        the next ``count`` of them only (later ones pass).

        The request runs on the node at once; its reply (and whatever follows on
        that connection) waits until :meth:`release_held_replies`.
        """
        if not match:
            raise ValueError("match must not be empty")
        if count is not None and count < 1:
            raise ValueError("count must be >= 1")

        async def arm() -> None:
            self._reply_match = match
            self._reply_left = count
            self._reply_gate = asyncio.Event()

        self._call(arm())

    def wait_for_held_replies(
        self, count: int = 1, timeout: float = CALL_TIMEOUT
    ) -> bool:
        """Wait until ``count`` replies are held back; return whether they are."""
        with self._stats:
            return self._stats.wait_for(lambda: self.held_replies >= count, timeout)

    def release_held_replies(self) -> None:
        """Deliver the held replies and stop holding new ones."""

        async def release() -> None:
            self._reply_match = None
            if self._reply_gate is not None:
                self._reply_gate.set()

        self._call(release())

    def wait_for_held(self, timeout: float = CALL_TIMEOUT) -> bool:
        """Wait until a request chunk is held back; return whether one is."""
        with self._stats:
            return self._stats.wait_for(lambda: self.held > 0, timeout)

    def deliver_held(self, timeout: float = CALL_TIMEOUT) -> bytes:
        """Send the held request on to the node and return the node's reply.

        The reply is what the node answered (the first chunk it sent after the
        delivery), whether or not the client is still there to read it.
        """
        return self._call(self._deliver(timeout), timeout + CALL_TIMEOUT)

    def wait_for_request(
        self, timeout: float = CALL_TIMEOUT, *, since: int | None = None
    ) -> bool:
        """Wait until a request chunk was forwarded to the node; return whether.

        "A request" means one more than ``since`` (a value of :attr:`requests`
        read earlier); by default, one more than when this call started. Read
        ``requests`` before starting the client to never miss a fast one.
        """
        with self._stats:
            floor = self.requests if since is None else since
            return self._stats.wait_for(lambda: self.requests > floor, timeout)

    def wait_for_reply_bytes(self, count: int, timeout: float = CALL_TIMEOUT) -> bool:
        """Wait until ``count`` reply bytes were delivered to clients; return whether.

        A client may read a reply before the proxy counts it: the count follows the
        write on the proxy's own thread.
        """
        with self._stats:
            return self._stats.wait_for(lambda: self.reply_bytes >= count, timeout)

    # Internals, run on the loop's thread.

    def _call(self, coro: Coroutine[Any, Any, T], timeout: float = CALL_TIMEOUT) -> T:
        loop = self._loop
        if loop is None:
            coro.close()
            raise FaultProxyError("the proxy is not running")
        future = asyncio.run_coroutine_threadsafe(coro, loop)
        try:
            return future.result(timeout)
        except TimeoutError as exc:
            future.cancel()
            raise FaultProxyError("the proxy's loop did not answer") from exc

    def _set_mode(
        self,
        mode: str,
        *,
        reply_delay: float = 0.0,
        request_delay: float = 0.0,
        trickle_pause: float | None = None,
    ) -> None:
        async def apply() -> None:
            self._mode = mode
            self._reply_delay = reply_delay
            self._request_delay = request_delay
            self._trickle_pause = trickle_pause
            self._notify()

        self._call(apply())

    def _notify(self) -> None:
        # Wake every writer waiting for a delay or the gate: it re-reads the mode.
        if self._changed is not None:
            self._changed.set()
        self._changed = asyncio.Event()

    async def _wait_for_change(self, due: float | None) -> None:
        changed = self._changed
        assert changed is not None
        timeout = None if due is None else max(0.0, due - time.monotonic())
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(changed.wait(), timeout)

    def _policy(self, arrived: float, *, replies: bool) -> tuple[str, float | None]:
        """Say what to do now with a chunk: forward, swallow, or wait (until when)."""
        mode = self._mode
        if mode == BLACKHOLE:
            return _SWALLOW, None
        if replies:
            if mode == DROP:
                return _SWALLOW, None
            if mode == HOLD:
                return _WAIT, None
            delay = self._reply_delay if mode == DELAY else 0.0
        else:
            delay = self._request_delay if mode == DELAY else 0.0
        due = arrived + delay
        if due > time.monotonic():
            return _WAIT, due
        return _FORWARD, None

    def _claim_reply_hold(self, data: bytes) -> bool:
        """Return whether the reply to ``data``, a request chunk, is to be held."""
        match = self._reply_match
        if match is None or match not in data:
            return False
        if self._reply_left is not None:
            self._reply_left -= 1
            if self._reply_left == 0:
                self._reply_match = None  # the held ones stay held
        with self._stats:
            self.held_replies += 1
            self._stats.notify_all()
        return True

    async def _reply_gate_open(self) -> None:
        gate = self._reply_gate
        if gate is not None:
            await gate.wait()
        with self._stats:
            self.held_replies -= 1
            self._stats.notify_all()

    def _claim_hold(self, pipe: _Pipe, data: bytes) -> bool:
        """Return whether ``data``, a request chunk just read, is to be held."""
        match = self._hold_match
        if match is None or match not in data:
            return False
        self._hold_match = None
        self._held_pipe = pipe
        with self._stats:
            self.held += 1
            self._stats.notify_all()
        return True

    async def _deliver(self, timeout: float) -> bytes:
        pipe = self._held_pipe
        if pipe is None:
            raise FaultProxyError("no request is held")
        replies = pipe.conn.replies
        seen = replies.chunks
        pipe.gate.set()
        if not await self._reply_after(pipe.conn, seen, timeout):
            raise FaultProxyError("the node did not answer the held request")
        self._held_pipe = None
        with self._stats:
            self.held -= 1
            self._stats.notify_all()
        return replies.last

    async def _reply_after(
        self, conn: _Connection, seen: int, timeout: float = CALL_TIMEOUT
    ) -> bool:
        """Wait until the node sent ``conn`` more than ``seen`` chunks; say whether."""
        deadline = time.monotonic() + timeout
        while conn.replies.chunks <= seen:
            if conn.replies.eof or time.monotonic() > deadline:
                return False
            await asyncio.sleep(0.001)
        return True

    def _received(self, data: bytes, *, replies: bool) -> None:
        if not replies:
            with self._stats:
                self.received_bytes += len(data)
                self._stats.notify_all()

    def _delivered(self, data: bytes, *, replies: bool, action: str) -> None:
        with self._stats:
            if action != _FORWARD:
                if replies:
                    self.swallowed_bytes += len(data)
            elif replies:
                self.reply_bytes += len(data)
            else:
                self.requests += 1
                self.request_bytes += len(data)
            self._stats.notify_all()

    async def _listen(self) -> None:
        self._changed = asyncio.Event()
        self._server = await asyncio.start_server(self._accept, HOST, 0)
        self._port = self._server.sockets[0].getsockname()[1]

    async def _accept(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        with self._stats:
            self.connections += 1
        try:
            upstream = await asyncio.open_connection(self.host, self.upstream_port)
        except OSError:
            # The node is down: the client sees its connection closed.
            writer.transport.abort()
            return
        conn = _Connection(self, (reader, writer), upstream)
        self._connections.add(conn)

    async def _flushed(self) -> None:
        while any(c.replies.pending for c in self._connections):
            await asyncio.sleep(0.001)

    async def _reset(self) -> None:
        for conn in list(self._connections):
            conn.close(rst=True)

    async def _shutdown(self) -> None:
        if self._server is not None:
            self._server.close()
        for conn in list(self._connections):
            conn.close(rst=True)
        tasks = [
            task for task in asyncio.all_tasks() if task is not asyncio.current_task()
        ]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if self._server is not None:
            await self._server.wait_closed()
