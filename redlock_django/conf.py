"""Read, validate and cache the ``REDLOCK`` setting.

This module is the only reader of ``settings.REDLOCK`` in the package. It holds
the ``DEFAULTS``, ``validate()`` (used by both the system checks and the runtime, so
they never disagree) and ``get_settings()``, which returns a frozen
``RedlockSettings`` and is cached until ``REDLOCK`` or ``CACHES`` changes.

Settings are read when ``get_settings()`` is called, never at import time: a
module imported before the settings are configured (or before a test overrides
them) would otherwise keep stale values forever.

What a NODES entry names (``NodeSpec``, URL and cache-alias parsing) is decided in
``address.py``, which also looks up the ``CACHES`` entry an alias names. The
messages are written here, where the values they show are at hand; their ids and
hints live in ``checks.py``.
One idea read top to bottom (defaults, reading, the validation rules, durations),
hence a little over 500 lines.
"""

from __future__ import annotations

import difflib
import functools
import math
import numbers
import re
import unicodedata
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from django.conf import settings
from django.core.exceptions import ImproperlyConfigured
from django.core.signals import setting_changed
from django.views.debug import SafeExceptionReporterFilter

from . import protocol
from .address import (
    AliasError,
    NodeSpec,
    parse_node,
    tls_unverified,
)

__all__ = [
    "DEFAULTS",
    "ERROR",
    "WARNING",
    "Problem",
    "RedlockSettings",
    "SafeSettingsReporterFilter",
    "check_seconds",
    "get_settings",
    "raw_settings",
    "reset",
    "validate",
]

ERROR = "error"
WARNING = "warning"

DEFAULTS: dict[str, object] = {
    "NODES": [],
    "KEY_PREFIX": "redlock",
    "TTL": 10.0,
    "WAIT_TIMEOUT": 10.0,
    "RETRY_DELAY": 0.05,
    "RETRY_JITTER": 0.05,
    "DRIFT_FACTOR": 0.01,
    "NODE_TIMEOUT": 0.05,
    "AUTO_EXTEND": False,
    "MAX_HOLD": 300.0,
    # Waiters subscribe to releases (wake.py) instead of only retrying on a timer.
    "WAKE_UPS": True,
    # Waiters are served in arrival order, through a queue on the nodes.
    "FAIR": False,
    # Seconds a fair waiter's queue entry lives unless refreshed (every third of it).
    "QUEUE_LIFE": protocol.QUEUE_LIFE,
    # A fair lock's release hands the lock to the next waiter with its wake-up.
    "HANDOFF": True,
}

MAX_TTL = 86400.0
#: A fair waiter refreshes its queue entry every third of QUEUE_LIFE, each refresh
#: a round trip of up to NODE_TIMEOUT: W008 below this many of them.
QUEUE_LIFE_NODE_TIMEOUTS = 10
MAX_KEY_PREFIX_LENGTH = 64
# Above this share of TTL, one slow node eats a visible part of the validity window.
NODE_TIMEOUT_SHARE = 0.05
# ``\\`` is the escape character of the SCAN MATCH pattern the inspector builds from
# the prefix, so it is as unsafe there as the glob characters themselves.
_GLOB_CHARACTERS = frozenset("*?[]\\")
# The userinfo of a URL, and query parameters whose name says "pass".
# From the first "scheme://" up to the last "@", spaces included: redis-py takes a
# password with an unencoded "@" or space whole, and one holding "/", "?", "#" or
# "://" is still a password (the check refuses the URL, this page shows it).
_URL_USERINFO = re.compile(r"([A-Za-z][A-Za-z0-9+.-]*://).*@", re.DOTALL)
_QUERY_PASSWORD = re.compile(r"(?i)([?&][^=&#\s]*pass[^=&#\s]*=)[^&#]*")


@dataclass(frozen=True)
class Problem:
    """One finding of ``validate()``: ``level`` is ``ERROR`` or ``WARNING``."""

    level: str
    id: str
    msg: str


@dataclass(frozen=True)
class RedlockSettings:
    """Hold the validated ``REDLOCK`` setting; durations are float seconds."""

    nodes: tuple[NodeSpec, ...]
    key_prefix: str
    ttl: float
    wait_timeout: float | None
    retry_delay: float
    retry_jitter: float
    drift_factor: float
    node_timeout: float
    auto_extend: bool
    max_hold: float | None
    wake_ups: bool = True
    fair: bool = False
    queue_life: float = protocol.QUEUE_LIFE
    handoff: bool = True


