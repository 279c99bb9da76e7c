"""The library's exceptions cross process boundaries intact.

Celery stores a task's exception in its result backend and hands it to eager
callers through pickle; multiprocessing does the same. Every error keeps its
class, message and context fields through a pickle round trip.
"""

from __future__ import annotations

import pickle

import pytest

from redlock_django import (
    LockContentionError,
    LockError,
    LockLostError,
    LockNotOwnedError,
    MissingFencingTokenError,
    QuorumUnavailableError,
    StaleFencingTokenError,
)


@pytest.mark.parametrize(
    "error",
    [
        LockError("m", resource="r"),
        LockContentionError(
            "could not acquire 'r': 1/3 nodes, quorum 2",
            resource="r",
            granted=1,
            nodes=3,
            quorum=2,
            failed={"node 2": "timeout"},
        ),
        QuorumUnavailableError("m", resource="r", nodes=5, quorum=3),
        LockNotOwnedError("m", resource="r"),
        LockLostError("m", resource="r", granted=2),
        StaleFencingTokenError(
            "m", resource="r", token=4, stored_token=7, read_token=3
        ),
        MissingFencingTokenError("m", resource="r"),
    ],
    ids=lambda error: type(error).__name__,
)
def test_errors_survive_a_pickle_round_trip(error: Exception) -> None:
    copy = pickle.loads(pickle.dumps(error))
    assert type(copy) is type(error)
    assert copy.args == error.args
    assert str(copy) == str(error)
    assert vars(copy) == vars(error)
