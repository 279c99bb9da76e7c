"""The public API is exactly what redlock_django exports."""

from __future__ import annotations

import redlock_django
from redlock_django import exceptions


def test_all_lists_every_public_name_and_nothing_else() -> None:
    public = {
        name
        for name, value in vars(redlock_django).items()
        if not name.startswith("_") and not isinstance(value, type(redlock_django))
    }
    assert set(redlock_django.__all__) == public | {"__version__"}


#: The public API as released; a change here is a change for every user.
PUBLIC_API = {
    "DistributedLockMixin",
    "FencedQuerySet",
    "FencingTokenField",
    "LockContentionError",
    "LockError",
    "LockLostError",
    "LockNotOwnedError",
    "MissingFencingTokenError",
    "QuorumUnavailableError",
    "Redlock",
    "SingletonCommandMixin",
    "StaleFencingTokenError",
    "__version__",
    "afenced_update",
    "current_lock",
    "distributed_lock",
    "fenced_update",
    "locked",
    "model_lock",
    "model_resource",
}


def test_all_is_the_released_public_api() -> None:
    """Moving code between modules leaves the names users import unchanged."""
    assert set(redlock_django.__all__) == PUBLIC_API
    assert len(redlock_django.__all__) == len(PUBLIC_API)


def test_every_exception_derives_from_lock_error() -> None:
    for name in exceptions.__all__:
        cls = getattr(exceptions, name)
        assert getattr(redlock_django, name) is cls
        if cls is not redlock_django.MissingFencingTokenError:
            assert issubclass(cls, redlock_django.LockError)
    assert issubclass(redlock_django.StaleFencingTokenError, redlock_django.LockError)
    # A programming error, not a lock failure a view would turn into 423/503.
    assert issubclass(redlock_django.MissingFencingTokenError, ValueError)
    assert not issubclass(
        redlock_django.MissingFencingTokenError, redlock_django.LockError
    )


def test_lock_error_carries_its_context() -> None:
    err = redlock_django.QuorumUnavailableError(
        "could not acquire 'r': 1/5 nodes, quorum 3",
        resource="r",
        granted=1,
        nodes=5,
        quorum=3,
        failed={"redis://127.0.0.1:7001/0": "timed out"},
    )
    assert (err.resource, err.granted, err.nodes, err.quorum) == ("r", 1, 5, 3)
    assert err.failed == {"redis://127.0.0.1:7001/0": "timed out"}
    assert str(err) == "could not acquire 'r': 1/5 nodes, quorum 3"


#: ``redlock_django.testing``: for users' test suites, never imported by the library.
TESTING_API = {
    "HOST",
    "SERVER_ENV",
    "TEST_TIMINGS",
    "NodeSet",
    "RedisNode",
    "RedisNodeError",
    "ServerNotFoundError",
    "find_redis_server",
    "find_valkey_server",
    "free_port",
    "redlock_config",
}


def test_testing_all_is_its_released_api() -> None:
    """The test helpers' names are pinned like the library's, and all exist."""
    import redlock_django.testing as testing

    assert set(testing.__all__) == TESTING_API
    assert all(hasattr(testing, name) for name in TESTING_API)
