"""A command written into a network partition never runs after its attempt gave up.

The partition is real: nftables drops this machine's packets to some of the
nodes' ports (on loopback), so the kernel keeps the unacknowledged commands and
retransmits them. Unless the driver resets the connections it gives up on, those
commands reach the nodes once the partition heals: a failed attempt's
``SET NX PX`` lands after its clean-up and holds the lock for a whole TTL for
nobody (the stall seen in the cluster run after "app1 cut from 3 of 5").

Needs root and ``nft``; the rules live in a table of their own that only names
the ports of this test's nodes, removed at teardown.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import subprocess
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import pytest

from harness.held import lock_key
from harness.nodes import NodeSet
from redlock_django import QuorumUnavailableError, Redlock

TABLE = f"redlock_test_{os.getpid()}"
NODE_TIMEOUT = 0.1
# Longer than Linux's first retransmission timeouts (0.2 s, then 0.4 s): what the
# kernel still holds has been sent again at least twice when the partition heals.
PARTITION_SECONDS = 1.0
# After the heal the next retransmission (due within about 1.6 s) is watched for.
WATCH_SECONDS = 3.0


def _nft(*args: str) -> None:
    subprocess.run(["nft", *args], check=True, capture_output=True, text=True)


def _missing() -> str | None:
    if os.geteuid() != 0:
        return "not root"
    if shutil.which("nft") is None:
        return "no nft (Debian's nftables package)"
    try:
        _nft("list", "tables")
    except subprocess.CalledProcessError as exc:
        return f"nft does not work here: {exc.stderr.strip()}"
    return None


@pytest.fixture
def partition() -> Iterator[
    Callable[[Sequence[int]], contextlib.AbstractContextManager[None]]
]:
    """``with partition(ports):`` drops every packet this machine sends to them."""
    why = _missing()
    if why is not None:
        pytest.skip(f"a real partition needs root and nftables: {why}")
    _nft("add", "table", "inet", TABLE)
    _nft(
        "add", "chain", "inet", TABLE, "output",
        "{ type filter hook output priority 0 ; policy accept ; }",
    )  # fmt: skip

    @contextlib.contextmanager
    def cut(ports: Sequence[int]) -> Iterator[None]:
        listed = ", ".join(str(port) for port in ports)
        _nft(
            "add", "rule", "inet", TABLE, "output",
            "ip", "daddr", "127.0.0.1", "tcp", "dport", f"{{ {listed} }}", "drop",
        )  # fmt: skip
        try:
            yield
        finally:
            _nft("flush", "chain", "inet", TABLE, "output")

    try:
        yield cut
    finally:
        _nft("delete", "table", "inet", TABLE)


def _landed(nodes: Sequence[Any], resource: str) -> list[int]:
    """The ports of the nodes that hold ``resource``'s lock key now."""
    found = []
    for node in nodes:
        with node.client() as client:
            if client.exists(lock_key(resource)):
                found.append(node.port)
    return found


def _watch(nodes: Sequence[Any], resource: str) -> list[tuple[float, list[int]]]:
    """Poll the nodes for WATCH_SECONDS; return when and where the key appeared."""
    seen = []
    healed = time.monotonic()
    while time.monotonic() - healed < WATCH_SECONDS:
        found = _landed(nodes, resource)
        if found:
            seen.append((round(time.monotonic() - healed, 2), found))
        time.sleep(0.05)
    return seen


@pytest.fixture
def five(settings: Any, nodes: NodeSet) -> NodeSet:
    settings.REDLOCK = {"NODES": nodes.urls, "NODE_TIMEOUT": NODE_TIMEOUT, "TTL": 10.0}
    return nodes


def test_an_attempt_given_up_in_a_partition_does_not_land_after_the_heal(
    five: NodeSet, partition: Any
) -> None:
    """One attempt, then the process stays idle: nothing settles its connections."""
    lock = Redlock("phantom-idle")
    assert lock.acquire(blocking=False)  # a connection to every node, kept idle
    lock.release()
    cut = list(five)[:3]
    with partition([node.port for node in cut]):
        with pytest.raises(QuorumUnavailableError):
            lock.acquire(blocking=False)
        time.sleep(PARTITION_SECONDS)
    assert _watch(cut, "phantom-idle") == []
    assert lock.acquire(blocking=False)  # and the lock is free for anyone
    lock.release()


def test_attempts_retried_through_a_partition_do_not_land_after_the_heal(
    five: NodeSet, partition: Any
) -> None:
    """A waiter retrying for the whole partition: its given-up connections drop."""
    lock = Redlock("phantom-retried")
    assert lock.acquire(blocking=False)
    lock.release()
    cut = list(five)[:3]
    ports = [node.port for node in cut]
    with partition(ports), pytest.raises(QuorumUnavailableError):
        lock.acquire(timeout=PARTITION_SECONDS)
    assert _watch(cut, "phantom-retried") == []


def test_an_async_attempt_given_up_in_a_partition_does_not_land_after_the_heal(
    five: NodeSet, partition: Any
) -> None:
    async def scenario() -> list[tuple[float, list[int]]]:
        lock = Redlock("phantom-async")
        assert await lock.aacquire(blocking=False)
        await lock.arelease()
        cut = list(five)[:3]
        with partition([node.port for node in cut]):
            with pytest.raises(QuorumUnavailableError):
                await lock.aacquire(blocking=False)
            await asyncio.sleep(PARTITION_SECONDS)
        return await asyncio.to_thread(_watch, cut, "phantom-async")

    assert asyncio.run(scenario()) == []


def _held_on(nodes: Sequence[Any], resource: str) -> list[int]:
    """Poll ``nodes`` for WATCH_SECONDS; the ports still holding the key at the end."""
    deadline = time.monotonic() + WATCH_SECONDS
    while time.monotonic() < deadline and _landed(nodes, resource):
        time.sleep(0.05)
    return _landed(nodes, resource)


def test_a_release_given_up_in_a_partition_runs_after_the_heal(
    five: NodeSet, partition: Any
) -> None:
    """A release cut off from a majority is given up with its commands still
    unacknowledged: they are closed in order, not reset, so the kernel delivers
    them when the partition heals and the keys go then, not a TTL (10 s) later.
    A release only ever deletes its own token's key, so running late is safe."""
    lock = Redlock("late-release")
    assert lock.acquire(blocking=False)
    cut = list(five)[:3]
    with partition([node.port for node in cut]):
        lock.release()  # 2 of 5 answer: not a quorum, the others keep it for now
        time.sleep(PARTITION_SECONDS)
    assert _held_on(cut, "late-release") == []


def test_an_async_release_given_up_in_a_partition_runs_after_the_heal(
    five: NodeSet, partition: Any
) -> None:
    async def scenario() -> list[int]:
        lock = Redlock("late-async-release")
        assert await lock.aacquire(blocking=False)
        cut = list(five)[:3]
        with partition([node.port for node in cut]):
            await lock.arelease()
            await asyncio.sleep(PARTITION_SECONDS)
        return await asyncio.to_thread(_held_on, cut, "late-async-release")

    assert asyncio.run(scenario()) == []