class SafeSettingsReporterFilter(SafeExceptionReporterFilter):
    """Django's error-report filter, also masking passwords in URL settings.

    Django hides settings whose *name* looks secret (``PASSWORD``, ``SECRET_KEY``),
    but shows ``REDLOCK = {"NODES": ["redis://:pw@host/0"]}`` (or a cache
    ``LOCATION``) as written, on the DEBUG page and in the error e-mails. Set
    ``DEFAULT_EXCEPTION_REPORTER_FILTER =
    "redlock_django.conf.SafeSettingsReporterFilter"`` to replace the userinfo of
    every URL, and query parameters named like a password, with stars.
    """

    def cleanse_setting(self, key: Any, value: Any) -> Any:
        cleansed = super().cleanse_setting(key, value)
        if isinstance(cleansed, str) and "://" in cleansed:
            stars = self.cleansed_substitute
            cleansed = _URL_USERINFO.sub(rf"\g<1>{stars}@", cleansed)
            cleansed = _QUERY_PASSWORD.sub(rf"\g<1>{stars}", cleansed)
        return cleansed


# --- reading settings -------------------------------------------------------------


def raw_settings() -> object:
    """Return ``settings.REDLOCK`` as it is, or ``{}`` when it is not set."""
    return getattr(settings, "REDLOCK", {})


def cache_settings() -> Mapping[str, Any]:
    """Return ``settings.CACHES``, where NODES entries that are aliases are found."""
    caches = getattr(settings, "CACHES", {})
    return caches if isinstance(caches, Mapping) else {}


@functools.cache
def get_settings() -> RedlockSettings:
    """Return the validated settings, cached until ``REDLOCK`` or ``CACHES`` changes.

    Raise ``ImproperlyConfigured`` when ``validate()`` finds an error; the message
    starts with the check id, e.g. ``redlock.E002: REDLOCK['NODES'] is empty``.
    Warnings do not raise: the system checks report them.
    """
    problems, values, nodes = _validate(raw_settings())
    errors = [problem for problem in problems if problem.level == ERROR]
    if errors:
        raise ImproperlyConfigured(
            "; ".join(f"{problem.id}: {problem.msg}" for problem in errors)
        )
    return RedlockSettings(
        nodes=tuple(nodes),
        key_prefix=str(values["KEY_PREFIX"]),
        ttl=_seconds(values["TTL"]),
        wait_timeout=_optional_seconds(values["WAIT_TIMEOUT"]),
        retry_delay=_seconds(values["RETRY_DELAY"]),
        retry_jitter=_seconds(values["RETRY_JITTER"]),
        drift_factor=_seconds(values["DRIFT_FACTOR"]),
        node_timeout=_seconds(values["NODE_TIMEOUT"]),
        auto_extend=bool(values["AUTO_EXTEND"]),
        max_hold=_optional_seconds(values["MAX_HOLD"]),
        wake_ups=bool(values["WAKE_UPS"]),
        fair=bool(values["FAIR"]),
        queue_life=_seconds(values["QUEUE_LIFE"]),
        handoff=bool(values["HANDOFF"]),
    )


def parse_nodes(entries: list[str] | tuple[str, ...]) -> tuple[NodeSpec, ...]:
    """Parse a lock's own ``nodes=[...]`` list, once per distinct list.

    Locks built in a loop with the same explicit list would otherwise re-parse
    every URL each time. Cached until ``REDLOCK`` or ``CACHES`` changes (an alias
    may then name another server); a list that cannot be hashed is parsed as is,
    so that its bad entry gets ``parse_node()``'s message.
    """
    entries = tuple(entries)
    try:
        return _parse_nodes(entries)
    except TypeError:  # an unhashable entry: not a string, refused below
        caches = cache_settings()
        return tuple(parse_node(e, i, caches) for i, e in enumerate(entries))


@functools.lru_cache(maxsize=256)
def _parse_nodes(entries: tuple[str, ...]) -> tuple[NodeSpec, ...]:
    caches = cache_settings()
    return tuple(parse_node(e, i, caches) for i, e in enumerate(entries))


def reset() -> None:
    """Forget the cached settings and parsed node lists (nodes.py closes its
    clients on its own)."""
    get_settings.cache_clear()
    _parse_nodes.cache_clear()


