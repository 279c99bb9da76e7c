"""The validity rule, with real clocks and a real network in between.

A lock is granted only if a quorum said yes *and* time is left after the replies
came back: ``validity = ttl - elapsed - (ttl * drift_factor + 2 ms)``, where
``elapsed`` runs from before the first request to after the last reply. The
latency comes from ``harness/proxy.py`` proxies in front of real Redis nodes, and the
"process pause" of Kleppmann's critique is a real SIGSTOP of a child process.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from harness.held import fence_key, lock_key
from harness.nodes import NodeSet
from harness.processes import process_state
from harness.proxy import FaultProxy
from redlock_django import (
    LockLostError,
    QuorumUnavailableError,
    Redlock,
)
from redlock_django.scripts import (
    ACQUIRE_SCRIPT,
    EXTEND_SCRIPT,
    FENCE_SCRIPT,
    PTTL_SCRIPT,
    RELEASE_SCRIPT,
)

pytestmark = pytest.mark.timeout(60)

ROOT = Path(__file__).resolve().parents[1]
PREFIX = "redlock"
DRIFT_FACTOR = 0.01


def drift(ttl: float, drift_factor: float = DRIFT_FACTOR) -> float:
    return ttl * drift_factor + 0.002


@pytest.fixture
def scripts_cached(nodes: NodeSet) -> None:
    """Load the lock's scripts on every node, so EVALSHA never costs a NOSCRIPT trip.

    Under an injected delay, a NOSCRIPT reply would double the round trip and the
    timings below would measure the script cache instead of the validity rule.
    """
    for node in nodes:
        with node.client() as client:
            for script in (
                ACQUIRE_SCRIPT,
                RELEASE_SCRIPT,
                EXTEND_SCRIPT,
                FENCE_SCRIPT,
                PTTL_SCRIPT,
            ):
                assert client.script_load(script.source) == script.sha


@pytest.fixture
def proxies(nodes: NodeSet, scripts_cached: None) -> Iterator[list[FaultProxy]]:
    """One fault proxy in front of each of the five nodes, closed at teardown."""
    with contextlib.ExitStack() as stack:
        yield [stack.enter_context(FaultProxy(node.port)) for node in nodes]


@pytest.fixture
def spawn() -> Iterator[Callable[[dict[str, Any]], subprocess.Popen[str]]]:
    """Start ``_child_acquire`` in a fresh Python process; kill it at teardown."""
    children: list[subprocess.Popen[str]] = []

    def start(args: dict[str, Any]) -> subprocess.Popen[str]:
        env = {
            **os.environ,
            "DJANGO_SETTINGS_MODULE": "tests.settings",
            "PYTHONPATH": str(ROOT),
        }
        child = subprocess.Popen(
            [
                sys.executable,
                "-c",
                "from tests.test_validity import _child_acquire; _child_acquire()",
                json.dumps(args),
            ],
            cwd=ROOT,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        children.append(child)
        return child

    try:
        yield start
    finally:
        for child in children:
            if child.poll() is None:
                child.kill()  # SIGKILL ends a SIGSTOPped process too
            child.communicate(timeout=10)


def _child_acquire() -> None:
    """Run in the child: one non-blocking acquire; print what happened as JSON.

    Besides the outcome, it reports the exception's ``granted`` count: how many
    nodes answered "granted" in the attempt, before the validity check.
    """
    import django

    args = json.loads(sys.argv[1])
    django.setup()
    from redlock_django import LockError
    from redlock_django import Redlock as ChildLock

    lock = ChildLock(
        args["resource"],
        nodes=args["urls"],
        ttl=args["ttl"],
        node_timeout=args["node_timeout"],
        drift_factor=DRIFT_FACTOR,
    )
    report: dict[str, Any] = {"acquired": False, "error": None, "granted": None}
    start = time.monotonic()
    try:
        report["acquired"] = lock.acquire(blocking=False)
    except LockError as exc:
        report.update(
            error=type(exc).__name__,
            message=str(exc),
            granted=exc.granted,
            quorum=exc.quorum,
        )
    report["elapsed"] = time.monotonic() - start
    print(json.dumps(report), flush=True)


def wait_for_state(pid: int, state: str, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while process_state(pid) != state:
        assert time.monotonic() < deadline, f"process {pid} never reached {state!r}"
        time.sleep(0.002)


def holders(nodes: NodeSet, resource: str) -> list[tuple[bytes | None, int]]:
    """Return each node's (token, PTTL in ms) for ``resource``'s lock key."""
    found = []
    for node in nodes:
        with node.client() as client:
            found.append(
                (
                    client.hget(lock_key(resource), "token"),
                    client.pttl(lock_key(resource)),
                )
            )
    return found


def test_validity_is_the_ttl_minus_the_elapsed_time_minus_the_drift(
    redlock_settings: dict[str, Any], proxies: list[FaultProxy]
) -> None:
    """With 30 ms of reply latency, ``validity`` is TTL - elapsed - drift.

    The round trip through the proxies takes at least the delay, so a lock that
    ignored the elapsed time, or the drift (22 ms here), would report more than
    the upper bound; the lower bound is the TTL minus all the time measured
    around the call. The same lock without the delay reports more than the upper
    bound, so the bound measures the latency, not a constant.
    """
    ttl, delay = 2.0, 0.03
    lock = Redlock(
        "latency",
        nodes=[proxy.url for proxy in proxies],
        ttl=ttl,
        node_timeout=0.2,
        drift_factor=DRIFT_FACTOR,
    )
    for proxy in proxies:
        proxy.delay(delay)
    before = time.monotonic()
    assert lock.acquire(blocking=False)
    after = time.monotonic()
    validity = lock.validity
    read = time.monotonic()
    lock.release()

    assert after - before >= delay
    assert validity <= ttl - delay - drift(ttl)
    assert validity >= ttl - (read - before) - drift(ttl)

    # Negative control: without the delay the validity is above that bound.
    for proxy in proxies:
        proxy.pass_through()
    assert lock.acquire(blocking=False)
    fast = lock.validity
    lock.release()
    assert fast > ttl - delay - drift(ttl)


@pytest.mark.timeout(90)
def test_acquisition_whose_replies_arrive_after_the_ttl_is_refused(
    redlock_settings: dict[str, Any],
    nodes: NodeSet,
    proxies: list[FaultProxy],
    spawn: Callable[[dict[str, Any]], subprocess.Popen[str]],
) -> None:
    """A client frozen while its SETs are in flight does not take the lock.

    Kleppmann's scenario: the client's requests land on every node, then the
    client pauses (SIGSTOP) until its keys expired, and another client takes the
    lock. When the first one resumes, it reads five "granted" replies, but
    it reads the clock after them (antirez's answer), finds no validity left,
    refuses the lock, and its clean-up deletes only keys with its own token. The
    reported ``granted`` count is the negative control: a client that only
    counted the replies would have believed it held the lock next to the other.
    """
    resource, ttl = "k-pause", 1.5
    for proxy in proxies:
        proxy.hold_replies()
    child = spawn(
        {
            "resource": resource,
            "urls": [proxy.url for proxy in proxies],
            "ttl": ttl,
            "node_timeout": 1.0,
        }
    )
    for proxy in proxies:
        assert proxy.wait_for_request(30.0, since=0), child.communicate(timeout=10)
    os.kill(child.pid, signal.SIGSTOP)
    wait_for_state(child.pid, "T")

    # The SETs landed: every node holds the child's token, stamped with its pid.
    landed = holders(nodes, resource)
    child_token = landed[0][0]
    assert child_token is not None
    assert all(token == child_token and pttl > 0 for token, pttl in landed)
    with nodes[0].client() as client:
        meta = json.loads(client.hget(lock_key(resource), "meta") or b"{}")
    assert meta["pid"] == child.pid

    # While the child is frozen its lease runs out, and a second client takes over.
    deadline = time.monotonic() + ttl + 5.0
    while any(token is not None for token, _ in holders(nodes, resource)):
        assert time.monotonic() < deadline, "the child's keys never expired"
        time.sleep(0.02)
    second = Redlock(resource, nodes=nodes.urls, ttl=10.0, node_timeout=0.2)
    assert second.acquire(blocking=False)
    second_token = holders(nodes, resource)[0][0]
    assert second_token not in (None, child_token)

    # The old replies reach the frozen child; then it runs again.
    for proxy in proxies:
        proxy.release_replies()
    os.kill(child.pid, signal.SIGCONT)
    out, err = child.communicate(timeout=30)
    assert child.returncode == 0, err
    report = json.loads(out.splitlines()[-1])

    assert report["acquired"] is False
    assert report["error"] == "QuorumUnavailableError"
    assert "too slowly" in report["message"]
    assert report["elapsed"] > ttl
    # Negative control: all five replies said "granted", a quorum is three.
    assert report["granted"] == 5
    assert report["quorum"] == 3
    # The second holder's keys are intact, with its token and its lease.
    for token, pttl in holders(nodes, resource):
        assert token == second_token
        assert pttl > 0
    second.release()


def counter_ahead(nodes: NodeSet, resource: str) -> None:
    """Put node 0's fencing counter ahead of the others': the token an acquisition
    draws there is the highest, and only one node has it, so it is written back."""
    with nodes[0].client() as client:
        client.set(fence_key(resource), 5)


def test_fenced_acquisition_slower_than_its_lease_is_refused(
    redlock_settings: dict[str, Any], nodes: NodeSet, proxies: list[FaultProxy]
) -> None:
    """Two slow round trips (acquire, then fence) use up the lease: not granted.

    One node's counter is ahead, so the token it draws must be written back. Each
    reply comes 180 ms late: the first round leaves validity, so the fence
    round runs and every node confirms it, but by then 360 ms > TTL - drift
    have passed. The lock is refused and nothing of it stays on the nodes but the
    fencing counter, which never goes down.
    """
    ttl, delay = 0.3, 0.18
    lock = Redlock(
        "slow-fence",
        nodes=[proxy.url for proxy in proxies],
        ttl=ttl,
        node_timeout=0.25,
        drift_factor=DRIFT_FACTOR,
        fencing=True,
    )
    counter_ahead(nodes, "slow-fence")
    for proxy in proxies:
        proxy.delay(delay)
    start = time.monotonic()
    with pytest.raises(QuorumUnavailableError, match="too slowly") as info:
        lock.acquire(blocking=False)
    assert time.monotonic() - start >= 2 * delay
    assert info.value.granted == 5  # the fence round was confirmed everywhere
    assert not lock.owned()

    for proxy in proxies:
        proxy.pass_through()
    # By now the 0.3 s lease ran out anyway; the clean-up itself is shown by
    # test_too_slow_fenced_acquisition_deletes_its_keys_before_they_expire.
    time.sleep(ttl)
    assert holders(nodes, "slow-fence") == [(None, -2)] * len(nodes)
    for node in nodes:
        with node.client() as client:
            assert client.get(f"{PREFIX}:fence:slow-fence") == b"6"


def test_unfenced_acquisition_with_one_slow_round_trip_is_granted(
    redlock_settings: dict[str, Any], proxies: list[FaultProxy]
) -> None:
    """The same 180 ms delay grants a lock taken in one round trip.

    The negative control of the test above: the delay alone does not refuse a
    lock, the time two round trips take does. The validity left is what remains
    of the TTL after the round trip and the drift.
    """
    ttl, delay = 0.3, 0.18
    lock = Redlock(
        "slow-plain",
        nodes=[proxy.url for proxy in proxies],
        ttl=ttl,
        node_timeout=0.25,
        drift_factor=DRIFT_FACTOR,
    )
    for proxy in proxies:
        proxy.delay(delay)
    assert lock.acquire(blocking=False)
    validity = lock.validity
    for proxy in proxies:
        proxy.pass_through()
    assert 0 < validity <= ttl - delay - drift(ttl)
    # Released in time or not, the outcome above is what this test is about.
    with contextlib.suppress(LockLostError):
        lock.release()


def test_too_slow_fenced_acquisition_deletes_its_keys_before_they_expire(
    redlock_settings: dict[str, Any], nodes: NodeSet, proxies: list[FaultProxy]
) -> None:
    """A refused acquisition unlocks the nodes itself instead of waiting for expiry.

    One node's counter is ahead (so the fence round runs). Requests are delayed
    by 350 ms and the drift factor is large (0.4, so the drift is 402 ms of a 1 s
    TTL): the acquire round leaves validity, the fence round does not. The keys
    landed 350 ms after the start with a 1 s lease, so they would live until
    1.35 s; the acquire returns after about 1.05 s (three one-way trips) and by
    then they are already gone.
    """
    ttl, delay, drift_factor = 1.0, 0.35, 0.4
    lock = Redlock(
        "slow-cleanup",
        nodes=[proxy.url for proxy in proxies],
        ttl=ttl,
        # Above the 350 ms delay, yet small enough that a reply at the timeout
        # would still leave validity (1.0 - 0.55 - 0.402 > 0), as the lock requires.
        node_timeout=0.55,
        drift_factor=drift_factor,
        fencing=True,
    )
    counter_ahead(nodes, "slow-cleanup")
    for proxy in proxies:
        proxy.delay(0.0, requests=delay)
    start = time.monotonic()
    with pytest.raises(QuorumUnavailableError, match="too slowly"):
        lock.acquire(blocking=False)
    found = holders(nodes, "slow-cleanup")
    checked = time.monotonic() - start
    # The keys landed after the request delay, so without the clean-up they
    # would still be alive now.
    assert checked < delay + ttl, f"too slow to tell ({checked:.3f}s)"
    assert found == [(None, -2)] * len(nodes)
