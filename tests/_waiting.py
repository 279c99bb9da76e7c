"""Fixtures and helpers shared by the wake-up and fair-queue tests.

``test_wake.py``, ``test_wake_liveness.py`` and ``test_fair.py`` park waiters (threads
here, or processes running ``tests/_fair_waiter.py``) and read what happened from
the nodes' queues and from the ``lock_acquired`` signal.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from harness.nodes import NodeSet
from redlock_django import nodes as nodes_module
from redlock_django import signals, wake
from redlock_django.conf import get_settings
from redlock_django.keys import queue_keys

__all__ = [
    "ROOT",
    "SLOW_RETRY",
    "acquisitions",
    "queued",
    "result",
    "spawn",
    "wait_for",
    "wait_until_queued",
    "wake_hub",
]

ROOT = Path(__file__).resolve().parent.parent
#: Long enough that a waiter sleeping it out would be obvious from its counts.
SLOW_RETRY = 30.0


@pytest.fixture
def spawn(nodes: NodeSet) -> Iterator[Callable[..., subprocess.Popen[str]]]:
    """``spawn(name, resource, *args, urls=None)``: start one fair waiter process
    (``tests/_fair_waiter.py``) on the test's nodes, or on ``urls``."""
    started: list[subprocess.Popen[str]] = []
    env = {k: v for k, v in os.environ.items() if k != "DJANGO_SETTINGS_MODULE"}
    env["PYTHONPATH"] = os.pathsep.join(
        filter(None, [str(ROOT), env.get("PYTHONPATH")])
    )

    def start(
        name: str, resource: str, *extra: str, urls: list[str] | None = None
    ) -> subprocess.Popen[str]:
        urls = urls or [node.url for node in nodes]
        proc = subprocess.Popen(
            [sys.executable, "-m", "tests._fair_waiter", "--nodes", ",".join(urls),
             "--resource", resource, "--name", name, *extra],
            cwd=ROOT, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
            stderr=subprocess.PIPE, text=True,
        )  # fmt: skip
        started.append(proc)
        return proc

    yield start
    for proc in started:
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(proc.pid, signal.SIGCONT)
                proc.kill()
        proc.communicate(timeout=10)


@pytest.fixture
def acquisitions() -> Iterator[list[dict[str, Any]]]:
    """Collect the ``lock_acquired`` signals of the test."""
    seen: list[dict[str, Any]] = []

    def receiver(**kwargs: Any) -> None:
        seen.append(kwargs)

    signals.lock_acquired.connect(receiver, weak=False)
    try:
        yield seen
    finally:
        signals.lock_acquired.disconnect(receiver)


def queued(nodes: NodeSet, resource: str) -> list[int]:
    """Per node, how many entries the resource's queue holds."""
    queue = queue_keys(resource, "redlock")[0]
    return [node.client().zcard(queue) for node in nodes]


def wait_until_queued(nodes: NodeSet, resource: str, count: int) -> None:
    """Until every node's queue of ``resource`` holds ``count`` entries or more."""
    deadline = time.monotonic() + 20
    while sum(1 for n in queued(nodes, resource) if n >= count) < len(nodes):
        if time.monotonic() > deadline:
            seen = queued(nodes, resource)
            raise AssertionError(f"{count} waiters never queued on all nodes: {seen}")
        time.sleep(0.01)


def wait_for(condition: Callable[[], bool], what: str, limit: float = 15.0) -> None:
    """Until ``condition()`` holds; fail saying ``what`` after ``limit`` seconds."""
    deadline = time.monotonic() + limit
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting until {what}")
        time.sleep(0.005)


def wake_hub() -> wake.Hub:
    """This process's wake-up hub for the current settings' nodes."""
    config = get_settings()
    return wake.hub(nodes_module.sync_pools(config.nodes, config.node_timeout))


def result(proc: subprocess.Popen[str], timeout: float = 40) -> dict[str, Any]:
    """A waiter process's report (its last line, JSON), once it exited cleanly."""
    out, err = proc.communicate(timeout=timeout)
    assert proc.returncode == 0, err
    return json.loads(out.splitlines()[-1])
