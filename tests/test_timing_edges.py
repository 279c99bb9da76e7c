"""Timing edges of the algorithm, on real nodes (and with a test clock where the
arithmetic alone shows it): what an attempt concludes when a fencing round
leaves it few replies, and per-lock timing options the settings would refuse.
Each test failed on the code before its fix (an adversarial review): nodes left
unawaited once a quorum answered counted as down after a fencing round (503 with
four live nodes); retry_delay=0 with retry_jitter=0 spun (~1,000 attempts in
0.3 s); a max_hold below the ttl let the first lease outlive the cap.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from typing import Any

import pytest

from harness.held import fence_key
from harness.nodes import NodeSet
from harness.proxy import FaultProxy
from redlock_django import Redlock
from redlock_django.protocol import (
    UNAWAITED,
    Fanout,
    NodeReply,
    Sleep,
    acquire_flow,
)
from redlock_django.scripts import (
    ACQUIRE_SCRIPT,
    EXTEND_SCRIPT,
    FENCE_SCRIPT,
    PTTL_SCRIPT,
    RELEASE_SCRIPT,
)
from tests.test_protocol import FakeClock
from tests.test_protocol import spec as make_spec

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def proxies(nodes: NodeSet) -> Iterator[list[FaultProxy]]:
    for node in nodes:
        with node.client() as client:
            for script in (
                ACQUIRE_SCRIPT,
                RELEASE_SCRIPT,
                EXTEND_SCRIPT,
                FENCE_SCRIPT,
                PTTL_SCRIPT,
            ):
                client.script_load(script.source)
    with contextlib.ExitStack() as stack:
        yield [stack.enter_context(FaultProxy(node.port)) for node in nodes]


def test_nodes_not_waited_for_do_not_count_as_an_outage_after_a_fence_round() -> None:
    """Three nodes granted (the two slower ones not waited for), then one of the
    three missed the fencing write-back: four of five nodes are alive, so the
    attempt is retried within the wait, not reported as a majority outage."""
    clock = FakeClock()
    spec = make_spec(fencing=True)
    flow = acquire_flow(spec, "tok", "{}", 5.0, clock, lambda: 0.5)
    step = flow.send(None)
    assert isinstance(step, Fanout) and step.script is ACQUIRE_SCRIPT
    clock.now += 0.002
    late = NodeReply(error=UNAWAITED)
    step = flow.send([NodeReply(7), NodeReply(1), NodeReply(1), late, late])
    assert isinstance(step, Fanout) and step.script is FENCE_SCRIPT
    clock.now += 0.1
    step = flow.send([NodeReply(1), NodeReply(1), NodeReply(error="timed out")])
    # The clean-up of the failed attempt, then a retry delay: no outage error.
    assert isinstance(step, Fanout) and step.script is RELEASE_SCRIPT
    step = flow.send([NodeReply(1)] * len(step.nodes or ()))
    assert isinstance(step, Sleep)


def test_fenced_acquire_with_two_slow_nodes_and_one_lost_fence_reply_retries(
    redlock_settings: dict[str, Any], nodes: NodeSet, proxies: list[FaultProxy]
) -> None:
    """Real nodes: two nodes answer 150 ms late (a quorum is not kept waiting for
    them), and one fast node's reply to the fencing write-back is held once.
    Nothing is down: the acquisition must retry and win within its 5 s wait."""
    resource = "review-fence-unawaited"
    with nodes[0].client() as client:
        client.set(fence_key(resource), 50)  # tokens disagree: a FENCE round runs
    lock = Redlock(
        resource,
        nodes=[proxy.url for proxy in proxies],
        ttl=10.0,
        node_timeout=0.4,
        fencing=True,
    )
    proxies[3].delay(0.15)
    proxies[4].delay(0.15)
    proxies[2].hold_reply_to(FENCE_SCRIPT.sha.encode(), count=1)
    try:
        assert lock.acquire(timeout=5.0)
        assert lock.fencing_token is not None and lock.fencing_token > 50
    finally:
        proxies[2].release_held_replies()
        for proxy in proxies:
            proxy.pass_through()
        if lock.owned():
            lock.release()


def _evalsha_calls(node: Any) -> int:
    with node.client() as client:
        stats = client.info("commandstats")
    return int(stats.get("cmdstat_evalsha", {}).get("calls", 0))


def test_a_lock_whose_retries_have_no_pause_is_refused_like_the_settings(
    redlock_settings: dict[str, Any], nodes: NodeSet
) -> None:
    """REDLOCK with RETRY_DELAY and RETRY_JITTER both 0 is error redlock.E009
    ("retries would spin without pause"); the same values given to one lock
    must be refused too, not spin against every node for the whole wait."""
    holder = Redlock("review-spin")
    assert holder.acquire(blocking=False)
    try:
        before = _evalsha_calls(nodes[0])
        try:
            lock = Redlock(
                "review-spin", retry_delay=0, retry_jitter=0, reentrant=False
            )
            assert not lock.acquire(timeout=0.3)
        except ValueError:
            return  # refused, as the settings are
        calls = _evalsha_calls(nodes[0]) - before
        pytest.fail(
            f"retry_delay=0, retry_jitter=0 accepted: {calls} attempts hit one "
            "node in a 0.3 s wait"
        )
    finally:
        holder.release()


def test_a_lock_whose_first_lease_outlives_its_max_hold_is_refused_like_the_settings(
    redlock_settings: dict[str, Any], nodes: NodeSet
) -> None:
    """REDLOCK with MAX_HOLD below TTL is error redlock.E009 ("the first lease
    would already outlive the cap"); given to one lock, the same values must be
    refused, not yield a hold that outlives max_hold."""
    try:
        lock = Redlock("review-cap", ttl=3.0, auto_extend=True, max_hold=0.5)
        assert lock.acquire(blocking=False)
    except ValueError:
        return  # refused, as the settings are
    try:
        time.sleep(1.0)
        assert not lock.owned(), (
            f"held past max_hold=0.5: {lock.validity:.2f}s of lease still left"
        )
    finally:
        with contextlib.suppress(Exception):
            lock.release()
