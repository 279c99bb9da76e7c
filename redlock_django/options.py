"""A ``Redlock``'s options resolved over the settings: what one lock runs with.

``Redlock`` keeps the options its caller gave; at first use, and again whenever the
settings change, ``resolve`` merges those that are set over ``settings.REDLOCK`` into
a frozen ``Config``: the protocol's ``LockSpec`` plus what the drivers, the wake-ups
and the watchdog need.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from dataclasses import dataclass
from typing import Any

from .address import NodeSpec
from .conf import RedlockSettings
from .keys import (
    fence_key,
    handoff_key,
    lock_key,
    queue_keys,
    waiting_key,
    wake_head,
)
from .protocol import LockSpec, drift, validity

__all__ = ["Config", "resolve"]


@dataclass(slots=True)
class Config:
    """A lock's options resolved against the settings of the moment.

    Never changed once made (shared across threads); not frozen, as ``LockSpec``.
    """

    spec: LockSpec
    nodes: tuple[NodeSpec, ...]
    node_timeout: float
    wait_timeout: float | None
    auto_extend: bool
    max_hold: float | None
    wake_ups: bool
    #: Identifies the lock across ``Redlock`` objects: same nodes, same key.
    identity: tuple[Any, ...]


@dataclass(frozen=True, slots=True)
class _Merged:
    """The settings with one set of options in place, and what every key shares."""

    settings: RedlockSettings
    node_names: tuple[str, ...]
    node_identities: tuple[Any, ...]


#: Configs resolved under one settings object, by resource, fencing and the options
#: given: locks made per request (``Redlock(f"product:{id}")``) resolve once per key.
#: Beside them, the settings merged with each set of options given, which every
#: resource shares: a new key costs its keys and specs, not a merge.
#: One tuple, replaced whole, so a thread never files a config under other settings.
_memo: tuple[
    RedlockSettings | None,
    dict[tuple[Any, ...], Config],
    dict[tuple[Any, ...], _Merged],
] = (None, {}, {})
MEMO_SIZE = 256


def resolve(
    settings: RedlockSettings, resource: str, fencing: bool, given: dict[str, Any]
) -> Config:
    """Return the config of a lock on ``resource``: ``given`` over ``settings``.

    Options ``given`` as None are unset and come from the settings. Raises
    ``ValueError`` when the TTL cannot outlast the node timeout and the drift.
    The result is remembered until the settings change (at most ``MEMO_SIZE``).
    """
    global _memo
    # Keyed by the options set: most locks set none, and () hashes at once.
    options = tuple([item for item in given.items() if item[1] is not None])
    key = (resource, fencing, options)
    owner, memo, merges = _memo
    # TypeError: an option that cannot be hashed (a list): resolved every time.
    if owner is settings:
        try:
            found = memo.get(key)
        except TypeError:
            found = None
        if found is not None:
            return found
    else:
        memo, merges = {}, {}
        _memo = (settings, memo, merges)
    try:
        merged = merges.get(options)
    except TypeError:
        merged = None
    if merged is None:
        merged = _merge(settings, given)
        if len(merges) >= MEMO_SIZE:
            merges.clear()
        with contextlib.suppress(TypeError):
            merges[options] = merged
    config = _resolve(merged, resource, fencing)
    if len(memo) >= MEMO_SIZE:
        memo.clear()
    with contextlib.suppress(TypeError):
        memo[key] = config
    return config


def _merge(settings: RedlockSettings, given: dict[str, Any]) -> _Merged:
    """The settings with the options ``given`` (those not None) in their place."""
    merged = dataclasses.replace(
        settings, **{name: v for name, v in given.items() if v is not None}
    )
    if validity(merged.ttl, merged.node_timeout, merged.drift_factor) <= 0:
        # Even a reply at the node timeout would leave no validity: every
        # attempt would be refused as too slow. Say so before sending anything.
        ttl, drift_factor = merged.ttl, merged.drift_factor
        raise ValueError(
            f"ttl ({ttl}s) leaves no validity after node_timeout "
            f"({merged.node_timeout}s) and the clock drift allowance "
            f"({drift(ttl, drift_factor):.3f}s)"
        )
    # The settings' own cross-field rules (conf.py, redlock.E009), for the values
    # one lock brings.
    if merged.retry_delay + merged.retry_jitter <= 0:
        raise ValueError(
            "retry_delay and retry_jitter are both 0: retries would spin without pause"
        )
    if (
        merged.auto_extend
        and merged.max_hold is not None
        and merged.max_hold < merged.ttl
    ):
        raise ValueError(
            f"max_hold ({merged.max_hold:g}s) is less than ttl ({merged.ttl:g}s): "
            "the first lease would already outlive the cap; give a max_hold of at "
            "least the ttl, or None"
        )
    return _Merged(
        settings=merged,
        node_names=tuple(n.display for n in merged.nodes),
        node_identities=tuple(n.identity for n in merged.nodes),
    )


def _resolve(shared: _Merged, resource: str, fencing: bool) -> Config:
    merged = shared.settings
    ttl, node_timeout = merged.ttl, merged.node_timeout
    drift_factor = merged.drift_factor
    prefix = merged.key_prefix
    spec = LockSpec(
        resource=resource,
        key=lock_key(resource, prefix),
        node_names=shared.node_names,
        ttl=ttl,
        drift_factor=drift_factor,
        retry_delay=merged.retry_delay,
        retry_jitter=merged.retry_jitter,
        fence_key=fence_key(resource, prefix) if fencing else None,
        queue=queue_keys(resource, prefix) if merged.fair else None,
        queue_life=merged.queue_life,
        wake_head=wake_head(prefix) if merged.fair else "",
        records=handoff_key(resource, prefix) if merged.fair else "",
        handoff=merged.fair and merged.handoff and merged.wake_ups,
        waiting=(
            waiting_key(resource, prefix) if merged.wake_ups and not merged.fair else ""
        ),
    )
    return Config(
        spec=spec,
        nodes=merged.nodes,
        node_timeout=node_timeout,
        wait_timeout=merged.wait_timeout,
        auto_extend=merged.auto_extend,
        # math.inf, given to one lock: extend without a cap whatever MAX_HOLD says.
        max_hold=None if merged.max_hold == math.inf else merged.max_hold,
        wake_ups=merged.wake_ups,
        identity=(shared.node_identities, spec.key),
    )