def _on_setting_changed(*, setting: str, **kwargs: object) -> None:
    if setting in ("REDLOCK", "CACHES"):
        reset()


# Connected here rather than in AppConfig.ready(), so the cache is cleared even when
# conf.py is used by a project that does not list the app in INSTALLED_APPS.
setting_changed.connect(_on_setting_changed, dispatch_uid="redlock_django.conf.reset")


# --- validation -------------------------------------------------------------------


def validate(raw: object) -> list[Problem]:
    """Return every problem of the ``REDLOCK`` value ``raw``, errors and warnings.

    Reads ``CACHES`` for nodes given as cache aliases; never touches the network.
    """
    return _validate(raw)[0]


def _validate(
    raw: object,
) -> tuple[list[Problem], dict[str, object], list[NodeSpec]]:
    problems: list[Problem] = []

    def error(check_id: str, msg: str) -> None:
        problems.append(Problem(ERROR, check_id, msg))

    def warning(check_id: str, msg: str) -> None:
        problems.append(Problem(WARNING, check_id, msg))

    if not isinstance(raw, Mapping):
        error(
            "redlock.E001",
            f"REDLOCK must be a dict, not {type(raw).__name__}",
        )
        return problems, dict(DEFAULTS), []
    for key in raw:
        if key not in DEFAULTS:
            error("redlock.E001", f"REDLOCK has an unknown key {key!r}{_suggest(key)}")
    values = {**DEFAULTS, **{key: raw[key] for key in raw if key in DEFAULTS}}

    nodes = _validate_nodes(values["NODES"], error, warning)

    ttl = _number(values["TTL"])
    if ttl is None or ttl <= 0:
        error(
            "redlock.E006",
            f"REDLOCK['TTL'] is {_show(values['TTL'])}; "
            "it must be a finite number of seconds above 0",
        )
        ttl = None
    elif ttl > MAX_TTL:
        error(
            "redlock.E006",
            f"REDLOCK['TTL'] is {ttl:g} seconds, more than a day ({MAX_TTL:g})",
        )
        ttl = None

    drift = _number(values["DRIFT_FACTOR"])
    if drift is None or not 0 <= drift < 0.5:
        error(
            "redlock.E007",
            f"REDLOCK['DRIFT_FACTOR'] is {_show(values['DRIFT_FACTOR'])}; "
            "it must be a number >= 0 and < 0.5",
        )
        drift = None

    node_timeout = _number(values["NODE_TIMEOUT"])
    if node_timeout is None or node_timeout <= 0:
        error(
            "redlock.E008",
            f"REDLOCK['NODE_TIMEOUT'] is {_show(values['NODE_TIMEOUT'])}; "
            "it must be a finite number of seconds above 0",
        )
    elif ttl is not None and node_timeout >= ttl:
        error(
            "redlock.E008",
            f"REDLOCK['NODE_TIMEOUT'] ({node_timeout:g}) is not below TTL ({ttl:g})",
        )
    elif (
        ttl is not None
        and drift is not None
        and protocol.validity(ttl, node_timeout, drift) <= 0
    ):
        error(
            "redlock.E008",
            f"REDLOCK['NODE_TIMEOUT'] ({node_timeout:g}) leaves no validity: TTL "
            f"{ttl:g} minus the drift allowance {protocol.drift(ttl, drift):g} "
            "minus NODE_TIMEOUT is <= 0",
        )
    elif ttl is not None and node_timeout > NODE_TIMEOUT_SHARE * ttl:
        warning(
            "redlock.W003",
            f"REDLOCK['NODE_TIMEOUT'] ({node_timeout:g}) is more than "
            f"{NODE_TIMEOUT_SHARE:.0%} of TTL ({ttl:g}): one slow node can use up "
            "most of the validity window",
        )

    _validate_timing(values, ttl, error, max_hold_is_default="MAX_HOLD" not in raw)
    queue_life = _number(values["QUEUE_LIFE"])
    if (
        (values["FAIR"] is True or "QUEUE_LIFE" in raw)
        and queue_life is not None
        and node_timeout is not None
        and 0 < node_timeout < (ttl or math.inf)
        and 0 < queue_life < QUEUE_LIFE_NODE_TIMEOUTS * node_timeout
    ):
        warning(
            "redlock.W008",
            f"REDLOCK['QUEUE_LIFE'] ({queue_life:g}) is less than "
            f"{QUEUE_LIFE_NODE_TIMEOUTS} x NODE_TIMEOUT ({node_timeout:g}): a fair "
            "waiter refreshes its queue entry every third of it, so one slow node "
            "can drop waiters that are still alive",
        )

    prefix = values["KEY_PREFIX"]
    reason = _prefix_problem(prefix)
    if reason:
        error("redlock.E010", f"REDLOCK['KEY_PREFIX'] {_show(prefix)} {reason}")

    for name in ("AUTO_EXTEND", "WAKE_UPS", "FAIR", "HANDOFF"):
        if not isinstance(values[name], bool):
            error(
                "redlock.E011",
                f"REDLOCK[{name!r}] is {_show(values[name])}, not a bool",
            )
    return problems, values, nodes


