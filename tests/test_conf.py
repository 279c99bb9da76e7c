"""Settings parsing and caching in ``redlock_django.conf``; no Redis server needed."""

from __future__ import annotations

import math
from typing import Any

import pytest
from django.core.exceptions import ImproperlyConfigured
from django.test import override_settings
from redis.connection import Connection, SSLConnection, UnixDomainSocketConnection

from redlock_django import checks, conf
from redlock_django.address import NodeSpec, connection_params, parse_node
from redlock_django.conf import get_settings
from redlock_django.options import resolve

FIVE_NODES = [f"redis://10.0.0.{i}:6379/0" for i in range(1, 6)]
SECRET = "s3cret-pw"


def ids(problems: list[conf.Problem]) -> list[str]:
    return [problem.id for problem in problems]


# --- get_settings / reset ---------------------------------------------------------


def test_get_settings_fills_unset_keys_with_the_defaults(settings: Any) -> None:
    """Keys left out of REDLOCK take the values of DEFAULTS, as float seconds."""
    settings.REDLOCK = {"NODES": FIVE_NODES}

    result = get_settings()

    assert result == conf.RedlockSettings(
        nodes=tuple(parse_node(entry, i) for i, entry in enumerate(FIVE_NODES)),
        key_prefix="redlock",
        ttl=10.0,
        wait_timeout=10.0,
        retry_delay=0.05,
        retry_jitter=0.05,
        drift_factor=0.01,
        node_timeout=0.05,
        auto_extend=False,
        max_hold=300.0,
    )


def test_get_settings_converts_integers_to_float_seconds(settings: Any) -> None:
    """Integer durations come back as floats; None stays None where allowed."""
    settings.REDLOCK = {
        "NODES": FIVE_NODES,
        "TTL": 30,
        "WAIT_TIMEOUT": None,
        "MAX_HOLD": None,
        "AUTO_EXTEND": True,
        "KEY_PREFIX": "shop:lock",
    }

    result = get_settings()

    assert type(result.ttl) is float and result.ttl == 30.0
    assert result.wait_timeout is None
    assert result.max_hold is None
    assert result.auto_extend is True
    assert result.key_prefix == "shop:lock"


def test_get_settings_is_cached_until_the_setting_changes(settings: Any) -> None:
    """Two calls return the same object; a new REDLOCK gives a new one."""
    settings.REDLOCK = {"NODES": FIVE_NODES, "TTL": 5.0}
    first = get_settings()
    assert get_settings() is first

    settings.REDLOCK = {"NODES": FIVE_NODES, "TTL": 7.0}

    assert get_settings().ttl == 7.0


def test_resolved_lock_configs_are_remembered_per_settings_and_options(
    settings: Any,
) -> None:
    """Equal values given for different options, or new settings, get their own
    config; the same request gets the remembered one."""
    settings.REDLOCK = {"NODES": FIVE_NODES, "TTL": 5.0}
    first = get_settings()
    ttl = resolve(first, "r", False, {"ttl": 2.0})
    assert resolve(first, "r", False, {"ttl": 2.0}) is ttl
    delay = resolve(first, "r", False, {"retry_delay": 2.0})
    assert (ttl.spec.ttl, ttl.spec.retry_delay) == (2.0, first.retry_delay)
    assert (delay.spec.ttl, delay.spec.retry_delay) == (5.0, 2.0)
    fenced = resolve(first, "r", True, {"ttl": 2.0})
    assert fenced.spec.fence_key is not None and ttl.spec.fence_key is None

    settings.REDLOCK = {"NODES": FIVE_NODES, "TTL": 7.0, "KEY_PREFIX": "other"}
    again = resolve(get_settings(), "r", False, {"retry_delay": 2.0})
    assert (again.spec.ttl, again.spec.key) == (7.0, "other:lock:r")


def test_get_settings_follows_override_settings_and_restores_after() -> None:
    """override_settings changes the result inside the block, and not after it."""
    before = get_settings()

    with override_settings(REDLOCK={"NODES": FIVE_NODES[:3], "KEY_PREFIX": "other"}):
        inside = get_settings()

    assert inside.key_prefix == "other"
    assert len(inside.nodes) == 3
    assert get_settings() == before


