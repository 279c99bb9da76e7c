"""Real ``redis-server`` (or ``valkey-server``) processes for tests.

Each :class:`RedisNode` owns one ``redis-server`` child process (not daemonized, so
the PID is ours) on a free loopback port, in its own directory. Tests crash it
(:meth:`RedisNode.kill`), stop it, restart it on the same port, or freeze it with
SIGSTOP (:meth:`RedisNode.pause`) to play a slow or partitioned master. Nothing here
is mocked: the lock code under test talks to real servers over TCP.

Three safety nets keep a run from leaving servers behind, including SIGSTOPped
ones: fixtures stop their nodes at teardown, an ``atexit`` hook kills whatever is
still alive, and on Linux each server gets ``PR_SET_PDEATHSIG`` so it dies with the
test process even when that process is killed.
"""

from __future__ import annotations

import atexit
import contextlib
import signal
import socket
import subprocess
import threading
import time
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any, overload

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from ._process import die_with_parent, process_state
from .binary import find_redis_server

HOST = "127.0.0.1"
START_TIMEOUT = 10.0
STOP_TIMEOUT = 5.0
PORT_ATTEMPTS = 5


def free_port() -> int:
    """Return a loopback TCP port that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((HOST, 0))
        port: int = sock.getsockname()[1]
        return port


class RedisNodeError(RuntimeError):
    """A redis-server process could not be started or did not answer."""


class _PortInUseError(RedisNodeError):
    pass


# Every node with a live process, so the atexit hook can reap them.
_live_nodes: set[RedisNode] = set()
_live_lock = threading.Lock()


def _kill_leftovers() -> None:
    with _live_lock:
        leftovers = list(_live_nodes)
    for node in leftovers:
        node.kill()


atexit.register(_kill_leftovers)


class RedisNode:
    """One real ``redis-server`` process on a loopback port.

    ``directory`` holds the server's working files and its log (``redis.log``).
    ``port`` pins the port; by default a free one is picked at the first
    :meth:`start` and kept for every restart. With ``appendfsync_always`` the
    server writes an append-only file and fsyncs every write, so data survives
    :meth:`kill`; otherwise nothing is persisted and a restart comes back empty.
    ``extra_args`` are appended to the command line (say ``["--replicaof",
    "127.0.0.1", "7001"]``). ``server`` is ``redis``, ``valkey`` or a binary's
    path (:func:`~redlock_django.testing.binary.find_redis_server`).
    """

    def __init__(
        self,
        directory: Path | str,
        *,
        port: int | None = None,
        appendfsync_always: bool = False,
        server: str | None = None,
        extra_args: Sequence[str] = (),
    ) -> None:
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.log_path = self.directory / "redis.log"
        self.appendfsync_always = appendfsync_always
        self.extra_args = tuple(extra_args)
        self.server = find_redis_server(server)
        self._port = port
        self._fixed_port = port is not None
        self._process: subprocess.Popen[bytes] | None = None
        self._paused = False

    def __repr__(self) -> str:
        state = "paused" if self.is_paused else "up" if self.is_running else "down"
        return f"<RedisNode {self._port or '?'} {state}>"

    @property
    def port(self) -> int:
        """Return the TCP port; fixed by the first :meth:`start`."""
        if self._port is None:
            raise RedisNodeError("the node has not been started yet: no port")
        return self._port

    @property
    def url(self) -> str:
        """Return the ``redis://`` URL of database 0 on this node."""
        return f"redis://{HOST}:{self.port}/0"

    @property
    def pid(self) -> int | None:
        """Return the server's process id, or ``None`` when it is not running."""
        return self._process.pid if self.is_running and self._process else None

    @property
    def is_running(self) -> bool:
        """Return whether the process is alive (a paused process is alive)."""
        return self._process is not None and self._process.poll() is None

    @property
    def is_paused(self) -> bool:
        """Return whether the process is alive and stopped by SIGSTOP."""
        return self._paused and self.is_running

    def client(self, **overrides: Any) -> redis.Redis:
        """Return a new plain ``redis.Redis`` for assertions in tests.

        Short timeouts and no retries, so a paused or dead node fails fast
        instead of hanging; ``decode_responses`` is off. ``overrides`` go to
        ``redis.Redis`` as keyword arguments.
        """
        options: dict[str, Any] = {
            "host": HOST,
            "port": self.port,
            "db": 0,
            "socket_timeout": 0.5,
            "socket_connect_timeout": 0.5,
            "retry": Retry(NoBackoff(), 0),
            "decode_responses": False,
        }
        options.update(overrides)
        return redis.Redis(**options)

    def start(self, timeout: float = START_TIMEOUT) -> None:
        """Start the server and wait until it answers PING; no-op if running.

        A port picked automatically that turns out to be taken is replaced by
        another one, up to a few times. Raise :class:`RedisNodeError`, with the
        tail of the server's log, when the server exits or stays silent for
        ``timeout`` seconds.
        """
        if self.is_running:
            return
        self._reap()
        # Only the first start may pick another port: a restarted node must come
        # back where the settings and URLs built from it point.
        first = self._port is None
        for attempt in range(PORT_ATTEMPTS):
            if self._port is None:
                self._port = free_port()
            try:
                self._spawn_and_wait(timeout)
                return
            except _PortInUseError:
                if self._fixed_port or not first or attempt == PORT_ATTEMPTS - 1:
                    raise
                self._port = None

    def stop(self, timeout: float = STOP_TIMEOUT) -> None:
        """Stop the server with SIGTERM, or SIGKILL if it ignores that; wait for it.

        A paused server is resumed first, since SIGTERM waits for SIGCONT.
        """
        process = self._process
        if process is None or process.poll() is not None:
            self._reap()
            return
        with contextlib.suppress(ProcessLookupError):
            if self._paused:
                process.send_signal(signal.SIGCONT)
            process.terminate()
        try:
            process.wait(timeout)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout)
        self._reap()

    def kill(self) -> None:
        """Kill the server with SIGKILL, like a crash, and reap it."""
        process = self._process
        if process is not None and process.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                process.kill()
            process.wait(STOP_TIMEOUT)
        self._reap()

    def restart(self) -> None:
        """Stop the server if it runs, then start it again on the same port."""
        self.stop()
        self.start()

    def crash_and_restart(self, delay: float = 0.0) -> float:
        """Kill the server (SIGKILL), wait ``delay`` seconds, start it again.

        The delayed-restart rule of the Redlock spec: a node without persistence
        comes back empty, so it must stay down for at least the longest lock TTL
        (plus drift) for no lease it granted to still be running when it returns.
        ``delay=0`` breaks the rule on purpose. Return the seconds it was down.
        """
        self.kill()
        down = time.monotonic()
        if delay > 0:
            time.sleep(delay)
        self.start()
        return time.monotonic() - down

    def pause(self) -> None:
        """Freeze the server with SIGSTOP: connections open, nothing answered.

        Pausing a paused node does nothing. Raise :class:`RedisNodeError` when
        the node is not running.
        """
        if not self.is_running or self._process is None:
            raise RedisNodeError(f"cannot pause {self!r}: it is not running")
        if self._paused:
            return
        self._process.send_signal(signal.SIGSTOP)
        self._paused = True
        self._wait_for_state(self._process.pid, stopped=True)

    def resume(self) -> None:
        """Let a paused server run again with SIGCONT; no-op otherwise."""
        if self._paused and self.is_running and self._process is not None:
            self._process.send_signal(signal.SIGCONT)
            self._wait_for_state(self._process.pid, stopped=False)
        self._paused = False

    @staticmethod
    def _wait_for_state(pid: int, *, stopped: bool) -> None:
        # Signals are delivered asynchronously: without this wait a command sent
        # right after pause() could still be answered.
        deadline = time.monotonic() + STOP_TIMEOUT
        while time.monotonic() < deadline:
            state = process_state(pid)
            if state is None or (state == "T") == stopped:
                return
            time.sleep(0.001)
        raise RedisNodeError(
            f"redis-server {pid} did not {'stop' if stopped else 'continue'}"
        )

    @contextlib.contextmanager
    def paused(self) -> Iterator[RedisNode]:
        """Pause the server for the ``with`` block, resuming it even on error."""
        self.pause()
        try:
            yield self
        finally:
            self.resume()

    def flush(self) -> None:
        """Delete every key on the server (FLUSHALL)."""
        with self.client() as client:
            client.flushall()

    def clog(
        self, key: str, token: bytes = b"foreign-token", ttl: float = 10.0
    ) -> None:
        """Hold ``key`` with a token that no lock under test owns.

        Simulates another client's lease on this one node: ``SET key token PX``.
        """
        with self.client() as client:
            client.set(key, token, px=int(ttl * 1000))

    def log_tail(self, lines: int = 20, since: int = 0) -> str:
        """Return the last ``lines`` lines of the server log, from byte ``since``."""
        try:
            with self.log_path.open("rb") as log:
                log.seek(since)
                text = log.read().decode(errors="replace")
        except FileNotFoundError:
            return "(no log)"
        return "\n".join(text.splitlines()[-lines:]) or "(empty log)"

    def _command(self) -> list[str]:
        command = [
            self.server,
            "--port", str(self.port),
            "--bind", HOST,
            "--daemonize", "no",
            "--dir", str(self.directory),
            "--save", "",
            "--logfile", "",
        ]  # fmt: skip
        if self.appendfsync_always:
            command += ["--appendonly", "yes", "--appendfsync", "always"]
        else:
            command += ["--appendonly", "no"]
        return command + list(self.extra_args)

    def _spawn_and_wait(self, timeout: float) -> None:
        log_start = self.log_path.stat().st_size if self.log_path.exists() else 0
        with self.log_path.open("ab") as log:
            process = subprocess.Popen(
                self._command(),
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                cwd=self.directory,
                # Keep a terminal's Ctrl-C away from the servers, so teardown
                # stops them in order instead of racing their own shutdown.
                start_new_session=True,
                preexec_fn=die_with_parent(),
            )
        self._process = process
        self._paused = False
        with _live_lock:
            _live_nodes.add(self)
        deadline = time.monotonic() + timeout
        while True:
            if process.poll() is not None:
                tail = self.log_tail(since=log_start)
                self._reap()
                error = _PortInUseError if "already in use" in tail else RedisNodeError
                raise error(
                    f"redis-server on port {self.port} exited with code "
                    f"{process.returncode}; log tail:\n{tail}"
                )
            if self._answers_as(process.pid):
                return
            if time.monotonic() > deadline:
                self.kill()
                raise RedisNodeError(
                    f"redis-server on port {self.port} did not answer PING within "
                    f"{timeout:.1f}s; log tail:\n{self.log_tail(since=log_start)}"
                )
            time.sleep(0.01)

    def _answers_as(self, pid: int) -> bool:
        # Check the PID too: another server that already held the port could
        # answer PING while ours fails to bind.
        # And done loading its append-only file: INFO answers while it loads, but
        # other commands get BusyLoadingError until it is done.
        try:
            with self.client(socket_timeout=0.2, socket_connect_timeout=0.2) as c:
                info = c.info("server")
                loading = c.info("persistence").get("loading")
        except (redis.ConnectionError, redis.TimeoutError):
            return False
        return bool(info.get("process_id") == pid) and not loading

    def _reap(self) -> None:
        if self._process is not None and self._process.poll() is None:
            return
        self._process = None
        self._paused = False
        with _live_lock:
            _live_nodes.discard(self)


