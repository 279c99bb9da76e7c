"""The Redlock arithmetic and flows, driven by hand: a fake clock, scripted replies."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from redlock_django.exceptions import (
    LockContentionError,
    LockLostError,
    QuorumUnavailableError,
)
from redlock_django.protocol import (
    LATE,
    Fanout,
    Grant,
    Lease,
    LockSpec,
    NodeReply,
    Sleep,
    acquire_flow,
    behind_for,
    confirm_retry_delay,
    drift,
    extend_flow,
    has_quorum,
    locked_flow,
    quorum,
    release_flow,
    released_on_quorum,
    tolerated_failures,
    unanswered_may_hold,
    validity,
    watchdog_flow,
)
from redlock_django.scripts import (
    ACQUIRE_SCRIPT,
    EXTEND_SCRIPT,
    FENCE_SCRIPT,
    RELEASE_SCRIPT,
)


class FakeClock:
    def __init__(self, now: float = 1000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def spec(n: int = 5, ttl: float = 10.0, fencing: bool = False) -> LockSpec:
    return LockSpec(
        resource="r",
        key="p:lock:r",
        node_names=tuple(f"node{i}" for i in range(n)),
        ttl=ttl,
        drift_factor=0.01,
        retry_delay=0.1,
        retry_jitter=0.2,
        fence_key="p:fence:r" if fencing else None,
    )


def ok(*values: Any) -> list[NodeReply]:
    return [NodeReply(v) for v in values]


Responder = Callable[[Fanout], list[NodeReply]]


def drive(flow: Any, respond: Responder, clock: FakeClock) -> tuple[Any, list[Any]]:
    """Run a flow to its end; Sleep steps advance the clock. Return (result, steps)."""
    steps: list[Any] = []
    reply: Any = None
    while True:
        try:
            step = flow.send(reply)
        except StopIteration as stop:
            return stop.value, steps
        steps.append(step)
        if isinstance(step, Sleep):
            clock.now += step.seconds
            reply = None
        else:
            reply = respond(step)


def test_quorum_is_a_strict_majority() -> None:
    assert [quorum(n) for n in range(1, 8)] == [1, 2, 2, 3, 3, 4, 4]


def test_has_quorum_from_exactly_a_majority_of_the_nodes() -> None:
    """1 of 1, 2 of 3, 3 of 4, 3 of 5 and 4 of 6 are a quorum; one fewer is not."""
    for count, node_count in [(1, 1), (2, 3), (3, 4), (3, 5), (4, 6)]:
        assert has_quorum(count, node_count) and has_quorum(node_count, node_count)
        assert not has_quorum(count - 1, node_count)


def test_unanswered_nodes_may_hold_a_lock_only_as_a_quorum_of_their_own() -> None:
    """3 of 5 silent nodes could hold a lock, 2 could not; of 4 nodes, 2 silent
    cannot (a lock needs 3) though the 2 that answered are no quorum either."""
    assert unanswered_may_hold(3, 5)
    assert not unanswered_may_hold(2, 5)
    assert unanswered_may_hold(3, 4)
    assert not unanswered_may_hold(2, 4)
    assert not has_quorum(4 - 2, 4)
    assert not unanswered_may_hold(0, 3)


def test_validity_subtracts_elapsed_time_and_drift() -> None:
    assert drift(10.0, 0.01) == pytest.approx(0.102)
    assert validity(10.0, 1.5, 0.01) == pytest.approx(10.0 - 1.5 - 0.1 - 0.002)


def test_acquire_succeeds_with_exactly_a_quorum_of_grants() -> None:
    clock = FakeClock()

    def respond(step: Fanout) -> list[NodeReply]:
        assert step.script is ACQUIRE_SCRIPT and step.nodes is None
        clock.now += 0.004
        return ok(0, 0, 0, -1, -1)

    grant, steps = drive(
        acquire_flow(spec(), "tok", "{}", 1.0, clock, lambda: 0.5), respond, clock
    )
    assert len(steps) == 1
    assert grant.granted == (0, 1, 2)
    assert grant.started == 1000.0
    assert grant.valid_until == pytest.approx(1000.0 + 10.0 - 0.102)
    assert grant.fencing_token is None


def test_acquire_sends_token_lease_in_ms_and_metadata() -> None:
    clock = FakeClock()
    seen: list[Fanout] = []

    def respond(step: Fanout) -> list[NodeReply]:
        seen.append(step)
        return ok(0, 0, 0)

    drive(
        acquire_flow(spec(3, ttl=2.5), "tok", '{"a":1}', 0, clock, lambda: 0),
        respond,
        clock,
    )
    assert seen[0].keys == ("p:lock:r",)
    # The given token is a base: attempt 1 writes "<base>.1".
    assert seen[0].args == ("tok.1", 2500, '{"a":1}')


def test_failed_attempt_releases_its_nodes_then_retries_after_jittered_delay() -> None:
    clock = FakeClock()
    attempts: list[Any] = []

    def respond(step: Fanout) -> list[NodeReply]:
        attempts.append(step)
        if step.script is RELEASE_SCRIPT:
            return ok(1, 1, 0, 0, 0)
        if len([s for s in attempts if s.script is ACQUIRE_SCRIPT]) == 1:
            return ok(0, 0, -1, -1, -1)
        return ok(0, 0, 0, 0, -1)

    grant, steps = drive(
        acquire_flow(spec(), "tok", "{}", 5.0, clock, lambda: 0.25), respond, clock
    )
    kinds = [type(s).__name__ if isinstance(s, Sleep) else s.script.name for s in steps]
    assert kinds == ["acquire", "release", "Sleep", "acquire"]
    cleanup = steps[1]
    # Nodes 0 and 1 granted; 2-4 answered "held by another" and wrote nothing.
    assert cleanup.nodes == (0, 1) and cleanup.critical
    # The clean-up names its attempt's token and announces no release: nobody
    # held the lock, and its own waiter must not be woken by it.
    assert cleanup.args == ("tok.1",)
    assert steps[2].seconds == pytest.approx(0.1 + 0.25 * 0.2)
    assert steps[2].wake == "p:lock:r"
    assert grant.granted == (0, 1, 2, 3)


def test_retry_delays_stay_within_delay_and_delay_plus_jitter() -> None:
    for r in (0.0, 0.999999):
        clock = FakeClock()
        flow = acquire_flow(spec(), "tok", "{}", 10.0, clock, lambda r=r: r)
        _, steps = drive_until_sleep(flow, clock)
        assert 0.1 <= steps[-1].seconds <= 0.3


def drive_until_sleep(flow: Any, clock: FakeClock) -> tuple[None, list[Any]]:
    steps: list[Any] = []
    reply: Any = None
    while True:
        step = flow.send(reply)
        steps.append(step)
        if isinstance(step, Sleep):
            return None, steps
        reply = ok(-1, -1, -1, -1, -1)


def test_acquisition_slower_than_the_ttl_is_not_granted() -> None:
    clock = FakeClock()

    def respond(step: Fanout) -> list[NodeReply]:
        if step.script is ACQUIRE_SCRIPT:
            clock.now += 10.5  # every node granted, but too late
            return ok(0, 0, 0, 0, 0)
        return ok(1, 1, 1, 1, 1)

    with pytest.raises(QuorumUnavailableError, match="too slowly") as info:
        drive(acquire_flow(spec(), "tok", "{}", 0, clock, lambda: 0), respond, clock)
    assert info.value.granted == 5


def test_validity_that_runs_out_mid_attempt_by_drift_alone_is_not_granted() -> None:
    clock = FakeClock()

    def respond(step: Fanout) -> list[NodeReply]:
        if step.script is ACQUIRE_SCRIPT:
            clock.now += 10.0 - 0.101  # less than the TTL, more than TTL - drift
            return ok(0, 0, 0)
        return ok(1, 1, 1)

    with pytest.raises(QuorumUnavailableError):
        drive(acquire_flow(spec(3), "tok", "{}", 0, clock, lambda: 0), respond, clock)


def test_majority_of_failed_nodes_fails_fast_with_quorum_error() -> None:
    clock = FakeClock()
    steps: list[Any] = []

    def respond(step: Fanout) -> list[NodeReply]:
        steps.append(step)
        down = NodeReply(error="ConnectionError: refused")
        return [NodeReply(0), NodeReply(0), down, down, down]

    with pytest.raises(QuorumUnavailableError) as info:
        drive(acquire_flow(spec(), "tok", "{}", 60.0, clock, lambda: 0), respond, clock)
    err = info.value
    assert (err.granted, err.nodes, err.quorum) == (2, 5, 3)
    assert set(err.failed) == {"node2", "node3", "node4"}
    assert str(err).startswith(
        "could not acquire 'r': too few nodes answered: 2/5 nodes, quorum 3"
    )
    # the partial lock is cleaned up, and nobody sleeps through a minute-long wait
    assert [s.script for s in steps] == [ACQUIRE_SCRIPT, RELEASE_SCRIPT]
    assert clock.now == 1000.0


def test_wait_running_out_under_contention_raises_contention_error() -> None:
    clock = FakeClock()

    def respond(step: Fanout) -> list[NodeReply]:
        return (
            ok(-1, -1, -1, 0, 0) if step.script is ACQUIRE_SCRIPT else ok(0, 0, 0, 1, 1)
        )

    with pytest.raises(LockContentionError) as info:
        drive(
            acquire_flow(spec(), "tok", "{}", 1.0, clock, lambda: 0.5), respond, clock
        )
    assert info.value.granted == 2 and info.value.quorum == 3
    # the last attempt happens at the deadline, not a retry delay after it
    assert clock.now == pytest.approx(1001.0)


def test_non_blocking_acquire_makes_exactly_one_attempt() -> None:
    clock = FakeClock()
    steps: list[Any] = []

    def respond(step: Fanout) -> list[NodeReply]:
        steps.append(step)
        return ok(-1, -1, -1)

    with pytest.raises(LockContentionError):
        drive(acquire_flow(spec(3), "tok", "{}", 0, clock, lambda: 0), respond, clock)
    # Every node said "held by another": nothing of ours to clean up.
    assert [s.script for s in steps] == [ACQUIRE_SCRIPT]


def test_failed_attempt_cleans_up_only_nodes_that_granted_or_did_not_answer() -> None:
    clock = FakeClock()
    steps: list[Any] = []

    def respond(step: Fanout) -> list[NodeReply]:
        steps.append(step)
        if step.script is ACQUIRE_SCRIPT:
            return [
                NodeReply(0),
                NodeReply(-1),
                NodeReply(error="timed out"),
                NodeReply(-1),
                NodeReply(-1),
            ]
        return ok(1, 0)

    with pytest.raises(LockContentionError):
        drive(acquire_flow(spec(), "tok", "{}", 0, clock, lambda: 0), respond, clock)
    assert [s.script for s in steps] == [ACQUIRE_SCRIPT, RELEASE_SCRIPT]
    assert steps[1].nodes == (0, 2) and steps[1].critical


def test_unlimited_wait_keeps_retrying() -> None:
    clock = FakeClock()
    calls = 0

    def respond(step: Fanout) -> list[NodeReply]:
        nonlocal calls
        if step.script is ACQUIRE_SCRIPT:
            calls += 1
            return ok(0, 0, 0) if calls == 50 else ok(-1, -1, -1)
        return ok(0, 0, 0)

    grant, _ = drive(
        acquire_flow(spec(3), "tok", "{}", None, clock, lambda: 0), respond, clock
    )
    assert calls == 50 and grant.granted == (0, 1, 2)


def test_interrupted_attempt_cleans_up_before_the_interruption_propagates() -> None:
    flow = acquire_flow(spec(3), "tok", "{}", 1.0, FakeClock(), lambda: 0)
    assert flow.send(None).script is ACQUIRE_SCRIPT
    cleanup = flow.throw(KeyboardInterrupt())
    assert cleanup.script is RELEASE_SCRIPT and cleanup.critical
    assert cleanup.args[0] == "tok.1"
    with pytest.raises(KeyboardInterrupt):
        flow.send(ok(1, 0, 0))


def test_each_attempt_writes_and_cleans_up_its_own_token() -> None:
    """Attempt k sends ``<base>.<k>`` and its clean-up releases exactly that token,
    so a late clean-up of attempt k can never delete attempt k+1's key; the grant
    (and so the lease and its release) carries the winning attempt's token."""
    clock = FakeClock()
    steps: list[Fanout] = []

    def respond(step: Fanout) -> list[NodeReply]:
        steps.append(step)
        if step.script is RELEASE_SCRIPT:
            return ok(*([1] * len(step.nodes or ())))
        tries = sum(1 for s in steps if s.script is ACQUIRE_SCRIPT)
        return ok(0, 0, 0, 0, 0) if tries == 3 else ok(0, 0, -1, -1, -1)

    grant, _ = drive(
        acquire_flow(spec(), "base", "{}", 5.0, clock, lambda: 0), respond, clock
    )
    sent = [(s.script.name, s.args[0]) for s in steps]
    assert sent == [
        ("acquire", "base.1"),
        ("release", "base.1"),
        ("acquire", "base.2"),
        ("release", "base.2"),
        ("acquire", "base.3"),
    ]
    assert [s.args for s in steps if s.script is RELEASE_SCRIPT] == [
        ("base.1",),
        ("base.2",),
    ]
    assert (grant.token, grant.attempts) == ("base.3", 3)


