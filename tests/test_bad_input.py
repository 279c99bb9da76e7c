"""Every invalid setting or argument, in one table: a clear error, nothing sent.

Each row sets ``REDLOCK`` (valid unless the row overrides it), then does one thing
with one bad value, and expects one exception class with a message naming what is
wrong. INFO's ``total_commands_processed`` on every node is read before and after:
the only command in between must be that first INFO itself, so the bad input was
refused before anything reached Redis.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import pytest
from django.core.exceptions import ImproperlyConfigured

from harness.nodes import NodeSet
from redlock_django import Redlock


@dataclass(frozen=True)
class Case:
    """One bad input: ``action(held)`` must raise ``error`` matching ``match``.

    ``held`` is a lock this owner holds when ``needs_lock`` (for extend), else None.
    ``settings`` are merged into a valid ``REDLOCK``; a ``None`` value deletes a key.
    """

    name: str
    action: Callable[[Redlock | None], Any]
    error: type[Exception]
    match: str
    settings: dict[str, Any] = field(default_factory=dict)
    needs_lock: bool = False


def acquire(**kwargs: Any) -> Callable[[Redlock | None], Any]:
    return lambda _: Redlock("bad-input", **kwargs).acquire()


def acquire_with(**kwargs: Any) -> Callable[[Redlock | None], Any]:
    return lambda _: Redlock("bad-input").acquire(**kwargs)


def acquire_and_release(**kwargs: Any) -> Callable[[Redlock | None], Any]:
    """Acquire (and, when that wrongly works, release) with ``kwargs``."""

    def run(_: Redlock | None) -> Any:
        lock = Redlock("bad-input")
        if lock.acquire(**kwargs):
            lock.release()

    return run


def extend(ttl: Any) -> Callable[[Redlock | None], Any]:
    def run(held: Redlock | None) -> Any:
        assert held is not None
        return held.extend(ttl)

    return run


def setting(key: str, value: Any, check: str, **more: Any) -> Case:
    return Case(
        f"{key}={value!r}"[:40],
        acquire(),
        ImproperlyConfigured,
        check,
        settings={key: value, **more},
    )


NAN, INF = math.nan, math.inf

CASES = [
    # --- REDLOCK settings: ImproperlyConfigured naming the check id ---
    setting("TTL", 0, r"redlock\.E006: REDLOCK\['TTL'\] is 0"),
    setting("TTL", -5, r"redlock\.E006: REDLOCK\['TTL'\] is -5"),
    setting("TTL", NAN, r"redlock\.E006: REDLOCK\['TTL'\] is nan"),
    setting("TTL", INF, r"redlock\.E006: REDLOCK\['TTL'\] is inf"),
    setting("TTL", 1e9, r"redlock\.E006: .* more than a day"),
    setting("TTL", "10", r"redlock\.E006: REDLOCK\['TTL'\] is '10'"),
    setting("TTL", True, r"redlock\.E006: REDLOCK\['TTL'\] is True"),
    setting("NODE_TIMEOUT", 0, r"redlock\.E008: REDLOCK\['NODE_TIMEOUT'\] is 0"),
    setting("NODE_TIMEOUT", -0.1, r"redlock\.E008"),
    setting("NODE_TIMEOUT", 20.0, r"redlock\.E008: .* is not below TTL"),
    setting("DRIFT_FACTOR", -0.01, r"redlock\.E007"),
    setting("DRIFT_FACTOR", 0.5, r"redlock\.E007"),
    setting("RETRY_DELAY", -1, r"redlock\.E009: REDLOCK\['RETRY_DELAY'\] is -1"),
    setting("RETRY_JITTER", -0.5, r"redlock\.E009: REDLOCK\['RETRY_JITTER'\]"),
    setting("RETRY_DELAY", 0, r"redlock\.E009: .* both 0", RETRY_JITTER=0),
    setting("RETRY_DELAY", NAN, r"redlock\.E009: REDLOCK\['RETRY_DELAY'\] is nan"),
    setting("WAIT_TIMEOUT", -1, r"redlock\.E009: REDLOCK\['WAIT_TIMEOUT'\] is -1"),
    setting("WAIT_TIMEOUT", NAN, r"redlock\.E009: REDLOCK\['WAIT_TIMEOUT'\]"),
    setting("MAX_HOLD", 0, r"redlock\.E009: REDLOCK\['MAX_HOLD'\] is 0"),
    setting("MAX_HOLD", 5.0, r"redlock\.E009: .* less than TTL"),
    setting("AUTO_EXTEND", "yes", r"redlock\.E011: .* not a bool"),
    setting(
        "WAKE_UPS", "yes", r"redlock\.E011: REDLOCK\['WAKE_UPS'\] is 'yes', not a bool"
    ),
    setting("FAIR", 1, r"redlock\.E011: REDLOCK\['FAIR'\] is 1, not a bool"),
    setting(
        "HANDOFF", "no", r"redlock\.E011: REDLOCK\['HANDOFF'\] is 'no', not a bool"
    ),
    setting("KEY_PREFIX", "", r"redlock\.E010: .* is empty"),
    setting("KEY_PREFIX", "lock*", r"redlock\.E010: .* pattern character"),
    setting("KEY_PREFIX", "my lock", r"redlock\.E010: .* whitespace"),
    setting("KEY_PREFIX", 7, r"redlock\.E010: .* not a string"),
    setting("TLL", 10, r"redlock\.E001: .* unknown key 'TLL'; did you mean 'TTL'"),
    setting("NODES", [], r"redlock\.E002: REDLOCK\['NODES'\] is empty"),
    setting("NODES", "redis://h:1/0", r"redlock\.E002: .* not str"),
    setting("NODES", {"0": "redis://h:1/0"}, r"redlock\.E002: .* not dict"),
    setting("NODES", [6379], r"redlock\.E002: .*\[0\] must be a string"),
    setting("NODES", [""], r"redlock\.E003: .*\[0\] is an empty string"),
    setting("NODES", ["http://h:1/0"], r"redlock\.E003: .* scheme 'http'"),
    setting("NODES", ["redis://h:port/0"], r"redlock\.E003: .* the port"),
    setting("NODES", ["redis://:pw@/0"], r"redlock\.E003: .* no host"),
    setting("NODES", ["redis://h:1/x"], r"redlock\.E003: .* not a database"),
    setting("NODES", ["redis://h:1/0?bogus=1"], r"redlock\.E003: .* unknown option"),
    setting("NODES", ["no-such-cache"], r"redlock\.E004: .* not in CACHES"),
    setting(
        "NODES",
        ["redis://h:1/0", "redis://localhost:2/0", "redis://H:1/0"],
        r"redlock\.E005: .* the same Redis server",
    ),
    # --- Redlock() arguments: ValueError / TypeError naming the argument ---
    Case("ttl=0", acquire(ttl=0), ValueError, r"ttl must be a positive number"),
    Case("ttl=-1", acquire(ttl=-1), ValueError, r"ttl must be a positive.*-1"),
    Case("ttl=nan", acquire(ttl=NAN), ValueError, r"ttl must be .* not nan"),
    Case("ttl=inf", acquire(ttl=INF), ValueError, r"ttl must be .* not inf"),
    Case("ttl=1e9", acquire(ttl=1e9), ValueError, r"ttl must be .* up to 86400"),
    Case("ttl='10'", acquire(ttl="10"), TypeError, r"ttl must be a number"),
    Case("ttl=True", acquire(ttl=True), TypeError, r"ttl must be a number"),
    Case("max_hold=0", acquire(max_hold=0), ValueError, r"max_hold must be"),
    Case("node_timeout=0", acquire(node_timeout=0), ValueError, r"node_timeout"),
    Case(
        "ttl=0.1,node_timeout=0.1",
        acquire(ttl=0.1, node_timeout=0.1),
        ValueError,
        r"leaves no validity after node_timeout",
    ),
    Case("retry_delay=-1", acquire(retry_delay=-1), ValueError, r"retry_delay"),
    Case("retry_jitter=-1", acquire(retry_jitter=-1), ValueError, r"retry_jitter"),
    Case("retry_delay='1'", acquire(retry_delay="1"), TypeError, r"retry_delay"),
    Case("retry_delay=nan", acquire(retry_delay=NAN), ValueError, r"retry_delay"),
    Case("retry_jitter=inf", acquire(retry_jitter=INF), ValueError, r"retry_jitter"),
    Case("drift_factor=0.5", acquire(drift_factor=0.5), ValueError, r"drift_factor"),
    Case("nodes=[]", acquire(nodes=[]), ValueError, r"nodes must be a non-empty"),
    Case("nodes=str", acquire(nodes="redis://h/0"), ValueError, r"nodes must be"),
    Case("nodes=ftp", acquire(nodes=["ftp://h/0"]), ValueError, r"scheme 'ftp'"),
    Case("nodes=[1]", acquire(nodes=[1]), ValueError, r"\[0\] must be a string"),
    Case("nodes=[{}]", acquire(nodes=[{}]), ValueError, r"\[0\] must be a string"),
    Case(
        "resource=None",
        lambda _: Redlock(None).acquire(),  # type: ignore[arg-type]
        ValueError,
        r"resource must be a non-empty string",
    ),
    Case(
        # The form a long name takes in keys: it would lock that long name.
        "resource=<160>~<32 hex>",
        lambda _: Redlock("r" * 160 + "~" + "0123456789abcdef" * 2).acquire(),
        ValueError,
        r"has the form of a hashed long name",
    ),
    # --- acquire() and extend() arguments ---
    Case(
        "non-blocking with timeout",
        acquire_with(blocking=False, timeout=1.0),
        ValueError,
        r"can't specify a timeout for a non-blocking call",
    ),
    Case("timeout='1'", acquire_with(timeout="1"), TypeError, r"timeout must be"),
    Case("timeout=True", acquire_with(timeout=True), TypeError, r"timeout must be"),
    Case("extend(0)", extend(0), ValueError, r"ttl must be a positive", {}, True),
    Case("extend(-1)", extend(-1), ValueError, r"ttl must be a positive", {}, True),
    Case("extend(nan)", extend(NAN), ValueError, r"ttl must be .* nan", {}, True),
    Case("extend(inf)", extend(INF), ValueError, r"ttl must be .* inf", {}, True),
    Case("extend('5')", extend("5"), TypeError, r"ttl must be a number", {}, True),
    Case("timeout=nan", acquire_and_release(timeout=NAN), ValueError, "timeout"),
]


def commands_processed(clients: list[Any]) -> list[int]:
    # The same open connections both times: a new one would send CLIENT SETINFO.
    return [int(client.info("stats")["total_commands_processed"]) for client in clients]


@pytest.mark.parametrize("case", [pytest.param(case, id=case.name) for case in CASES])
def test_bad_input_raises_a_clear_error_before_anything_is_sent(
    settings: Any, redlock_settings: dict[str, Any], nodes: NodeSet, case: Case
) -> None:
    held = None
    if case.needs_lock:
        held = Redlock("bad-input-held")
        assert held.acquire()
    config = {**redlock_settings, **case.settings}
    settings.REDLOCK = {k: v for k, v in config.items() if v is not None}
    clients = [node.client() for node in nodes]
    before = commands_processed(clients)
    try:
        with pytest.raises(case.error, match=case.match):
            case.action(held)
        after = commands_processed(clients)
    finally:
        for client in clients:
            client.close()
        if held is not None:
            settings.REDLOCK = redlock_settings
            held.release()
    # Exactly one command per node in between: the first INFO itself.
    assert [a - b for a, b in zip(after, before, strict=True)] == [1] * len(nodes)


def test_the_command_count_sees_a_lock_attempt(
    redlock_settings: dict[str, Any], nodes: NodeSet
) -> None:
    """Negative control of the table: a valid attempt does reach every node."""
    clients = [node.client() for node in nodes]
    before = commands_processed(clients)
    lock = Redlock("bad-input")
    assert lock.acquire()
    lock.release()
    after = commands_processed(clients)
    assert all(a - b > 1 for a, b in zip(after, before, strict=True))