class NodeSet(Sequence[RedisNode]):
    """An ordered group of :class:`RedisNode`: the masters of one Redlock setup.

    Indexing gives a node, slicing gives a smaller ``NodeSet``.
    """

    def __init__(self, nodes: Iterable[RedisNode]) -> None:
        self._nodes = list(nodes)

    @classmethod
    def create(
        cls,
        count: int,
        directory: Path | str,
        *,
        appendfsync_always: bool = False,
        server: str | None = None,
    ) -> NodeSet:
        """Return ``count`` unstarted nodes, each in a subdirectory of ``directory``.

        ``server`` is ``redis``, ``valkey`` or a binary's path, as in
        :func:`find_redis_server` (default: ``REDLOCK_TEST_SERVER``, else redis).
        """
        server = find_redis_server(server)
        return cls(
            RedisNode(
                Path(directory) / f"node{index}",
                appendfsync_always=appendfsync_always,
                server=server,
            )
            for index in range(count)
        )

    @overload
    def __getitem__(self, index: int) -> RedisNode: ...

    @overload
    def __getitem__(self, index: slice) -> NodeSet: ...

    def __getitem__(self, index: int | slice) -> RedisNode | NodeSet:
        if isinstance(index, slice):
            return NodeSet(self._nodes[index])
        return self._nodes[index]

    def __len__(self) -> int:
        return len(self._nodes)

    def __repr__(self) -> str:
        return f"NodeSet({self._nodes!r})"

    @property
    def urls(self) -> list[str]:
        """Return every node's URL, in order."""
        return [node.url for node in self._nodes]

    def require_password(self, password: str, user: str = "") -> list[str]:
        """Put every node behind ``requirepass``; return URLs logging in as ``user``."""
        for node in self._nodes:
            with node.client() as client:
                client.config_set("requirepass", password)
        return [f"redis://{user}:{password}@{HOST}:{n.port}/0" for n in self._nodes]

    @property
    def ports(self) -> list[int]:
        """Return every node's port, in order."""
        return [node.port for node in self._nodes]

    def start_all(self) -> None:
        """Start every node and wait until each answers PING.

        Nodes start one after the other, so two of them cannot pick the same
        free port. If one fails, the ones already started are stopped.
        """
        try:
            for node in self._nodes:
                node.start()
        except BaseException:
            self.stop_all()
            raise

    def stop_all(self) -> None:
        """Stop every node, paused ones included, even if stopping one fails."""
        errors: list[BaseException] = []
        for node in self._nodes:
            try:
                node.stop()
            except BaseException as exc:
                errors.append(exc)
                node.kill()
        if errors:
            raise errors[0]

    def resume_all(self) -> None:
        """Resume every paused node."""
        for node in self._nodes:
            node.resume()

    def ensure_running(self) -> None:
        """Resume paused nodes and restart stopped or killed ones."""
        for node in self._nodes:
            node.resume()
            node.start()

    def flush_all(self) -> None:
        """Delete every key on every node.

        A node that refuses (a test put it behind ``require_password``, say) is
        restarted: the nodes keep nothing on disk, so it comes back empty and
        with its own configuration.
        """
        for node in self._nodes:
            try:
                node.flush()
            except redis.RedisError:
                node.stop()
                node.start()
                node.flush()