def test_interrupted_later_attempt_cleans_up_that_attempts_token() -> None:
    """An interruption during attempt 2 releases ``<base>.2``, not attempt 1's."""
    flow = acquire_flow(spec(3), "base", "{}", 1.0, FakeClock(), lambda: 0)
    assert flow.send(None).args[0] == "base.1"
    assert flow.send(ok(0, -1, -1)).args[0] == "base.1"  # attempt 1's clean-up
    assert isinstance(flow.send(ok(1)), Sleep)
    assert flow.send(None).args[0] == "base.2"
    cleanup = flow.throw(KeyboardInterrupt())
    assert cleanup.script is RELEASE_SCRIPT and cleanup.args[0] == "base.2"
    with pytest.raises(KeyboardInterrupt):
        flow.send(ok(1, 0, 0))


def fenced_grant(*counters: int) -> tuple[Grant, list[Fanout]]:
    """Acquire a fenced spec whose nodes reply ``counters`` (-1: refused)."""
    steps: list[Fanout] = []

    def respond(step: Fanout) -> list[NodeReply]:
        steps.append(step)
        if step.script is ACQUIRE_SCRIPT:
            return [NodeReply(c) for c in counters]
        return ok(*([1] * len(step.nodes or ())))

    grant, _ = drive(
        acquire_flow(spec(fencing=True), "tok", "{}", 0, FakeClock(), lambda: 0),
        respond,
        FakeClock(),
    )
    return grant, steps


