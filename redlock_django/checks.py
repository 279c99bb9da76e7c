"""System checks for the ``REDLOCK`` setting (tag ``redlock``).

The findings come from ``conf.validate()``, the same function ``get_settings()``
runs, so ``manage.py check`` and the ``ImproperlyConfigured`` raised at runtime
always agree, word for word. The messages carry the offending value (URLs masked),
so they are built there; this module keeps the ids, one constant each.

``check_settings`` never touches the network: it runs before almost every
management command. ``check_nodes`` asks every node about itself, so it runs only
with ``manage.py check --deploy`` (tags ``redlock`` and ``redlock_nodes``); each
node costs at most one NODE_TIMEOUT to connect and one to answer, so a dead or
frozen node cannot hang it.

Errors:

- E001 ``REDLOCK`` is not a dict, or has an unknown key (the closest known key is
  suggested).
- E002 ``NODES`` is empty, not a list or tuple, or holds a non-string.
- E003 a ``NODES`` entry is a malformed URL.
- E004 a ``NODES`` entry names a cache alias that is missing or not a Redis cache.
- E005 two ``NODES`` entries are the same server and database.
- E006 ``TTL`` is not a positive finite number, or is more than a day.
- E007 ``DRIFT_FACTOR`` is outside [0, 0.5).
- E008 ``NODE_TIMEOUT`` is not positive, is not below ``TTL``, or leaves no validity.
- E009 ``WAIT_TIMEOUT``, ``RETRY_DELAY``, ``RETRY_JITTER``, ``MAX_HOLD`` or
  ``QUEUE_LIFE`` is invalid.
- E010 ``KEY_PREFIX`` is invalid.
- E011 ``AUTO_EXTEND``, ``WAKE_UPS``, ``FAIR`` or ``HANDOFF`` is not a bool.
- E012 (deploy) a node is a replica: it refuses writes, and a failover can
  promote it without the keys its master granted.
- E013 (deploy) two nodes are one server (same ``run_id`` and database) reached
  by different addresses, which the static E005 cannot see (DNS names, proxies).
- E020 (tag ``urls``) a URL pattern routes to a ``distributed_lock`` view without a
  kwarg its resource template names.
- E101 a ``FencingTokenField`` with ``null=True``: NULL < token is never true, so
  every fenced write of such a row would be refused.
- E102 a ``FencingTokenField`` whose default is not an integer <= 0: tokens start
  at 1, so writes would be refused until the token passed the default.

E101 and E102 are model field checks: ``FencingTokenField.check()`` (orm.py) runs
them, as Django's own field checks live on the field, with the messages built here.

Warnings:

- W001 an even number of nodes (more than one).
- W002 two nodes are different databases of one server.
- W003 ``NODE_TIMEOUT`` is more than 5% of ``TTL``.
- W004 a ``rediss://`` node does not verify the server certificate.
- W005 (deploy) a node's ``maxmemory-policy`` is not ``noeviction``. Every lock key
  carries a TTL, so the ``volatile-*`` policies can evict it as well as the
  ``allkeys-*`` ones (``volatile-ttl`` picks the keys closest to expiry first:
  short leases); an evicted key is a lock granted twice. Only ``noeviction``
  keeps a granted key until its TTL. Warned even with ``maxmemory 0`` (no limit
  now), since the limit can be set at runtime.
- W006 (deploy) a node did not answer the deploy check in NODE_TIMEOUT.
- W007 (deploy) a node does not run with ``appendonly yes`` and ``appendfsync
  always``: a crash loses its latest writes. For locks the delayed-restart rule
  (stay down longer than the longest TTL) is the alternative; fencing counters
  have no TTL, so only ``appendfsync always`` keeps tokens increasing across a
  restart. ``appendonly`` is read from INFO; ``appendfsync`` needs CONFIG GET,
  and where CONFIG is refused (ACLs, managed services) a node whose
  append-only file is on passes: its policy cannot be known, and a warning
  nobody can act on would only get W007 silenced everywhere.
- W008 ``QUEUE_LIFE`` is less than 10 x ``NODE_TIMEOUT``, with ``FAIR`` on or
  ``QUEUE_LIFE`` set: a fair waiter's refreshes (every third of it) could come
  too late behind one slow node, and a live waiter lose its place.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import redis
from django.apps import AppConfig
from django.core.checks import CheckMessage, Error, Warning
from django.core.exceptions import ImproperlyConfigured
from django.urls import URLPattern, URLResolver, get_resolver

from . import address, conf, nodes
from .decorators import Guard, guards_of, name_of

__all__ = [
    "E001",
    "E002",
    "E003",
    "E004",
    "E005",
    "E006",
    "E007",
    "E008",
    "E009",
    "E010",
    "E011",
    "E012",
    "E013",
    "E020",
    "E101",
    "E102",
    "HINTS",
    "NODES_TAG",
    "TAG",
    "W001",
    "W002",
    "W003",
    "W004",
    "W005",
    "W006",
    "W007",
    "W008",
    "check_nodes",
    "check_settings",
    "check_url_placeholders",
    "fencing_token_default",
    "fencing_token_null",
]

TAG = "redlock"
#: The deploy-only checks that connect to the nodes.
NODES_TAG = "redlock_nodes"

E001 = "redlock.E001"
E002 = "redlock.E002"
E003 = "redlock.E003"
E004 = "redlock.E004"
E005 = "redlock.E005"
E006 = "redlock.E006"
E007 = "redlock.E007"
E008 = "redlock.E008"
E009 = "redlock.E009"
E010 = "redlock.E010"
E011 = "redlock.E011"
E012 = "redlock.E012"
E013 = "redlock.E013"
E101 = "redlock.E101"
E102 = "redlock.E102"
W001 = "redlock.W001"
W002 = "redlock.W002"
W003 = "redlock.W003"
W004 = "redlock.W004"
W005 = "redlock.W005"
W006 = "redlock.W006"
W007 = "redlock.W007"
W008 = "redlock.W008"

#: How to fix each finding of ``conf.validate()``, by check id.
HINTS = {
    "redlock.E001": "REDLOCK must be a dict with these keys (all optional but NODES): "
    + ", ".join(conf.DEFAULTS)
    + ".",
    "redlock.E002": "List one entry per independent Redis master: a URL such as "
    "'redis://10.0.0.1:6379/0' or the alias of a Redis cache in CACHES, e.g. "
    "REDLOCK = {'NODES': ['redis://10.0.0.1:6379/0', 'redis://10.0.0.2:6379/0', "
    "'redis://10.0.0.3:6379/0']}.",
    "redlock.E003": "Use redis://[[user]:password@]host[:port][/db], "
    "rediss://... for TLS (valkey:// and valkeys:// for Valkey servers), or "
    "unix:///path/to.sock?db=N; percent-encode any "
    "/ ? # @ : in the password.",
    "redlock.E004": "Name a CACHES alias whose BACKEND is one of "
    + ", ".join(address.REDIS_CACHE_BACKENDS)
    + " with a single redis:// (or valkey://) LOCATION, or write the node as a URL.",
    "redlock.E005": "Give every node its own Redis server: one server listed twice "
    "votes twice, so a majority of entries is not a majority of servers.",
    "redlock.E006": "Set TTL to the lease length in seconds: a number above 0 and at "
    f"most {conf.MAX_TTL:g} (one day), e.g. 10.0.",
    "redlock.E007": "Set DRIFT_FACTOR to a number >= 0 and < 0.5; the default 0.01 "
    "allows for 1% clock drift between this host and the nodes.",
    "redlock.E008": "Set NODE_TIMEOUT to a small number of seconds, at most "
    f"{conf.NODE_TIMEOUT_SHARE:.0%} of TTL, e.g. 0.05 with TTL = 10.0.",
    "redlock.E009": "WAIT_TIMEOUT: seconds >= 0, or None to wait without limit. "
    "RETRY_DELAY, RETRY_JITTER: seconds >= 0, not both 0. MAX_HOLD: seconds "
    ">= TTL, or None for no cap on auto-extension. QUEUE_LIFE: seconds above 0 "
    f"and at most {conf.MAX_TTL:g}, e.g. 2.0.",
    "redlock.E010": "Use a short name such as 'redlock' or 'myproject:lock': at most "
    f"{conf.MAX_KEY_PREFIX_LENGTH} characters, no whitespace, no control characters "
    "and none of * ? [ ] \\.",
    "redlock.E011": "Set AUTO_EXTEND, WAKE_UPS, FAIR and HANDOFF to True or False.",
    "redlock.W001": "The quorum is N//2 + 1, so 2 nodes tolerate no failure and "
    "4 nodes tolerate no more failures than 3: use an odd count, 5 recommended.",
    "redlock.W002": "Databases of one server fail together: give every node its "
    "own Redis server.",
    "redlock.W003": "Keep NODE_TIMEOUT well under TTL (at most "
    f"{conf.NODE_TIMEOUT_SHARE:.0%}), or one slow node can eat the validity window.",
    "redlock.W008": "Raise QUEUE_LIFE to at least "
    f"{conf.QUEUE_LIFE_NODE_TIMEOUTS} x NODE_TIMEOUT (the default is "
    f"{conf.DEFAULTS['QUEUE_LIFE']:g} s), or lower NODE_TIMEOUT.",
    "redlock.W004": "Drop ssl_cert_reqs=none (the default is 'required') and set "
    "ssl_ca_certs to the CA that signed the node's certificate.",
}


_OBJ = "settings.REDLOCK"


def fencing_token_null(field: object) -> Error:
    """Return E101 for a ``FencingTokenField`` declared with ``null=True``."""
    return Error(
        "FencingTokenField cannot be null: a NULL token is never older than the "
        "lock's, so every fenced write would be refused.",
        hint="Remove null=True (the field defaults to 0).",
        obj=field,
        id=E101,
    )


def fencing_token_default(field: object, default: object) -> Error:
    """Return E102 for a ``FencingTokenField`` whose ``default`` is not <= 0."""
    return Error(
        f"FencingTokenField default must be an integer <= 0, not {default!r}: "
        "tokens start at 1, so fenced writes would be refused until the lock's "
        "token passed the default.",
        hint="Remove the default (it is 0).",
        obj=field,
        id=E102,
    )


def check_settings(
    app_configs: Sequence[AppConfig] | None = None, **kwargs: Any
) -> list[CheckMessage]:
    """Return an Error or Warning for every problem of ``settings.REDLOCK``.

    The setting is project-wide, so ``app_configs`` is ignored (as Django's own
    cache checks do).
    """
    messages: list[CheckMessage] = []
    for problem in conf.validate(conf.raw_settings()):
        level = Error if problem.level == conf.ERROR else Warning
        messages.append(
            level(problem.msg, hint=HINTS[problem.id], obj=_OBJ, id=problem.id)
        )
    return messages


def _node(spec: address.NodeSpec) -> str:
    return f"REDLOCK['NODES'][{spec.index}] {spec.display}"


def check_nodes(
    app_configs: Sequence[AppConfig] | None = None, **kwargs: Any
) -> list[CheckMessage]:
    """Ask every node its role, identity, eviction and persistence (``--deploy``).

    Uses the lock's own pools (NODE_TIMEOUT, no retries), one pipelined round
    trip per node. An invalid setting is left to ``check_settings``.
    """
    try:
        config = conf.get_settings()
    except ImproperlyConfigured:
        return []
    messages: list[CheckMessage] = []
    seen: dict[tuple[str, object], address.NodeSpec] = {}
    #: The first node seen of each server, whatever its database (W002).
    servers: dict[str, address.NodeSpec] = {}
    pools = nodes.sync_pools(config.nodes, config.node_timeout)
    for spec, pool in zip(config.nodes, pools, strict=True):
        client = redis.Redis(connection_pool=pool)
        try:
            pipe = client.pipeline(transaction=False)
            for section in ("server", "replication", "memory", "persistence"):
                pipe.info(section)
            pipe.config_get("appendfsync")
            *infos, fsync = pipe.execute(raise_on_error=False)
            for info in infos:
                if isinstance(info, Exception):
                    raise info
            server, replication, memory, persistence = infos
        except (redis.RedisError, OSError) as exc:
            messages.append(
                Warning(
                    f"{_node(spec)} did not answer the deploy check: "
                    f"{nodes.describe(exc)}",
                    hint="Check that every node is up and reachable from this "
                    "host; a lock needs a majority of them.",
                    obj=_OBJ,
                    id=W006,
                )
            )
            continue
        role = str(replication.get("role", "master"))
        if role != "master":
            messages.append(
                Error(
                    f"{_node(spec)} is a replica (role {role}): it refuses the "
                    "lock's writes, and a failover could promote it without the "
                    "keys its master granted",
                    hint="List independent masters only, no replicas and no "
                    "replication between nodes.",
                    obj=_OBJ,
                    id=E012,
                )
            )
        run_id = server.get("run_id")
        if run_id:
            key = (str(run_id), spec.identity[-1])
            first = seen.setdefault(key, spec)
            other_db = servers.setdefault(str(run_id), spec)
            if first is spec and other_db is not spec:
                messages.append(
                    Warning(
                        f"NODES[{other_db.index}] and NODES[{spec.index}] are "
                        f"different databases of one Redis server (run_id "
                        f"{str(run_id)[:8]}...) reached by two addresses",
                        hint=HINTS[W002],
                        obj=_OBJ,
                        id=W002,
                    )
                )
            if first is not spec:
                messages.append(
                    Error(
                        f"NODES[{first.index}] and NODES[{spec.index}] are the same "
                        f"Redis server and database (run_id {str(run_id)[:8]}...) "
                        "reached by two addresses, not independent nodes",
                        hint="Give each node its own redis-server, ideally on "
                        "its own host.",
                        obj=_OBJ,
                        id=E013,
                    )
                )
        policy = str(memory.get("maxmemory_policy", "noeviction"))
        if policy != "noeviction":
            messages.append(
                Warning(
                    f"{_node(spec)} has maxmemory-policy {policy} (maxmemory "
                    f"{memory.get('maxmemory', '?')}): under memory pressure it can "
                    "evict lock keys, which all carry a TTL, and grant a held "
                    "lock again",
                    hint="Set maxmemory-policy noeviction on lock nodes (writes "
                    "then fail when memory is full, and the lock reports it).",
                    obj=_OBJ,
                    id=W005,
                )
            )
        persistent = _persistence(persistence, fsync)
        if persistent is not None:
            messages.append(
                Warning(
                    f"{_node(spec)} runs with {persistent}: a crash loses its "
                    "latest writes, the locks it granted and the fencing "
                    "counters, which have no TTL; a later holder can then get a "
                    "fencing token no greater than an earlier one",
                    hint="Run lock nodes with appendonly yes and appendfsync "
                    "always. Keeping a restarted node down longer than the "
                    "longest TTL protects locks, not fencing tokens.",
                    obj=_OBJ,
                    id=W007,
                )
            )
    return messages


def _persistence(persistence: dict[str, Any], fsync: object) -> str | None:
    """Describe a node's persistence unless it is ``appendfsync always``.

    None also when the append-only file is on but CONFIG GET was refused.
    """
    if not int(persistence.get("aof_enabled", 0)):
        return "appendonly no"
    if not isinstance(fsync, dict):
        return None
    policy = next(iter(fsync.values()), b"")
    if isinstance(policy, bytes):
        policy = policy.decode(errors="replace")
    if policy == "always":
        return None
    return f"appendonly yes and appendfsync {policy or '?'}"


# E020: a URL pattern routing to a locked view without a kwarg its template names.
# Registered by the app under Django's ``urls`` tag, not ``redlock``: it reads the
# URLconf, not the setting.


#: A URL pattern routes to a locked view without a kwarg its resource template
#: names.
E020 = "redlock.E020"
_E020_MSG = (
    "lock resource {source!r} of view {view} names {{{name}}}, which URL pattern "
    "{route!r} never passes to the view"
)
_E020_HINT = (
    "Capture <{name}> in the route, pass it in the pattern's kwargs, or use a "
    "request attribute such as {{request.user.pk}}."
)


def _route_names(pattern: Any) -> frozenset[str]:
    regex = getattr(pattern, "regex", None)
    return frozenset(getattr(regex, "groupindex", {}) or {})


def _walk(
    patterns: Sequence[Any], supplied: frozenset[str], prefix: str
) -> Iterator[tuple[URLPattern, frozenset[str], str]]:
    for entry in patterns:
        names = supplied | _route_names(entry.pattern)
        route = prefix + str(entry.pattern)
        if isinstance(entry, URLResolver):
            names |= frozenset(entry.default_kwargs)
            yield from _walk(entry.url_patterns, names, route)
        elif isinstance(entry, URLPattern):
            yield entry, names | frozenset(entry.default_args), route


def _view_guards(callback: Any) -> Iterator[tuple[Guard, str]]:
    found: list[tuple[Guard, str]] = []
    view_class = getattr(callback, "view_class", None)
    if view_class is not None:
        name = name_of(view_class)
        found.extend(
            (g, name) for g in guards_of(getattr(view_class, "dispatch", None))
        )
        mixin_guard = getattr(view_class, "_redlock_guard", None)
        if isinstance(mixin_guard, Guard):
            found.append((mixin_guard, name))
    found.extend((guard, name_of(callback)) for guard in guards_of(callback))
    # as_view() copies the attributes of dispatch onto the view function.
    seen: set[int] = set()
    for guard, name in found:
        if id(guard) not in seen:
            seen.add(id(guard))
            yield guard, name


def check_url_placeholders(
    app_configs: Sequence[AppConfig] | None = None, **kwargs: Any
) -> list[CheckMessage]:
    """Report URL patterns routing to a locked view without a kwarg it names.

    Registered by the app under the ``urls`` tag; it reads the root URLconf only.
    """
    try:
        entries = list(_walk(get_resolver().url_patterns, frozenset(), ""))
    except Exception:
        # A broken URLconf is reported by Django's own urls check.
        return []
    errors: list[CheckMessage] = []
    for entry, supplied, route in entries:
        for guard, view_name in _view_guards(entry.callback):
            if guard.template is None:
                continue
            for name in sorted(guard.template.kwargs - supplied):
                errors.append(
                    Error(
                        _E020_MSG.format(
                            source=guard.template.source,
                            view=view_name,
                            name=name,
                            route=route,
                        ),
                        hint=_E020_HINT.format(name=name),
                        obj=entry,
                        id=E020,
                    )
                )
    return errors