def test_get_settings_follows_a_change_of_caches(settings: Any) -> None:
    """A node given as a cache alias picks up a new CACHES LOCATION."""
    settings.CACHES = {**settings.CACHES, "locks": _django_redis("redis://h1:6379/1")}
    settings.REDLOCK = {"NODES": ["locks"]}
    assert get_settings().nodes[0].display == "cache:locks (redis://h1:6379/1)"

    settings.CACHES = {**settings.CACHES, "locks": _django_redis("redis://h2:6379/2")}

    assert get_settings().nodes[0].display == "cache:locks (redis://h2:6379/2)"


def test_changing_redlock_or_caches_resets_the_node_clients(
    settings: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The setting_changed receiver closes nodes.py's clients for REDLOCK and CACHES."""
    from redlock_django import nodes

    calls: list[str] = []
    monkeypatch.setattr(nodes, "reset", lambda: calls.append("reset"))

    settings.REDLOCK = {"NODES": FIVE_NODES}
    settings.CACHES = {**settings.CACHES}
    settings.USE_TZ = not settings.USE_TZ

    assert calls == ["reset", "reset"]


def test_get_settings_raises_improperly_configured_starting_with_the_check_id(
    settings: Any,
) -> None:
    """A bad REDLOCK fails at runtime with the same id the system check reports."""
    settings.REDLOCK = {"NODES": []}

    with pytest.raises(ImproperlyConfigured) as excinfo:
        get_settings()

    assert str(excinfo.value).startswith("redlock.E002: REDLOCK['NODES'] is empty")


def test_get_settings_names_every_error_and_never_a_password(settings: Any) -> None:
    """All errors are listed, each with its id; a URL's password is masked."""
    settings.REDLOCK = {
        "NODES": [f"redis://:{SECRET}@h1:port/0", "redis://h2/0", "redis://h3/0"],
        "TTL": -1,
    }

    with pytest.raises(ImproperlyConfigured) as excinfo:
        get_settings()

    message = str(excinfo.value)
    assert "redlock.E003: REDLOCK['NODES'][0] 'redis://***@h1:port/0'" in message
    assert "; redlock.E006: REDLOCK['TTL'] is -1" in message
    assert SECRET not in message


def test_get_settings_does_not_raise_for_warnings(settings: Any) -> None:
    """An even node count is a warning, so the settings still load."""
    settings.REDLOCK = {"NODES": FIVE_NODES[:4]}

    assert len(get_settings().nodes) == 4


def test_missing_redlock_setting_counts_as_an_empty_dict(settings: Any) -> None:
    """Without settings.REDLOCK the only problem is the missing NODES."""
    del settings.REDLOCK

    assert conf.raw_settings() == {}
    assert ids(conf.validate(conf.raw_settings())) == ["redlock.E002"]
    with pytest.raises(ImproperlyConfigured, match=r"^redlock\.E002: "):
        get_settings()


# --- validate ---------------------------------------------------------------------


def test_a_good_five_node_config_has_no_problems() -> None:
    """Five distinct servers with every key set to a sane value pass cleanly."""
    config = {**conf.DEFAULTS, "NODES": FIVE_NODES, "WAIT_TIMEOUT": None}

    assert conf.validate(config) == []


@pytest.mark.parametrize(
    ("key", "suggestion"),
    [
        ("NODE", "; did you mean 'NODES'?"),
        ("ttl", "; did you mean 'TTL'?"),
        ("TIMEOUT", "; did you mean 'WAIT_TIMEOUT' or 'NODE_TIMEOUT'?"),
        ("RETRY_DELAYS", "; did you mean 'RETRY_DELAY'?"),
        ("PASSWORD", ""),
    ],
)
def test_unknown_key_names_the_key_and_suggests_the_closest(
    key: str, suggestion: str
) -> None:
    """A typo is named, with the nearest known key(s) when one is close enough."""
    problems = conf.validate({"NODES": FIVE_NODES, key: 1})

    assert [(p.level, p.id, p.msg) for p in problems] == [
        ("error", "redlock.E001", f"REDLOCK has an unknown key {key!r}{suggestion}")
    ]


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        ({"TTL": True}, "redlock.E006"),
        ({"TTL": math.nan}, "redlock.E006"),
        ({"TTL": math.inf}, "redlock.E006"),
        ({"TTL": "10"}, "redlock.E006"),
        ({"TTL": 86400.5}, "redlock.E006"),
        ({"DRIFT_FACTOR": 0.5}, "redlock.E007"),
        ({"DRIFT_FACTOR": -0.001}, "redlock.E007"),
        ({"NODE_TIMEOUT": None}, "redlock.E008"),
        ({"NODE_TIMEOUT": 0}, "redlock.E008"),
        ({"WAIT_TIMEOUT": math.inf}, "redlock.E009"),
        ({"WAIT_TIMEOUT": -0.1}, "redlock.E009"),
        ({"RETRY_JITTER": -1}, "redlock.E009"),
        ({"MAX_HOLD": False}, "redlock.E009"),
        ({"QUEUE_LIFE": True}, "redlock.E009"),
        ({"QUEUE_LIFE": -2.0}, "redlock.E009"),
        ({"QUEUE_LIFE": math.nan}, "redlock.E009"),
        ({"AUTO_EXTEND": 1}, "redlock.E011"),
    ],
)
def test_values_of_the_wrong_type_or_range_are_errors(
    overrides: dict[str, object], expected: str
) -> None:
    """Bools are not numbers, NaN and infinity are not durations."""
    assert ids(conf.validate({"NODES": FIVE_NODES, **overrides})) == [expected]


