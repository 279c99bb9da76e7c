"""The Redlock algorithm, written once for the sync and the asyncio drivers.

Each flow is a generator that yields *steps* (``Fanout``: run a script on nodes;
``Sleep``) and receives the replies; it never does I/O, never sleeps and never reads
the clock except through the ``clock`` it is given. ``sync.py`` and ``aio.py`` run the
same flows, so quorum, validity, drift, retries and fencing live only here.

Timeline of one acquisition attempt (spec: redis.io "Distributed Locks with Redis")::

    start = clock()                        before the first byte is sent
    Fanout(ACQUIRE) to all N nodes         one round trip, nodes in parallel
    elapsed = clock() - start              after the last reply (or node timeout)
    validity = ttl - elapsed - (ttl * drift_factor + 2 ms)
    granted >= N // 2 + 1 and validity > 0  -> held until start + ttl - drift
    otherwise Fanout(RELEASE) to all N nodes, Sleep(delay + jitter), try again

Attempt k of one acquisition writes its own token, ``<base>.<k>``, and its clean-up
releases only that token: a clean-up delayed in the network can then never delete
the key a later attempt counted toward its quorum.

One idea, read top to bottom (steps, arithmetic, then the acquire, extend, release,
locked and watchdog flows), hence over 500 lines: splitting it would scatter the
algorithm again.
"""

from __future__ import annotations

import dataclasses
import hashlib
import time
from collections.abc import Callable, Generator, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from .exceptions import (
    LockContentionError,
    LockError,
    LockLostError,
    QuorumUnavailableError,
)
from .scripts import (
    ACQUIRE_SCRIPT,
    DEQUEUE_SCRIPT,
    ENQUEUE_SCRIPT,
    EXTEND_SCRIPT,
    FAIR_ACQUIRE_SCRIPT,
    FENCE_SCRIPT,
    PTTL_SCRIPT,
    QUEUED_RELEASE_SCRIPT,
    RELEASE_SCRIPT,
    WITHDRAW_SCRIPT,
    Script,
)

#: Redis expires keys with millisecond precision; the spec adds 2 ms to the drift.
EXPIRE_PRECISION = 0.002
#: The error of a node whose reply was not waited for: a quorum had already won.
UNAWAITED = "not waited for: a quorum had answered"
#: The start of the error of a node whose reply a driver could not wait for fairly:
#: the client itself ran late (a busy event loop, a starved thread), so the missing
#: reply says nothing about the node. Such failures never count towards an outage.
LATE = "client ran late"
#: A look at the replies more than this share of NODE_TIMEOUT after the deadline
#: means the client itself was late: the nodes it did not hear are marked ``LATE``.
#: Half a timeout: far above the scheduling noise of a loaded host (a few ms), far
#: below the stalls (a blocked loop, a starved thread) that made healthy nodes look
#: dead.
LATE_SLACK = 0.5
#: The error of a node that did not answer within NODE_TIMEOUT (``nodes.describe``'s
#: word for a timeout, and the drivers' for a node still silent at the deadline).
TIMED_OUT = "timed out"
#: Least time given to the other nodes once a quorum decided a fan-out.
_GRACE = 0.001
#: Seconds a fair lock's queue entry lives unless its waiter refreshes it (every
#: third of it): a waiter that died or froze holds its place no longer than this.
#: The default of ``REDLOCK["QUEUE_LIFE"]`` (``LockSpec.queue_life``).
QUEUE_LIFE = 2.0
#: How long after the first entry's expiry a waiter behind it tries again.
BEHIND_SLACK = 0.01


def grace(elapsed: float) -> float:
    """Return how long a fan-out still waits once ``need`` winning replies arrived.

    Healthy nodes answer within a few round trips of each other, so twice the
    ``elapsed`` time of the fan-out (at least ``_GRACE``): only a slow or hung node
    is left behind.
    """
    return max(_GRACE, 2 * elapsed)


Clock = Callable[[], float]
Random = Callable[[], float]


class NodeReply(NamedTuple):
    """One node's answer to a script: its value, or why it gave none.

    A named tuple: drivers make one per node per fan-out, the hottest allocation.
    """

    value: Any = None
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None


# Fanout, Sleep, Grant and Release are made several times a lock cycle: plain slotted
# dataclasses, whose construction costs half a frozen one's (treat them as values).
@dataclass(slots=True)
class Fanout:
    """Run ``script`` on the given nodes (all when ``nodes`` is None) at once.

    ``critical`` steps are clean-ups a driver must finish even while the caller is
    being cancelled, or a partial lock would be left behind until its lease ends.
    """

    script: Script
    keys: tuple[str, ...]
    args: tuple[str | int, ...]
    nodes: tuple[int, ...] | None = None
    critical: bool = False
    #: A driver may stop waiting once ``need`` nodes answered with a value that
    #: ``wins`` accepts: the outcome is known, and a slow node then costs nothing.
    #: The nodes not waited for reply ``UNAWAITED``.
    need: int = 0
    wins: Callable[[Any], bool] | None = None


def granted(value: Any) -> bool:
    """An ACQUIRE reply that grants the lock (the fencing counter, >= 0)."""
    return isinstance(value, int) and value >= 0


def refused(value: Any) -> bool:
    """An ACQUIRE reply that wrote no lock: held by another (-1), not our turn in a
    fair queue (-2), or either with the ticket the refusal queued us with."""
    if isinstance(value, list) and value:
        value = value[0]
    return isinstance(value, int) and value in (-1, -2)


def queued_with(value: Any) -> int | None:
    """The ticket a FAIR_ACQUIRE refusal queued the waiter with, if it did."""
    if isinstance(value, list) and len(value) >= 2 and _ticketed(value[1]):
        return int(value[1])
    return None


