"""What each of the lock's scripts costs a node, per call, in its hot-path case.

A fair lock's hand-off is as fast as the slowest of a quorum of nodes running
``QUEUED_RELEASE``; every waiter's refresh runs ``FAIR_ACQUIRE`` on every node. On
a small host the nodes share the cores with the clients, so what a script costs
the server is paid by the whole sale. Each case below is set up with plain
commands, then one script runs ``--calls`` times by EVALSHA (the last case by
EVAL, as the lock sends its releases); its cost is the server's own count for
that command, so set-up commands are not in it:

- by default, Redis's ``usec_per_call`` (noisy on a shared host: compare ratios;
  it leaves out an EVAL's hashing of its source, done before the command runs),
- with ``--callgrind``, instructions per call of a ``redis-server`` run under
  valgrind's callgrind, the script lookup before the command included: exact and
  repeatable, whatever else the host is doing.

Each case is also shown as a ratio over an empty script (``return 0``) called
with the same keys and arguments: the part of the cost that is the script's own.

Usage::

    .venv/bin/python -m benchmarks.scripts                # about 10 s
    .venv/bin/python -m benchmarks.scripts --callgrind    # about a minute
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import redis

META = (
    '{"host":"app-1","pid":4242,"label":"shop.views.buy","ns":"0123456789abcdef",'
    '"acquired":"2026-11-28T18:00:00.000000+00:00","ttl":10000,"attempt":1}'
)
LOCK, QUEUE, WAITERS, TICKETS, RECORDS = (
    "rl:bench",
    "rl:q:bench",
    "rl:w:bench",
    "rl:t:bench",
    "rl:handoff:bench",
)
HEAD = "rl:\x00wake:"
HOLDER, WAITER, TAG = "aaaaaaaaaaaaaaaa:01", "bbbbbbbbbbbbbbbb:02", "02"


class Case:
    """One script in one situation: ``prepare`` writes the keys before each call,
    which goes by EVALSHA, or by EVAL with the source (``by_eval``)."""

    def __init__(
        self,
        name: str,
        script: Any,
        prepare: Callable[[redis.Redis, int], None],
        keys: Callable[[int], Sequence[str]],
        args: Callable[[int], Sequence[Any]],
        by_eval: bool = False,
    ) -> None:
        self.name, self.script, self.by_eval = name, script, by_eval
        self.prepare, self.keys, self.args = prepare, keys, args


def _cases() -> list[Case]:
    from redlock_django import scripts

    def nothing(r: redis.Redis, i: int) -> None:
        r.delete(f"{LOCK}:{i}")

    def held(r: redis.Redis, i: int) -> None:
        r.hset(f"{LOCK}:{i}", mapping={"token": f"t{i}.1", "meta": META})
        r.pexpire(f"{LOCK}:{i}", 60_000)

    def queued(r: redis.Redis, i: int) -> None:
        # A foreign holder; our waiter second in line with its ticket and the
        # record of its last attempt (a refresh), the keys as a refresh a moment
        # ago left them (lives of 4 x the entry's 3 s).
        now = int(r.time()[0]) * 1000
        r.hset(LOCK, mapping={"token": "holder.1", "meta": META})
        r.pexpire(LOCK, 60_000)
        r.zadd(QUEUE, {HOLDER: 1, WAITER: 2})
        r.zadd(WAITERS, {HOLDER: now + 60_000, WAITER: now + 60_000})
        r.set(TICKETS, 2)
        r.delete(RECORDS)
        r.zadd(RECORDS, {f"{WAITER}|waiter{i}~{TAG}.0|{now}|10000|-|{META}": 0})
        for key in (QUEUE, WAITERS, TICKETS, RECORDS):
            r.pexpire(key, 12_000)

    def handing(r: redis.Redis, i: int) -> None:
        # Our holder first in line, a waiter behind it with a hand-off record.
        now = int(r.time()[0]) * 1000
        r.hset(LOCK, mapping={"token": f"holder{i}.1", "meta": META})
        r.pexpire(LOCK, 60_000)
        r.zadd(QUEUE, {HOLDER: 1, WAITER: 2})
        r.zadd(WAITERS, {HOLDER: now + 60_000, WAITER: now + 60_000})
        r.delete(RECORDS)
        r.zadd(RECORDS, {f"{WAITER}|waiter{i}~{TAG}.1|{now}|10000|-|{META}": 0})

    fair_keys = (LOCK, QUEUE, WAITERS, TICKETS, RECORDS)
    return [
        Case(
            "acquire (free key)",
            scripts.ACQUIRE_SCRIPT,
            nothing,
            lambda i: (f"{LOCK}:{i}",),
            lambda i: (f"t{i}.1", 10_000, META),
        ),
        Case(
            "release (our key)",
            scripts.RELEASE_SCRIPT,
            held,
            lambda i: (f"{LOCK}:{i}",),
            lambda i: (f"t{i}.1", "0123456789ab"),
        ),
        Case(
            "fair_acquire (refused, refresh)",
            scripts.FAIR_ACQUIRE_SCRIPT,
            queued,
            lambda i: fair_keys,
            lambda i: (f"waiter{i}~{TAG}.1", 10_000, META, WAITER, 3000, 2, "1"),
        ),
    ] + [
        # The second as the asyncio driver sends its releases (and the sync driver
        # the source it writes behind an unanswered EVALSHA): by EVAL, which Redis
        # hashes whole before it runs it (not in usec_per_call).
        Case(
            "queued_release (hand-off" + (", by EVAL)" if by_eval else ")"),
            scripts.QUEUED_RELEASE_SCRIPT,
            handing,
            lambda i: (LOCK, QUEUE, WAITERS, RECORDS),
            lambda i: (f"holder{i}.1", "0123456789ab", HOLDER, HEAD, "-"),
            by_eval=by_eval,
        )
        for by_eval in (False, True)
    ]


def _start(port: int, out: Path | None) -> subprocess.Popen:
    from harness.nodes import find_redis_server

    command = [str(find_redis_server()), "--port", str(port), "--save", ""]
    command += ["--appendonly", "no", "--bind", "127.0.0.1"]
    if out is not None:
        profiler = ["valgrind", "--tool=callgrind", f"--callgrind-out-file={out}"]
        command = [*profiler, *command]
    proc = subprocess.Popen(
        command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    client = redis.Redis(port=port)
    deadline = time.monotonic() + 60
    while True:
        try:
            client.ping()
            return proc
        except redis.ConnectionError:
            if time.monotonic() > deadline or proc.poll() is not None:
                proc.kill()
                raise RuntimeError("redis-server did not start") from None
            time.sleep(0.1)


def _run(case: Case, port: int, calls: int, empty: bool) -> float:
    """Run one case; return usec_per_call of its EVALSHA (or EVAL)."""
    r = redis.Redis(port=port)
    listener = redis.Redis(port=port).pubsub()
    listener.subscribe(HEAD + TAG)
    source = "return 0" if empty else case.script.source
    sha = r.script_load(source)
    r.config_resetstat()
    for i in range(calls):
        case.prepare(r, i)
        keys, args = case.keys(i), case.args(i)
        if case.by_eval:
            r.eval(source, len(keys), *keys, *args)
        else:
            r.evalsha(sha, len(keys), *keys, *args)
        if i % 64 == 0:
            while listener.get_message(timeout=0):
                pass
    listener.close()
    stat = "cmdstat_eval" if case.by_eval else "cmdstat_evalsha"
    return float(r.info("commandstats")[stat]["usec_per_call"])


def _instructions(out: Path, by_eval: bool) -> int:
    """Instructions counted inside the script's command and the script lookup
    Redis makes before it (``evalGetCommandFlags``: where an EVAL's source is
    hashed), from a callgrind output file."""
    text = subprocess.run(
        ["callgrind_annotate", "--inclusive=yes", str(out)],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    command = "evalCommand" if by_eval else "evalShaCommand"
    found = {}
    for line in text.splitlines():
        for name in (command, "evalGetCommandFlags"):
            if name not in found and re.search(rf"\b{name}\b", line):
                found[name] = int(line.split()[0].replace(",", ""))
    if command not in found:
        raise RuntimeError(f"no {command} in the profile: is redis-server stripped?")
    return sum(found.values())


def measure(case: Case, calls: int, callgrind: bool) -> tuple[float, float]:
    from harness.nodes import free_port

    results = []
    for empty in (False, True):
        port = free_port()
        with tempfile.TemporaryDirectory() as tmp:
            out = Path(tmp) / "callgrind.out" if callgrind else None
            proc = _start(port, out)
            try:
                usec = _run(case, port, calls, empty)
            finally:
                proc.terminate()
                proc.wait(timeout=60)
            results.append(
                _instructions(out, case.by_eval) / calls if out is not None else usec
            )
    return results[0], results[1]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--callgrind", action="store_true")
    parser.add_argument("--calls", type=int, default=None)
    args = parser.parse_args(argv)
    if args.calls is not None and args.calls < 1:
        parser.error(f"--calls must be at least 1, not {args.calls}")
    if args.callgrind and shutil.which("valgrind") is None:
        parser.error("--callgrind needs valgrind (apt-get install valgrind)")
    calls = args.calls or (1000 if args.callgrind else 5000)
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "shop.settings")
    import django

    django.setup()
    unit = "instructions" if args.callgrind else "usec"
    header = f"{'script (case)':<34} {unit + '/call':>18} {'empty script':>13}"
    print(f"{header} {'x empty':>8}")
    for case in _cases():
        cost, empty = measure(case, calls, args.callgrind)
        print(f"{case.name:<34} {cost:>18,.1f} {empty:>13,.1f} {cost / empty:>7.2f}x")
        sys.stdout.flush()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
