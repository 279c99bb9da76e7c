"""The fault-matrix recorder: per-scenario figures from real test runs (issue 6).

A scenario test asks the ``matrix`` fixture for a :class:`Tally` of its scenario
number and records into it what really happened: every acquisition it tried (and
whether it was granted), its latency on ``time.monotonic()``, the holders'
validity windows, which the overlap oracle (:func:`overlaps`) compares, and for
the data-level scenarios the lost updates seen in the database. The autouse scan
of ``tests/test_faults.py`` adds the PTTL scans run after the test.

The session-scoped :class:`Matrix` merges the tallies of every test into one row
per scenario (negative controls get their own row). When ``REDLOCK_MATRIX_OUT``
names a file, the figures are written there as JSON when the session ends, and
``python -m tests._matrix render FILE`` prints the markdown table that
``docs/reliability.md`` publishes. Nothing in a row is typed in by hand: an empty
column means the run did not measure it.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

#: Environment variable naming the JSON file written at the end of the session.
OUT_ENV = "REDLOCK_MATRIX_OUT"
#: Library keys allowed to live without a TTL: fencing counters, by design.
FENCE_INFIX = ":fence:"

#: Short names of the scenarios of issue 6 (the table's second column).
TITLES = {
    1: "2 of 5 nodes black-holed or paused",
    2: "3 of 5 nodes down",
    3: "Latency: elapsed near TTL / moderate",
    4: "SET applied, reply lost",
    5: "Two clients split the vote",
    6: "Holder frozen with replies in flight > TTL",
    7: "Holder paused past TTL before its write (Kleppmann)",
    8: "Node restarted while a lock is held",
    9: "Extension: minority, expiry, cap, stop",
    10: "Holder killed with kill -9",
    11: "NOSCRIPT after SCRIPT FLUSH",
    12: "Async cancellation behind a 100 ms delay",
    13: "One lock object shared by threads / tasks",
    14: "Client wall clock jumps ±1 h",
    15: "Replica, duplicate server, evicting policy",
    16: "ATOMIC_REQUESTS: release after commit",
    17: "Flash sale under chaos (Locust)",
}


@dataclass(frozen=True)
class Window:
    """A holder's monotonic validity window: [start, end)."""

    start: float
    end: float

    def overlaps(self, other: Window) -> bool:
        return self.start < other.end and other.start < self.end


def overlaps(windows: Sequence[Window]) -> int:
    """The overlap oracle: how many pairs of windows of one resource overlap."""
    return sum(
        1
        for i, first in enumerate(windows)
        for second in windows[i + 1 :]
        if first.overlaps(second)
    )


def percentile(values: Sequence[float], share: float) -> float | None:
    """Return the nearest-rank percentile (``share`` in (0, 1]) or None if empty."""
    if not values:
        return None
    ordered = sorted(values)
    rank = max(1, math.ceil(share * len(ordered)))
    return ordered[rank - 1]


def keys_without_ttl(nodes: Any, prefix: str = "redlock") -> dict[int, list[str]]:
    """SCAN ``prefix:*`` on every running, unpaused node; return keys with PTTL -1.

    Fencing counters (``<prefix>:fence:*``) are included: callers decide.
    """
    found: dict[int, list[str]] = {}
    for i, node in enumerate(nodes):
        if not node.is_running or node.is_paused:
            continue
        with node.client() as client:
            for key in client.scan_iter(match=f"{prefix}:*", count=1000):
                if client.pttl(key) == -1:
                    found.setdefault(i, []).append(key.decode())
    return found


def unexpected_keys_without_ttl(nodes: Any, prefix: str = "redlock") -> list[str]:
    """Return ``node<i>:<key>`` for every key with PTTL -1 that is not a fence."""
    return sorted(
        f"node{i}:{key}"
        for i, keys in keys_without_ttl(nodes, prefix).items()
        for key in keys
        if FENCE_INFIX not in key
    )


