"""Fencing tokens: every acquisition's token exceeds every earlier holder's.

The majorities here differ for real: the nodes left out are frozen with SIGSTOP
while the lock is taken, so only the rest can grant. A lock is released after
its nodes are resumed, which also clears whatever a frozen node did late with the
commands it had queued. The negative control runs the naive scheme (INCR on each
granting node, token = the max of the replies) through the same majorities on the
same servers and shows it going backwards.
"""

from __future__ import annotations

import contextlib
import itertools
import threading
import time
import uuid
from collections.abc import Iterator, Sequence
from typing import Any

import pytest
import redis

from harness.held import fence_key, lock_key
from harness.nodes import NodeSet, RedisNode
from harness.proxy import FaultProxy
from redlock_django import LockError, QuorumUnavailableError, Redlock

RESOURCE = "fenced"
LOCK_KEY = lock_key(RESOURCE)
FENCE_KEY = fence_key(RESOURCE)
QUORUM = 3

#: Every majority of five nodes: all 3-, 4- and 5-subsets.
EVERY_MAJORITY = [
    majority
    for size in (3, 4, 5)
    for majority in itertools.combinations(range(5), size)
]
#: The research note's construction: node 0 is in every majority until its counter
#: is far ahead of the others', then comes a majority without it.
FAR_AHEAD_NODE = [(0, 1, 2), (0, 3, 4)] * 3 + [(1, 2, 3)]


def counters(nodes: NodeSet, key: str = FENCE_KEY) -> list[int | None]:
    """Return every node's fencing counter (None where there is none)."""
    values: list[int | None] = []
    for node in nodes:
        with node.client() as client:
            raw = client.get(key)
        values.append(None if raw is None else int(raw))
    return values


def lock_fence(node: RedisNode) -> int | None:
    """Return the fencing token recorded on ``node``'s lock hash, if any."""
    with node.client() as client:
        raw = client.hget(LOCK_KEY, "fence")
    return None if raw is None else int(raw)


@contextlib.contextmanager
def only(nodes: NodeSet, majority: Sequence[int]) -> Iterator[None]:
    """Freeze (SIGSTOP) every node outside ``majority`` for the block."""
    frozen = [node for i, node in enumerate(nodes) if i not in majority]
    for node in frozen:
        node.pause()
    try:
        yield
    finally:
        for node in frozen:
            node.resume()


@contextlib.contextmanager
def held(lock: Redlock) -> Iterator[None]:
    """Release ``lock`` if the block fails while this thread holds it.

    Otherwise the hold would outlive the test, and a later test's acquire in the
    same thread would merely re-enter it.
    """
    try:
        yield
    except BaseException:
        if lock.depth:
            with contextlib.suppress(LockError):
                lock.release()
        raise


def assert_strictly_increasing(tokens: Sequence[int]) -> None:
    for step, (before, after) in enumerate(itertools.pairwise(tokens), start=1):
        assert after > before, f"step {step}: token {after} after {before}: {tokens}"


def first_non_increase(tokens: Sequence[int]) -> int | None:
    """Return the first step whose token is not above the previous one."""
    for step, (before, after) in enumerate(itertools.pairwise(tokens), start=1):
        if after <= before:
            return step
    return None


def fenced_lock(**options: Any) -> Redlock:
    """Return a fencing lock whose short lease ends a frozen node's late write soon."""
    return Redlock(RESOURCE, fencing=True, ttl=1.0, **options)


def wait_until_free(nodes: NodeSet) -> None:
    """Wait until no node holds the lock key (at most its 1 s lease, plus slack).

    A node frozen in the previous step runs that step's acquire and release once
    resumed, on two connections in either order: a late acquire left after the
    release holds the key for its lease, and that node would rightly refuse the
    next step (seen on a loaded machine: node 2 did not grant with all five awake).
    """
    deadline = time.monotonic() + 3.0
    while any(_holds_key(node) for node in nodes):
        assert time.monotonic() < deadline, "a lock key outlived its 1 s lease"
        time.sleep(0.01)