def test_fencing_token_is_the_top_counter_written_back_when_few_drew_it() -> None:
    # node 3 refuses: its (higher) counter must not count; only node 1 drew 9
    grant, steps = fenced_grant(7, 9, 4, -1, 8)
    assert grant.fencing_token == 9
    fence = steps[1]
    assert fence.script is FENCE_SCRIPT
    assert fence.nodes == (0, 1, 2, 4)
    assert fence.keys == ("p:lock:r", "p:fence:r")
    assert fence.args == ("tok.1", 9)


def test_fencing_token_drawn_by_a_quorum_needs_no_write_back() -> None:
    grant, steps = fenced_grant(5, 5, -1, 5, 4)
    assert grant.fencing_token == 5
    assert [step.script for step in steps] == [ACQUIRE_SCRIPT]
    assert grant.granted == (0, 1, 3, 4)


def test_fencing_write_back_confirmed_by_a_minority_fails_the_attempt() -> None:
    clock = FakeClock()

    def respond(step: Fanout) -> list[NodeReply]:
        if step.script is ACQUIRE_SCRIPT:
            return ok(1, 2, 1, -1, -1)  # only one drew the top: write it back
        if step.script is FENCE_SCRIPT:
            return [NodeReply(1), NodeReply(0), NodeReply(error="timed out")]
        return ok(1, 1, 1, 0, 0)

    with pytest.raises(LockContentionError) as info:
        drive(
            acquire_flow(spec(fencing=True), "tok", "{}", 0, clock, lambda: 0),
            respond,
            clock,
        )
    assert info.value.granted == 1