@pytest.mark.parametrize(
    "overrides",
    [
        {"TTL": 86400, "MAX_HOLD": 86400},
        {"TTL": 1, "NODE_TIMEOUT": 0.05, "MAX_HOLD": 1},
        {"DRIFT_FACTOR": 0},
        {"WAIT_TIMEOUT": 0},
        {"RETRY_DELAY": 0},
        {"RETRY_JITTER": 0},
        {"MAX_HOLD": None},
        {"KEY_PREFIX": "x" * 64},
        {"QUEUE_LIFE": 86400},
        {"QUEUE_LIFE": 0.5, "FAIR": True},  # 10 x the default NODE_TIMEOUT
    ],
)
def test_boundary_values_are_accepted(overrides: dict[str, object]) -> None:
    """The limits themselves are valid: a day of TTL, zero waits, 64-char prefix."""
    assert conf.validate({"NODES": FIVE_NODES, **overrides}) == []


def test_max_hold_below_ttl_is_an_error_even_when_left_at_its_default() -> None:
    """A TTL above the default MAX_HOLD (300 s) needs MAX_HOLD raised too."""
    problems = conf.validate({"NODES": FIVE_NODES, "TTL": 600})

    assert [(p.id, p.msg) for p in problems] == [
        (
            "redlock.E009",
            "REDLOCK['MAX_HOLD'] (300, the default) is less than TTL (600): the "
            "first lease would already outlive the cap",
        )
    ]


def test_node_timeout_just_above_five_percent_of_ttl_warns() -> None:
    """W003 starts right above NODE_TIMEOUT = 5% of TTL."""
    assert conf.validate({"NODES": FIVE_NODES, "TTL": 2, "NODE_TIMEOUT": 0.1}) == []

    problems = conf.validate({"NODES": FIVE_NODES, "TTL": 2, "NODE_TIMEOUT": 0.101})

    assert [(p.level, p.id) for p in problems] == [("warning", "redlock.W003")]


def test_node_timeout_that_leaves_no_validity_is_an_error() -> None:
    """TTL minus drift (ttl * factor + 2 ms) minus NODE_TIMEOUT must stay above 0."""
    problems = conf.validate({"NODES": FIVE_NODES, "TTL": 0.01, "NODE_TIMEOUT": 0.008})

    assert ids(problems) == ["redlock.E008"]
    assert "leaves no validity" in problems[0].msg


def test_every_problem_has_a_hint(settings) -> None:
    """Each problem's check message says how to fix it."""
    settings.REDLOCK = {"NODES": "redis://h/0", "TTL": 0, "X": 1}
    messages = checks.check_settings()

    assert [m.id for m in messages] == ["redlock.E001", "redlock.E002", "redlock.E006"]
    assert all(message.hint for message in messages)
    settings_ids = {f"redlock.E{n:03}" for n in range(1, 12)}
    warnings = {f"redlock.W{n:03}" for n in (1, 2, 3, 4, 8)}
    assert set(checks.HINTS) == settings_ids | warnings