def _validate_nodes(
    entries: object,
    error: Any,
    warning: Any,
) -> list[NodeSpec]:
    if not isinstance(entries, list | tuple):
        error(
            "redlock.E002",
            "REDLOCK['NODES'] must be a list or tuple of Redis URLs or cache "
            f"aliases, not {type(entries).__name__}",
        )
        return []
    if not entries:
        error("redlock.E002", "REDLOCK['NODES'] is empty")
        return []
    nodes: list[NodeSpec] = []
    caches = cache_settings()
    for index, entry in enumerate(entries):
        if not isinstance(entry, str):
            # The value itself may be a dict holding a password: show the type only.
            error(
                "redlock.E002",
                f"REDLOCK['NODES'][{index}] must be a string (a Redis URL or a "
                f"CACHES alias), not {type(entry).__name__}",
            )
            continue
        try:
            nodes.append(parse_node(entry, index, caches))
        except AliasError as exc:
            error("redlock.E004", str(exc))
        except ValueError as exc:
            error("redlock.E003", str(exc))

    count = len(entries)
    if count > 1 and count % 2 == 0:
        warning(
            "redlock.W001",
            f"REDLOCK['NODES'] has {count} nodes, an even number: the quorum "
            f"is {protocol.quorum(count)}, so it tolerates "
            f"{protocol.tolerated_failures(count)} failed node(s), no more than "
            f"{count - 1} nodes would",
        )

    by_identity: dict[tuple[str | int, ...], list[NodeSpec]] = {}
    for node in nodes:
        by_identity.setdefault(node.identity, []).append(node)
    by_server: dict[tuple[str | int, ...], list[NodeSpec]] = {}
    for identity, same in by_identity.items():
        by_server.setdefault(identity[:-1], []).append(same[0])
        if len(same) > 1:
            error(
                "redlock.E005",
                f"{_positions(same)} are the same Redis server and database "
                f"({same[0].display}), not independent nodes",
            )
    for same_server in by_server.values():
        if len(same_server) > 1:
            warning(
                "redlock.W002",
                f"{_positions(same_server)} are different databases on one Redis "
                f"server ({', '.join(node.display for node in same_server)}), "
                "not independent nodes",
            )

    for node in nodes:
        if tls_unverified(node):
            warning(
                "redlock.W004",
                f"REDLOCK['NODES'][{node.index}] ({node.display}) uses TLS with "
                "ssl_cert_reqs=none: the server certificate is not verified",
            )
    return nodes


def _validate_timing(
    values: dict[str, object],
    ttl: float | None,
    error: Any,
    *,
    max_hold_is_default: bool,
) -> None:
    wait_timeout = values["WAIT_TIMEOUT"]
    number = _number(wait_timeout)
    if wait_timeout is not None and (number is None or number < 0):
        error(
            "redlock.E009",
            f"REDLOCK['WAIT_TIMEOUT'] is {_show(wait_timeout)}; it must be a finite "
            "number of seconds >= 0, or None to wait without limit",
        )
    delays: list[float] = []
    for key in ("RETRY_DELAY", "RETRY_JITTER"):
        number = _number(values[key])
        if number is None or number < 0:
            error(
                "redlock.E009",
                f"REDLOCK[{key!r}] is {_show(values[key])}; it must be a finite "
                "number of seconds >= 0",
            )
        else:
            delays.append(number)
    if len(delays) == 2 and sum(delays) <= 0:
        error(
            "redlock.E009",
            "REDLOCK['RETRY_DELAY'] and REDLOCK['RETRY_JITTER'] are both 0: "
            "retries would spin without pause",
        )
    queue_life = values["QUEUE_LIFE"]
    number = _number(queue_life)
    if number is None or not 0 < number <= MAX_TTL:
        error(
            "redlock.E009",
            f"REDLOCK['QUEUE_LIFE'] is {_show(queue_life)}; it must be a finite "
            f"number of seconds above 0 and at most {MAX_TTL:g}",
        )
    max_hold = values["MAX_HOLD"]
    number = _number(max_hold)
    if max_hold is not None and (number is None or number <= 0):
        error(
            "redlock.E009",
            f"REDLOCK['MAX_HOLD'] is {_show(max_hold)}; it must be a finite number "
            "of seconds above 0, or None for no cap on auto-extension",
        )
    elif number is not None and ttl is not None and number < ttl:
        error(
            "redlock.E009",
            f"REDLOCK['MAX_HOLD'] ({number:g}"
            + (", the default" if max_hold_is_default else "")
            + f") is less than TTL ({ttl:g}): the first lease would already "
            "outlive the cap",
        )