def test_a_fair_waiter_behind_others_waits_for_the_first_entry() -> None:
    fair = spec()
    # [code, ticket, entries ahead, ms until the first entry expires]
    behind = ok([-1, 7, 2, 1500], [-1, 7, 1, 900], [-1, 7, 2, 1400], [-2, 7, 0, 0], -1)
    assert behind_for(fair, behind) == 0.9  # the soonest a node reports
    first = ok([-1, 7, 0, 0], [-1, 7, 0, 0], [-1, 7, 2, 800], [-1, 7, 1, 80], -1)
    assert behind_for(fair, first) is None  # only two say someone is ahead
    expired = ok(*([[-2, 7, 1, -40]] * 5))
    assert behind_for(fair, expired) == 0.0  # the first entry is past its life


def lease(valid_until: float) -> Lease:
    return Lease("tok", acquired=1000.0, valid_until=valid_until)


def test_a_failed_confirmation_is_tried_again_within_what_is_left_of_its_lease() -> (
    None
):
    """After a handed-over lease's extension failed: a retry delay (0.1 s plus
    up to 0.2 s of jitter here) while plenty is left, half of what is left when
    that is sooner, never once the lease is over or lost."""
    s = spec()
    assert confirm_retry_delay(s, lease(1002.0), 1000.0, lambda: 0.5) == 0.2
    assert confirm_retry_delay(s, lease(1000.1), 1000.0, lambda: 0.5) == pytest.approx(
        0.05
    )
    assert confirm_retry_delay(s, lease(1000.0), 1000.0, lambda: 0.5) is None
    assert confirm_retry_delay(s, lease(999.0), 1000.0, lambda: 0.5) is None
    gone = lease(1002.0)
    gone.lost = "marked lost"
    assert confirm_retry_delay(s, gone, 1000.0, lambda: 0.5) is None


