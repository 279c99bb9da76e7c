"""Side-by-side lock benchmark: redlock_django against its peers and the raw floors.

One command starts its own ``redis-server`` nodes on loopback (as the tests do),
configures Django itself, and measures:

* uncontended acquire + release of a fresh key (cycles/s, p50/p99 latency) on 1, 3,
  5 and 7 nodes for the raw floor (``SET NX PX`` then a compare-and-delete script,
  every node written before any reply is read, over raw sockets), the same floor
  running redlock_django's own acquire and release scripts, redlock_django
  (default settings, and with ``fencing=True``; on 1 and 5 nodes also a lock built
  with an explicit ``nodes=[...]`` list) and pottery's ``Redlock``; on one
  node also redis-py's ``Lock``, django-redis' ``cache.lock`` and python-redis-lock.
  Every configuration runs once per rep, reps interleaved; the medians are shown.
* contended: 4 processes on one key, each looping acquire / GET + SET a counter /
  release for a fixed time: acquisitions/s, handoffs/s (owner changes), the median
  handoff gap (previous holder starts releasing -> next holder's acquire returns),
  the owner-change fraction, the smallest process share of the acquisitions
  (starvation) and whether the counter equals the acquisitions (correctness).
  Every contestant runs ``--rounds`` times (3), the rounds interleaved, and its
  rounds are pooled: a ratio to a baseline is then not one lucky pairing, and the
  targets print it round by round as well.

Usage::

    .venv/bin/python -m benchmarks.locks            # about 5 minutes
    .venv/bin/python -m benchmarks.locks --quick    # about 2 minutes
    .venv/bin/python -m benchmarks.locks --json out.json

The peers come from the ``bench`` extra (``pip install -e '.[bench]'``). A peer
that is not installed is skipped. Everything is bounded in time; every process and
server started here is stopped at the end, including on Ctrl-C.
"""

from __future__ import annotations

import argparse
import itertools
import json
import multiprocessing
import os
import platform
import secrets
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import django
import redis
from django.conf import settings

NODE_COUNTS = (1, 3, 5, 7)
TTL_MS = 10_000
#: Compare-and-delete, the floor's release (redis-py Lock's script, in spirit).
RELEASE_LUA = (
    "if redis.call('get', KEYS[1]) == ARGV[1] then "
    "return redis.call('del', KEYS[1]) end return 0"
)
CONTENDERS = 4


# --- the raw floor ------------------------------------------------------------------


def _resp(*parts: bytes | str | int) -> bytes:
    out = [b"*%d\r\n" % len(parts)]
    for part in parts:
        raw = part if isinstance(part, bytes) else str(part).encode()
        out.append(b"$%d\r\n%s\r\n" % (len(raw), raw))
    return b"".join(out)


class RawNode:
    """One pipelined raw RESP socket: the cheapest way to talk to a node."""

    def __init__(self, port: int) -> None:
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=2.0)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.buf = b""

    def send(self, data: bytes) -> None:
        self.sock.sendall(data)

    def line(self) -> bytes:
        """Read one single-line reply (+OK, $-1, :1, -ERR ...)."""
        while True:
            end = self.buf.find(b"\r\n")
            if end >= 0:
                reply, self.buf = self.buf[:end], self.buf[end + 2 :]
                return reply
            chunk = self.sock.recv(65536)
            if not chunk:
                raise ConnectionError("node closed the connection")
            self.buf += chunk

    def close(self) -> None:
        self.sock.close()


class RawFloor:
    """SET NX PX on every node, then compare-and-delete on every node.

    Each phase writes to every node before reading any reply: one round trip per
    phase whatever the node count, no thread, no pool, no parsing beyond a line.
    """

    def __init__(self, ports: Sequence[int]) -> None:
        self.nodes = [RawNode(port) for port in ports]
        self.quorum = len(self.nodes) // 2 + 1
        sha = self._load()
        self.release_head = b"EVALSHA", sha.encode(), b"1"

    def _load(self) -> str:
        shas = set()
        for node in self.nodes:
            node.send(_resp("SCRIPT", "LOAD", RELEASE_LUA))
            header = node.line()  # $40
            assert header.startswith(b"$"), header
            shas.add(node.line().decode())
        (sha,) = shas
        return sha

    def try_acquire(self, key: bytes, token: bytes) -> bool:
        command = _resp(b"SET", key, token, b"NX", b"PX", TTL_MS)
        for node in self.nodes:
            node.send(command)
        granted = sum(node.line() == b"+OK" for node in self.nodes)
        return granted >= self.quorum

    def release(self, key: bytes, token: bytes) -> None:
        command = _resp(*self.release_head, key, token)
        for node in self.nodes:
            node.send(command)
        for node in self.nodes:
            node.line()

    def cycle(self, key: str) -> None:
        token = secrets.token_bytes(20)
        raw = key.encode()
        if not self.try_acquire(raw, token):
            raise RuntimeError(f"the floor could not take the fresh key {key!r}")
        self.release(raw, token)

    def close(self) -> None:
        for node in self.nodes:
            node.close()


class ScriptFloor(RawFloor):
    """The raw floor running redlock_django's own scripts: ``ACQUIRE_SCRIPT`` by
    EVALSHA with a token and holder metadata like the library's, then
    ``RELEASE_SCRIPT`` by EVALSHA (as the sync driver releases).

    The same raw sockets and no Python beyond the floor's: its ratio to the raw
    floor is what the lock's data model costs the nodes, and the library's ratio
    to it what the client's Python costs.
    """

    def __init__(self, ports: Sequence[int]) -> None:
        from redlock_django import meta
        from redlock_django.scripts import ACQUIRE_SCRIPT, RELEASE_SCRIPT

        super().__init__(ports)
        self.acquire_head = b"EVALSHA", ACQUIRE_SCRIPT.sha.encode(), b"1"
        self.release_head = b"EVALSHA", RELEASE_SCRIPT.sha.encode(), b"1"
        self.ttl = str(TTL_MS).encode()
        self.meta = meta.encode("bench", TTL_MS / 1000, "").encode()

    def _load(self) -> str:
        """Load the acquire and release scripts on every node."""
        from redlock_django.scripts import ACQUIRE_SCRIPT, RELEASE_SCRIPT

        for node in self.nodes:
            for script in (ACQUIRE_SCRIPT, RELEASE_SCRIPT):
                node.send(_resp("SCRIPT", "LOAD", script.source))
                header = node.line()  # $40
                assert header.startswith(b"$"), header
                node.line()
        return ACQUIRE_SCRIPT.sha

    def try_acquire(self, key: bytes, token: bytes) -> bool:
        command = _resp(*self.acquire_head, key, token, self.ttl, self.meta)
        for node in self.nodes:
            node.send(command)
        granted = sum(node.line() == b":0" for node in self.nodes)
        return granted >= self.quorum

    def release(self, key: bytes, token: bytes) -> None:
        command = _resp(*self.release_head, key, token, b"bench-release")
        for node in self.nodes:
            node.send(command)
        for node in self.nodes:
            node.line()

    def cycle(self, key: str) -> None:
        # A token as the library's (``lock.TOKEN_BYTES``), then ".<attempt>".
        token = secrets.token_urlsafe(20).encode() + b".1"
        raw = key.encode()
        if not self.try_acquire(raw, token):
            raise RuntimeError(f"the floor could not take the fresh key {key!r}")
        self.release(raw, token)