def test_a_node_spec_pickled_in_another_process_hashes_as_one_parsed_here() -> None:
    """NodeSpec keeps its hash from construction; a copy made by another process
    (another hash seed: string hashes differ) is rebuilt, so it equals and hashes
    like the same node parsed here, and finds the same dict entries."""
    import os
    import pickle
    import subprocess
    import sys

    entry = "redis://cache.example.com:7001/2"
    script = (
        "import pickle, sys; from redlock_django.address import parse_node; "
        f"sys.stdout.buffer.write(pickle.dumps(parse_node({entry!r}, 3)))"
    )
    seed = "54321" if os.environ.get("PYTHONHASHSEED") == "12345" else "12345"
    env = {**os.environ, "PYTHONHASHSEED": seed}
    done = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    theirs = pickle.loads(done.stdout)
    ours = parse_node(entry, 3)
    assert theirs == ours
    assert hash(theirs) == hash(ours)
    assert {ours: "pools"}[theirs] == "pools"


# --- parse_node -------------------------------------------------------------------


@pytest.mark.parametrize(
    ("entry", "display", "identity"),
    [
        (
            "redis://127.0.0.1:7001/0",
            "redis://127.0.0.1:7001/0",
            ("127.0.0.1", 7001, 0),
        ),
        ("redis://localhost", "redis://localhost:6379/0", ("127.0.0.1", 6379, 0)),
        ("redis://[::1]:7002/3", "redis://[::1]:7002/3", ("127.0.0.1", 7002, 3)),
        ("redis://Cache.Example.COM/2", "redis://cache.example.com:6379/2", None),
        ("redis://h:7001/1?db=4", "redis://h:7001/4", ("h", 7001, 4)),
        ("REDIS://h:7001", "redis://h:7001/0", ("h", 7001, 0)),
        ("rediss://h:6380/0", "rediss://h:6380/0", ("h", 6380, 0)),
    ],
)
def test_parse_node_reads_tcp_urls(
    entry: str, display: str, identity: tuple[object, ...] | None
) -> None:
    """Host, port (6379 by default) and db (0 by default, ?db= wins) are read."""
    node = parse_node(entry, 2)

    assert node.index == 2
    assert node.alias is None
    assert node.entry == entry
    assert node.display == display
    assert str(node) == display
    if identity is not None:
        assert node.identity == ("tcp", *identity)


def test_parse_node_reads_a_unix_socket_url() -> None:
    """A unix:// node is identified by its socket path and db."""
    node = parse_node("unix:///tmp/redis.sock?db=3", 0)

    assert node.identity == ("unix", "/tmp/redis.sock", 3)
    assert node.display == "unix:///tmp/redis.sock (db 3)"
    assert parse_node("unix:///tmp/redis.sock", 0).display == "unix:///tmp/redis.sock"


def test_parse_node_never_shows_the_password() -> None:
    """Userinfo and query string stay out of display, str() and repr()."""
    entry = f"rediss://admin:{SECRET}@h:6380/1?password={SECRET}"

    node = parse_node(entry, 0)

    assert node.display == "rediss://h:6380/1"
    for text in (str(node), repr(node), node.display):
        assert SECRET not in text
        assert "admin" not in text


@pytest.mark.parametrize(
    ("entry", "reason"),
    [
        (
            "http://h:6379",
            "the scheme 'http' is not redis://, rediss://, valkey://, valkeys:// "
            "or unix://",
        ),
        ("redis://", "no host"),
        (f"redis://:{SECRET}@/0", "no host"),
        (f"redis://:{SECRET}@h:abc/0", "the port is not a number from 1 to 65535"),
        ("redis://h:70000", "the port is not a number from 1 to 65535"),
        ("redis://h:0", "the port is not a number from 1 to 65535"),
        ("redis://h/abc", "the path '/abc' is not a database number"),
        ("redis://h/1/2", "the path '/1/2' is not a database number"),
        ("redis://h?db=-1", "the database number -1 is negative"),
        ("redis://h?db=x", "invalid value for 'db' in connection URL"),
        ("redis://h?socket_timeout=soon", "invalid value for 'socket_timeout'"),
        ("redis://h?colour=red", "unknown option 'colour' for a redis:// connection"),
        ("rediss://h?ssl_cert_reqs=NONE", "ssl_cert_reqs must be none"),
        ("redis://[::1:7000", "the host has unbalanced [ ] brackets"),
        ("unix://", "no socket path"),
    ],
)
def test_parse_node_rejects_malformed_urls_with_the_reason(
    entry: str, reason: str
) -> None:
    """The ValueError names the entry's index and what is wrong, password masked."""
    with pytest.raises(ValueError) as excinfo:
        parse_node(entry, 4)

    message = str(excinfo.value)
    assert message.startswith("REDLOCK['NODES'][4] ")
    assert "is not a valid Redis URL: " + reason in message
    assert SECRET not in message