def _holds_key(node: RedisNode) -> bool:
    with node.client() as client:
        return bool(client.exists(LOCK_KEY))


def redlock_step(nodes: NodeSet, lock: Redlock, majority: Sequence[int]) -> int:
    """Acquire ``lock`` with only ``majority`` awake; check who granted; release.

    A quorum of the granting nodes hold the token on the lock hash and as their
    counter, the others no more than it; no counter went down. (A node left out
    runs the step's late acquire once resumed, which may raise its own counter.)
    """
    wait_until_free(nodes)
    before = counters(nodes)
    with only(nodes, majority), held(lock):
        assert lock.acquire(timeout=3.0), f"not acquired with {majority} awake"
        token = lock.fencing_token
        assert isinstance(token, int)
        recorded = [lock_fence(nodes[i]) for i in majority]
        assert recorded.count(token) >= QUORUM, f"{majority}: {recorded}"
        assert all(0 < (fence or 0) <= token for fence in recorded), recorded
    after = counters(nodes)
    lock.release()
    msg = f"{majority}: counters {before} -> {after}, token {token}"
    assert sum(1 for value in after if (value or 0) >= token) >= QUORUM, msg
    assert all((a or 0) >= (b or 0) for a, b in zip(after, before, strict=True)), msg
    return token


class NaiveFencing:
    """The naive scheme: SET NX PX on every node, then INCR each granting node's
    counter and take the max of the replies as the token. No write-back.
    """

    lock_key = f"naive:lock:{RESOURCE}"
    fence_key = f"naive:fence:{RESOURCE}"
    ttl_ms = 1000

    def __init__(self, nodes: NodeSet) -> None:
        self.nodes = nodes
        self.clients = [
            node.client(socket_timeout=0.05, socket_connect_timeout=0.05)
            for node in nodes
        ]

    def close(self) -> None:
        for client in self.clients:
            client.close()

    def _lock_on(self, client: redis.Redis, value: str) -> bool:
        try:
            return bool(client.set(self.lock_key, value, nx=True, px=self.ttl_ms))
        except redis.RedisError:
            return False

    def step(self, majority: Sequence[int]) -> int:
        """Acquire with only ``majority`` awake, take a token, release."""
        value = uuid.uuid4().hex
        with only(self.nodes, majority):
            granted = [
                i
                for i, client in enumerate(self.clients)
                if self._lock_on(client, value)
            ]
            assert granted == list(majority)
            token = max(int(self.clients[i].incr(self.fence_key)) for i in granted)
        for client in self.clients:
            if client.get(self.lock_key) == value.encode():
                client.delete(self.lock_key)
        return token


def test_successive_acquisitions_get_strictly_increasing_tokens(
    redlock_settings: dict[str, Any], nodes: NodeSet
) -> None:
    """50 acquisitions in a row, with new lock objects too, get rising tokens."""
    tokens: list[int] = []
    for i in range(50):
        lock = Redlock(RESOURCE, fencing=True) if i % 2 else fenced_lock()
        with lock:
            token = lock.fencing_token
            assert isinstance(token, int)
            tokens.append(token)
    assert_strictly_increasing(tokens)
    assert counters(nodes) == [tokens[-1]] * 5


async def test_async_successive_acquisitions_get_strictly_increasing_tokens(
    redlock_settings: dict[str, Any], nodes: NodeSet
) -> None:
    """50 ``async with`` acquisitions in a row get rising tokens."""
    lock = Redlock(RESOURCE, fencing=True)
    tokens: list[int] = []
    for _ in range(50):
        async with lock:
            token = lock.fencing_token
            assert isinstance(token, int)
            tokens.append(token)
    assert_strictly_increasing(tokens)
    # A majority holds the last token; a node whose reply came after the fan-out
    # stopped waiting (a loaded host) may have had a later write skipped, and
    # lags behind, never ahead.
    counted = counters(nodes)
    assert counted.count(tokens[-1]) >= 3, counted
    assert all(c is not None and c <= tokens[-1] for c in counted), counted