def behind_for(spec: LockSpec, replies: Replies) -> float | None:
    """When a majority of FAIR_ACQUIRE refusals put another waiter ahead of this
    one: the seconds until that first entry expires unless refreshed (the
    soonest any node reports). None when this waiter may be first in line."""
    left = [
        r.value[3]
        for r in replies
        if isinstance(r.value, list) and len(r.value) >= 4 and r.value[2] >= 1
    ]
    if len(left) < spec.quorum:
        return None
    return max(0.0, float(min(left))) / 1000


def confirmed(value: Any) -> bool:
    """A FENCE or EXTEND reply that confirms our token still holds the key."""
    return isinstance(value, int) and value == 1


def released(value: Any) -> bool:
    """A RELEASE reply that deleted our key (1 + the subscribers told)."""
    return isinstance(value, int) and value >= 1


@dataclass(slots=True)
class Sleep:
    """Wait before the next attempt.

    With ``wake`` (a lock key) a driver may end the wait early when a release of
    that key is announced; the flow simply tries again.
    """

    seconds: float
    wake: str | None = None
    #: The waiter's id (a fair lock's, or one on a lock's waiting list): a
    #: release that names another waiter passes it by.
    waiter: str | None = None
    #: Clock time of the attempt this wait follows: a release announced after it
    #: and before the driver started listening still ends the wait at once.
    since: float | None = None


Step = Fanout | Sleep
Replies = Sequence[NodeReply]
Flow = Generator[Step, Any, Any]


@dataclass(slots=True)
class LockSpec:
    """What one lock needs to know: its keys, its nodes and its timing.

    Never changed once made (configs share it across threads), but not frozen: a
    frozen dataclass's ``__init__`` sets each field through ``object.__setattr__``,
    which doubled what a new key's spec cost (one per fresh resource).
    """

    resource: str
    key: str
    node_names: tuple[str, ...]
    ttl: float
    drift_factor: float
    retry_delay: float
    retry_jitter: float
    #: Key of the fencing counter; None when the lock takes no fencing token.
    fence_key: str | None = None
    #: A fair lock's queue keys (entries, their expiries, tickets), else None.
    queue: tuple[str, str, str] | None = None
    #: Seconds a queue entry lives unless its waiter refreshes it.
    queue_life: float = QUEUE_LIFE
    #: A fair lock's channel head: a waiter is woken on this followed by its
    #: process's tag (``wake_channel``); "" wakes on the lock key's channel.
    wake_head: str = ""
    #: A fair lock's hand-off records (what a release needs to hand the lock to a
    #: waiter), and whether its releases hand over (``HANDOFF``).
    records: str = ""
    handoff: bool = False
    #: A lock that is not fair: the key of its waiting list, so that a release
    #: wakes one waiter by name (``scripts._WAITING``); "" without wake-ups.
    waiting: str = ""
    #: The majority of the nodes, computed once (every step of a flow reads it).
    quorum: int = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        self.quorum = quorum(len(self.node_names))

    @property
    def node_count(self) -> int:
        return len(self.node_names)


@dataclass(slots=True)
class Grant:
    """A successful acquisition."""

    #: The winning attempt's token (``<base>.<attempt>``): the lease's token.
    token: str
    #: Monotonic time just before the winning attempt was sent.
    started: float
    #: Monotonic time after which the lease may have run out on a quorum.
    valid_until: float
    granted: tuple[int, ...]
    fencing_token: int | None = None
    #: Attempts made, and waits between them that a release cut short.
    attempts: int = 1
    wakeups: int = 0
    #: Handed over by the previous holder's release (a fair lock): ``valid_until``
    #: is then the handed lease's, short of the TTL until it is extended.
    handed: bool = False


@dataclass(frozen=True)
class Extension:
    """The outcome of an extension: ``valid_until`` is set only when it worked."""

    confirmed: int
    valid_until: float | None
    failed: dict[str, str] = field(default_factory=dict)


@dataclass(slots=True)
class Release:
    """The outcome of a release: how many nodes still had our token and dropped it."""

    released: int
    failed: dict[str, str] = field(default_factory=dict)
    #: Per node, how many subscribers heard the release (0 where not released).
    listeners: tuple[int, ...] = ()
    #: Why the lock was lost while held, or None: the verdict ``release_flow``
    #: reaches when given the lease.
    lost: str | None = None


@dataclass
class Lease:
    """A held lock as its holder sees it; the watchdog moves ``valid_until`` on."""

    token: str
    #: Monotonic time the lock was granted at.
    acquired: float
    valid_until: float
    fencing_token: int | None = None
    #: Why the lease was lost (an extension failed or it ran out), else None.
    lost: str | None = None
    #: Extensions sent so far; each carries the next number (``extend_flow``).
    extensions: int = 0


def quorum(node_count: int) -> int:
    """Return how many nodes make a majority."""
    return node_count // 2 + 1


def tolerated_failures(node_count: int) -> int:
    """Return how many of ``node_count`` nodes can fail with locks still granted."""
    return node_count - quorum(node_count)


def has_quorum(count: int, node_count: int) -> bool:
    """Return whether ``count`` of ``node_count`` nodes are at least a quorum.

    ``count`` is whatever was counted: nodes that answered (a lock can be taken), or
    nodes holding a lock's token (the lock is held, not a leftover).
    """
    return count >= quorum(node_count)


def unanswered_may_hold(unanswered: int, node_count: int) -> bool:
    """Return whether a lock may still be held on nodes that did not answer.

    It may when the ``unanswered`` of ``node_count`` nodes are a quorum on their own:
    whoever read or released the others cannot say that the lock is free or gone.
    """
    return has_quorum(unanswered, node_count)


def drift(ttl: float, drift_factor: float) -> float:
    """Return the clock-drift allowance for a lease of ``ttl`` seconds."""
    return ttl * drift_factor + EXPIRE_PRECISION