def test_extend_after_the_lease_ran_out_raises_lost_without_network() -> None:
    clock = FakeClock(2000.0)
    flow = extend_flow(spec(), lease(valid_until=1999.0), 10.0, clock=clock)
    with pytest.raises(LockLostError):
        next(flow)


def test_extend_rejects_a_non_positive_ttl_before_sending() -> None:
    flow = extend_flow(spec(), lease(valid_until=2000.0), 0, clock=FakeClock())
    with pytest.raises(ValueError):
        next(flow)


def test_extend_with_a_quorum_in_time_moves_validity_on() -> None:
    clock = FakeClock()

    def respond(step: Fanout) -> list[NodeReply]:
        assert step.script is EXTEND_SCRIPT and step.args == ("tok", 4000, 1)
        clock.now += 0.01
        return ok(1, 1, 1, 0, 0)

    held = lease(valid_until=1005.0)
    ext, _ = drive(extend_flow(spec(), held, 4.0, clock), respond, clock)
    assert ext.confirmed == 3
    assert ext.valid_until == pytest.approx(1000.0 + 4.0 - drift(4.0, 0.01))
    assert held.valid_until == ext.valid_until and held.extensions == 1


def test_extend_confirmed_by_a_minority_fails() -> None:
    clock = FakeClock()
    held = lease(valid_until=1005.0)
    ext, _ = drive(
        extend_flow(spec(), held, 10.0, clock),
        lambda s: ok(1, 1, 0, 0, 0),
        clock,
    )
    assert ext.valid_until is None and ext.confirmed == 2
    # It may still have landed on some nodes, with a longer lease: no change.
    assert held.valid_until == 1005.0


def test_extend_whose_replies_arrive_after_the_old_lease_ended_fails() -> None:
    clock = FakeClock()

    def respond(step: Fanout) -> list[NodeReply]:
        clock.now += 6.0  # past the old valid_until of 1005
        return ok(1, 1, 1, 1, 1)

    ext, _ = drive(extend_flow(spec(), lease(1005.0), 10.0, clock), respond, clock)
    assert ext.valid_until is None


def test_an_unconfirmed_shorter_extension_shortens_the_lease_to_its_end() -> None:
    """It may have landed on a majority after all: count on its end at most."""
    clock = FakeClock()
    held = lease(valid_until=1009.0)
    ext, _ = drive(
        extend_flow(spec(), held, 2.0, clock), lambda s: ok(1, 1, 0, 0, 0), clock
    )
    assert ext.valid_until is None
    assert held.valid_until == pytest.approx(1000.0 + 2.0 - drift(2.0, 0.01))


def test_each_extension_of_a_lease_carries_the_next_number() -> None:
    """Nodes refuse an extension older than the last they applied, by number."""
    clock = FakeClock()
    held = lease(valid_until=1009.0)
    numbers = []

    def respond(step: Fanout) -> list[NodeReply]:
        numbers.append(step.args[2])
        return ok(1, 1, 1, 1, 1)

    for _ in range(3):
        drive(extend_flow(spec(), held, 10.0, clock), respond, clock)
    assert numbers == [1, 2, 3] and held.extensions == 3


def test_extend_of_a_lease_marked_lost_raises_without_network() -> None:
    held = lease(valid_until=2000.0)
    held.lost = "the watchdog failed"
    with pytest.raises(LockLostError, match="the watchdog failed"):
        next(extend_flow(spec(), held, 10.0, clock=FakeClock()))


def test_release_counts_nodes_that_still_had_our_token() -> None:
    clock = FakeClock()
    down = NodeReply(error="timed out")
    rel, steps = drive(
        release_flow(spec(), "tok"),
        lambda s: [NodeReply(1), NodeReply(1), NodeReply(0), down, NodeReply(1)],
        clock,
    )
    assert rel.released == 3 and rel.failed == {"node3": "timed out"}
    assert steps[0].critical