@dataclass
class Row:
    """The merged figures of one scenario (or of its negative control)."""

    scenario: int
    negative_control: bool = False
    tests: set[str] = field(default_factory=set)
    tried: int = 0
    succeeded: int = 0
    windows: int = 0
    overlaps: int = 0
    lost_updates: int | None = None
    latencies: list[float] = field(default_factory=list)
    scans: int = 0
    keys_without_ttl: int = 0
    notes: list[str] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        p50 = percentile(self.latencies, 0.5)
        p99 = percentile(self.latencies, 0.99)
        return {
            "scenario": self.scenario,
            "title": TITLES.get(self.scenario, ""),
            "negative_control": self.negative_control,
            "tests": sorted(self.tests),
            "tried": self.tried,
            "succeeded": self.succeeded,
            "windows": self.windows,
            "overlaps": self.overlaps,
            "lost_updates": self.lost_updates,
            "latencies": len(self.latencies),
            "p50_ms": None if p50 is None else round(p50 * 1000, 2),
            "p99_ms": None if p99 is None else round(p99 * 1000, 2),
            "scans": self.scans,
            "keys_without_ttl": self.keys_without_ttl,
            "notes": sorted(set(self.notes)),
        }


class Attempt:
    """One timed operation; set ``ok`` to True when it succeeded."""

    __slots__ = ("ok",)

    def __init__(self) -> None:
        self.ok = False


class Tally:
    """What one test records into one row; safe to use from several threads."""

    def __init__(self, matrix: Matrix, row: Row) -> None:
        self._matrix = matrix
        self.row = row

    @contextmanager
    def attempt(self) -> Iterator[Attempt]:
        """Time one acquisition (or other operation) and count it as tried.

        An exception inside counts as not succeeded and propagates.
        """
        attempt = Attempt()
        start = time.monotonic()
        try:
            yield attempt
        finally:
            elapsed = time.monotonic() - start
            with self._matrix.lock:
                self.row.tried += 1
                self.row.succeeded += bool(attempt.ok)
                self.row.latencies.append(elapsed)

    def add(self, tried: int, succeeded: int, latencies: Sequence[float] = ()) -> None:
        """Count operations measured elsewhere (in a subprocess, say)."""
        with self._matrix.lock:
            self.row.tried += tried
            self.row.succeeded += succeeded
            self.row.latencies.extend(latencies)

    def check(self, windows: Sequence[Window]) -> int:
        """Run the oracle on the windows of one resource; record and return it."""
        found = overlaps(windows)
        with self._matrix.lock:
            self.row.windows += len(windows)
            self.row.overlaps += found
        return found

    def lost(self, updates: int) -> None:
        """Record lost updates (or oversold units) seen on the data."""
        with self._matrix.lock:
            self.row.lost_updates = (self.row.lost_updates or 0) + updates

    def note(self, text: str) -> None:
        with self._matrix.lock:
            self.row.notes.append(text)

    def scan(self, nodes: Any) -> list[str]:
        """Scan ``nodes`` for library keys without a TTL; record and return them."""
        found = unexpected_keys_without_ttl(nodes)
        with self._matrix.lock:
            self.row.scans += 1
            self.row.keys_without_ttl += len(found)
        return found


class Matrix:
    """Every row of the session, merged from the tests' tallies."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.rows: dict[tuple[int, bool], Row] = {}
        #: Test node id -> the tallies it opened (for the after-test scan).
        self.by_test: dict[str, list[Tally]] = {}

    def tally(self, scenario: int, test: str, *, negative_control: bool) -> Tally:
        if scenario not in TITLES:
            raise ValueError(f"no scenario {scenario} in the matrix")
        with self.lock:
            key = (scenario, negative_control)
            row = self.rows.get(key)
            if row is None:
                row = self.rows[key] = Row(scenario, negative_control)
            row.tests.add(test)
            tally = Tally(self, row)
            self.by_test.setdefault(test, []).append(tally)
            return tally

    def scanned(self, test: str, found: int) -> None:
        """Record one PTTL scan after ``test`` in each row the test wrote to."""
        with self.lock:
            rows = {id(t.row): t.row for t in self.by_test.get(test, [])}
            for row in rows.values():
                row.scans += 1
                row.keys_without_ttl += found

    def to_json(self) -> dict[str, Any]:
        rows = [self.rows[key].to_json() for key in sorted(self.rows)]
        return {
            "python": platform.python_version(),
            "platform": platform.platform(),
            "cpus": os.cpu_count(),
            "rows": rows,
        }

    def write(self, path: Path) -> None:
        path.write_text(json.dumps(self.to_json(), indent=2) + "\n")


@pytest.fixture(scope="session")
def matrix_recorder() -> Iterator[Matrix]:
    """The session's :class:`Matrix`; written to ``$REDLOCK_MATRIX_OUT`` at the end."""
    recorder = Matrix()
    yield recorder
    out = os.environ.get(OUT_ENV)
    if out:
        recorder.write(Path(out))


