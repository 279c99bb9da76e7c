"""Mutual exclusion across processes: a read-modify-write counter stays exact.

Four worker processes (``tests/_workers.py``, each configuring Django on its own)
increment one plain key on node 0 with a separate GET and SET. Under the lock no
increment is lost; without it, the very same code loses many. Workers are bounded
in time: a worker that fails fails the test with its traceback, one that hangs is
killed.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import os
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from harness.nodes import NodeSet
from redlock_django import Redlock
from tests._workers import Keys

REPO = Path(__file__).resolve().parent.parent
WORKERS = 4
#: Seconds a worker may take to import Django and say it is ready.
START_TIMEOUT = 30.0


@dataclass
class Outcome:
    """What a run of workers left behind on the counter node."""

    counter: int
    inside: int
    order: list[str]
    results: list[dict[str, Any]]
    elapsed: float

    @property
    def overlaps(self) -> int:
        """How many increments found another worker already inside."""
        return sum(result["overlaps"] for result in self.results)

    @property
    def handoffs(self) -> int:
        """How often the next increment was made by a different process."""
        owners = [name.split(".")[0] for name in self.order]
        return sum(1 for a, b in itertools.pairwise(owners) if a != b)


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


def _report(procs: list[subprocess.Popen[str]], outputs: dict[int, str]) -> str:
    """Kill the workers still running and return every worker's stderr."""
    for i, proc in enumerate(procs):
        if i not in outputs:
            if proc.poll() is None:
                proc.kill()
            outputs[i] = proc.communicate()[1]
    lines = []
    for i, proc in enumerate(procs):
        lines.append(f"--- worker w{i} (exit {proc.returncode}) ---")
        lines.append(outputs.get(i, "").rstrip() or "(no stderr)")
    return "\n".join(lines)


def run_workers(
    nodes: NodeSet,
    *,
    mode: str,
    iterations: int,
    concurrency: int = 1,
    gap: float = 0.0,
    deadline: float = 60.0,
) -> Outcome:
    """Run ``WORKERS`` worker processes together and return what they did.

    Fails the test, with every worker's stderr, when a worker exits with an error
    or does not finish within ``deadline`` seconds (it is then killed).
    """
    keys = Keys(f"mutex:{uuid.uuid4().hex}")
    env = {k: v for k, v in os.environ.items() if k != "DJANGO_SETTINGS_MODULE"}
    env["PYTHONPATH"] = os.pathsep.join(
        filter(None, [str(REPO), env.get("PYTHONPATH")])
    )
    common = [
        "--mode", mode,
        "--nodes", ",".join(nodes.urls),
        "--counter-url", nodes[0].url,
        "--prefix", keys.counter.rsplit(":", 1)[0],
        "--iterations", str(iterations),
        "--concurrency", str(concurrency),
        "--gap", str(gap),
        "--deadline", str(deadline),
    ]  # fmt: skip
    procs: list[subprocess.Popen[str]] = []
    stderr: dict[int, str] = {}
    client = nodes[0].client()
    try:
        for i in range(WORKERS):
            procs.append(
                subprocess.Popen(
                    [
                        sys.executable,
                        "-m",
                        "tests._workers",
                        "--name",
                        f"w{i}",
                        *common,
                    ],
                    cwd=REPO,
                    env=env,
                    stdin=subprocess.DEVNULL,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.PIPE,
                    text=True,
                )
            )
        ready_by = time.monotonic() + START_TIMEOUT
        while int(client.get(keys.ready) or 0) < WORKERS:
            if any(proc.poll() is not None for proc in procs):
                pytest.fail(
                    "a worker exited before the start:\n" + _report(procs, stderr)
                )
            if time.monotonic() > ready_by:
                pytest.fail(
                    f"workers not ready within {START_TIMEOUT}s:\n"
                    + _report(procs, stderr)
                )
            time.sleep(0.01)
        started = time.monotonic()
        client.set(keys.go, b"1")
        results: list[dict[str, Any]] = []
        for i, proc in enumerate(procs):
            left = started + deadline + 5.0 - time.monotonic()
            try:
                out, stderr[i] = proc.communicate(timeout=max(0.1, left))
            except subprocess.TimeoutExpired:
                pytest.fail(
                    f"worker w{i} still running after {deadline}s; killed:\n"
                    + _report(procs, stderr)
                )
            if proc.returncode != 0:
                pytest.fail(f"worker w{i} failed:\n" + _report(procs, stderr))
            results.append(json.loads(out.strip().splitlines()[-1]))
        elapsed = time.monotonic() - started
        return Outcome(
            counter=int(client.get(keys.counter) or 0),
            inside=int(client.get(keys.inside) or 0),
            order=[_text(name) for name in client.lrange(keys.order, 0, -1)],
            results=results,
            elapsed=elapsed,
        )
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.communicate()
        client.close()