# --- the contestants ----------------------------------------------------------------


def _client(port: int) -> redis.Redis:
    return redis.Redis(host="127.0.0.1", port=port, socket_timeout=2.0)


def _redlock_settings(urls: Sequence[str]) -> Any:
    from django.test import override_settings

    return override_settings(REDLOCK={"NODES": list(urls)})


class Contestant:
    """Builds a cycle(key) function for one library on a set of nodes.

    ``setup`` returns (cycle, close); ``cycle`` acquires and releases ``key``.
    """

    def __init__(
        self, name: str, counts: Sequence[int], setup: Callable[..., Any]
    ) -> None:
        self.name = name
        self.counts = counts
        self.setup = setup


def setup_floor(ports: Sequence[int], urls: Sequence[str]) -> Any:
    floor = RawFloor(ports)
    return floor.cycle, floor.close


def setup_script_floor(ports: Sequence[int], urls: Sequence[str]) -> Any:
    floor = ScriptFloor(ports)
    return floor.cycle, floor.close


def _setup_redlock(fencing: bool) -> Callable[..., Any]:
    def setup(ports: Sequence[int], urls: Sequence[str]) -> Any:
        from redlock_django import Redlock

        override = _redlock_settings(urls)
        override.enable()

        def cycle(key: str) -> None:
            lock = Redlock(key, fencing=fencing)
            if not lock.acquire(blocking=False):
                raise RuntimeError(f"redlock_django could not take {key!r}")
            lock.release()

        return cycle, override.disable

    return setup


def setup_explicit_nodes(ports: Sequence[int], urls: Sequence[str]) -> Any:
    """A new lock per cycle built with ``nodes=[...]`` (no REDLOCK setting needed)."""
    from redlock_django import Redlock

    nodes = list(urls)

    def cycle(key: str) -> None:
        lock = Redlock(key, nodes=nodes)
        if not lock.acquire(blocking=False):
            raise RuntimeError(f"redlock_django could not take {key!r}")
        lock.release()

    return cycle, lambda: None


def setup_pottery(ports: Sequence[int], urls: Sequence[str]) -> Any:
    from pottery import Redlock

    masters = {_client(port) for port in ports}

    def cycle(key: str) -> None:
        lock = Redlock(key=key, masters=masters)
        if not lock.acquire(blocking=False):
            raise RuntimeError(f"pottery could not take {key!r}")
        lock.release()

    def close() -> None:
        for client in masters:
            client.close()

    return cycle, close


def setup_redis_py(ports: Sequence[int], urls: Sequence[str]) -> Any:
    client = _client(ports[0])

    def cycle(key: str) -> None:
        lock = client.lock(key, timeout=TTL_MS / 1000)
        if not lock.acquire(blocking=False):
            raise RuntimeError(f"redis-py Lock could not take {key!r}")
        lock.release()

    return cycle, client.close


def setup_django_redis(ports: Sequence[int], urls: Sequence[str]) -> Any:
    from django.core.cache import cache

    def cycle(key: str) -> None:
        lock = cache.lock(key, timeout=TTL_MS / 1000)
        if not lock.acquire(blocking=False):
            raise RuntimeError(f"django-redis cache.lock could not take {key!r}")
        lock.release()

    return cycle, lambda: None