def _prefix_problem(prefix: object) -> str | None:
    if not isinstance(prefix, str):
        return f"is a {type(prefix).__name__}, not a string"
    if not prefix:
        return "is empty"
    if len(prefix) > MAX_KEY_PREFIX_LENGTH:
        return f"is {len(prefix)} characters long, more than {MAX_KEY_PREFIX_LENGTH}"
    if any(char.isspace() or unicodedata.category(char)[0] == "C" for char in prefix):
        return "contains whitespace or a control character"
    glob = sorted(_GLOB_CHARACTERS.intersection(prefix))
    if glob:
        return f"contains the pattern character(s) {' '.join(glob)}"
    return None


def _suggest(key: object) -> str:
    """Return "; did you mean 'X'?" for the known key(s) closest to ``key``."""
    text = str(key).upper()
    scores = {
        known: difflib.SequenceMatcher(None, text, known).ratio() for known in DEFAULTS
    }
    best = max(scores.values())
    if best < 0.6:
        return ""
    closest = [repr(known) for known, score in scores.items() if score == best]
    return f"; did you mean {' or '.join(closest)}?"


def _positions(nodes: list[NodeSpec]) -> str:
    indexes = [f"NODES[{node.index}]" for node in nodes]
    return ", ".join(indexes[:-1]) + " and " + indexes[-1]


def _number(value: object) -> float | None:
    """Return ``value`` as a finite float, or None if it is no finite real number."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        return None
    try:
        number = float(value)
    except OverflowError:  # an int past the float range
        return None
    return number if math.isfinite(number) else None


def check_seconds(
    name: str,
    value: object,
    *,
    allow_none: bool = False,
    allow_zero: bool = False,
    limit: float | None = MAX_TTL,
    wait: bool = False,
) -> float | None:
    """Return ``value`` as seconds, or raise ``TypeError``/``ValueError`` naming it.

    The one rule for durations given as arguments (the lock's and the decorator's),
    as the settings apply it: a finite real number (never a bool, NaN or infinity),
    above 0 (or 0 with ``allow_zero``) and at most ``limit``; None only with
    ``allow_none``. A ``wait`` is how long to wait for a lock, taken as
    ``threading.Lock.acquire`` takes its timeout: any real number but NaN (no
    deadline would ever pass), where a negative one means no limit (None) and
    infinity is returned as it is.
    """
    if value is None:
        if allow_none:
            return None
        raise ValueError(f"{name} must be a number of seconds, not None")
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a number of seconds, not {value!r}")
    if wait:
        if value < 0:
            return None
        try:
            seconds = float(value)
        except OverflowError:  # an int past the float range: no deadline
            return math.inf
        if math.isnan(seconds):
            raise ValueError(f"{name} must be a number of seconds, not {value!r}")
        return seconds
    number = _number(value)
    low_ok = number is not None and (number >= 0 if allow_zero else number > 0)
    if number is None or not low_ok or (limit is not None and number > limit):
        low = "a number >= 0" if allow_zero else "a positive number"
        high = "" if limit is None else f" up to {limit:g}"
        raise ValueError(f"{name} must be {low} of seconds{high}, not {value!r}")
    return number


def _seconds(value: object) -> float:
    number = _number(value)
    assert number is not None, "validated"
    return number


def _optional_seconds(value: object) -> float | None:
    return None if value is None else _seconds(value)


def _show(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."