@pytest.mark.parametrize(
    ("entry", "message"),
    [
        ("", "REDLOCK['NODES'][1] is an empty string"),
        (
            7001,
            "REDLOCK['NODES'][1] must be a string (a Redis URL or a CACHES alias), "
            "not int",
        ),
        (
            "nosuchcache",
            "REDLOCK['NODES'][1] names the cache alias 'nosuchcache', which is not "
            "in CACHES",
        ),
        (
            f"redis:{SECRET}@h:6379",
            "REDLOCK['NODES'][1] names the cache alias '***@h:6379', which is not "
            "in CACHES (a URL needs a scheme such as redis://)",
        ),
    ],
)
def test_parse_node_rejects_non_urls_that_are_not_cache_aliases(
    entry: Any, message: str
) -> None:
    """Empty strings, non-strings and unknown aliases raise a specific ValueError."""
    with pytest.raises(ValueError) as excinfo:
        parse_node(entry, 1)

    assert str(excinfo.value) == message


def test_parse_node_reads_the_location_of_a_cache_alias(settings: Any) -> None:
    """An alias is identified by the first (write) server of its LOCATION."""
    settings.CACHES = {
        **settings.CACHES,
        "locks": {
            "BACKEND": "django.core.cache.backends.redis.RedisCache",
            "LOCATION": f"redis://:{SECRET}@LOCALHOST:6390/1;redis://replica:6390/1",
        },
    }

    node = parse_node("locks", 3, settings.CACHES)

    assert node == NodeSpec(
        3, "locks", "locks", "cache:locks (redis://localhost:6390/1)",
        ("tcp", "127.0.0.1", 6390, 1),
    )  # fmt: skip
    assert SECRET not in repr(node)


@pytest.mark.parametrize(
    ("cache", "reason"),
    [
        (
            {"BACKEND": "django.core.cache.backends.locmem.LocMemCache"},
            "whose BACKEND 'django.core.cache.backends.locmem.LocMemCache' is not "
            "a Redis cache",
        ),
        (
            {
                "BACKEND": "django_redis.cache.RedisCache",
                "LOCATION": ["redis://a:6379/0", "redis://b:6379/0"],
                "OPTIONS": {"CLIENT_CLASS": "django_redis.client.ShardClient"},
            },
            "a sharded cache that spans several servers",
        ),
        (
            {"BACKEND": "django_redis.cache.RedisCache"},
            "whose LOCATION is not a Redis URL",
        ),
        (
            {
                "BACKEND": "django_redis.cache.RedisCache",
                "LOCATION": f"redis://:{SECRET}@h:port/0",
            },
            "whose LOCATION 'redis://***@h:port/0' is not a valid Redis URL: "
            "the port is not a number from 1 to 65535",
        ),
    ],
)
def test_parse_node_rejects_aliases_of_unusable_caches(
    settings: Any, cache: dict[str, Any], reason: str
) -> None:
    """Only a cache with a Redis backend and a single-server URL is a node."""
    settings.CACHES = {**settings.CACHES, "locks": cache}

    with pytest.raises(ValueError) as excinfo:
        parse_node("locks", 0, settings.CACHES)

    assert str(excinfo.value) == (
        f"REDLOCK['NODES'][0] names the cache alias 'locks', {reason}"
    )


# --- connection_params ------------------------------------------------------------


def test_connection_params_for_a_redis_url() -> None:
    """A redis:// URL gives Connection and parse_url's kwargs, minus pool options."""
    node = parse_node(f"redis://u:{SECRET}@h:7001/2?socket_timeout=1.5", 0)

    connection_class, kwargs = connection_params(node)

    assert connection_class is Connection
    assert kwargs == {
        "host": "h",
        "port": 7001,
        "db": 2,
        "username": "u",
        "password": SECRET,
        "socket_timeout": 1.5,
    }