def setup_python_redis_lock(ports: Sequence[int], urls: Sequence[str]) -> Any:
    import redis_lock

    client = _client(ports[0])

    def cycle(key: str) -> None:
        lock = redis_lock.Lock(client, key, expire=TTL_MS // 1000)
        if not lock.acquire(blocking=False):
            raise RuntimeError(f"python-redis-lock could not take {key!r}")
        lock.release()

    return cycle, client.close


def _installed(module: str) -> bool:
    try:
        __import__(module)
    except ImportError:
        return False
    return True


def contestants() -> list[Contestant]:
    made = [
        Contestant("raw floor", NODE_COUNTS, setup_floor),
        Contestant("raw floor, our scripts", NODE_COUNTS, setup_script_floor),
        Contestant("redlock_django", NODE_COUNTS, _setup_redlock(fencing=False)),
        Contestant("redlock_django fencing", NODE_COUNTS, _setup_redlock(fencing=True)),
        Contestant("redlock_django nodes=[...]", (1, 5), setup_explicit_nodes),
    ]
    if _installed("pottery"):
        made.append(Contestant("pottery Redlock", NODE_COUNTS, setup_pottery))
    made.append(Contestant("redis-py Lock", (1,), setup_redis_py))
    if _installed("django_redis"):
        made.append(Contestant("django-redis cache.lock", (1,), setup_django_redis))
    if _installed("redis_lock"):
        made.append(Contestant("python-redis-lock", (1,), setup_python_redis_lock))
    return made


# --- uncontended --------------------------------------------------------------------


@dataclass
class Uncontended:
    name: str
    nodes: int
    cycles_per_s: list[float] = field(default_factory=list)
    p50_ms: list[float] = field(default_factory=list)
    p99_ms: list[float] = field(default_factory=list)

    def median(self, attr: str) -> float:
        values = getattr(self, attr)
        return statistics.median(values) if values else float("nan")


def measure(cycle: Callable[[str], None], prefix: str, seconds: float) -> tuple:
    """Run cycles on fresh keys for ``seconds``; return (cycles/s, p50, p99 ms)."""
    clock = time.perf_counter
    latencies: list[float] = []
    started = clock()
    end = started + seconds
    i = 0
    now = started
    while now < end:
        before = clock()
        cycle(f"{prefix}:{i}")
        now = clock()
        latencies.append(now - before)
        i += 1
    elapsed = now - started
    latencies.sort()
    p50 = latencies[len(latencies) // 2]
    p99 = latencies[min(len(latencies) - 1, int(len(latencies) * 0.99))]
    return len(latencies) / elapsed, p50 * 1000, p99 * 1000


def run_uncontended(
    ports: Sequence[int], urls: Sequence[str], reps: int, seconds: float, warmup: int
) -> list[Uncontended]:
    results: dict[tuple[str, int], Uncontended] = {}
    plan = [(c, n) for c in contestants() for n in c.counts]
    for rep in range(reps):
        # Interleave: every configuration once per rep, the order rotated each rep,
        # so a slow phase of the machine does not fall on one contestant only.
        shift = rep % len(plan)
        for contestant, n in plan[shift:] + plan[:shift]:
            cycle, close = contestant.setup(ports[:n], urls[:n])
            try:
                tag = f"u:{contestant.name.replace(' ', '-')}:{n}:{rep}"
                for i in range(warmup):
                    cycle(f"{tag}:warm:{i}")
                rate, p50, p99 = measure(cycle, tag, seconds)
            finally:
                close()
            result = results.setdefault(
                (contestant.name, n), Uncontended(contestant.name, n)
            )
            result.cycles_per_s.append(rate)
            result.p50_ms.append(p50)
            result.p99_ms.append(p99)
            print(
                f"  rep {rep + 1}/{reps}  {contestant.name:<24} {n} node(s): "
                f"{rate:8.0f} cycles/s  p50 {p50:.3f} ms  p99 {p99:.3f} ms",
                flush=True,
            )
    return list(results.values())


#: The uncontended targets that are ratios of two contestants on the same nodes:
#: (measured, baseline, nodes). Each is also measured paired (``run_paired``).
PAIRS = (
    ("redlock_django", "raw floor", 5),
    ("redlock_django", "pottery Redlock", 5),
    ("redlock_django", "redis-py Lock", 1),
    ("redlock_django nodes=[...]", "redlock_django", 5),
    # Not targets: where the gap to the floor is, nodes (the scripts) or client.
    ("raw floor, our scripts", "raw floor", 5),
    ("redlock_django", "raw floor, our scripts", 5),
    ("redlock_django", "raw floor, our scripts", 1),
)


@dataclass
class Paired:
    """Two contestants run in alternating blocks: the ratio of their rates."""

    name: str
    baseline: str
    nodes: int
    #: Cycles and seconds of each side, summed over the blocks.
    cycles: list[int] = field(default_factory=lambda: [0, 0])
    seconds: list[float] = field(default_factory=lambda: [0.0, 0.0])
    #: The ratio over each half of the blocks: how far it moved within the run.
    halves: list[float] = field(default_factory=list)

    @property
    def ratio(self) -> float:
        rate, base = (
            c / t if t else 0.0 for c, t in zip(self.cycles, self.seconds, strict=True)
        )
        return rate / base if base else float("nan")


def _block(cycle: Callable[[str], None], prefix: str, seconds: float) -> tuple:
    clock = time.perf_counter
    started = now = clock()
    n = 0
    while now - started < seconds:
        cycle(f"{prefix}:{n}")
        n += 1
        now = clock()
    return n, now - started


def run_paired(
    ports: Sequence[int],
    urls: Sequence[str],
    seconds: float,
    warmup: int,
    block: float = 0.1,
) -> list[Paired]:
    """Measure each of ``PAIRS`` as one ratio: the two sides alternate in blocks of
    ``block`` seconds for ``seconds`` in all, so both see the same machine.

    A ratio of two medians of separate runs moves by 10-20% with what else the
    machine runs (other tenants' CPU); alternating every tenth of a second leaves
    only changes faster than that to fall on one side.
    """
    by_name = {c.name: c for c in contestants()}
    results = []
    for name, baseline, n in PAIRS:
        if name not in by_name or baseline not in by_name:
            continue
        result = Paired(name, baseline, n)
        closers = []
        try:
            cycles = []
            for side in (name, baseline):
                cycle, close = by_name[side].setup(ports[:n], urls[:n])
                closers.append(close)
                cycles.append(cycle)
            tag = f"p:{name.replace(' ', '-')}:{baseline.replace(' ', '-')}:{n}"
            for side, cycle in enumerate(cycles):
                for i in range(warmup):
                    cycle(f"{tag}:warm:{side}:{i}")
            blocks = max(2, round(seconds / (2 * block)))
            half: list[list[float]] = [[0, 0.0, 0, 0.0], [0, 0.0, 0, 0.0]]
            for b in range(blocks):
                # Each pair of blocks starts with the other side: neither always
                # runs right after the other's garbage.
                order = (0, 1) if b % 2 == 0 else (1, 0)
                for side in order:
                    done, took = _block(cycles[side], f"{tag}:{b}:{side}", block)
                    result.cycles[side] += done
                    result.seconds[side] += took
                    h = half[0 if b < blocks // 2 else 1]
                    h[2 * side] += done
                    h[2 * side + 1] += took
            for c0, t0, c1, t1 in half:
                if t0 and t1 and c1:
                    result.halves.append((c0 / t0) / (c1 / t1))
        finally:
            for close in reversed(closers):
                close()
        results.append(result)
        print(
            f"  paired  {name} / {baseline}, {n} node(s): {result.ratio:.2f}x "
            f"(halves {' / '.join(f'{x:.2f}' for x in result.halves)})",
            flush=True,
        )
    return results


# --- contended ----------------------------------------------------------------------


def _locker(kind: str, ports: Sequence[int], urls: Sequence[str], key: str) -> Any:
    """Return (acquire, release) for one contended process; acquire blocks."""
    if kind in ("redlock_django", "redlock_django fair"):
        from redlock_django import Redlock, signals

        lock = Redlock(key, nodes=list(urls), fair=kind.endswith("fair"))

        def count(**kwargs: Any) -> None:
            ATTEMPTS.append(kwargs["attempts"])

        signals.lock_acquired.connect(count, weak=False)

        def acquire() -> bool:
            return lock.acquire(timeout=10.0)

        return acquire, lock.release
    if kind == "pottery":
        from pottery import Redlock as PotteryRedlock

        plock = PotteryRedlock(key=key, masters={_client(p) for p in ports})
        return (lambda: plock.acquire(timeout=10.0)), plock.release
    if kind == "redis-py":
        rlock = _client(ports[0]).lock(key, timeout=10.0)
        return (lambda: rlock.acquire(blocking_timeout=10.0)), rlock.release
    if kind == "python-redis-lock":
        import redis_lock

        client = _client(ports[0])
        state: dict[str, Any] = {}

        def acquire_prl() -> bool:
            state["lock"] = redis_lock.Lock(client, key, expire=10)
            return bool(state["lock"].acquire(timeout=10))

        return acquire_prl, lambda: state["lock"].release()
    if kind == "raw spin":
        floor = RawFloor(ports)
        raw = key.encode()
        held: dict[str, bytes] = {}

        def acquire_spin() -> bool:
            deadline = time.monotonic() + 10.0
            while time.monotonic() < deadline:
                token = secrets.token_bytes(20)
                if floor.try_acquire(raw, token):
                    held["token"] = token
                    return True
                floor.release(raw, token)  # undo the partial grants, retry at once
            return False

        return acquire_spin, lambda: floor.release(raw, held.pop("token"))
    raise ValueError(kind)


#: Per contended process: attempts of each redlock_django acquisition.
ATTEMPTS: list[int] = []


def _contender(
    kind: str,
    ports: Sequence[int],
    urls: Sequence[str],
    key: str,
    start: float,
    seconds: float,
    ident: int,
    out: Any,
) -> None:
    """One contended process: loop until start + seconds, send its events."""
    try:
        acquire, release = _locker(kind, ports, urls, key)
        counter = _client(ports[0])
        counter_key = f"{key}:counter"
        events: list[tuple[float, float]] = []
        failures = 0
        end = start + seconds
        time.sleep(max(0.0, start - time.monotonic()))
        while time.monotonic() < end:
            if not acquire():
                failures += 1
                continue
            got = time.monotonic()
            value = int(counter.get(counter_key) or 0)
            counter.set(counter_key, value + 1)
            done = time.monotonic()
            release()
            events.append((got, done))
        out.send(
            {
                "ident": ident,
                "events": events,
                "failures": failures,
                "attempts": list(ATTEMPTS),
            }
        )
    except BaseException as exc:  # report, never hang the parent
        out.send({"ident": ident, "error": f"{type(exc).__name__}: {exc}"})
    finally:
        out.close()


@dataclass
class Contended:
    name: str
    nodes: int
    seconds: float
    acquisitions: int = 0
    handoffs: int = 0
    gap_ms: float = float("nan")
    owner_change: float = float("nan")
    shares: list[int] = field(default_factory=list)
    counter: int = -1
    failures: int = 0
    #: Tries on the nodes per acquisition (redlock_django only; else empty).
    attempts: list[int] = field(default_factory=list, repr=False)
    errors: list[str] = field(default_factory=list)
    #: Seconds from one holder starting its release to the next one's grant.
    gaps: list[float] = field(default_factory=list, repr=False)
    #: Handoffs/s of each round, when this result pools several.
    rounds: list[float] = field(default_factory=list)
    #: Share of the host's CPU time taken by the hypervisor (steal) during the run,
    #: or during each round when pooled: NaN where /proc/stat does not say.
    steal: float = float("nan")
    steals: list[float] = field(default_factory=list)

    @property
    def acq_per_s(self) -> float:
        return self.acquisitions / self.seconds

    @property
    def handoffs_per_s(self) -> float:
        return self.handoffs / self.seconds

    @property
    def min_share(self) -> float:
        """The smallest process's acquisitions over a fair share (1.0 = fair)."""
        if not self.shares or not self.acquisitions:
            return 0.0
        return min(self.shares) / (self.acquisitions / len(self.shares))

    @property
    def correct(self) -> bool:
        return not self.errors and self.counter == self.acquisitions

    @classmethod
    def pooled(cls, rounds: Sequence[Contended]) -> Contended:
        """One result from interleaved rounds of one contestant: counts and times
        summed, gaps and attempts pooled; a round with a wrong counter is an error."""
        first = rounds[0]
        pooled = cls(first.name, first.nodes, 0.0, shares=[0] * len(first.shares))
        pooled.counter = 0
        for number, r in enumerate(rounds, 1):
            pooled.seconds += r.seconds
            pooled.acquisitions += r.acquisitions
            pooled.handoffs += r.handoffs
            pooled.counter += r.acquisitions
            pooled.failures += r.failures
            pooled.attempts.extend(r.attempts)
            pooled.gaps.extend(r.gaps)
            pooled.rounds.append(r.handoffs_per_s)
            pooled.steals.append(r.steal)
            pooled.shares = [
                a + b for a, b in zip(pooled.shares, r.shares, strict=True)
            ]
            pooled.errors.extend(f"round {number}: {e}" for e in r.errors)
            if not r.errors and r.counter != r.acquisitions:
                pooled.errors.append(
                    f"round {number}: counter {r.counter} != acquisitions "
                    f"{r.acquisitions}"
                )
        if pooled.gaps:
            pooled.gap_ms = statistics.median(pooled.gaps) * 1000
        if pooled.acquisitions > len(rounds):
            pooled.owner_change = pooled.handoffs / (pooled.acquisitions - len(rounds))
        return pooled


def _cpu_times() -> list[int] | None:
    """The host's CPU time counters (/proc/stat's ``cpu`` line), or None."""
    try:
        with open("/proc/stat") as stat:
            fields = stat.readline().split()
    except OSError:
        return None
    if len(fields) < 9 or fields[0] != "cpu":
        return None
    return [int(f) for f in fields[1:]]


def _steal(before: list[int] | None, after: list[int] | None) -> float:
    """The share of CPU time stolen by the hypervisor between two readings: a
    round run while other guests took the host's cores is slow for that reason,
    not for its contestant's."""
    if before is None or after is None:
        return float("nan")
    total = sum(after[:8]) - sum(before[:8])  # guest time is counted in user
    if total <= 0:
        return float("nan")
    return (after[7] - before[7]) / total


def run_contended(
    kind: str, label: str, ports: Sequence[int], urls: Sequence[str], seconds: float
) -> Contended:
    key = f"c:{kind.replace(' ', '-')}:{len(ports)}:{secrets.token_hex(4)}"
    context = multiprocessing.get_context("fork")
    start = time.monotonic() + 0.5
    before = _cpu_times()
    pipes, procs = [], []
    for ident in range(CONTENDERS):
        parent_end, child_end = context.Pipe(duplex=False)
        proc = context.Process(
            target=_contender,
            args=(kind, ports, urls, key, start, seconds, ident, child_end),
            daemon=True,
        )
        proc.start()
        child_end.close()
        pipes.append(parent_end)
        procs.append(proc)
    result = Contended(label, len(ports), seconds)
    reports = []
    deadline = start + seconds + 25.0  # a blocked acquire gives up after 10 s
    try:
        for pipe in pipes:
            if pipe.poll(max(0.1, deadline - time.monotonic())):
                reports.append(pipe.recv())
            else:
                result.errors.append("a process did not report in time")
    finally:
        for proc in procs:
            proc.join(timeout=2.0)
            if proc.is_alive():
                proc.kill()
                proc.join()
    result.steal = _steal(before, _cpu_times())
    events: list[tuple[float, float, int]] = []
    result.shares = [0] * CONTENDERS
    for report in reports:
        if "error" in report:
            result.errors.append(report["error"])
            continue
        result.failures += report["failures"]
        result.attempts.extend(report.get("attempts", ()))
        result.shares[report["ident"]] = len(report["events"])
        events.extend((got, done, report["ident"]) for got, done in report["events"])
    events.sort()
    result.acquisitions = len(events)
    gaps = []
    for (_, done, owner), (got, _, nxt) in itertools.pairwise(events):
        if nxt != owner:
            result.handoffs += 1
            gaps.append(got - done)
    result.gaps = gaps
    if gaps:
        result.gap_ms = statistics.median(gaps) * 1000
    if len(events) > 1:
        result.owner_change = result.handoffs / (len(events) - 1)
    with _client(ports[0]) as client:
        result.counter = int(client.get(f"{key}:counter") or 0)
    return result


def _describe(result: Contended) -> str:
    return (
        f"{result.acq_per_s:7.0f} acq/s {result.handoffs_per_s:7.1f} handoffs/s gap "
        f"{result.gap_ms:.2f} ms owner change {result.owner_change:.0%} shares "
        f"{result.shares} counter {'exact' if result.correct else 'WRONG'}"
        + (
            f" attempts/acq {statistics.mean(result.attempts):.2f}"
            if result.attempts
            else ""
        )
        + (f" host steal {result.steal:.0%}" if result.steal == result.steal else "")
    )


def run_contended_rounds(nodes: Any, rounds: int, seconds: float) -> list[Contended]:
    """Run the contended plan ``rounds`` times, interleaved, and pool each
    contestant's rounds: the machine's drift between runs falls on every
    contestant alike, and a ratio is not one lucky pairing."""
    plan = contended_plan()
    results: dict[tuple[str, int], list[Contended]] = {}
    ports, urls = nodes.ports, nodes.urls
    print(
        f"contended: {CONTENDERS} processes, {rounds} interleaved rounds of "
        f"{seconds}s each"
    )
    for number in range(1, rounds + 1):
        for kind, label, n in plan:
            nodes.flush_all()
            result = run_contended(kind, label, ports[:n], urls[:n], seconds)
            results.setdefault((label, n), []).append(result)
            print(
                f"  round {number} {label:<20} {n} node(s): {_describe(result)}",
                flush=True,
            )
    pooled = [Contended.pooled(results[(label, n)]) for _, label, n in plan]
    print("pooled:")
    for result in pooled:
        print(f"  {result.name:<28} {result.nodes} node(s): {_describe(result)}")
    return pooled


def contended_plan() -> list[tuple[str, str, int]]:
    plan = [
        ("redlock_django", "redlock_django", 5),
        ("redlock_django", "redlock_django", 1),
        ("redlock_django fair", "redlock_django fair", 5),
        ("redlock_django fair", "redlock_django fair", 1),
        ("raw spin", "raw spin loop", 5),
        ("raw spin", "raw spin loop", 1),
        ("redis-py", "redis-py Lock", 1),
    ]
    if _installed("pottery"):
        plan.insert(2, ("pottery", "pottery Redlock", 5))
    if _installed("redis_lock"):
        plan.append(("python-redis-lock", "python-redis-lock", 1))
    return plan


# --- a slow node, and memory ---------------------------------------------------------

SLOW_DELAY = 0.2
#: Node timeout of the waiters parked for the memory measurement.
SLOW_TIMEOUT = 0.5


@dataclass
class SlowNode:
    """Acquire latency with one of five nodes behind a proxy that delays replies."""

    node_timeout: float
    delay: float
    latencies: list[float] = field(default_factory=list, repr=False)
    acquired: int = 0

    def pct(self, q: float) -> float:
        ordered = sorted(self.latencies)
        return ordered[min(len(ordered) - 1, int(q * len(ordered)))] * 1000


def run_slow_node(ports: Sequence[int], urls: Sequence[str], samples: int) -> SlowNode:
    """Acquire + release ``samples`` fresh locks while node 5 answers 200 ms late."""
    from harness.proxy import FaultProxy
    from redlock_django import Redlock
    from redlock_django.conf import get_settings

    result = SlowNode(get_settings().node_timeout, SLOW_DELAY)
    with FaultProxy(ports[4]) as proxy:
        proxy.delay(SLOW_DELAY)
        via = [*urls[:4], proxy.url]
        for i in range(samples):
            lock = Redlock(f"slow:{i}:{secrets.token_hex(4)}", nodes=via)
            began = time.monotonic()
            got = lock.acquire(timeout=5.0)
            result.latencies.append(time.monotonic() - began)
            if got:
                result.acquired += 1
                lock.release()
    return result


@dataclass
class Memory:
    """Redis memory per held lock (all nodes) and client memory per waiting lock."""

    nodes: int
    redis_bytes: float = 0.0
    redis_bytes_fenced: float = 0.0
    key_bytes: int = 0
    fence_key_bytes: int = 0
    client_bytes_per_waiter: float = 0.0
    waiters: int = 0
    #: Waiters whose first attempt failed (a cold burst can outrun NODE_TIMEOUT).
    failed_waiters: int = 0
    subscriber_connections: int = 0


def _used_memory(ports: Sequence[int]) -> int:
    total = 0
    for port in ports:
        with _client(port) as client:
            total += int(client.info("memory")["used_memory"])
    return total


def run_memory(ports: Sequence[int], held: int, waiters: int) -> Memory:
    """Hold ``held`` locks and measure the nodes; park ``waiters`` asyncio waiters
    behind held locks and measure this process with tracemalloc."""
    import asyncio
    import tracemalloc

    from redlock_django import Redlock, nodes, wake
    from redlock_django.conf import get_settings

    result = Memory(nodes=5)
    for fencing in (False, True):
        before = _used_memory(ports[:5])
        locks = [Redlock(f"mem:{fencing}:{i}", fencing=fencing) for i in range(held)]
        for lock in locks:
            assert lock.acquire(blocking=False)
        after = _used_memory(ports[:5])
        with _client(ports[0]) as client:
            spec = locks[0]._resolve().spec
            if fencing:
                result.redis_bytes_fenced = (after - before) / held
                result.fence_key_bytes = int(client.memory_usage(spec.fence_key) or 0)
            else:
                result.redis_bytes = (after - before) / held
                result.key_bytes = int(client.memory_usage(spec.key) or 0)
        for lock in locks:
            lock.release()

    holders = [Redlock(f"mem:wait:{i}") for i in range(waiters)]
    for lock in holders:
        assert lock.acquire(blocking=False)

    async def park() -> None:
        # Started ten at a time: 200 first attempts at once would open 1,000
        # connections within one NODE_TIMEOUT, and many would time out.
        waiting = []
        for i in range(waiters):
            # tracemalloc slows Python several times: a first connection may
            # not fit the default 50 ms node timeout.
            lock = Redlock(f"mem:wait:{i}", node_timeout=SLOW_TIMEOUT)
            waiting.append(asyncio.create_task(lock.aacquire(timeout=60)))
            if i % 10 == 9:
                await asyncio.sleep(0.05)
        # Every waiter made its first attempt and is parked on its channel, and
        # every channel is confirmed by node 1 (200 first attempts open 200
        # connections per node, slowly under tracemalloc).
        config = get_settings()
        hub = wake.hub(nodes.sync_pools(config.nodes, SLOW_TIMEOUT))
        channels = [lock._resolve().spec.key.encode() for lock in holders]

        def parked() -> int:
            return sum(hub.waiting(c) == 1 and hub.listening(0, c) for c in channels)

        give_up = time.monotonic() + 30
        while time.monotonic() < give_up and parked() + sum(
            t.done() for t in waiting
        ) < len(waiting):
            await asyncio.sleep(0.1)
        result.waiters = parked()
        result.failed_waiters = sum(t.done() for t in waiting)
        snapshot = tracemalloc.take_snapshot()
        stats = snapshot.compare_to(base, "filename")
        grown = sum(max(0, s.size_diff) for s in stats)
        result.client_bytes_per_waiter = grown / max(1, result.waiters)
        with _client(ports[0]) as client:
            result.subscriber_connections = sum(
                1 for c in client.client_list() if int(c.get("sub", 0)) > 0
            )
        for task in waiting:
            task.cancel()
        await asyncio.gather(*waiting, return_exceptions=True)

    tracemalloc.start()
    base = tracemalloc.take_snapshot()
    try:
        asyncio.run(park())
    finally:
        tracemalloc.stop()
        for lock in holders:
            lock.release()
    return result


def extras_report(slow: SlowNode | None, memory: Memory | None) -> str:
    lines = []
    if slow is not None and slow.latencies:
        lines.append(
            f"slow node: 1 of 5 nodes delayed {slow.delay * 1000:.0f} ms by a proxy, "
            f"NODE_TIMEOUT {slow.node_timeout * 1000:.0f} ms, "
            f"{len(slow.latencies)} acquisitions ({slow.acquired} granted): "
            f"acquire p50 {slow.pct(0.5):.1f} ms, p99 {slow.pct(0.99):.1f} ms, "
            f"max {max(slow.latencies) * 1000:.1f} ms"
        )
    if memory is not None:
        lines.append(
            f"memory: Redis per held lock, all {memory.nodes} nodes: "
            f"{memory.redis_bytes:.0f} B ({memory.redis_bytes_fenced:.0f} B with "
            f"fencing, whose counter outlives the lock); MEMORY USAGE on one node: "
            f"lock hash {memory.key_bytes} B, "
            f"fencing counter {memory.fence_key_bytes} B"
        )
        lines.append(
            f"memory: client per waiting lock (asyncio, tracemalloc, "
            f"{memory.waiters} waiters parked on as many resources, "
            f"{memory.failed_waiters} failed their first attempt): "
            f"{memory.client_bytes_per_waiter:.0f} B; subscriber connections on "
            f"node 1 for all of them: {memory.subscriber_connections}"
        )
    return "\n".join(lines)


# --- report -------------------------------------------------------------------------


def _ratio(value: float, base: float | None) -> str:
    if base is None or not base or value != value:
        return "-"
    return f"{value / base:.2f}x"


def table(uncontended: list[Uncontended], contended: list[Contended]) -> str:
    floor = {
        r.nodes: r.median("cycles_per_s") for r in uncontended if r.name == "raw floor"
    }
    pottery = {
        r.nodes: r.median("cycles_per_s")
        for r in uncontended
        if r.name == "pottery Redlock"
    }
    head = (
        f"{'scenario':<36} {'nodes':>5} {'cycles/s':>9} {'p50 ms':>7} {'p99 ms':>7} "
        f"{'handoff/s':>9} {'gap ms':>7} {'owner chg':>9} {'min share':>9} "
        f"{'correct':>7} {'x floor':>8} {'x pottery':>9}"
    )
    lines = [head, "-" * len(head)]
    for r in sorted(uncontended, key=lambda r: (r.nodes, r.name != "raw floor")):
        rate = r.median("cycles_per_s")
        lines.append(
            f"{'uncontended ' + r.name:<36} {r.nodes:>5} {rate:>9.0f} "
            f"{r.median('p50_ms'):>7.3f} {r.median('p99_ms'):>7.3f} "
            f"{'':>9} {'':>7} {'':>9} {'':>9} {'':>7} "
            f"{_ratio(rate, floor.get(r.nodes)):>8} "
            f"{_ratio(rate, pottery.get(r.nodes)):>9}"
        )
    spin = {c.nodes: c.handoffs_per_s for c in contended if c.name == "raw spin loop"}
    pot_c = {
        c.nodes: c.handoffs_per_s for c in contended if c.name == "pottery Redlock"
    }
    lines.append("-" * len(head))
    for c in contended:
        lines.append(
            f"{'contended ' + c.name:<36} {c.nodes:>5} {c.acq_per_s:>9.0f} "
            f"{'':>7} {'':>7} {c.handoffs_per_s:>9.1f} {c.gap_ms:>7.2f} "
            f"{c.owner_change:>9.0%} {c.min_share:>9.2f} "
            f"{'yes' if c.correct else 'NO':>7} "
            f"{_ratio(c.handoffs_per_s, spin.get(c.nodes)):>8} "
            f"{_ratio(c.handoffs_per_s, pot_c.get(c.nodes)):>9}"
        )
    lines.append("")
    lines.append(
        "uncontended: cycles/s = acquire + release of a fresh key; median of the reps."
    )
    lines.append(
        "contended: cycles/s = acquisitions/s of 4 processes on one key; handoff = "
        "owner change; gap = previous holder starts release -> next acquire returns; "
        "min share = smallest process's acquisitions / fair share; x floor / "
        "x pottery compare handoffs/s with the raw spin loop / pottery at that "
        "node count."
    )
    for c in contended:
        for error in c.errors:
            lines.append(f"ERROR {c.name} {c.nodes}: {error}")
        if c.failures:
            lines.append(f"note {c.name} {c.nodes}: {c.failures} acquire timeouts")
    return "\n".join(lines)


def _per_round(a: Contended, b: Contended) -> str:
    """``a``'s handoffs/s over ``b``'s, round by round (the rounds interleave)."""
    if len(a.rounds) < 2 or len(a.rounds) != len(b.rounds):
        return ""
    ratios = " / ".join(
        f"{x / y:.2f}" if y else "-" for x, y in zip(a.rounds, b.rounds, strict=True)
    )
    return f"; per round {ratios}x{_stolen(a, b)}"


#: Host steal above this share in a round is named next to its ratio.
NOISY_STEAL = 0.05


def _stolen(a: Contended, b: Contended) -> str:
    """The larger host steal of ``a``'s and ``b``'s runs, round by round, when
    some round had more than ``NOISY_STEAL``: its ratio says little."""
    if len(a.steals) != len(a.rounds) or len(b.steals) != len(b.rounds):
        return ""
    worst = [max(x, y) for x, y in zip(a.steals, b.steals, strict=True)]
    if not any(w >= NOISY_STEAL for w in worst):  # NaN compares False
        return ""
    shown = " / ".join("-" if w != w else f"{w:.0%}" for w in worst)
    return f" (host steal {shown})"


def targets(
    uncontended: list[Uncontended],
    contended: list[Contended],
    slow: SlowNode | None = None,
    paired: Sequence[Paired] = (),
) -> str:
    def u(name: str, n: int) -> float:
        for r in uncontended:
            if r.name == name and r.nodes == n:
                return r.median("cycles_per_s")
        return float("nan")

    def ratio(name: str, baseline: str, n: int) -> tuple[float, str]:
        """The paired ratio where measured (its medians' ratio beside it)."""
        medians = u(name, n) / u(baseline, n)
        for p in paired:
            if (p.name, p.baseline, p.nodes) == (name, baseline, n):
                return p.ratio, f"paired; medians of the runs {medians:.2f}x"
        return medians, "medians of the runs"

    def c(name: str, n: int) -> Contended | None:
        return next((x for x in contended if x.name == name and x.nodes == n), None)

    checks = []
    if uncontended:
        rd5 = u("redlock_django", 5)
        to_floor, how = ratio("redlock_django", "raw floor", 5)
        checks.append(
            (
                f"uncontended 5 nodes >= 0.7x floor ({to_floor:.2f}x, {how})",
                to_floor >= 0.7,
            )
        )
        to_pottery, how = ratio("redlock_django", "pottery Redlock", 5)
        checks.append(
            (
                f"uncontended 5 nodes >= 6x pottery ({to_pottery:.1f}x, {how})",
                to_pottery >= 6,
            )
        )
        to_redis_py, how = ratio("redlock_django", "redis-py Lock", 1)
        checks.append(
            (
                f"uncontended 1 node >= redis-py Lock ({to_redis_py:.2f}x, {how})",
                to_redis_py >= 1,
            )
        )
        explicit, how = ratio("redlock_django nodes=[...]", "redlock_django", 5)
        checks.append(
            (
                f"nodes=[...] within 5% of the settings path, 5 nodes "
                f"({explicit:.2f}x, {how})",
                explicit >= 0.95,
            )
        )
        floor5 = u("raw floor", 5)
        f5 = u("redlock_django fencing", 5)
        # One extra round trip at most: the fenced cycle costs at most the plain cycle
        # plus one more floor round trip (half a floor cycle).
        budget = 1 / rd5 + 0.5 / floor5
        checks.append(
            (
                f"fencing at most one extra round trip (5 nodes: {1000 / f5:.3f} ms vs "
                f"budget {budget * 1000:.3f} ms)",
                1 / f5 <= budget,
            )
        )
    r5, s5, r1, p1 = (
        c("redlock_django", 5),
        c("raw spin loop", 5),
        c("redlock_django", 1),
        c("python-redis-lock", 1),
    )
    if r5 and s5:
        checks.append(
            (
                f"contended 5 nodes handoffs/s >= raw spin ({r5.handoffs_per_s:.0f} vs "
                f"{s5.handoffs_per_s:.0f}{_per_round(r5, s5)})",
                r5.handoffs_per_s >= s5.handoffs_per_s,
            )
        )
        checks.append(
            (f"contended 5 nodes median gap < 1 ms ({r5.gap_ms:.2f} ms)", r5.gap_ms < 1)
        )
    if r1 and p1:
        checks.append(
            (
                f"contended 1 node handoffs/s >= python-redis-lock "
                f"({r1.handoffs_per_s:.0f} vs {p1.handoffs_per_s:.0f}"
                f"{_per_round(r1, p1)})",
                r1.handoffs_per_s >= p1.handoffs_per_s,
            )
        )
    fair5, fair1 = c("redlock_django fair", 5), c("redlock_django fair", 1)
    for x in (r5, r1, fair5, fair1):
        if x and x.attempts:
            per_acq = statistics.mean(x.attempts)
            checks.append(
                (
                    f"{x.name} {x.nodes} node(s): attempts per acquisition <= 1.2 "
                    f"({per_acq:.2f})",
                    per_acq <= 1.2,
                )
            )
    if fair5 and s5:
        checks.append(
            (
                f"fair, 5 nodes: handoffs/s >= 1.5x raw spin "
                f"({fair5.handoffs_per_s:.0f} vs {s5.handoffs_per_s:.0f}"
                f"{_per_round(fair5, s5)}), gap p50 "
                f"< 1 ms ({fair5.gap_ms:.2f} ms)",
                fair5.handoffs_per_s >= 1.5 * s5.handoffs_per_s and fair5.gap_ms < 1,
            )
        )
    if fair1 and p1:
        checks.append(
            (
                f"fair, 1 node: handoffs/s >= python-redis-lock "
                f"({fair1.handoffs_per_s:.0f} vs {p1.handoffs_per_s:.0f}"
                f"{_per_round(fair1, p1)})",
                fair1.handoffs_per_s >= p1.handoffs_per_s,
            )
        )
    for x in (fair5, fair1):
        if x:
            checks.append(
                (
                    f"fair {x.nodes} node(s): min share >= 0.9 ({x.min_share:.2f}), "
                    "counter exact",
                    x.min_share >= 0.9 and x.correct,
                )
            )
    for x in (r5, r1):
        if x:
            checks.append(
                (
                    f"no starvation {x.nodes} node(s): owner change > 50% "
                    f"({x.owner_change:.0%}), min share {x.min_share:.2f}",
                    x.owner_change > 0.5 and x.min_share > 0.5,
                )
            )
            checks.append((f"counter exact {x.nodes} node(s)", x.correct))
    if slow is not None and slow.latencies:
        bound = slow.node_timeout * 1000 + 5
        checks.append(
            (
                f"slow node: acquire p99 {slow.pct(0.99):.1f} ms within NODE_TIMEOUT "
                f"+ 5 ms ({bound:.0f} ms)",
                slow.pct(0.99) <= bound,
            )
        )
    return "\n".join(f"  [{'met' if ok else 'NOT met'}] {text}" for text, ok in checks)


def machine() -> dict[str, str]:
    cpu = "?"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    from harness.nodes import find_redis_server

    version = subprocess.run(
        [find_redis_server(), "--version"], capture_output=True, text=True
    ).stdout.strip()
    import importlib.metadata as md

    peers = {}
    for dist in ("redis", "django-redis", "pottery", "python-redis-lock", "Django"):
        try:
            peers[dist] = md.version(dist)
        except md.PackageNotFoundError:
            peers[dist] = "not installed"
    return {
        "nproc": str(os.cpu_count()),
        "cpu": cpu,
        "redis-server": version,
        "python": platform.python_version(),
        "platform": platform.platform(),
        **peers,
    }


# --- main ---------------------------------------------------------------------------


def configure(urls: Sequence[str]) -> None:
    settings.configure(
        INSTALLED_APPS=["redlock_django"],
        REDLOCK={"NODES": list(urls[:5])},
        CACHES={
            "default": {
                "BACKEND": "django_redis.cache.RedisCache",
                "LOCATION": urls[0],
                "OPTIONS": {"CLIENT_CLASS": "django_redis.client.DefaultClient"},
            }
        },
        USE_TZ=True,
    )
    django.setup()


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description="Benchmark redlock_django against its peers and the raw floors."
    )
    parser.add_argument("--quick", action="store_true", help="about two minutes")
    parser.add_argument("--json", type=Path, help="also write the results here")
    parser.add_argument(
        "--only", choices=("uncontended", "contended"), help="run one half only"
    )
    parser.add_argument(
        "--rounds",
        type=int,
        default=3,
        help="contended: run every contestant this many times, interleaved "
        "(default 3), and pool the rounds",
    )
    args = parser.parse_args(argv)
    if args.rounds < 1:
        parser.error(f"--rounds must be at least 1, not {args.rounds}")
    if args.quick:
        reps, seconds, warmup, contended_seconds = 3, 0.25, 30, 1.5
        paired_seconds = 4.0
    else:
        reps, seconds, warmup, contended_seconds = 5, 0.8, 100, 5.0
        paired_seconds = 10.0

    from harness.nodes import NodeSet

    info = machine()
    print("machine: " + ", ".join(f"{k}={v}" for k, v in info.items()), flush=True)
    with tempfile.TemporaryDirectory(prefix="bench-locks-") as tmp:
        nodes = NodeSet.create(max(NODE_COUNTS), Path(tmp))
        nodes.start_all()
        try:
            configure(nodes.urls)
            ports, urls = nodes.ports, nodes.urls
            uncontended: list[Uncontended] = []
            paired: list[Paired] = []
            contended: list[Contended] = []
            began = time.monotonic()
            if args.only != "contended":
                print(f"uncontended: {reps} reps of {seconds}s per configuration")
                uncontended = run_uncontended(ports, urls, reps, seconds, warmup)
                print(f"paired: {paired_seconds}s per ratio target, blocks of 0.1s")
                paired = run_paired(ports, urls, paired_seconds, warmup)
            if args.only != "uncontended":
                contended = run_contended_rounds(nodes, args.rounds, contended_seconds)
            slow: SlowNode | None = None
            memory: Memory | None = None
            if args.only is None:
                nodes.flush_all()
                slow = run_slow_node(ports, urls, 30 if args.quick else 100)
                nodes.flush_all()
                memory = run_memory(ports, 500, 200)
            print(f"\nran in {time.monotonic() - began:.0f}s\n")
            print(table(uncontended, contended))
            print(extras_report(slow, memory))
            if uncontended or contended:
                print("\nissue 5 and 12 targets (this run):")
                print(targets(uncontended, contended, slow, paired))
            if args.json:
                args.json.write_text(
                    json.dumps(
                        {
                            "machine": info,
                            "quick": args.quick,
                            "slow_node": None if slow is None else asdict(slow),
                            "memory": None if memory is None else asdict(memory),
                            "uncontended": [asdict(r) for r in uncontended],
                            "paired": [{**asdict(p), "ratio": p.ratio} for p in paired],
                            "contended": [
                                {
                                    **asdict(c),
                                    "acq_per_s": c.acq_per_s,
                                    "handoffs_per_s": c.handoffs_per_s,
                                    "min_share": c.min_share,
                                    "correct": c.correct,
                                }
                                for c in contended
                            ],
                        },
                        indent=1,
                    )
                )
        finally:
            nodes.stop_all()
    return 0


if __name__ == "__main__":
    sys.exit(main())
