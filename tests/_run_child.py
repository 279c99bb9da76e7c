"""The program the ``redlock run`` tests run, as ``python tests/_run_child.py MODE``.

- ``count DIR GAP``: append this pid to ``DIR/runs``, then increment the counter in
  ``DIR/counter`` with a read, a ``GAP``-second sleep and a write: updates are lost
  when two runs overlap. ``DIR/go``, when given with ``--hold``, is waited for
  before exiting, so a run stays inside until the test lets it go.
- ``trap DIR``: write ``DIR/ready``, then wait; on SIGTERM (or SIGINT) append the
  signal's name to ``DIR/signals`` and exit 7.

Plain Python, no Django: it is the user's program, not part of the library.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time
from pathlib import Path
from types import FrameType

#: How long a child waits at most (for "go", or for a signal): tests end sooner.
DEADLINE = 60.0


def count(directory: Path, gap: float, hold: bool) -> int:
    with (directory / "runs").open("a") as runs:
        runs.write(f"{os.getpid()} {time.time():.6f}\n")
    counter = directory / "counter"
    value = int(counter.read_text()) if counter.exists() else 0
    time.sleep(gap)
    counter.write_text(str(value + 1))
    with (directory / "ends").open("a") as ends:
        ends.write(f"{os.getpid()} {time.time():.6f}\n")
    if hold:
        _wait_for(directory / "go")
    return 0


def trap(directory: Path) -> int:
    def record(signum: int, frame: FrameType | None) -> None:
        with (directory / "signals").open("a") as signals:
            signals.write(signal.Signals(signum).name + "\n")
        sys.exit(7)

    signal.signal(signal.SIGTERM, record)
    signal.signal(signal.SIGINT, record)
    # Written whole, then renamed: a reader that sees "ready" also sees the pid
    # (CI once read it empty, between the create and the write).
    pending = directory / "ready.tmp"
    pending.write_text(str(os.getpid()))
    pending.replace(directory / "ready")
    time.sleep(DEADLINE)
    return 0


def _wait_for(path: Path) -> None:
    deadline = time.monotonic() + DEADLINE
    while not path.exists() and time.monotonic() < deadline:
        time.sleep(0.02)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("mode", choices=["count", "trap"])
    parser.add_argument("directory", type=Path)
    parser.add_argument("gap", type=float, nargs="?", default=0.0)
    parser.add_argument("--hold", action="store_true")
    args = parser.parse_args()
    if args.mode == "count":
        return count(args.directory, args.gap, args.hold)
    return trap(args.directory)


if __name__ == "__main__":
    sys.exit(main())
