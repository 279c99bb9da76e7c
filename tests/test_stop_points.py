"""Lock holders frozen at named points (``python -m tests._holders staged``).

A child process acquires a lock and stops itself with SIGSTOP at one of three
points: after its acquire reached every node but before it read a reply, after
the grant and its validity check, and right before its protected write. While it
is frozen past its lease, a second client takes the lock; then the child is
resumed and reports what it did. Each point shows a different guard at work.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from harness.held import tokens
from harness.nodes import NodeSet
from redlock_django import Redlock
from tests._holders import FENCED_WRITE

ROOT = Path(__file__).resolve().parent.parent
TTL = 0.5


class Staged:
    """One staged child: started, read line by line, resumed, always reaped."""

    def __init__(self, nodes: NodeSet, resource: str, *extra: str) -> None:
        env = {k: v for k, v in os.environ.items() if k != "DJANGO_SETTINGS_MODULE"}
        env["PYTHONPATH"] = str(ROOT)
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "tests._holders",
                "staged",
                "--nodes",
                ",".join(nodes.urls),
                "--resource",
                resource,
                "--ttl",
                str(TTL),
                *extra,
            ],
            cwd=ROOT,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )

    def line(self) -> dict[str, Any]:
        assert self.proc.stdout is not None
        text = self.proc.stdout.readline()
        assert text, self.proc.stderr.read() if self.proc.stderr else "no output"
        return dict(json.loads(text))

    def wait_stopped(self) -> None:
        deadline = time.monotonic() + 10
        while not _stopped(self.proc.pid):
            assert time.monotonic() < deadline, "the child never stopped"
            time.sleep(0.005)

    def resume(self) -> dict[str, Any]:
        os.kill(self.proc.pid, signal.SIGCONT)
        result = self.line()
        assert self.proc.wait(timeout=10) == 0
        return result

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


def _stopped(pid: int) -> bool:
    with open(f"/proc/{pid}/stat") as stat:
        return stat.read().rsplit(")", 1)[1].split()[0] == "T"


@pytest.fixture
def staged(nodes: NodeSet) -> Iterator[Any]:
    children: list[Staged] = []

    def start(resource: str, *extra: str) -> Staged:
        child = Staged(nodes, resource, *extra)
        children.append(child)
        return child

    yield start
    for child in children:
        child.close()


def test_holder_frozen_after_sending_its_acquire_refuses_the_late_grant(
    redlock_settings: dict[str, Any], nodes: NodeSet, staged: Any
) -> None:
    child = staged("stop:send", "--stop-at", "after-send")
    assert child.line()["at"] == "after-send"
    child.wait_stopped()
    time.sleep(TTL + 0.1)  # its keys expire on every node while it is frozen
    second = Redlock("stop:send", ttl=10)
    assert second.acquire(blocking=False)
    ours = tokens(nodes, "stop:send")
    result = child.resume()
    # The grants it reads now are older than its lease: not acquired, and its
    # clean-up left the second holder's keys alone.
    # ("granted, but too slowly for any validity": QuorumUnavailableError)
    assert result == {
        "event": "result",
        "acquired": False,
        "error": "QuorumUnavailableError",
    }
    assert tokens(nodes, "stop:send") == ours
    second.release()


def test_holder_frozen_after_its_validity_check_learns_its_lease_is_gone(
    redlock_settings: dict[str, Any], nodes: NodeSet, staged: Any
) -> None:
    child = staged("stop:validity", "--stop-at", "after-validity")
    stop = child.line()
    assert stop["at"] == "after-validity"
    child.wait_stopped()
    time.sleep(max(0.0, stop["valid_until"] - time.monotonic()) + 0.1)
    second = Redlock("stop:validity", ttl=10)
    assert second.acquire(blocking=False)
    second_started = time.monotonic()
    result = child.resume()
    # Its window ended at its validity, before the second holder began: no
    # overlap; resumed, it sees the lease lost, and its release says so without
    # touching the second holder's keys.
    assert stop["valid_until"] <= second_started
    assert result["acquired"] is True
    assert result["owned"] is False and result["lost"] is True
    assert result["release"] == "LockLostError"
    assert None not in tokens(nodes, "stop:validity")
    second.release()


@pytest.mark.parametrize("fenced", [True, False], ids=["fenced", "unfenced"])
def test_holder_frozen_before_its_write_is_refused_by_fencing_only(
    redlock_settings: dict[str, Any], nodes: NodeSet, staged: Any, fenced: bool
) -> None:
    resource = f"stop:write:{fenced}"
    storage = f"storage:{fenced}"
    extra = ["--stop-at", "before-write", "--storage-key", storage]
    child = staged(resource, *extra, *([] if fenced else ["--unfenced"]))
    stop = child.line()
    assert stop["at"] == "before-write"
    child.wait_stopped()
    time.sleep(TTL + 0.1)
    second = Redlock(resource, ttl=10, fencing=fenced)
    assert second.acquire(blocking=False)
    client = nodes[0].client()
    if fenced:
        assert second.fencing_token > stop["fencing_token"]
        assert client.eval(FENCED_WRITE, 1, storage, second.fencing_token, "fresh")
    else:
        client.hset(storage, mapping={"value": "fresh"})
    second.release()
    result = child.resume()
    value = client.hget(storage, "value")
    if fenced:
        # The stale holder's write carried the older token: refused.
        assert result["written"] is False and value == b"fresh"
    else:
        # Negative control: without fencing the stale write lands over the new one.
        assert result["written"] is True and value == b"stale"