def test_connection_params_drops_pool_options() -> None:
    """max_connections configures a pool, not a connection, so it is left out."""
    node = parse_node("redis://h:7001/0?max_connections=5", 0)

    assert "max_connections" not in connection_params(node)[1]


@pytest.mark.parametrize(
    ("entry", "expected_class", "expected"),
    [
        (
            "rediss://h:6380/0?ssl_cert_reqs=optional",
            SSLConnection,
            {"host": "h", "port": 6380, "db": 0, "ssl_cert_reqs": "optional"},
        ),
        (
            "unix:///tmp/r.sock?db=3",
            UnixDomainSocketConnection,
            {"path": "/tmp/r.sock", "db": 3},
        ),
    ],
)
def test_connection_params_picks_the_class_for_the_scheme(
    entry: str, expected_class: type, expected: dict[str, object]
) -> None:
    """rediss:// maps to SSLConnection, unix:// to UnixDomainSocketConnection."""
    connection_class, kwargs = connection_params(parse_node(entry, 0))

    assert connection_class is expected_class
    assert kwargs == expected


def test_connection_params_for_a_django_redis_alias(settings: Any) -> None:
    """The class and kwargs come from the cache's own pool: its OPTIONS apply."""
    settings.CACHES = {
        **settings.CACHES,
        "locks": _django_redis(
            "redis://127.0.0.1:6390/1",
            OPTIONS={"PASSWORD": SECRET, "SOCKET_TIMEOUT": 2.5},
        ),
    }
    node = parse_node("locks", 0, settings.CACHES)

    connection_class, kwargs = connection_params(node)

    assert connection_class is Connection
    assert kwargs["host"] == "127.0.0.1"
    assert kwargs["port"] == 6390
    assert kwargs["db"] == 1
    assert kwargs["password"] == SECRET
    assert kwargs["socket_timeout"] == 2.5
    # The pool's own bookkeeping would tie a new pool to the cache's pool.
    assert "maint_notifications_pool_handler" not in kwargs
    assert "maint_notifications_config" not in kwargs
    assert "orig_socket_timeout" not in kwargs


def test_connection_params_for_a_django_builtin_redis_alias(settings: Any) -> None:
    """Django's own RedisCache works too, with OPTIONS passed to its pool."""
    settings.CACHES = {
        **settings.CACHES,
        "locks": {
            "BACKEND": "django.core.cache.backends.redis.RedisCache",
            "LOCATION": "rediss://h:6391/2",
            "OPTIONS": {"ssl_cert_reqs": "required"},
        },
    }

    connection_class, kwargs = connection_params(
        parse_node("locks", 0, settings.CACHES)
    )

    assert connection_class is SSLConnection
    assert (kwargs["host"], kwargs["port"], kwargs["db"]) == ("h", 6391, 2)
    assert kwargs["ssl_cert_reqs"] == "required"


@pytest.mark.parametrize(
    ("entry", "display", "expected_class"),
    [
        ("valkey://h:6379/2", "valkey://h:6379/2", Connection),
        ("VALKEYS://h:6380/0", "valkeys://h:6380/0", SSLConnection),
    ],
)
def test_valkey_urls_are_redis_protocol_nodes_shown_as_written(
    entry: str, display: str, expected_class: type
) -> None:
    """valkey:// and valkeys:// are redis:// and rediss:// to the client."""
    node = parse_node(entry, 0)
    connection_class, kwargs = connection_params(node)

    assert node.display == display
    assert (
        node.identity
        == parse_node(entry.lower().replace("valkey", "redis"), 0).identity
    )
    assert connection_class is expected_class
    assert kwargs["host"] == "h"


def test_connection_params_for_a_django_valkey_alias(settings: Any) -> None:
    """django-valkey's pool is valkey-py's: its kind and arguments map to redis-py."""
    settings.CACHES = {
        **settings.CACHES,
        "locks": {
            "BACKEND": "django_valkey.cache.ValkeyCache",
            "LOCATION": "valkey://127.0.0.1:6392/3",
            "OPTIONS": {"PASSWORD": SECRET},
        },
    }
    node = parse_node("locks", 0, settings.CACHES)

    connection_class, kwargs = connection_params(node)

    assert node.display == "cache:locks (valkey://127.0.0.1:6392/3)"
    assert connection_class is Connection
    assert (kwargs["host"], kwargs["port"], kwargs["db"]) == ("127.0.0.1", 6392, 3)
    assert kwargs["password"] == SECRET