def test_tokens_strictly_increase_across_acquisitions_won_by_different_majorities(
    redlock_settings: dict[str, Any], nodes: NodeSet
) -> None:
    """Two rounds of all 16 majorities of 5 (the rest frozen): tokens always rise.

    Each step also checks that exactly the awake nodes granted: they record the
    token on the lock hash and raise their counter to it; frozen nodes do not.
    """
    lock = fenced_lock()
    sequence = EVERY_MAJORITY + list(reversed(EVERY_MAJORITY))
    tokens = [redlock_step(nodes, lock, majority) for majority in sequence]
    assert_strictly_increasing(tokens)


async def test_async_tokens_strictly_increase_across_different_majorities(
    redlock_settings: dict[str, Any], nodes: NodeSet
) -> None:
    """The asyncio API through every 3-node majority: tokens always rise."""
    lock = fenced_lock()
    tokens = []
    for majority in itertools.combinations(range(5), 3):
        try:
            with only(nodes, majority):
                assert await lock.aacquire(timeout=3.0)
                token = lock.fencing_token
                assert isinstance(token, int)
                for i in majority:
                    assert lock_fence(nodes[i]) == token
        finally:
            if lock.depth:
                await lock.arelease()
        tokens.append(token)
    assert_strictly_increasing(tokens)


@pytest.mark.parametrize(
    "sequence",
    [FAR_AHEAD_NODE, list(itertools.combinations(range(5), 3))],
    ids=["far-ahead-node", "every-3-of-5"],
)
def test_naive_per_node_incr_goes_backwards_where_redlock_tokens_do_not(
    redlock_settings: dict[str, Any], nodes: NodeSet, sequence: list[tuple[int, ...]]
) -> None:
    """INCR + max over the granting nodes is not monotonic; the write-back is.

    Driven through the same majorities on the same servers, the naive scheme hands
    out a token no greater than an earlier one, while ``Redlock`` never does.
    """
    naive = NaiveFencing(nodes)
    try:
        naive_tokens = [naive.step(majority) for majority in sequence]
    finally:
        naive.close()
    step = first_non_increase(naive_tokens)
    assert step is not None, f"naive tokens rose throughout: {naive_tokens}"

    lock = fenced_lock()
    tokens = [redlock_step(nodes, lock, majority) for majority in sequence]
    assert_strictly_increasing(tokens)


def test_fencing_token_is_recorded_on_the_lock_and_a_quorum_of_counters(
    redlock_settings: dict[str, Any], nodes: NodeSet
) -> None:
    """The granting nodes store the token (``HGET ... fence``) and a counter >= it.

    (The write-back returns once a quorum confirmed: the fourth node's may land a
    moment later.)
    """
    with nodes[1].client() as client:
        client.set(FENCE_KEY, 41)  # one node is ahead: the token must pass it
    lock = Redlock(RESOURCE, fencing=True)
    with only(nodes, (0, 1, 2, 3)), lock:
        token = lock.fencing_token
        # Past node 1's 41: 42, or more if a slow reply on a loaded host made
        # the acquisition try again (each attempt draws once more).
        assert token is not None and token >= 42
        settle(lambda: [lock_fence(nodes[i]) for i in range(4)], [token] * 4)
        for i in range(4):
            with nodes[i].client() as client:
                assert client.pttl(LOCK_KEY) > 0
    at_least = [value for value in counters(nodes) if (value or 0) >= token]
    assert len(at_least) >= QUORUM
    assert counters(nodes)[:4] == [token] * 4
    # Node 4 was frozen: once resumed, the late acquire it ran raises only its own.
    assert (counters(nodes)[4] or 0) <= 1