def scenario_test_id(request: pytest.FixtureRequest) -> str:
    """Return ``file.py::test[params]`` for the requesting test."""
    return (
        f"{Path(str(request.node.path)).name}::{request.node.nodeid.split('::', 1)[-1]}"
    )


@pytest.fixture
def matrix(request: pytest.FixtureRequest, matrix_recorder: Matrix) -> Any:
    """Return ``matrix(scenario, negative_control=False) -> Tally`` for this test."""
    test = scenario_test_id(request)

    def open_tally(scenario: int, *, negative_control: bool = False) -> Tally:
        return matrix_recorder.tally(scenario, test, negative_control=negative_control)

    return open_tally


# Rendering: ``python -m tests._matrix render results.json``.


def _cell(value: object, unit: str = "") -> str:
    if value is None:
        return "—"
    if isinstance(value, float):
        return f"{value:.1f}{unit}"
    return f"{value}{unit}"


def render(data: dict[str, Any]) -> str:
    """Return the markdown table of a results file."""
    lines = [
        "| # | Fault | Tried | Succeeded | Windows | Overlaps | Lost updates "
        "| Latency p50 | Latency p99 | PTTL scans (keys w/o TTL) | Tests |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    seen = set()
    for row in data["rows"]:
        seen.add(row["scenario"])
        title = row["title"]
        overlaps_cell = str(row["overlaps"]) if row["windows"] else "— (no windows)"
        lost_cell = _cell(row["lost_updates"])
        if row["negative_control"]:
            title += " — **negative control**"
            # The control shows harm where this row measures it.
            if row["windows"]:
                overlaps_cell = f"**{row['overlaps']}** (expected > 0)"
            if row["lost_updates"] is not None:
                lost_cell = f"**{row['lost_updates']}** (expected > 0)"
        tests = "<br>".join(f"`{t}`" for t in row["tests"])
        scans = f"{row['scans']} ({row['keys_without_ttl']})" if row["scans"] else "—"
        lines.append(
            f"| {row['scenario']} | {title} | {row['tried']} | {row['succeeded']} "
            f"| {row['windows']} | {overlaps_cell} | {lost_cell} "
            f"| {_cell(row['p50_ms'], ' ms')} | {_cell(row['p99_ms'], ' ms')} "
            f"| {scans} | {tests} |"
        )
    for scenario in sorted(set(TITLES) - seen):
        lines.append(
            f"| {scenario} | {TITLES[scenario]} | — | — | — | — | — | — | — | — "
            "| not in this run |"
        )
    notes = [
        f"- {row['scenario']}{' (negative control)' if row['negative_control'] else ''}"
        f": {note}"
        for row in data["rows"]
        for note in row["notes"]
    ]
    if notes:
        lines += ["", "Notes recorded by the tests:", "", *notes]
    return "\n".join(lines)


def main(argv: Sequence[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests._matrix")
    sub = parser.add_subparsers(dest="command", required=True)
    render_cmd = sub.add_parser("render", help="print the markdown table")
    render_cmd.add_argument("results", type=Path)
    args = parser.parse_args(argv)
    data = json.loads(args.results.read_text())
    print(render(data))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
