"""The sync driver's two paths side by side: fast (redis-py internals) and portable.

Uncontended acquire + release of a fresh key with default settings on 1, 3 and 5
nodes, measured as in ``benchmarks.locks`` (cycles/s, p50/p99), once in a child
process on the fast path and once in a child with ``REDLOCK_SYNC_DRIVER=portable``
(the switch is read at import, hence a process per path). Reps interleave the two,
the order alternating; the medians and the portable/fast ratio are printed.

Usage::

    .venv/bin/python -m benchmarks.driver            # about 40 s
    .venv/bin/python -m benchmarks.driver --quick    # about 15 s
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

COUNTS = (1, 3, 5)
PATHS = ("fast", "portable")
ROOT = Path(__file__).resolve().parent.parent


def child(urls: Sequence[str], seconds: float, warmup: int) -> None:
    """Measure every node count on this process's path; print one JSON line."""
    from benchmarks.locks import _setup_redlock, configure, measure
    from redlock_django import wire

    configure(urls)
    setup = _setup_redlock(fencing=False)
    results = {}
    for n in COUNTS:
        cycle, close = setup([], urls[:n])
        try:
            tag = f"d:{os.getpid()}:{n}"
            for i in range(warmup):
                cycle(f"{tag}:warm:{i}")
            results[n] = measure(cycle, tag, seconds)
        finally:
            close()
    paths = sorted({p.name for p in wire.PATHS.values()})
    print(json.dumps({"paths": paths, "results": results}))


def run_child(path: str, urls: Sequence[str], seconds: float, warmup: int) -> dict:
    env = dict(os.environ)
    env.pop("REDLOCK_SYNC_DRIVER", None)
    if path == "portable":
        env["REDLOCK_SYNC_DRIVER"] = "portable"
    env["PYTHONPATH"] = os.pathsep.join(
        filter(None, [str(ROOT), env.get("PYTHONPATH")])
    )
    args = ["--child", "--seconds", str(seconds), "--warmup", str(warmup), *urls]
    done = subprocess.run(
        [sys.executable, "-m", "benchmarks.driver", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    )
    out = json.loads(done.stdout.splitlines()[-1])
    if out["paths"] != [path]:
        raise RuntimeError(f"the {path} child ran on {out['paths']}")
    return {int(n): r for n, r in out["results"].items()}


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--seconds", type=float, default=0.8, help=argparse.SUPPRESS)
    parser.add_argument("--warmup", type=int, default=100, help=argparse.SUPPRESS)
    parser.add_argument("urls", nargs="*", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        child(args.urls, args.seconds, args.warmup)
        return 0
    reps, seconds, warmup = (3, 0.25, 30) if args.quick else (5, 0.8, 100)

    from benchmarks.locks import machine
    from harness.nodes import NodeSet

    info = machine()
    print("machine: " + ", ".join(f"{k}={v}" for k, v in info.items()), flush=True)
    rates: dict[tuple[str, int], list[float]] = {}
    p50s: dict[tuple[str, int], list[float]] = {}
    p99s: dict[tuple[str, int], list[float]] = {}
    began = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="bench-driver-") as tmp:
        nodes = NodeSet.create(max(COUNTS), Path(tmp))
        nodes.start_all()
        try:
            for rep in range(reps):
                order = PATHS if rep % 2 == 0 else PATHS[::-1]
                for path in order:
                    results = run_child(path, nodes.urls, seconds, warmup)
                    for n, (rate, p50, p99) in results.items():
                        rates.setdefault((path, n), []).append(rate)
                        p50s.setdefault((path, n), []).append(p50)
                        p99s.setdefault((path, n), []).append(p99)
                        print(
                            f"  rep {rep + 1}/{reps} {path:<8} {n} node(s): "
                            f"{rate:7.0f} cycles/s p50 {p50:.3f} ms p99 {p99:.3f} ms",
                            flush=True,
                        )
        finally:
            nodes.stop_all()
    print(f"\nran in {time.monotonic() - began:.0f}s\n")
    print(
        f"{'path':<9}{'nodes':>6}{'cycles/s':>10}{'p50 ms':>9}{'p99 ms':>9}"
        f"{'x fast':>8}"
    )
    for n in COUNTS:
        fast = statistics.median(rates[("fast", n)])
        for path in PATHS:
            rate = statistics.median(rates[(path, n)])
            print(
                f"{path:<9}{n:>6}{rate:>10.0f}"
                f"{statistics.median(p50s[(path, n)]):>9.3f}"
                f"{statistics.median(p99s[(path, n)]):>9.3f}"
                f"{rate / fast:>7.2f}x"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