def test_connection_params_returns_a_fresh_dict(settings: Any) -> None:
    """Changing the returned kwargs does not change the cache's pool or later calls."""
    settings.CACHES = {**settings.CACHES, "locks": _django_redis("redis://h:6390/1")}
    node = parse_node("locks", 0, settings.CACHES)

    connection_params(node)[1]["socket_timeout"] = 99

    assert connection_params(node)[1].get("socket_timeout") != 99


def _django_redis(location: str, **extra: Any) -> dict[str, Any]:
    return {"BACKEND": "django_redis.cache.RedisCache", "LOCATION": location, **extra}


def test_a_cache_alias_takes_its_db_from_options_as_its_pool_does(
    settings: Any,
) -> None:
    """Django's RedisCache (OPTIONS) and django-redis (CONNECTION_POOL_KWARGS) give
    the pool a db the URL overrides: an alias on ``redis://h:6379`` with db 1 is
    the database of ``redis://h:6379/1`` (E005 when both are listed; they were
    compared as db 0), and two aliases on dbs 1 and 2 are two databases."""
    location = "redis://127.0.0.1:6379"
    settings.CACHES = {
        **settings.CACHES,
        "one": {"BACKEND": "django.core.cache.backends.redis.RedisCache",
                "LOCATION": location, "OPTIONS": {"db": 1}},
        "two": {"BACKEND": "django_redis.cache.RedisCache", "LOCATION": location,
                "OPTIONS": {"CONNECTION_POOL_KWARGS": {"db": 2}}},
        "url-wins": {"BACKEND": "django.core.cache.backends.redis.RedisCache",
                     "LOCATION": f"{location}/3", "OPTIONS": {"db": 1}},
        "bad-db": {"BACKEND": "django.core.cache.backends.redis.RedisCache",
                   "LOCATION": location, "OPTIONS": {"db": "one"}},
    }  # fmt: skip
    node = parse_node("one", 0, settings.CACHES)
    assert connection_params(node)[1]["db"] == 1  # where its locks really go
    assert node.display == "cache:one (redis://127.0.0.1:6379/1)"
    assert parse_node("url-wins", 0, settings.CACHES).display.endswith(":6379/3)")
    others = FIVE_NODES[:3]
    duplicate = conf.validate({"NODES": ["one", f"{location}/1", *others]})
    assert [p.id for p in duplicate] == ["redlock.E005"], duplicate
    distinct = conf.validate({"NODES": ["one", "two", *others]})
    assert all(p.id != "redlock.E005" for p in distinct), distinct
    bad = conf.validate({"NODES": ["bad-db", *others]})
    assert any("OPTIONS db 'one'" in p.msg for p in bad), bad


@pytest.mark.parametrize("query", ["port=7000", "host=10.9.9.9"])
def test_an_address_given_in_the_query_string_is_refused(query: str) -> None:
    """redis-py connects to ``?port=7000`` when the URL has no port, though the node
    was shown and compared (E005) as port 6379: the address belongs in the URL."""
    problems = conf.validate({"NODES": [f"redis://h/0?{query}", *FIVE_NODES[:2]]})
    assert [p.id for p in problems] == ["redlock.E003"], problems
    assert f"the query sets {query.partition('=')[0]!r}" in problems[0].msg


@pytest.mark.parametrize("key", ["TTL", "NODE_TIMEOUT", "MAX_HOLD", "WAIT_TIMEOUT"])
def test_an_integer_too_large_for_a_float_is_a_check_error_not_a_crash(
    key: str,
) -> None:
    """A duration past the float range is reported with its check id (it raised
    OverflowError out of the checks); as an argument, a ValueError, or for a wait
    no deadline."""
    problems = conf.validate({"NODES": FIVE_NODES[:3], key: 10**400})
    assert problems and all(p.level == conf.ERROR for p in problems), problems
    with pytest.raises(ValueError, match="ttl must be a positive number"):
        conf.check_seconds("ttl", 10**400)
    assert conf.check_seconds("timeout", 10**400, wait=True) == math.inf