def test_locked_needs_a_quorum_of_live_keys() -> None:
    clock = FakeClock()
    held, _ = drive(locked_flow(spec()), lambda s: ok(900, 800, 700, -2, -2), clock)
    free, _ = drive(locked_flow(spec()), lambda s: ok(900, 800, -2, -2, -2), clock)
    assert held is True and free is False


def test_locked_checks_again_when_only_the_clients_lateness_left_it_undecided() -> None:
    clock = FakeClock()
    late = NodeReply(error=f"{LATE}: looked 90 ms after its deadline")
    answers = iter(
        [
            [NodeReply(900), late, late, late, NodeReply(-2)],
            ok(900, 800, 700, -2, -2),
        ]
    )
    flow = locked_flow(spec(), 1.0, clock, lambda: 0.5)
    held, steps = drive(flow, lambda s: next(answers), clock)
    assert held is True
    assert [type(step) for step in steps] == [Fanout, Sleep, Fanout]


def test_locked_gives_up_when_the_wait_ends_and_at_once_on_a_real_outage() -> None:
    clock = FakeClock()
    late = NodeReply(error=f"{LATE}: looked 90 ms after its deadline")
    down = NodeReply(error="timed out")
    started = clock.now

    def always_late(step: Any) -> list[NodeReply]:
        return [NodeReply(900), late, late, late, NodeReply(-2)]

    with pytest.raises(QuorumUnavailableError, match="ran late"):
        drive(locked_flow(spec(), 1.0, clock, lambda: 0.5), always_late, clock)
    assert 1.0 <= clock.now - started < 1.5
    flow = locked_flow(spec(), 1.0, clock, lambda: 0.5)
    next(flow)
    with pytest.raises(QuorumUnavailableError, match="too few nodes answered"):
        flow.send([NodeReply(900), down, down, down, NodeReply(-2)])


def test_watchdog_extends_about_a_third_into_each_lease() -> None:
    clock = FakeClock()
    s = spec(3, ttl=3.0)
    lease = Lease("tok", acquired=1000.0, valid_until=1000.0 + 3.0 - drift(3.0, 0.01))
    flow = watchdog_flow(s, lease, None, clock, lambda: 0)
    step = next(flow)
    assert isinstance(step, Sleep)
    assert step.seconds == pytest.approx(1.0 - drift(3.0, 0.01))
    clock.now += step.seconds
    ext = flow.send(None)
    assert ext.script is EXTEND_SCRIPT
    step = flow.send(ok(1, 1, 0))
    assert isinstance(step, Sleep)
    assert lease.valid_until == pytest.approx(clock.now + 3.0 - drift(3.0, 0.01))
    assert lease.lost is None


def test_watchdog_marks_the_lease_lost_when_no_extension_lands_in_time() -> None:
    clock = FakeClock()
    s = spec(3, ttl=3.0)
    lease = Lease("tok", acquired=1000.0, valid_until=1000.0 + 2.9)

    def respond(step: Fanout) -> list[NodeReply]:
        clock.now += 0.05
        return [
            NodeReply(1),
            NodeReply(error="timed out"),
            NodeReply(error="timed out"),
        ]

    drive(watchdog_flow(s, lease, None, clock, lambda: 0), respond, clock)
    assert lease.lost is not None
    assert clock.now >= 1000.0 + 2.9


def test_watchdog_stops_extending_at_max_hold() -> None:
    clock = FakeClock()
    s = spec(3, ttl=3.0)
    lease = Lease("tok", acquired=1000.0, valid_until=1000.0 + 2.9)
    extensions: list[Fanout] = []

    def respond(step: Fanout) -> list[NodeReply]:
        extensions.append(step)
        return ok(1, 1, 1)

    drive(watchdog_flow(s, lease, 7.0, clock, lambda: 0), respond, clock)
    assert lease.lost is None
    assert lease.valid_until <= 1000.0 + 7.0
    assert len(extensions) >= 3
    assert extensions[-1].args[1] < 3000  # the last lease was shortened to the cap


# A client that ran late (issue 10, hole 8): its own delay is not an outage.


def late(detail: str = "52 ms after its deadline") -> NodeReply:
    """The reply a driver gives for a node it could not wait for fairly."""
    return NodeReply(error=f"{LATE}: {detail}")