#: Handoffs that prove the workers contended (about 5 per worker); runs show 100+.
MIN_HANDOFFS = 20


def test_redlock_keeps_a_counter_exact_across_processes(nodes: NodeSet) -> None:
    """4 processes x 500 GET-then-SET increments under ``with Redlock``: none lost."""
    iterations = 500
    outcome = run_workers(nodes, mode="sync", iterations=iterations)

    expected = WORKERS * iterations
    assert outcome.counter == expected, outcome.results
    assert outcome.overlaps == 0
    assert outcome.inside == 0
    assert len(outcome.order) == expected
    # The processes really contended: the lock changed hands again and again
    # instead of each process running its increments after the others.
    assert outcome.handoffs >= MIN_HANDOFFS, f"only {outcome.handoffs} handoffs"


def test_same_workers_lose_updates_without_the_lock_and_none_with_it(
    nodes: NodeSet,
) -> None:
    """With a 1 ms gap between GET and SET, lock-free workers lose increments.

    The negative control: the same workers, iterations and race window, run
    first without and then with the lock; only the lock makes the count exact.
    """
    iterations = 100
    expected = WORKERS * iterations

    unlocked = run_workers(nodes, mode="none", iterations=iterations, gap=0.001)
    assert len(unlocked.order) == expected
    assert unlocked.overlaps > 0
    assert unlocked.counter < expected

    locked = run_workers(nodes, mode="sync", iterations=iterations, gap=0.001)
    assert locked.counter == expected, locked.results
    assert locked.overlaps == 0
    assert locked.handoffs >= MIN_HANDOFFS, f"only {locked.handoffs} handoffs"


def test_async_redlock_keeps_a_counter_exact_across_processes(nodes: NodeSet) -> None:
    """4 processes x 2 tasks x 125 increments under ``async with``: none lost.

    The two tasks of a process share one ``Redlock`` object: each task is an owner
    of its own, so they exclude each other as well as the other processes.
    """
    iterations = 125
    outcome = run_workers(nodes, mode="async", iterations=iterations, concurrency=2)

    expected = WORKERS * 2 * iterations
    assert outcome.counter == expected, outcome.results
    assert outcome.overlaps == 0
    assert outcome.inside == 0
    assert len(outcome.order) == expected
    assert outcome.handoffs >= MIN_HANDOFFS, f"only {outcome.handoffs} handoffs"


def script_calls(nodes: NodeSet) -> list[int]:
    """Return how many EVAL and EVALSHA commands each node has run so far."""
    calls = []
    for node in nodes:
        with node.client() as client:
            stats = client.info("commandstats")
        calls.append(
            sum(
                stats.get(f"cmdstat_{name}", {}).get("calls", 0)
                for name in ("eval", "evalsha")
            )
        )
    return calls


def test_an_acquire_and_release_run_one_script_each_per_node(
    redlock_settings: dict[str, Any], nodes: NodeSet
) -> None:
    """The blocking API sends each step once per node and reads each reply.

    A command sent twice leaves a reply nobody reads on a pooled connection; the
    next command there takes it for its own, so an acquire can read a stale ``0``
    and count a node as granting that did not: the lost increments above.
    """
    lock = Redlock("counter")
    with lock:  # warm up: pools built, scripts cached on every node
        pass
    time.sleep(0.05)
    before = script_calls(nodes)
    with lock:
        pass
    time.sleep(0.05)  # let a duplicate, if any was sent, reach the servers
    after = script_calls(nodes)
    assert [a - b for a, b in zip(after, before, strict=True)] == [2] * len(nodes)


async def test_async_acquire_and_release_run_one_script_each_per_node(
    redlock_settings: dict[str, Any], nodes: NodeSet
) -> None:
    """The asyncio API, too, sends each step once per node."""
    lock = Redlock("counter")
    async with lock:
        pass
    before = script_calls(nodes)
    async with lock:
        pass
    await asyncio.sleep(0.05)
    after = script_calls(nodes)
    assert [a - b for a, b in zip(after, before, strict=True)] == [2] * len(nodes)