def scripts_run(nodes: NodeSet) -> list[int]:
    """Per node, how many scripts (EVAL/EVALSHA) it ran since its stats were reset;
    an EVALSHA answered NOSCRIPT (the driver then sends the source) is not one."""
    runs = []
    for node in nodes:
        with node.client() as client:
            stats = client.info("commandstats")
        ran = 0
        for command in ("eval", "evalsha"):
            counts = stats.get(f"cmdstat_{command}", {})
            ran += counts.get("calls", 0) - counts.get("failed_calls", 0)
        runs.append(ran)
    return runs


def settle(read: Any, expected: Any, within: float = 2.0) -> None:
    """Wait until ``read()`` returns ``expected``: a fan-out returns once a quorum
    answered, so the last node's script may run a moment after it."""
    deadline = time.monotonic() + within
    while (seen := read()) != expected:
        assert time.monotonic() < deadline, seen
        time.sleep(0.005)


def test_a_fenced_acquisition_whose_counters_agree_writes_nothing_back(
    redlock_settings: dict[str, Any], nodes: NodeSet
) -> None:
    """Counters that agree (the usual case) make the token final in the acquire
    round: one script per node. Control: one counter ahead of the others needs
    the write-back, a second script on every granting node, and gets past it."""
    with Redlock(RESOURCE, fencing=True):
        pass  # the scripts are loaded, the counters all at 1
    wait_until_free(nodes)  # every node ran the release
    for node in nodes:
        with node.client() as client:
            client.config_resetstat()
    lock = Redlock(RESOURCE, fencing=True)
    with lock:
        assert lock.fencing_token == 2
        settle(lambda: scripts_run(nodes), [1] * 5)
        time.sleep(0.05)  # nothing more comes
        assert scripts_run(nodes) == [1] * 5
    settle(lambda: counters(nodes), [2] * 5)

    with nodes[1].client() as client:
        client.set(FENCE_KEY, 41)
    wait_until_free(nodes)
    for node in nodes:
        with node.client() as client:
            client.config_resetstat()
    with lock:
        assert lock.fencing_token == 42
        settle(lambda: scripts_run(nodes), [2] * 5)
    settle(lambda: counters(nodes), [42] * 5)


def test_lock_without_fencing_has_no_token_and_writes_no_counter(
    redlock_settings: dict[str, Any], nodes: NodeSet
) -> None:
    """Without ``fencing``: ``fencing_token`` is None, no counter, no ``fence``."""
    plain = Redlock(RESOURCE)
    with plain:
        assert plain.fencing_token is None
        for node in nodes:
            with node.client() as client:
                assert client.hgetall(LOCK_KEY).keys() == {b"token", b"meta"}
    for node in nodes:
        with node.client() as client:
            assert client.keys("redlock:fence:*") == []

    # Control: the same checks see the counter that a fencing lock writes.
    with Redlock(RESOURCE, fencing=True) as fenced:
        assert fenced.fencing_token == 1
        for node in nodes:
            with node.client() as client:
                assert client.hget(LOCK_KEY, "fence") == b"1"
    for node in nodes:
        with node.client() as client:
            assert client.keys("redlock:fence:*") == [FENCE_KEY.encode()]


class FreezeOnGrant(threading.Thread):
    """Freeze ``targets`` as soon as each of them holds the lock key.

    The first round's replies are already sent then; the write-back round that
    follows finds them frozen.
    """

    def __init__(self, targets: Sequence[RedisNode], limit: float = 5.0) -> None:
        super().__init__(daemon=True)
        self.targets = list(targets)
        self.limit = limit
        self.frozen: list[RedisNode] = []

    def run(self) -> None:
        deadline = time.monotonic() + self.limit
        clients = [node.client() for node in self.targets]
        try:
            while len(self.frozen) < len(self.targets):
                if time.monotonic() > deadline:
                    return
                for node, client in zip(self.targets, clients, strict=True):
                    if node not in self.frozen and client.exists(LOCK_KEY):
                        node.pause()
                        self.frozen.append(node)
                time.sleep(0.0005)
        finally:
            for client in clients:
                client.close()