def test_a_client_that_ran_late_retries_instead_of_reporting_an_outage() -> None:
    """Three of five replies missing only because the client itself resumed late
    are no evidence that nodes are down: the attempt is cleaned up and retried,
    and the retry wins."""
    clock = FakeClock()
    attempts = iter([[NodeReply(0), NodeReply(0), late(), late(), late()]])

    def respond(step: Fanout) -> list[NodeReply]:
        clock.now += 0.06
        if step.script is RELEASE_SCRIPT:
            return [NodeReply(1)] * len(step.nodes or range(5))
        return next(attempts, ok(0, 0, 0, 0, 0))

    grant, steps = drive(
        acquire_flow(spec(), "tok", "{}", 20.0, clock, lambda: 0), respond, clock
    )
    assert grant.attempts == 2
    assert [type(s).__name__ for s in steps] == ["Fanout", "Fanout", "Sleep", "Fanout"]
    # The late attempt is cleaned up everywhere: its writes may have landed.
    assert steps[1].script is RELEASE_SCRIPT and steps[1].nodes == (0, 1, 2, 3, 4)
    # Validity is still counted from the winning attempt's own start.
    assert grant.started == pytest.approx(1000.0 + 0.06 * 2 + 0.1)


def test_late_attempts_until_the_wait_ends_raise_contention_not_an_outage() -> None:
    """When every attempt of the wait was late, the caller gets
    LockContentionError saying the client ran late, never QuorumUnavailableError
    (a 503 claiming the nodes are down)."""
    clock = FakeClock()

    def respond(step: Fanout) -> list[NodeReply]:
        clock.now += 0.06
        if step.script is RELEASE_SCRIPT:
            return [NodeReply(1)] * len(step.nodes or range(5))
        return [NodeReply(0), NodeReply(error="timed out"), late(), late(), late()]

    with pytest.raises(LockContentionError) as info:
        drive(acquire_flow(spec(), "tok", "{}", 1.0, clock, lambda: 0), respond, clock)
    assert not isinstance(info.value, QuorumUnavailableError)
    assert "ran late" in str(info.value)
    assert clock.now >= 1001.0


def test_a_non_blocking_late_attempt_raises_contention() -> None:
    """A single attempt (no wait) that was late is not an outage either."""
    clock = FakeClock()

    def respond(step: Fanout) -> list[NodeReply]:
        if step.script is RELEASE_SCRIPT:
            return [NodeReply(1)] * len(step.nodes or range(5))
        return [NodeReply(0), late(), late(), late(), late()]

    with pytest.raises(LockContentionError) as info:
        drive(acquire_flow(spec(), "tok", "{}", 0, clock, lambda: 0), respond, clock)
    assert not isinstance(info.value, QuorumUnavailableError)


def test_a_majority_that_really_failed_fails_fast_even_if_the_client_was_late() -> None:
    """Lateness excuses only the replies it concerns: three nodes that timed out
    or refused (a real majority) still raise QuorumUnavailableError at once."""
    clock = FakeClock()
    steps: list[Any] = []

    def respond(step: Fanout) -> list[NodeReply]:
        steps.append(step)
        if step.script is RELEASE_SCRIPT:
            return [NodeReply(1)] * len(step.nodes or range(5))
        down = NodeReply(error="timed out")
        return [late(), down, down, NodeReply(error="ConnectionError: refused"), late()]

    with pytest.raises(QuorumUnavailableError) as info:
        drive(acquire_flow(spec(), "tok", "{}", 60.0, clock, lambda: 0), respond, clock)
    assert len(info.value.failed) == 5
    assert [s.script for s in steps] == [ACQUIRE_SCRIPT, RELEASE_SCRIPT]
    assert clock.now == 1000.0


def test_release_judges_the_lease_lost_when_too_few_nodes_still_had_it() -> None:
    """A first release that finds our token on fewer than a quorum says the lock
    was lost; a retry (its first try deleted the keys) and a full release do not."""
    clock = FakeClock()
    down = NodeReply(error="timed out")
    replies = [NodeReply(1), NodeReply(0), NodeReply(0), down, NodeReply(0)]
    held = lease(valid_until=2000.0)
    first, _ = drive(
        release_flow(spec(), "tok", lease=held, clock=clock), lambda s: replies, clock
    )
    retry, _ = drive(
        release_flow(spec(), "tok", lease=held, clock=clock, retry=True),
        lambda s: replies,
        clock,
    )
    full, _ = drive(
        release_flow(spec(), "tok", lease=held, clock=clock),
        lambda s: ok(1, 1, 1, 0, 0),
        clock,
    )
    assert first.lost == "only 1/5 nodes still held it (1 did not answer)"
    assert retry.lost is None and full.lost is None