def validity(ttl: float, elapsed: float, drift_factor: float) -> float:
    """Return the seconds a lease still guarantees after ``elapsed`` seconds."""
    return ttl - elapsed - drift(ttl, drift_factor)


def retry_delay(spec: LockSpec, rand: Random) -> float:
    """Return a random delay in [retry_delay, retry_delay + retry_jitter]."""
    return spec.retry_delay + rand() * spec.retry_jitter


def ttl_ms(ttl: float) -> int:
    """Return a lease in whole milliseconds (at least 1: PEXPIRE 0 deletes)."""
    return max(1, int(ttl * 1000))


def release_id(token: str, attempt: int = 0) -> str:
    """Name one release in its wake-up message: a short hash, never the token.

    BLAKE2b, half the time of SHA-256 on a token: one is made for every release."""
    digest = hashlib.blake2b(token.encode(), digest_size=6).hexdigest()
    return f"{digest}.{attempt}" if attempt else digest


def waiter_id(token: str) -> str:
    """Name an acquisition in a fair lock's queue, or on a lock's waiting list: a
    short hash, never the token.

    ``token`` is the acquisition's base or any of its attempts' tokens. A base
    that ends in ``~<tag>`` (the waiting process's tag, see ``wake.process_tag``)
    gives ``<hash>:<tag>``: a release that names this waiter publishes on that
    process's channel only (``wake_channel``).
    """
    base = token.rsplit(".", 1)[0] if "." in token else token
    digest = hashlib.sha256(f"waiter:{base}".encode()).hexdigest()[:16]
    _, _, tag = base.rpartition("~")
    return f"{digest}:{tag}" if "~" in base and tag else digest


def wake_channel(spec: LockSpec, waiter: str) -> str:
    """The channel on which a release that names ``waiter`` reaches it."""
    _, _, tag = waiter.partition(":")
    return spec.wake_head + tag if tag and spec.wake_head else spec.key


def _failed(spec: LockSpec, replies: Replies, nodes: Sequence[int]) -> dict[str, str]:
    failed: dict[str, str] = {}
    for i, reply in zip(nodes, replies, strict=True):
        if reply.error is not None:
            failed[spec.node_names[i]] = reply.error
    return failed


def _all_silent(spec: LockSpec, failed: dict[str, str]) -> bool:
    """Whether no node answered at all: every one timed out.

    Five independent masters do not fall silent at once; a host too busy to let
    any of them run (its CPU, or a VM's, given to others) looks just like that.
    Such an attempt is tried once more before the nodes are called down; a node
    that refused the connection, or a minority that did answer, is evidence.
    """
    return len(failed) == spec.node_count and all(
        why == TIMED_OUT for why in failed.values()
    )


def _error(
    cls: type[LockError],
    spec: LockSpec,
    why: str,
    granted: int,
    failed: dict[str, str],
    action: str = "acquire",
) -> LockError:
    message = (
        f"could not {action} {spec.resource!r}: {why}: "
        f"{granted}/{spec.node_count} nodes, quorum {spec.quorum}"
    )
    if failed:
        index = {name: i for i, name in enumerate(spec.node_names)}
        reasons = "; ".join(
            f"node[{index.get(name, '?')}] {name}: {reason}"
            for name, reason in failed.items()
        )
        message += f" (failed: {reasons})"
    return cls(
        message,
        resource=spec.resource,
        granted=granted,
        nodes=spec.node_count,
        quorum=spec.quorum,
        failed=failed,
    )


def attempt_token(base: str, attempt: int) -> str:
    """Return the token attempt number ``attempt`` (from 1) of an acquisition writes.

    Each attempt has its own token so that a late clean-up of one attempt cannot
    delete a key a later attempt counted; ACQUIRE parses the number after the last
    dot to let a later attempt take over an earlier one's leftover key.
    """
    return f"{base}.{attempt}"


def _cleanup(
    spec: LockSpec, token: str, nodes: tuple[int, ...] | None = None
) -> Fanout:
    """Undo a failed attempt (its own ``token``) on ``nodes`` (all by default).

    It announces nothing (no release id): nobody held the lock, so no waiter can
    win because of it, and its own waiter would be woken by it and retry at once,
    thousands of times a second, instead of sleeping its retry delay.
    """
    return Fanout(RELEASE_SCRIPT, (spec.key,), (token,), nodes=nodes, critical=True)


