"""What a NODES entry names: ``NodeSpec``, parsed from a URL or a cache alias.

A node is one independent Redis (or Valkey) master, given in ``REDLOCK["NODES"]``
(or a lock's ``nodes=``) as a URL (``redis://``, ``rediss://``, ``valkey://``,
``valkeys://``, ``unix://``) or as the alias of a Redis or Valkey cache in
``CACHES``. ``parse_node()`` turns an entry into a ``NodeSpec``
without connecting, and ``connection_params()`` gives the redis-py connection class
and arguments that ``nodes.py`` builds its pools from. This module reads no setting:
``conf.py`` hands it the ``CACHES`` setting an alias is looked up in.

URLs can carry passwords, so only ``NodeSpec.display`` (no userinfo, no query
string) ever goes into a message, a log line or a page.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import ipaddress
import re
import ssl
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any
from urllib.parse import parse_qs, unquote, urlsplit

from django.core.exceptions import ImproperlyConfigured
from django.utils.module_loading import import_string
from redis.connection import (
    AbstractConnection,
    Connection,
    SSLConnection,
    UnixDomainSocketConnection,
    parse_url,
)

__all__ = [
    "REDIS_CACHE_BACKENDS",
    "AliasError",
    "NodeSpec",
    "connection_params",
    "parse_node",
    "tls_unverified",
]

REDIS_CACHE_BACKENDS = (
    "django_redis.cache.RedisCache",
    "django.core.cache.backends.redis.RedisCache",
    # django-valkey: a Valkey server through valkey-py; the nodes are still reached
    # with redis-py, which speaks the same protocol.
    "django_valkey.cache.ValkeyCache",
)
#: Valkey's URL schemes, read as the redis-py schemes they stand for.
_VALKEY_SCHEMES = {"valkey": "redis", "valkeys": "rediss"}
#: redis-py's connection class for each URL scheme.
_SCHEME_CLASSES: dict[
    str, type[Connection | SSLConnection | UnixDomainSocketConnection]
] = {
    "redis": Connection,
    "rediss": SSLConnection,
    "unix": UnixDomainSocketConnection,
}
#: The scheme of a connection class by its name: valkey-py's classes have the same
#: names and arguments as redis-py's.
_KINDS = {cls.__name__: scheme for scheme, cls in _SCHEME_CLASSES.items()}

_DEFAULT_PORT = 6379
# Options a URL may carry that configure the pool rather than each connection.
_POOL_OPTIONS = frozenset({"max_connections", "timeout"})
# Keys a redis-py 8 pool adds to its own connection_kwargs: they belong to that pool
# (its maintenance handler and config, the timeouts to restore after a maintenance
# event), so a pool built from them would share state with the cache's, undo its
# timeouts, or refuse RESP2 because the copied config enables notifications.
_POOL_STATE = frozenset(
    {
        "himport_registry",
        "maint_notifications_config",
        "maint_notifications_pool_handler",
        "oss_cluster_maint_notifications_handler",
        "orig_host_address",
        "orig_socket_timeout",
        "orig_socket_connect_timeout",
    }
)
_SCHEME_RE = re.compile(r"[A-Za-z][A-Za-z0-9+.-]{0,15}")


@dataclass(frozen=True)
class NodeSpec:
    """Describe one node of ``REDLOCK["NODES"]`` without connecting to it.

    ``entry`` is the raw setting (it may hold a password, so it is left out of
    ``repr()``); ``alias`` is the cache alias or None for a URL; ``display`` is a
    masked address safe for messages and pages; ``identity`` tells which server
    and database the node is, for duplicate detection: ``("tcp", host, port, db)``
    or ``("unix", path, db)``, with localhost, 127.0.0.1 and ::1 all written
    ``127.0.0.1`` (redis-server listens on both loopback addresses by default).
    """

    index: int
    entry: str = field(repr=False)
    alias: str | None
    display: str
    identity: tuple[str | int, ...]
    #: The ``CACHES`` entry an alias named when it was parsed (None for a URL).
    cache: Mapping[str, Any] | None = field(
        default=None, repr=False, compare=False, hash=False
    )

    def __post_init__(self) -> None:
        # Hashed once: a lock's options (its node list among them) key the
        # resolved configs, and an explicit ``nodes=[...]`` list is hashed at every
        # lock built with it.
        whole = (self.index, self.entry, self.alias, self.display, self.identity)
        object.__setattr__(self, "_hash", hash(whole))

    def __hash__(self) -> int:
        return self._hash  # type: ignore[no-any-return, attr-defined]

    def __reduce__(self) -> tuple[Any, ...]:
        # Rebuilt, not copied: a string's hash differs from process to process.
        fields = (self.index, self.entry, self.alias, self.display, self.identity)
        return (NodeSpec, (*fields, self.cache))

    def __str__(self) -> str:
        return self.display


class AliasError(ValueError):
    """A NODES entry names a cache alias that is not a usable Redis cache."""


#: Said instead of quoting the path or the query of a URL with userinfo.
_ENCODE_HINT = (
    " (not quoted: it may hold part of the password; percent-encode / ? # @ and :"
    " in a password)"
)


class _URLError(ValueError):
    """A URL is malformed; the message is the reason, without the URL."""


@dataclass(frozen=True)
class _Target:
    scheme: str
    host: str
    port: int
    path: str
    db: int
    options: dict[str, Any] = field(repr=False)

    @property
    def display(self) -> str:
        if self.scheme == "unix":
            return f"unix://{self.path}" + (f" (db {self.db})" if self.db else "")
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{self.scheme}://{host}:{self.port}/{self.db}"

    @property
    def identity(self) -> tuple[str | int, ...]:
        if self.scheme == "unix":
            return ("unix", self.path, self.db)
        return ("tcp", _canonical_host(self.host), self.port, self.db)


def parse_node(
    entry: str, index: int, caches: Mapping[str, Any] | None = None
) -> NodeSpec:
    """Parse the NODES entry at position ``index`` into a ``NodeSpec``.

    An entry containing ``://`` is a URL; any other string is an alias looked up
    in ``caches`` (the ``CACHES`` setting, read by ``conf.cache_settings()``).
    Raise ``ValueError`` naming the index and the reason when the entry is not a
    string, is empty, is a malformed URL, or names an alias that is missing or not
    a Redis cache. Messages mask the userinfo.
    """
    where = f"REDLOCK['NODES'][{index}]"
    if not isinstance(entry, str):
        raise ValueError(
            f"{where} must be a string (a Redis URL or a CACHES alias), "
            f"not {type(entry).__name__}"
        )
    if not entry.strip():
        raise ValueError(f"{where} is an empty string")
    if "://" not in entry:
        return _parse_alias(entry, index, where, caches)
    try:
        target = _parse_url(entry)
    except _URLError as exc:
        raise ValueError(
            f"{where} {_mask(entry)!r} is not a valid Redis URL: {exc}"
        ) from None
    return NodeSpec(index, entry, None, target.display, target.identity)


def connection_params(
    node: NodeSpec,
) -> tuple[type[AbstractConnection], dict[str, Any]]:
    """Return the redis-py connection class and its keyword arguments for ``node``.

    For a URL they come from ``redis.connection.parse_url`` (pool-level options
    such as ``max_connections`` are dropped); for a cache alias, from the pool of
    that cache's write client, so the cache's OPTIONS (password, TLS, timeouts)
    apply, without the bookkeeping keys the pool adds for itself. Nothing connects.
    The dict is a fresh copy the caller may change.
    """
    if node.alias is None:
        kwargs = _redis_parse_url(_normalise_scheme(node.entry))
        connection_class = kwargs.pop("connection_class", Connection)
        for option in _POOL_OPTIONS:
            kwargs.pop(option, None)
        return connection_class, kwargs
    from django.core.cache import caches

    cache = caches[node.alias]
    # django-redis wraps its client in ``.client``; Django's own backend in ``._cache``.
    client = getattr(cache, "client", None) or getattr(cache, "_cache", None)
    if client is None or not hasattr(client, "get_client"):
        raise ImproperlyConfigured(
            f"redlock.E004: {node.display} is not a Redis cache with one write client"
        )
    pool = client.get_client(write=True).connection_pool
    kwargs = {
        name: value
        for name, value in pool.connection_kwargs.items()
        if name not in _POOL_STATE
    }
    connection_class = pool.connection_class
    if not issubclass(connection_class, AbstractConnection):
        # A valkey-py pool (django-valkey): the redis-py class of the same kind,
        # given only the arguments it knows.
        scheme = next(
            (
                _KINDS[k.__name__]
                for k in connection_class.__mro__
                if k.__name__ in _KINDS
            ),
            "redis",
        )
        connection_class = _SCHEME_CLASSES[scheme]
        known = _connection_parameters(scheme)
        kwargs = {name: value for name, value in kwargs.items() if name in known}
    return connection_class, kwargs


def _parse_url(url: str) -> _Target:
    scheme = url.partition("://")[0]
    if scheme.lower() not in ("redis", "rediss", "unix", *_VALKEY_SCHEMES):
        shown = repr(scheme) if _SCHEME_RE.fullmatch(scheme) else "of the entry"
        raise _URLError(
            f"the scheme {shown} is not redis://, rediss://, valkey://, valkeys:// "
            "or unix://"
        )
    url = _normalise_scheme(url)
    # A password holding an unencoded "/", "?" or "#" ends the address early, and
    # its rest would be read as the path or the query: with userinfo written, no
    # reason quotes what it read there.
    secret = "@" in url.partition("://")[2]
    try:
        parts = urlsplit(url)
    except ValueError:
        raise _URLError("the host has unbalanced [ ] brackets") from None
    try:
        port = parts.port
    except ValueError:
        port = 0
    if port == 0:
        raise _URLError("the port is not a number from 1 to 65535")
    try:
        options = _redis_parse_url(url)
    except ValueError as exc:
        if secret:
            raise _URLError(f"an option is not valid{_ENCODE_HINT}") from None
        # redis-py names the option but not its value: safe to repeat. redis-py
        # 5.x quotes the name with backticks, 6.0 and later with single quotes.
        reason = str(exc).replace("`", "'")
        raise _URLError(reason[0].lower() + reason[1:].rstrip(".")) from None
    options.pop("connection_class", None)
    _check_options(parts.scheme, options, secret)
    # redis-py takes these from the query when the address lacks them, so the
    # node would connect somewhere else than it is shown and compared as.
    placed = sorted(
        {"host", "port", "path", "unix_socket_path"} & set(parse_qs(parts.query))
    )
    if placed:
        raise _URLError(
            "the query sets "
            + ", ".join(repr(name) for name in placed)
            + ": write the address in the URL itself"
        )
    db = options.get("db", 0)
    if parts.scheme == "unix":
        if not options.get("path"):
            raise _URLError("no socket path (write unix:///path/to.sock)")
        return _Target("unix", "", 0, options["path"], _check_db(db), options)
    if not parts.hostname:
        raise _URLError("no host")
    path = unquote(parts.path)
    if path not in ("", "/") and "db" not in parse_qs(parts.query):
        if not re.fullmatch(r"/\d+/?", path):
            if secret:
                raise _URLError(f"the path is not a database number{_ENCODE_HINT}")
            raise _URLError(f"the path {path!r} is not a database number")
        db = int(path.strip("/"))
    host = unquote(parts.hostname)
    # Shown as written: a valkey:// node stays valkey:// in messages and pages.
    written = scheme.lower() if scheme.lower() in _VALKEY_SCHEMES else parts.scheme
    return _Target(written, host, port or _DEFAULT_PORT, "", _check_db(db), options)


def _check_db(db: int) -> int:
    if db < 0:
        raise _URLError(f"the database number {db} is negative")
    return db


def _check_options(scheme: str, options: dict[str, Any], secret: bool) -> None:
    known = _connection_parameters(scheme) | _POOL_OPTIONS
    unknown = sorted(set(options) - known)
    if unknown and secret:
        raise _URLError(f"the query has an unknown option{_ENCODE_HINT}")
    if unknown:
        raise _URLError(
            "unknown option "
            + ", ".join(repr(name) for name in unknown)
            + f" for a {scheme}:// connection"
        )
    cert_reqs = options.get("ssl_cert_reqs")
    if isinstance(cert_reqs, str) and cert_reqs not in ("none", "optional", "required"):
        raise _URLError("ssl_cert_reqs must be none, optional or required")


@functools.cache
def _connection_parameters(scheme: str) -> frozenset[str]:
    connection_class = _SCHEME_CLASSES[scheme]
    # Connection.__init__ passes **kwargs up to AbstractConnection.__init__, so the
    # accepted names are those of every __init__ in the MRO.
    names: set[str] = set()
    for klass in connection_class.__mro__:
        init = klass.__dict__.get("__init__")
        if init is None:
            continue
        names.update(
            name
            for name, parameter in inspect.signature(init).parameters.items()
            if parameter.kind
            in (parameter.POSITIONAL_OR_KEYWORD, parameter.KEYWORD_ONLY)
        )
    names.discard("self")
    return frozenset(names)


def _redis_parse_url(url: str) -> dict[str, Any]:
    kwargs: dict[str, Any] = parse_url(url)  # type: ignore[no-untyped-call]
    return kwargs


def _parse_alias(
    alias: str, index: int, where: str, caches: Mapping[str, Any] | None
) -> NodeSpec:
    named = f"{where} names the cache alias {_mask(alias)!r}"
    config = caches.get(alias) if isinstance(caches, Mapping) else None
    if not isinstance(config, Mapping):
        looks_like_url = any(char in alias for char in ":/@")
        raise AliasError(
            f"{named}, which is not in CACHES"
            + (" (a URL needs a scheme such as redis://)" if looks_like_url else "")
        )
    backend = config.get("BACKEND")
    if not _is_redis_backend(backend):
        raise AliasError(f"{named}, whose BACKEND {backend!r} is not a Redis cache")
    client_class = _mapping(config.get("OPTIONS")).get("CLIENT_CLASS", "")
    if isinstance(client_class, str) and client_class.endswith("ShardClient"):
        raise AliasError(f"{named}, a sharded cache that spans several servers")
    location = _primary_location(config.get("LOCATION"))
    if location is None:
        raise AliasError(f"{named}, whose LOCATION is not a Redis URL")
    try:
        target = _parse_url(location)
    except _URLError as exc:
        raise AliasError(
            f"{named}, whose LOCATION {_mask(location)!r} is not a valid Redis URL: "
            f"{exc}"
        ) from None
    if not _names_db(location):
        # The cache's pool takes OPTIONS (Django's backend) or its
        # CONNECTION_POOL_KWARGS (django-redis) as defaults the URL overrides.
        options = _mapping(config.get("OPTIONS"))
        pooled = {**options, **_mapping(options.get("CONNECTION_POOL_KWARGS"))}
        db = pooled.get("db", 0)
        if isinstance(db, bool) or not isinstance(db, int) or db < 0:
            raise AliasError(
                f"{named}, whose OPTIONS db {db!r} is not a database number"
            )
        target = replace(target, db=db)
    display = f"cache:{alias} ({target.display})"
    return NodeSpec(index, alias, alias, display, target.identity, cache=config)


def _names_db(url: str) -> bool:
    """Whether the URL says which database (its path or a ``db`` query option)."""
    parts = urlsplit(_normalise_scheme(url))
    return unquote(parts.path) not in ("", "/") or "db" in parse_qs(parts.query)


def _is_redis_backend(backend: object) -> bool:
    if not isinstance(backend, str):
        return False
    if backend in REDIS_CACHE_BACKENDS:
        return True
    try:
        backend_class = import_string(backend)
    except ImportError:
        return False
    bases = []
    for path in REDIS_CACHE_BACKENDS:
        # Only the backends installed here can be subclassed.
        with contextlib.suppress(ImportError):
            bases.append(import_string(path))
    return isinstance(backend_class, type) and issubclass(backend_class, tuple(bases))


def _primary_location(location: object) -> str | None:
    # Both backends write to the first server of a list or a ;/,-separated string.
    if isinstance(location, str):
        location = re.split("[;,]", location)
    if isinstance(location, list | tuple) and location:
        first = location[0]
        if isinstance(first, str) and "://" in first:
            return first
    return None


def _mapping(value: object) -> Mapping[str, Any]:
    return value if isinstance(value, Mapping) else {}


def _normalise_scheme(url: str) -> str:
    # parse_url() only accepts a lower-case redis-py scheme.
    scheme, _, rest = url.partition("://")
    scheme = scheme.lower()
    return f"{_VALKEY_SCHEMES.get(scheme, scheme)}://{rest}"


def _mask(entry: str) -> str:
    """Return ``entry`` with everything up to its last ``@`` and its query hidden."""
    # The first "://" ends the scheme: a password may hold another one.
    scheme, separator, rest = entry.partition("://")
    if not separator:
        scheme, rest = "", entry
    if "@" in rest:
        rest = "***@" + rest.rpartition("@")[2]
    rest = rest.partition("?")[0].partition("#")[0]
    return f"{scheme}{separator}{rest}"


def _canonical_host(host: str) -> str:
    host = host.lower().rstrip(".")
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        return "127.0.0.1" if host == "localhost" else host
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped:
        address = address.ipv4_mapped
    return "127.0.0.1" if str(address) in ("127.0.0.1", "::1") else str(address)


def tls_unverified(node: NodeSpec) -> bool:
    """Tell whether ``node`` uses TLS without verifying the server certificate."""
    if node.alias is None:
        url, extra = node.entry, {}
    else:
        config = node.cache
        assert config is not None
        url = _primary_location(config.get("LOCATION")) or ""
        options = _mapping(config.get("OPTIONS"))
        # Django's backend passes OPTIONS to the pool; django-redis nests them.
        extra = {**options, **_mapping(options.get("CONNECTION_POOL_KWARGS"))}
    if not _normalise_scheme(url).startswith("rediss://"):
        return False
    cert_reqs = {**_parse_url(url).options, **extra}.get("ssl_cert_reqs", "required")
    # redis-py reads None as ssl.CERT_NONE.
    return cert_reqs is None or cert_reqs in ("none", ssl.CERT_NONE)