def test_acquisition_fails_when_the_write_back_misses_a_quorum(
    redlock_settings: dict[str, Any], nodes: NodeSet
) -> None:
    """Four nodes grant, two of them freeze before the write-back: no lock.

    Node 2's counter is ahead, so its draw is the token and the write-back runs.
    Node 4 is frozen from the start. Requests to nodes 0 and 1 go through proxies
    that deliver them 50 ms late, so the freezer has that long to stop those two
    nodes between their grant and the write-back reaching them. Only nodes 2 and 3
    confirm the token, fewer than a quorum: the acquisition must fail.
    """
    with nodes[2].client() as client:
        client.set(FENCE_KEY, 5)
    with FaultProxy(nodes[0].port) as slow0, FaultProxy(nodes[1].port) as slow1:
        for proxy in (slow0, slow1):
            proxy.delay(0.0, requests=0.05)
        urls = [slow0.url, slow1.url, *nodes.urls[2:]]
        lock = Redlock(RESOURCE, fencing=True, ttl=5.0, node_timeout=0.3, nodes=urls)
        nodes[4].pause()
        freezer = FreezeOnGrant([nodes[0], nodes[1]])
        freezer.start()
        with held(lock), pytest.raises(QuorumUnavailableError) as caught:
            lock.acquire(timeout=0)
        freezer.join()
    assert set(freezer.frozen) == {nodes[0], nodes[1]}
    assert caught.value.granted == 2
    assert len(caught.value.failed) == 3
    assert not lock.owned()
    assert lock.fencing_token is None
    # The two awake nodes did take the write-back: node 3's counter rose to 6.
    assert counters(nodes[2:4]) == [6, 6]


def test_acquisition_holds_when_the_write_back_reaches_exactly_a_quorum(
    redlock_settings: dict[str, Any], nodes: NodeSet
) -> None:
    """Four nodes grant (node 1's counter ahead: the write-back runs), one freezes
    before the write-back: three confirm, held."""
    with nodes[1].client() as client:
        client.set(FENCE_KEY, 4)
    lock = Redlock(RESOURCE, fencing=True, ttl=5.0, node_timeout=0.3)
    nodes[4].pause()
    freezer = FreezeOnGrant([nodes[0]])
    freezer.start()
    assert lock.acquire(timeout=0)
    freezer.join()
    try:
        assert freezer.frozen == [nodes[0]]
        assert lock.owned()
        assert lock.fencing_token == 5
        assert [lock_fence(nodes[i]) for i in (1, 2, 3)] == [5, 5, 5]
    finally:
        nodes.resume_all()
        lock.release()


@pytest.mark.parametrize("corruption", ["wrong-type", "not-a-number"])
def test_a_node_whose_counter_is_corrupt_is_left_out_of_the_quorum(
    redlock_settings: dict[str, Any], nodes: NodeSet, corruption: str
) -> None:
    """A counter that is not an integer makes its node fail, like any node error.

    The lock is taken on the other four with a token above their counters, and
    its release leaves nothing behind on any node.
    """
    with nodes[0].client() as client:
        if corruption == "wrong-type":
            client.hset(FENCE_KEY, "field", "1")
        else:
            client.set(FENCE_KEY, "not-a-number")
    for node in nodes[1:]:
        with node.client() as client:
            client.set(FENCE_KEY, 7)
    lock = Redlock(RESOURCE, fencing=True)
    assert lock.acquire(timeout=0)
    try:
        assert lock.fencing_token == 8
        assert lock_fence(nodes[0]) is None
        assert [lock_fence(node) for node in nodes[1:]] == [8, 8, 8, 8]
    finally:
        lock.release()
    for node in nodes:
        with node.client() as client:
            assert client.exists(LOCK_KEY) == 0