def acquire_flow(
    spec: LockSpec,
    token: str,
    meta: str,
    wait: float | None,
    clock: Clock,
    rand: Random,
    defer: float = 0.0,
) -> Generator[Step, Any, Grant]:
    """Acquire ``spec`` on a quorum, retrying for up to ``wait`` seconds.

    ``token`` is a random base: attempt k writes ``attempt_token(token, k)``, and
    the grant carries the winning attempt's token. ``wait`` 0 makes a single
    attempt; None retries without limit. Raises ``LockContentionError`` when the
    wait runs out while others hold the lock, and ``QuorumUnavailableError`` at
    once when too few nodes answer to ever make a quorum (an outage: waiting would
    not help), or when the wait runs out while nodes answer too slowly for any
    validity to be left. "At once" is after one attempt, or two when the first
    heard no node at all (``_all_silent``) and may wait.

    A node whose reply the driver marks ``LATE`` (the client itself resumed too
    late to judge it) is not counted as failed for the outage rule: only replies
    that really failed can make ``QuorumUnavailableError``. An attempt that missed
    the quorum because of lateness is retried while the wait lasts; when the wait
    runs out on one, ``LockContentionError`` says the client ran late (HTTP 423,
    "try again"), since nothing showed that a majority is down.

    A fair lock (``spec.queue``) that must wait takes a place in its queue (its
    first refused attempt draws the ticket, else ``_take_place``), keeps it fresh
    while it waits, and leaves it if it gives up.
    """
    every = tuple(range(spec.node_count))
    fenced: tuple[str, ...] = (spec.key,)
    if spec.fence_key is not None:
        fenced = (spec.key, spec.fence_key)
    script, keys = ACQUIRE_SCRIPT, fenced
    place = None if spec.queue is None else _Place(waiter_id(token))
    if place is not None and spec.queue is not None:
        keys = (spec.key, *spec.queue, spec.records, *fenced[1:])
        script = FAIR_ACQUIRE_SCRIPT
    record: tuple[str, ...] = ("1",) if spec.handoff else ()
    # A waiter of a lock that is not fair goes on its waiting list when refused.
    waiter = waiter_id(token) if spec.waiting and place is None and wait != 0 else ""
    listed = False  # refused once: on the list of some node
    listing = arrived = ""
    if waiter:
        keys = (*fenced, spec.waiting)
        listing = f"{waiter} {waiting_life(spec)}"
        # Its place on the list, not a duration: a stamp the same on every node
        # and comparable between hosts, so the wall clock (the nodes hold it to
        # within 100 ms of theirs); nothing is timed with it.
        arrived = str(time.time_ns() // 1_000_000)
    lease = ttl_ms(spec.ttl)
    deadline = None if wait is None else clock() + wait
    if defer > 0 and wait != 0 and place is None:
        # This owner just released the lock while others waited: let one of them
        # take it before trying again, or a busy owner would starve the rest. (A
        # fair lock's queue already refuses it while others wait ahead.)
        yield Sleep(defer if wait is None else min(defer, wait))
    attempt = wakeups = 0
    silent_before = False  # the last attempt heard no node at all
    try:
        while True:
            attempt += 1
            mine = attempt_token(token, attempt)
            extra: tuple[Any, ...] = ()
            queueing = False
            if place is not None:
                # The first attempt that may wait also takes a place if refused;
                # once it has one, each attempt refreshes it.
                queueing = place.ticket is None and wait != 0
                if queueing:
                    extra = (place.waiter, ttl_ms(spec.queue_life), 0, *record)
                    place.ticket = 0  # from here on, giving up must leave
                elif place.ticket:
                    life = ttl_ms(spec.queue_life)
                    extra = (place.waiter, life, place.ticket, *record)
                else:
                    extra = (place.waiter, 0, 0, *record)
            elif waiter:
                extra = (f"{listing} {int(listed)} {arrived}",)
            start = clock()
            if place is not None:
                place.attempt, place.started = attempt, start
                place.cleaned = ()
            # From the attempt's write to its grant or clean-up, whatever stops
            # the flow (an interruption thrown in at a step, or raised by a signal
            # handler in this code) first unlocks every node: a key left behind
            # would keep others off until its lease ends. A clean-up cut short
            # is sent again in full.
            try:
                replies: Replies = yield Fanout(
                    script,
                    keys,
                    (mine, lease, meta, *extra),
                    need=spec.quorum,
                    wins=granted,
                )
                # A generator, not a list comprehension: on Python 3.13 a signal
                # handler's exception raised in one here escaped this try, its
                # clean-up never sent (tests/test_back_edges.py).
                won = tuple(
                    i for i, r in zip(every, replies, strict=True) if granted(r.value)
                )
                failed = _failed(spec, replies, every)
                left = validity(spec.ttl, clock() - start, spec.drift_factor)
                fencing_token = None
                if len(won) >= spec.quorum and left > 0 and spec.fence_key is not None:
                    # Each granting node raised its counter by one: the token is
                    # the highest. Once a majority's counters are at it, every later
                    # majority meets one of them and draws past it; when fewer
                    # granting nodes reached it, it is written back to them first.
                    drawn = tuple(replies[i].value for i in won)  # see ``won``
                    fencing_token = max(drawn)
                    if drawn.count(fencing_token) < spec.quorum:
                        confirms: Replies = yield Fanout(
                            FENCE_SCRIPT,
                            fenced,
                            (mine, fencing_token),
                            nodes=won,
                            need=spec.quorum,
                            wins=confirmed,
                        )
                        failed.update(_failed(spec, confirms, won))
                        won = tuple(
                            i
                            for i, r in zip(won, confirms, strict=True)
                            if confirmed(r.value)
                        )
                        left = validity(spec.ttl, clock() - start, spec.drift_factor)
                if len(won) >= spec.quorum and left > 0:
                    valid_until = start + spec.ttl - drift(spec.ttl, spec.drift_factor)
                    return Grant(
                        mine, start, valid_until, won, fencing_token, attempt, wakeups
                    )

                # Failed attempt: unlock every node that may hold our key: those
                # that granted, and those that did not answer (the write may have
                # landed and only its reply been lost). A node that answered "held
                # by another" (-1) or "not your turn" (-2, a fair lock) wrote
                # nothing, so under plain contention a failed try costs one round
                # trip, not two.
                suspect = tuple(
                    i
                    for i, r in zip(every, replies, strict=True)
                    if not r.ok or not refused(r.value)
                )
                if suspect:
                    if place is not None:
                        # A release may hand this attempt the lock on a node whose
                        # reply was late; this clean-up then deletes it there
                        # (before or after the hand-off): those nodes never count
                        # for one.
                        place.cleaned = suspect
                    yield _cleanup(spec, mine, suspect)
            except GeneratorExit:
                raise
            except BaseException:
                yield _cleanup(spec, mine)
                raise
            if waiter and not listed:
                # Refused: on that node's list (one that did not answer may have
                # listed it too; a release that names it there wakes nobody).
                listed = any(r.ok and refused(r.value) for r in replies)
            if place is not None:
                tickets = [t for t in map(queued_with, (r.value for r in replies)) if t]
                if queueing:
                    yield from _settle_place(spec, place, tickets, clock)
                elif place.ticket and tickets.count(place.ticket) >= spec.quorum:
                    # This attempt refreshed the entry.
                    place.placed_at = start
                    place.refresh_at = start + spec.queue_life / 3
            most = spec.node_count - spec.quorum
            # A client late for the replies is no evidence of an outage; nor is a
            # node left unawaited once a quorum answered (the fencing round's
            # failures may come on top of those) while a retry can still tell.
            last = wait == 0 or (deadline is not None and clock() >= deadline)
            down = sum(
                1
                for why in failed.values()
                if not why.startswith(LATE) and (last or why != UNAWAITED)
            )
            silent = _all_silent(spec, failed)
            # All silent: a busy host looks just like that; not called an outage
            # before a second attempt is (row 29 of docs/reliability.md).
            if down > most and (wait == 0 or not silent or silent_before):
                raise _error(
                    QuorumUnavailableError,
                    spec,
                    "too few nodes answered",
                    len(won),
                    failed,
                )
            silent_before = silent
            now = clock()
            if deadline is not None and now >= deadline:
                if len(won) >= spec.quorum:
                    why = f"nodes answered too slowly for a {spec.ttl:g}s lease"
                    raise _error(QuorumUnavailableError, spec, why, len(won), failed)
                if len(failed) > most:
                    why = "the client ran late for the nodes' replies (a busy process)"
                elif wait:
                    why = "held by another owner"
                else:
                    why = "held by another owner, no wait"
                raise _error(LockContentionError, spec, why, len(won), failed)
            delay = retry_delay(spec, rand)
            later = None  # the try time without the cap, should the first live on
            if place is not None and (ahead := behind_for(spec, replies)) is not None:
                # Someone is ahead in the queue: it must take the lock before this
                # waiter can, and the release that lets this one in wakes it. Only
                # the first in line retries at the retry delay (a holder that died
                # is found by its retries); this one checks again when its entry
                # is due for a refresh (the attempt refreshes it), or just after
                # the first entry expires if that one stopped being refreshed.
                due = place.refresh_at - now if place.ticket else spec.queue_life / 3
                delay = max(delay, min(due, ahead + BEHIND_SLACK))
                if ahead > 0:
                    # Never past that expiry, though the retry delay may be longer
                    # than an entry's life: behind one that died it would be waited
                    # out. An entry already expired (a holder's own, unrefreshed
                    # while it holds) is no reason to retry sooner: the release
                    # wakes this waiter. Each refresh of this waiter's entry
                    # moves the cap on while that entry is refreshed too.
                    if ahead + BEHIND_SLACK < delay:
                        later = now + delay
                    delay = min(delay, ahead + BEHIND_SLACK)
            if deadline is not None:
                delay = min(delay, deadline - now)
                if later is not None:
                    later = min(later, deadline)
            if place is None:
                # A driver answers a wait with True when a release ended it early;
                # one it heard since this attempt started ends it at once.
                woken = yield Sleep(delay, spec.key, waiter or None, start)
            else:
                woken = yield from _wait_in_queue(
                    spec, place, now + delay, start, clock, later
                )
            if woken:
                wakeups += 1
            if isinstance(woken, dict) and place is not None:
                # A release handed the lock over with its wake-up: no attempt.
                handed = _handed(spec, place, token, woken, clock)
                if handed is not None:
                    return dataclasses.replace(
                        handed, attempts=attempt, wakeups=wakeups
                    )
    except GeneratorExit:
        raise
    except BaseException:
        if place is not None and place.ticket is not None:
            yield _leave(spec, place, token)
        elif listed:
            yield _withdraw(spec, waiter)
        raise


def waiting_life(spec: LockSpec) -> int:
    """How long (ms) a lock's waiting list lives after its last refusal: longer
    than any waiter sleeps between attempts, which renew it."""
    return ttl_ms(4 * max(spec.queue_life, spec.retry_delay + spec.retry_jitter))


def _withdraw(spec: LockSpec, waiter: str) -> Fanout:
    """Take a waiter that gives up off the lock's waiting list on every node."""
    keys = (spec.key, spec.waiting)
    args = (waiter, release_id(f"left {waiter}"))
    return Fanout(WITHDRAW_SCRIPT, keys, args, critical=True)


@dataclass
class _Place:
    """A waiter's place in a fair lock's queue."""

    waiter: str
    #: The ticket it holds on a quorum; None before it asked for one. 0 while a
    #: draw failed: it asks again after its next attempt.
    ticket: int | None = None
    #: Clock time its entry must be refreshed by.
    refresh_at: float = 0.0
    #: Clock time of the last write of its entry that a quorum confirmed: when it
    #: started (a refresh, an attempt), or when a draw's replies came.
    placed_at: float = 0.0
    #: The number of the waiter's last attempt, and the clock time it started:
    #: a hand-off names the attempt whose refusal it follows, and its lease
    #: counts from that start.
    attempt: int = 0
    started: float = 0.0
    #: The nodes where that attempt's own clean-up ran: a hand-off there may be
    #: deleted by it, so it is not counted (``_handed``).
    cleaned: tuple[int, ...] = ()


def _handed(
    spec: LockSpec, place: _Place, token: str, handed: dict[int, str], clock: Clock
) -> Grant | None:
    """The grant a release's hand-off makes, or None when it makes none.

    ``handed`` is each node's message: ``<attempt> <lease ms> <ms since the
    refusal> [<fencing token>]``. A node's key lives at least until the start of
    that attempt plus the two (the node refused it after it started). Only a
    hand-off of the waiter's last attempt counts: a later attempt may have taken
    the handed key over, and its clean-up deleted it. Nor does one on a node where
    that attempt's own clean-up ran (its reply was late or lost: the clean-up
    deletes the handed key whenever it lands). Counted are the nodes that name
    that attempt, if a quorum do: the lock is valid until
    the quorum-th latest of their keys ends, less the drift allowance. The fencing
    token is the least of theirs: every one of them is past the previous holder's,
    and every later majority meets one of these nodes (docs/fairness.md).
    """
    parsed: dict[int, tuple[int, ...]] = {}
    for index, message in handed.items():
        try:
            parsed[index] = tuple(int(part) for part in message.split())
        except ValueError:
            continue
    attempt, start = place.attempt, place.started
    nodes = tuple(
        sorted(
            i
            for i, fields in parsed.items()
            if len(fields) >= 3 and fields[0] == attempt and i not in place.cleaned
        )
    )
    if len(nodes) < spec.quorum:
        return None
    fencing_token = None
    if spec.fence_key is not None:
        fences = [parsed[i][3] for i in nodes if len(parsed[i]) >= 4]
        if len(fences) < len(nodes):
            return None
        fencing_token = min(fences)
    ends = sorted(((parsed[i][1] + parsed[i][2]) / 1000 for i in nodes), reverse=True)
    life = ends[spec.quorum - 1]
    valid_until = start + life - drift(life, spec.drift_factor)
    now = clock()
    if valid_until <= now:
        return None
    return Grant(
        attempt_token(token, attempt),
        now,
        valid_until,
        nodes,
        fencing_token,
        handed=True,
    )


def _ticketed(value: Any) -> bool:
    """An ENQUEUE reply: the ticket the entry was written with."""
    return isinstance(value, int) and value > 0


def _enqueue(
    spec: LockSpec, place: _Place, ticket: int, report: bool = False
) -> Fanout:
    """ENQUEUE on every node; ``report``: reply with the place in line too."""
    assert spec.queue is not None
    # With the hand-off records: entries it drops as expired lose theirs too.
    keys = (*spec.queue, spec.records) if spec.records else spec.queue
    args: tuple[Any, ...] = (place.waiter, ticket, ttl_ms(spec.queue_life))
    return Fanout(
        ENQUEUE_SCRIPT,
        keys,
        (*args, "1") if report else args,
        need=spec.quorum,
        wins=_placed if report else _ticketed,
    )


def _placed(value: Any) -> bool:
    """An ENQUEUE reply with the place in line: the entry was written."""
    return queued_with(value) is not None


def _take_place(
    spec: LockSpec, place: _Place, clock: Clock
) -> Generator[Step, Any, None]:
    """Draw a ticket and queue with it on every node.

    Each node in a majority draws one (INCR) and queues the waiter with it; the
    waiter takes the highest and, unless they all agree, writes it on every node,
    raising their counters to it (one round trip saved in the common case, where
    every node saw the same draws). Any later draw meets
    one of those nodes, so a waiter that queued before another started comes
    first on every node where both are; equal tickets are ordered by waiter id.
    """
    place.ticket = 0
    drawn: Replies = yield _enqueue(spec, place, 0)
    tickets = [r.value for r in drawn if _ticketed(r.value)]
    yield from _settle_place(spec, place, tickets, clock)


def _settle_place(
    spec: LockSpec, place: _Place, tickets: list[int], clock: Clock
) -> Generator[Step, Any, None]:
    """Keep the highest of the ``tickets`` a majority drew (see ``_take_place``)."""
    if len(tickets) < spec.quorum:
        return
    top = max(tickets)
    if min(tickets) < top:
        # The nodes disagree (draws raced): raise the lower ones to the highest.
        # When a majority drew the same ticket, each of them already holds the
        # entry with it and a counter at it: the waiter has arrived.
        written: Replies = yield _enqueue(spec, place, top)
        if sum(1 for r in written if _ticketed(r.value)) < spec.quorum:
            return
    place.ticket = top
    place.placed_at = clock()
    place.refresh_at = place.placed_at + spec.queue_life / 3


def _leave(spec: LockSpec, place: _Place, token: str) -> Fanout:
    """Take a waiter that gives up out of the queue on every node, at once, with
    any lock a release handed to it (a key holding its ``token`` base)."""
    assert spec.queue is not None
    keys = (*spec.queue[:2], spec.key, spec.records)
    args = (
        place.waiter,
        release_id(f"left {place.waiter}"),
        spec.wake_head,
        f"{token}.",
    )
    return Fanout(DEQUEUE_SCRIPT, keys, args, critical=True)


def _wait_in_queue(
    spec: LockSpec,
    place: _Place,
    try_at: float,
    since: float,
    clock: Clock,
    later: float | None = None,
) -> Generator[Step, Any, Any]:
    """Queue (if not yet), then wait until ``try_at`` or a release that names us.

    The entry is refreshed whenever it is due during the wait. ``try_at`` capped
    at the expiry of the first entry, ahead of ours, is moved on to that entry's
    new expiry (up to ``later``, the uncapped time) when a refresh finds it
    refreshed. A refresh overdue enough that the entry may have lapsed ends the
    wait instead, as does one that reaches a majority again only after the
    entry may have lapsed. Returns whether a wake-up ended the wait.
    """
    if not place.ticket:
        yield from _take_place(spec, place, clock)
    while True:
        nap = try_at - clock()
        if place.ticket:
            nap = min(nap, place.refresh_at - clock())
        channel = wake_channel(spec, place.waiter)
        woken = yield Sleep(max(0.0, nap), channel, place.waiter, since)
        if woken:
            return woken  # True, or the nodes' hand-off messages
        if clock() >= try_at:
            return False  # the attempt refreshes the entry too
        if place.ticket and clock() >= place.refresh_at + spec.queue_life / 3:
            # The refresh is overdue by a third of the entry's life (this process
            # was frozen, or starved of CPU): the entry may have lapsed, and a
            # release passed it by with the lock free. An attempt finds out, and
            # queues this waiter again if it must wait; one that does not refresh
            # the entry on a quorum leaves it to the next refresh, not to another
            # attempt at once.
            place.refresh_at = clock() + spec.queue_life / 3
            return False
        if place.ticket and clock() >= place.refresh_at:
            began = clock()
            replies = yield _enqueue(spec, place, place.ticket, later is not None)
            place.refresh_at = clock() + spec.queue_life / 3
            written = _placed if later is not None else _ticketed
            if sum(1 for r in replies if r.ok and written(r.value)) >= spec.quorum:
                lapsed = began >= place.placed_at + spec.queue_life * 2 / 3
                place.placed_at = began
                if lapsed:
                    # The refreshes before this one reached no majority (the
                    # nodes were cut off): the entry may have lapsed meanwhile,
                    # and a release passed it by with the lock free.
                    return False
            if later is not None:
                ahead = behind_for(spec, replies)
                if ahead is not None and ahead > 0:
                    try_at = min(later, clock() + ahead + BEHIND_SLACK)


def extend_flow(
    spec: LockSpec, lease: Lease, ttl: float, clock: Clock
) -> Generator[Step, Any, Extension]:
    """Reset the lease to ``ttl`` seconds on every node that still has our token.

    It counts only if a quorum confirms before the current lease runs out; a lease
    that already ran out (or was lost) raises ``LockLostError`` without any network
    call, because reviving it could overlap a holder that came in between. The
    flow updates ``lease.valid_until`` itself, so that it always reflects the lease
    the nodes applied last. Extensions of one hold must not overlap (the caller
    runs one at a time); each is numbered, and nodes refuse one older than the last
    they applied, so a late one never replaces a later lease. One that a quorum did
    not confirm may still have landed: the lease can only shrink to its end then.
    """
    if ttl <= 0:
        raise ValueError(f"ttl must be a positive number of seconds, not {ttl!r}")
    if validity(ttl, 0.0, spec.drift_factor) <= 0:
        # Sent, it would cut the lease on every node to a time that no reply,
        # however fast, could confirm: the lock would be gone.
        raise ValueError(
            f"ttl ({ttl}s) is within the clock drift allowance "
            f"({drift(ttl, spec.drift_factor):.3f}s): no reply could confirm it"
        )
    start = clock()
    if lease.lost is not None or start >= lease.valid_until:
        why = lease.lost or "its lease already ran out"
        raise LockLostError(
            f"cannot extend {spec.resource!r}: {why}",
            resource=spec.resource,
            nodes=spec.node_count,
            quorum=spec.quorum,
        )
    lease.extensions += 1
    every = tuple(range(spec.node_count))
    ends = start + ttl - drift(ttl, spec.drift_factor)
    try:
        replies: Replies = yield Fanout(
            EXTEND_SCRIPT,
            (spec.key,),
            (lease.token, ttl_ms(ttl), lease.extensions),
            need=spec.quorum,
            wins=confirmed,
        )
    except BaseException:
        # Interrupted or cancelled with the command sent: the nodes may have
        # applied it, so a shorter lease holds from now on, as for an
        # unconfirmed one.
        lease.valid_until = min(lease.valid_until, ends)
        raise
    now = clock()
    confirms = sum(1 for r in replies if confirmed(r.value))
    failed = _failed(spec, replies, every)
    fresh = validity(ttl, now - start, spec.drift_factor)
    if confirms >= spec.quorum and fresh > 0 and now < lease.valid_until:
        lease.valid_until = ends
        return Extension(confirms, ends, failed)
    lease.valid_until = min(lease.valid_until, ends)
    return Extension(confirms, None, failed)


def release_flow(
    spec: LockSpec,
    token: str,
    *,
    lease: Lease | None = None,
    clock: Clock | None = None,
    retry: bool = False,
) -> Generator[Step, Any, Release]:
    """Delete our token's key on every node; keys of other tokens are left alone.

    Given the ``lease`` (and a ``clock``), the outcome also says whether the lock
    was lost while held: the lease was marked lost, ran out before the release
    ended, or, on a first try (not a ``retry``, which finds the keys its first
    try deleted), fewer than a quorum of nodes still had our token.
    """
    if lease is not None and clock is None:
        raise ValueError("release_flow needs a clock to judge a lease")
    every = tuple(range(spec.node_count))
    keys: tuple[str, ...] = (spec.key,)
    args: tuple[str, ...] = (token, release_id(token))
    script = RELEASE_SCRIPT
    if spec.waiting:
        # Names the first waiter on the list: only that one is woken.
        keys = (spec.key, spec.waiting)
    if spec.queue is not None:
        # Also takes our entry out of the queue, and names the next waiter to its
        # process alone.
        script, keys = QUEUED_RELEASE_SCRIPT, (spec.key, *spec.queue[:2])
        args = (*args, waiter_id(token), spec.wake_head)
        if spec.handoff:
            # Hands the lock to that waiter if it left a record (QUEUED_RELEASE):
            # a fenced one is handed a token past this holder's.
            keys = (*keys, spec.records)
            mine = None if lease is None else lease.fencing_token
            if spec.fence_key is not None and mine is not None:
                keys = (*keys, spec.fence_key)
            args = (*args, "-" if mine is None else str(mine))
    replies: Replies = yield Fanout(
        script,
        keys,
        args,
        critical=True,
        need=spec.quorum,
        wins=released,
    )
    # A node that deleted our key answers 1 + the subscribers it woke. (One loop:
    # every release runs this, and a generator per figure cost a cycle more.)
    heard: list[int] = []
    done = 0
    for reply in replies:
        value = reply.value
        if released(value):
            done += 1
            heard.append(value - 1)
        else:
            heard.append(0)
    listeners = tuple(heard)
    failed = _failed(spec, replies, every)
    lost = None
    if lease is not None and clock is not None:
        lost = _lost_at_release(spec, lease, clock(), done, len(failed), retry)
    return Release(done, failed, listeners, lost)


def _lost_at_release(
    spec: LockSpec, lease: Lease, now: float, done: int, failed: int, retry: bool
) -> str | None:
    """Why a lease just released was lost while held, or None if it was not."""
    if lease.lost is not None:
        return lease.lost
    if now >= lease.valid_until:
        return f"its lease ran out {now - lease.valid_until:.3f}s before release"
    if not retry and done + failed < spec.quorum:
        # Nodes that answered no longer had our token: it was force-released,
        # evicted, or lost in a restart, so another holder may have come in.
        return (
            f"only {done}/{spec.node_count} nodes still held it "
            f"({failed} did not answer)"
        )
    return None


def released_on_quorum(spec: LockSpec, outcome: Release) -> bool:
    """Return whether a release deleted our key on at least a quorum of nodes.

    When it did not, and the lease was not lost, the other nodes did not answer (or
    a retry found the keys its first try deleted): their keys expire with the lease.
    """
    return outcome.released >= spec.quorum


def locked_flow(
    spec: LockSpec,
    wait: float | None = 0.0,
    clock: Clock | None = None,
    rand: Random | None = None,
) -> Generator[Step, Any, bool]:
    """Return whether anyone holds the lock on a quorum of nodes.

    Too few answers to decide raise ``QuorumUnavailableError``. When the nodes not
    heard from were only ``LATE`` (the client itself was late: a busy loop), the
    check is made again after a retry delay while ``wait`` lasts (None: without
    limit), as an acquisition would be; so is a first check that heard no node at
    all (``_all_silent``).
    """
    every = tuple(range(spec.node_count))
    most = spec.node_count - spec.quorum
    deadline = None if wait is None or clock is None else clock() + wait
    silent_before = False
    while True:
        replies: Replies = yield Fanout(PTTL_SCRIPT, (spec.key,), ())
        # -1: a key without a TTL, which no lock writes: another's value, which an
        # acquisition is refused by too.
        held = sum(1 for r in replies if r.ok and (r.value > 0 or r.value == -1))
        failed = _failed(spec, replies, every)
        if held >= spec.quorum or len(failed) <= most:
            return held >= spec.quorum
        down = sum(1 for why in failed.values() if not why.startswith(LATE))
        silent = _all_silent(spec, failed)
        # The wait is over (or there is none): no look again.
        over = clock is None or (deadline is not None and clock() >= deadline)
        if down > most and (over or rand is None or not silent or silent_before):
            why = "too few nodes answered"
            break
        if over or rand is None:
            why = "the client ran late for the nodes' replies (a busy process)"
            break
        silent_before = silent
        yield Sleep(retry_delay(spec, rand))
    raise _error(QuorumUnavailableError, spec, why, held, failed, "check")


def confirm_retry_delay(
    spec: LockSpec, lease: Lease, now: float, rand: Random
) -> float | None:
    """After a handed-over lease's extension failed: seconds until the next try
    (a retry delay, or half of what is left of the lease if sooner), or None
    once the lease is lost or over and no try could keep it."""
    left = lease.valid_until - now
    if lease.lost is not None or left <= 0:
        return None
    return min(retry_delay(spec, rand), left / 2)


def watchdog_delay(lease: Lease, ttl: float, now: float) -> float:
    """Return how long to wait before extending: about a third into each lease."""
    return max(0.0, lease.valid_until - now - ttl * 2 / 3)


def watchdog_flow(
    spec: LockSpec, lease: Lease, max_hold: float | None, clock: Clock, rand: Random
) -> Generator[Step, Any, None]:
    """Keep ``lease`` alive until the flow is stopped, the hold cap or a loss.

    The flow sleeps until a third of the lease has passed, then extends it; a failed
    extension is retried after a retry delay while validity is left. It marks the
    lease lost when validity runs out without a confirmed extension. With
    ``max_hold`` the last extensions are shortened so the lock ends by then. A
    lease its owner extended meanwhile is extended only when a third of *it* has
    passed: the watchdog never shortens a lease (``max_hold`` caps its own
    extensions, not the owner's).
    """
    while lease.lost is None:
        yield Sleep(watchdog_delay(lease, spec.ttl, clock()))
        if watchdog_delay(lease, spec.ttl, clock()) > 0:
            # The owner extended the lease meanwhile (extend(), maybe longer than
            # the TTL): extending now would shorten it.
            continue
        ttl, last = spec.ttl, False
        if max_hold is not None:
            cap = lease.acquired + max_hold - clock()
            if cap <= spec.ttl:
                # One last, shorter lease ends the hold at the cap; one too short to
                # outlast the drift is not worth a round trip.
                if cap <= spec.retry_delay + drift(spec.ttl, spec.drift_factor):
                    return
                if clock() + cap - drift(cap, spec.drift_factor) <= lease.valid_until:
                    return  # the owner's own extension already runs past the cap
                ttl, last = cap, True
        try:
            extension = yield from extend_flow(spec, lease, ttl, clock)
        except LockLostError:
            if lease.lost is None:
                lease.lost = "its lease ran out before the watchdog could extend it"
            return
        if extension.valid_until is not None:
            if last:
                return
            continue
        left = lease.valid_until - clock()
        if left <= 0:
            lease.lost = (
                f"extension confirmed by {extension.confirmed}/{spec.node_count} "
                f"nodes, quorum {spec.quorum}"
            )
            return
        yield Sleep(min(retry_delay(spec, rand), left))