def test_release_judges_a_lease_marked_lost_or_run_out_lost() -> None:
    """The lease's own loss comes first; a lease past its validity when the
    release ends ran out while held, whatever the nodes answered."""
    clock = FakeClock(1000.0)
    marked = lease(valid_until=2000.0)
    marked.lost = "the watchdog failed"
    gone, _ = drive(
        release_flow(spec(), "tok", lease=marked, clock=clock),
        lambda s: ok(1, 1, 1, 1, 1),
        clock,
    )
    late = lease(valid_until=999.5)
    ran_out, _ = drive(
        release_flow(spec(), "tok", lease=late, clock=clock),
        lambda s: ok(1, 1, 1, 1, 1),
        clock,
    )
    assert gone.lost == "the watchdog failed"
    assert ran_out.lost == "its lease ran out 0.500s before release"


def test_release_on_fewer_than_a_quorum_of_nodes_is_short() -> None:
    """A release counts as done on a quorum from ``quorum(N)`` deleted keys on."""
    clock = FakeClock()
    down = NodeReply(error="timed out")
    short, _ = drive(
        release_flow(spec(), "tok"), lambda s: [*ok(1, 1, 0, 0), down], clock
    )
    enough, _ = drive(release_flow(spec(), "tok"), lambda s: ok(1, 1, 1, 0, 0), clock)
    assert not released_on_quorum(spec(), short)
    assert released_on_quorum(spec(), enough)


@pytest.mark.parametrize(
    ("nodes", "tolerated"), [(1, 0), (2, 0), (3, 1), (4, 1), (5, 2), (7, 3)]
)
def test_tolerated_failures_is_what_the_quorum_leaves(nodes, tolerated):
    """An even count tolerates no more failures than one node fewer would."""
    assert tolerated_failures(nodes) == tolerated


# A fair lock's hand-off: the grant a majority of a release's messages makes.


def _waiting(attempt: int, started: float) -> Any:
    from redlock_django.protocol import _Place

    place = _Place("w")
    place.attempt, place.started = attempt, started
    return place


def test_a_hand_off_of_the_last_attempt_by_a_majority_is_a_grant() -> None:
    from redlock_django.protocol import _handed

    clock = FakeClock(1000.5)
    # Nodes 0-2 handed attempt 3 over; their keys end 0.3 s + 1.5 s, 0.3 s + 1.2 s
    # and 0.3 s + 1.8 s after the attempt's start: valid until the majority-th
    # (3rd) latest of them, 1.5 s, less the drift allowance on that span.
    messages = {0: "3 1500 300", 1: "3 1200 300", 2: "3 1800 300"}
    grant = _handed(spec(), _waiting(3, 1000.0), "base", messages, clock)
    assert grant is not None and grant.handed
    assert grant.token == "base.3" and grant.granted == (0, 1, 2)
    assert grant.started == 1000.5
    assert grant.valid_until == pytest.approx(1000.0 + 1.5 - drift(1.5, 0.01))
    assert grant.fencing_token is None


def test_a_fenced_hand_off_takes_the_least_token_of_the_nodes_counted() -> None:
    from redlock_django.protocol import _handed

    messages = {0: "2 1500 0 7", 2: "2 1500 0 9", 4: "2 1500 0 8"}
    grant = _handed(spec(fencing=True), _waiting(2, 1000.0), "b", messages, FakeClock())
    assert grant is not None and grant.fencing_token == 7
    # A node that sent no token cannot be counted for a fenced lock.
    messages[4] = "2 1500 0"
    assert (
        _handed(spec(fencing=True), _waiting(2, 1000.0), "b", messages, FakeClock())
        is None
    )


@pytest.mark.parametrize(
    "messages",
    [
        {0: "3 1500 0", 1: "3 1500 0"},  # a minority
        {0: "2 1500 0", 1: "2 1500 0", 2: "2 1500 0"},  # an earlier attempt
        {0: "3 1500 0", 1: "3 1500 0", 2: "2 1500 0", 3: "x"},  # mixed, unreadable
        {0: "3 100 0", 1: "3 100 0", 2: "3 100 0"},  # ran out before it was read
    ],
    ids=["minority", "earlier-attempt", "mixed", "run-out"],
)
def test_a_hand_off_that_makes_no_majority_of_the_last_attempt_is_no_grant(
    messages: dict[int, str],
) -> None:
    from redlock_django.protocol import _handed

    clock = FakeClock(1000.2)
    assert _handed(spec(), _waiting(3, 1000.0), "base", messages, clock) is None
