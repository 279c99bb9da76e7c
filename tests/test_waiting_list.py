"""A lock that is not fair keeps its waiters on a list on the nodes: a release
wakes one of them by name, whichever process it is in, not one of each process.

Each waiter is its own process (``tests/_fair_waiter.py --barging``), so only the
nodes can tell a release whom to wake. The proofs read the ``lock_acquired``
signal's ``attempts`` and ``wakeups`` and the lists' sizes on the nodes, never wall
time: with a 30 s retry delay, every attempt after the first is a wake-up.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from collections.abc import Callable
from typing import Any

import pytest

from harness.nodes import NodeSet
from redlock_django import Redlock
from redlock_django.keys import lock_key, waiting_key
from redlock_django.scripts import ACQUIRE_SCRIPT
from tests._waiting import SLOW_RETRY, result

pytestmark = pytest.mark.django_db(transaction=False)


def _listed(nodes: NodeSet, resource: str) -> list[int]:
    """Per node, how many waiters the resource's waiting list holds."""
    key = waiting_key(resource, "redlock")
    return [node.client().zcard(key) for node in nodes]


def _wait_until(condition: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + 20
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting until {what}")
        time.sleep(0.01)


def _line_up(
    nodes: NodeSet,
    spawn: Callable[..., subprocess.Popen[str]],
    resource: str,
    names: str,
    *extra: str,
) -> list[subprocess.Popen[str]]:
    """One waiter process per name, each on the list of every node and listening
    on the lock's channel there before the next starts."""
    channel = lock_key(resource, "redlock")
    procs = []
    for k, name in enumerate(names, start=1):
        delay = ("--retry-delay", str(SLOW_RETRY))
        procs.append(spawn(name, resource, "--barging", *delay, *extra))
        _wait_until(
            lambda k=k: all(n >= k for n in _listed(nodes, resource)),
            f"{k} waiters are listed on every node",
        )
        _wait_until(
            lambda k=k: all(
                node.client().pubsub_numsub(channel)[0][1] >= k for node in nodes
            ),
            f"{k} waiters listen on every node",
        )
    # The attempt each waiter makes when its subscription is confirmed (it could
    # not hear a release before), refused like its first.
    time.sleep(0.2)
    return procs


def test_a_release_wakes_the_first_listed_waiter_of_all_processes_alone(
    nodes: NodeSet, spawn: Callable[..., Any], hold: Callable[..., Redlock]
) -> None:
    """Four waiter processes on one lock that is not fair: the release wakes the
    first on the list alone, which takes the lock, and its release the next. Woken
    one per process, the other three would each make an attempt that cannot win
    at every release (the last waiter 5 attempts or more, seen on the code
    before the list)."""
    resource, names = "listed:one-at-a-time", "ABCD"
    holder = hold(resource, ttl=60)
    procs = _line_up(nodes, spawn, resource, names)

    holder.release()
    results = [result(proc) for proc in procs]

    assert all(r["event"] == "acquired" for r in results), results
    # Served in the order they were listed: nobody else attempted in between.
    assert [r["name"] for r in sorted(results, key=lambda r: r["at"])] == list(names)
    for r in results:
        assert r["wakeups"] == r["attempts"] - 1, f"a wait ran out: {r}"
        # The first attempt, the one its subscription's confirmation started, and
        # the one it was woken for, which won.
        assert r["attempts"] <= 3, f"woken for a release that was not its: {r}"
    assert _listed(nodes, resource) == [0] * len(nodes), "entries left behind"


def test_a_waiter_that_gives_up_leaves_the_list_at_once(
    nodes: NodeSet, spawn: Callable[..., Any], hold: Callable[..., Redlock]
) -> None:
    """A waiter whose wait runs out takes its entry off every node's list as it
    goes: a release would otherwise name it, and wake nobody."""
    resource = "listed:gives-up"
    hold(resource, ttl=60)
    (proc,) = _line_up(nodes, spawn, resource, "A", "--timeout", "1")
    assert result(proc)["event"] == "gave up"
    assert _listed(nodes, resource) == [0] * len(nodes)


def test_a_waiter_that_took_the_lock_on_its_timer_takes_itself_off_the_list(
    nodes: NodeSet, spawn: Callable[..., Any], hold: Callable[..., Redlock]
) -> None:
    """The lock's keys vanish without a release (as on expiry), so no release
    takes the waiter off: its own grant does, on every node that granted it. It
    leaves no entry for a later release to name, and wake nobody with."""
    resource = "listed:served"
    hold(resource, ttl=60)
    delay, holding = ("--retry-delay", "0.2"), ("--hold", "5")
    (proc,) = _line_up(nodes, spawn, resource, "A", *delay, *holding)
    for node in nodes:
        node.client().delete(lock_key(resource, "redlock"))
    assert proc.stdout is not None
    got = json.loads(proc.stdout.readline())
    assert got["event"] == "acquired" and got["wakeups"] < got["attempts"] - 1, got
    # Looked at while it holds: its own release would take it off as well.
    assert _listed(nodes, resource) == [0] * len(nodes)
    proc.kill()


@pytest.mark.parametrize("fault", ["SIGKILL", "SIGSTOP"])
def test_a_dead_or_frozen_first_waiter_delays_the_next_by_one_retry_at_most(
    fault: str, nodes: NodeSet, spawn: Callable[..., Any], hold: Callable[..., Redlock]
) -> None:
    """The release names the first waiter, killed or frozen, and wakes nobody: the
    second waiter's timed retry (1 s here) finds the lock free. The release took
    the dead waiter off the list, so no later release names it again."""
    resource = "listed:dead"
    holder = hold(resource, ttl=60)
    first, second = _line_up(nodes, spawn, resource, "AB", "--retry-delay", "1")
    os.kill(first.pid, getattr(signal, fault))
    stopped = time.monotonic()
    holder.release()
    got = result(second)
    assert got["event"] == "acquired", got
    assert got["at"] - stopped < 1.0 + 0.5, got["at"] - stopped
    assert _listed(nodes, resource) == [0] * len(nodes)


@pytest.mark.parametrize("off_by_ms", [-3_600_000, 3_600_000, -40])
def test_a_waiters_arrival_is_held_within_100_ms_of_the_nodes_clock(
    nodes: NodeSet, hold: Callable[..., Redlock], off_by_ms: int
) -> None:
    """A refused attempt ranks its waiter by the arrival the client sends, kept
    within 100 ms of the node's clock: a host whose clock is an hour behind is
    not first on every list for good (nor one an hour ahead last), and a
    client a little off keeps its own figure, the same on every node."""
    resource = "listed:skewed"
    hold(resource, ttl=60)
    node = nodes[0].client()
    seconds, micros = node.time()
    now = seconds * 1000 + micros // 1000
    keys = (lock_key(resource, "redlock"), waiting_key(resource, "redlock"))
    arrived = now + off_by_ms
    args = ("other.1", 1000, "{}", f"0123456789abcdef 8000 0 {arrived}")
    node.script_load(ACQUIRE_SCRIPT.source)
    assert node.evalsha(ACQUIRE_SCRIPT.sha, len(keys), *keys, *args) == -1
    [(member, score)] = node.zrange(keys[1], 0, -1, withscores=True)
    assert member == b"0123456789abcdef"
    if abs(off_by_ms) > 100:
        assert abs(score - now) <= 100 + 50, (score, now)
    else:
        assert score == arrived
