"""Lock holders for ``tests/test_faults.py``, run as ``python -m tests._holders``.

Each one configures Django itself (``settings.configure``, nothing inherited from
pytest) with the node URLs it is given, then plays one part:

- ``hold``: acquire the lock (optionally fenced and auto-extended), print one JSON
  line ``{"event": "held", "started": <monotonic>, "valid_until": <monotonic>}``
  and keep holding until killed. CLOCK_MONOTONIC is system-wide on Linux, so the
  parent can compare these times with its own.
- ``staged``: acquire once and freeze itself (SIGSTOP) at the named point given
  by ``--stop-at``: ``after-send`` (the acquire written to every node, replies not
  yet read), ``after-validity`` (granted, validity checked), ``before-write``
  (granted, about to write ``--storage-key`` on the first node with its fencing
  token, or plainly with ``--unfenced``). It prints ``{"event": "stopped", ...}``
  just before freezing, and one result line once the parent resumed it (SIGCONT).
- ``clockjump``: run under libfaketime with a ``FAKETIME_TIMESTAMP_FILE`` that this
  process rewrites itself (``+3600``, ``-3600``) while it holds or waits for locks,
  and print one JSON line with what it measured: the wall-clock jumps, and the
  validity, waits and extensions seen by the lock across them.

Any error prints a traceback on stderr and exits 1.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import sys
import threading
import time
import traceback
from collections.abc import Sequence
from pathlib import Path
from typing import Any


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m tests._holders")
    parser.add_argument("part", choices=("hold", "staged", "clockjump"))
    parser.add_argument(
        "--stop-at", choices=("after-send", "after-validity", "before-write")
    )
    parser.add_argument("--storage-key", default="storage")
    parser.add_argument("--unfenced", action="store_true")
    parser.add_argument("--nodes", required=True, help="comma-separated Redis URLs")
    parser.add_argument("--resource", default="held")
    parser.add_argument("--label", default="", help="the holder metadata's label")
    parser.add_argument("--ttl", type=float, default=1.0)
    parser.add_argument("--fencing", action="store_true")
    parser.add_argument("--auto-extend", action="store_true")
    parser.add_argument("--jump-file", help="the FAKETIME_TIMESTAMP_FILE to rewrite")
    return parser.parse_args(argv)


def setup_django(urls: list[str], wake_ups: bool = True) -> None:
    import django
    from django.conf import settings

    settings.configure(
        INSTALLED_APPS=["redlock_django"],
        REDLOCK={
            "NODES": urls,
            "TTL": 10.0,
            "NODE_TIMEOUT": 0.2,
            "RETRY_DELAY": 0.02,
            "RETRY_JITTER": 0.02,
            "WAIT_TIMEOUT": 2.0,
            "WAKE_UPS": wake_ups,
        },
    )
    django.setup()


def say(payload: dict[str, Any]) -> None:
    print(json.dumps(payload), flush=True)


def hold(args: argparse.Namespace) -> None:
    from redlock_django import Redlock

    lock = Redlock(
        args.resource,
        ttl=args.ttl,
        fencing=args.fencing,
        auto_extend=args.auto_extend,
        label=args.label,
    )
    started = time.monotonic()
    if not lock.acquire(blocking=False):
        raise RuntimeError("the holder could not acquire its lock")
    now = time.monotonic()
    say(
        {
            "event": "held",
            "started": started,
            "valid_until": now + lock.validity,
            "fencing_token": lock.fencing_token,
        }
    )
    threading.Event().wait()


def freeze(point: str, **details: Any) -> None:
    """Announce the stop point, then stop this process until SIGCONT."""
    say({"event": "stopped", "at": point, "time": time.monotonic(), **details})
    os.kill(os.getpid(), signal.SIGSTOP)


# A fenced write: the storage keeps the highest fencing token it accepted and
# refuses a write that carries a lower one (what FencingTokenField does in SQL).
FENCED_WRITE = """
local seen = tonumber(redis.call('hget', KEYS[1], 'token') or '0')
if tonumber(ARGV[1]) < seen then
  return 0
end
redis.call('hset', KEYS[1], 'token', ARGV[1], 'value', ARGV[2])
return 1
"""


def staged(args: argparse.Namespace) -> None:
    """Acquire, freezing at ``args.stop_at``; see the module docstring."""
    import redis

    from redlock_django import LockError, Redlock, sync
    from redlock_django.scripts import ACQUIRE_SCRIPT

    urls = args.nodes.split(",")

    lock = Redlock(args.resource, ttl=args.ttl, fencing=not args.unfenced)
    if args.stop_at == "after-send":
        # Freeze between the acquire's last write and its first read: the nodes
        # grant while this process is stopped, and their replies wait for it. A
        # profile hook sees the fan-out start reading (its writes all done);
        # nothing of the library is replaced.
        reading = sync._Round.read.__code__

        def hook(frame: Any, event: str, arg: Any) -> None:
            if (
                event == "call"
                and frame.f_code is reading
                and frame.f_locals["self"].step.script is ACQUIRE_SCRIPT
            ):
                sys.setprofile(None)
                freeze("after-send")

        sys.setprofile(hook)
    started = time.monotonic()
    try:
        acquired = lock.acquire(blocking=False)
    except LockError as exc:
        say({"event": "result", "acquired": False, "error": type(exc).__name__})
        return
    result: dict[str, Any] = {"event": "result", "acquired": acquired}
    if acquired and args.stop_at == "after-validity":
        valid_until = time.monotonic() + lock.validity
        freeze("after-validity", started=started, valid_until=valid_until)
    if acquired and args.stop_at == "before-write":
        freeze("before-write", fencing_token=lock.fencing_token)
        with redis.Redis.from_url(urls[0]) as client:
            if args.unfenced:
                client.hset(args.storage_key, mapping={"value": "stale"})
                result["written"] = True
            else:
                result["written"] = bool(
                    client.eval(
                        FENCED_WRITE, 1, args.storage_key, lock.fencing_token, "stale"
                    )
                )
    if acquired:
        result["owned"] = lock.owned()
        result["lost"] = lock.lost
        try:
            lock.release()
            result["release"] = "ok"
        except LockError as exc:
            result["release"] = type(exc).__name__
    say(result)


def clockjump(args: argparse.Namespace) -> None:
    """Measure the lock across wall-clock jumps; see the module docstring."""
    from redlock_django import Redlock

    jump_file = Path(args.jump_file)

    def jump(offset: str) -> None:
        jump_file.write_text(f"{offset}\n")

    def pause(seconds: float) -> None:
        # time.sleep() fails with EINVAL under FAKETIME_DONT_FAKE_MONOTONIC;
        # Event.wait() (a relative monotonic wait) does not.
        threading.Event().wait(seconds)

    result: dict[str, Any] = {}
    try:
        time.sleep(0.001)
    except OSError as exc:
        result["time_sleep_error"] = exc.errno
    else:
        result["time_sleep_error"] = None

    # 1. A held lease across +1 h and -1 h jumps of the wall clock.
    jump("+0")
    lock = Redlock("clock:held", ttl=args.ttl)
    assert lock.acquire(blocking=False)
    wall0, mono0, validity0 = time.time(), time.monotonic(), lock.validity
    jump("+3600")
    pause(0.2)
    wall1, mono1, validity1 = time.time(), time.monotonic(), lock.validity
    owned1 = lock.owned()
    jump("-3600")
    pause(0.2)
    wall2, mono2, validity2 = time.time(), time.monotonic(), lock.validity
    owned2 = lock.owned()
    extended = lock.extend()
    validity_after_extend = lock.validity
    lock.release()
    result["held"] = {
        "wall_jump_forward": wall1 - wall0,
        "wall_jump_back": wall2 - wall1,
        "mono_1": mono1 - mono0,
        "mono_2": mono2 - mono1,
        "validity": [validity0, validity1, validity2],
        "owned": [owned1, owned2],
        "extended": extended,
        "validity_after_extend": validity_after_extend,
    }

    # 2. The watchdog keeps extending on monotonic time while the wall clock jumps.
    jump("+0")
    watched = Redlock("clock:watched", ttl=0.6, auto_extend=True)
    assert watched.acquire(blocking=False)
    jump("+3600")
    pause(0.5)
    jump("-3600")
    pause(0.5)
    jump("+0")
    result["watchdog"] = {
        "owned": watched.owned(),
        "lost": watched.lost,
        "validity": watched.validity,
    }
    watched.release()

    # 3. Waits (asyncio: its sleeps work under faketime) measured on monotonic time.
    result["waits"] = asyncio.run(waits(jump, args.ttl))
    jump("+0")
    say(result)


async def waits(jump: Any, ttl: float) -> dict[str, Any]:
    from redlock_django import Redlock

    out: dict[str, Any] = {}
    # The holder outlives every wait below: their durations are what is checked.
    holder_lock = Redlock("clock:wait", ttl=max(ttl, 10.0))
    waiter_lock = Redlock("clock:wait", ttl=ttl)
    held = asyncio.Event()
    release = asyncio.Event()

    async def holder() -> None:
        await holder_lock.aacquire(blocking=False)
        held.set()
        await release.wait()
        await holder_lock.arelease()

    holding = asyncio.ensure_future(holder())
    await held.wait()

    # A wait that times out: +1 h mid-wait must not end it early.
    jump("+0")
    loop = asyncio.get_running_loop()
    loop.call_later(0.1, jump, "+3600")
    start = time.monotonic()
    got = await waiter_lock.aacquire(timeout=0.5)
    out["timeout_forward"] = {"acquired": got, "waited": time.monotonic() - start}

    # -1 h mid-wait must not make it last an hour longer.
    loop.call_later(0.1, jump, "-3600")
    start = time.monotonic()
    got = await waiter_lock.aacquire(timeout=0.5)
    out["timeout_back"] = {"acquired": got, "waited": time.monotonic() - start}

    # A wait that ends when the holder releases, with a jump in between.
    jump("+0")
    loop.call_later(0.1, jump, "+3600")
    loop.call_later(0.3, release.set)
    start = time.monotonic()
    got = await waiter_lock.aacquire(timeout=2.0)
    out["handover"] = {
        "acquired": got,
        "waited": time.monotonic() - start,
        "validity": waiter_lock.validity,
    }
    await holding
    if got:
        await waiter_lock.arelease()
    return out


def main(argv: Sequence[str]) -> int:
    args = parse_args(argv)
    # Under libfaketime (clockjump) the wake-up reader threads stall the whole
    # process (measured: starting them took up to 0.7 s, a 0.3 s hand-over took
    # 1.4 s; not seen without libfaketime, cause inside libfaketime not pinned
    # down). The waits measured there are the timed retries'; wake-ups themselves
    # use only monotonic timeouts and are tested in tests/test_wake.py.
    setup_django(args.nodes.split(","), wake_ups=args.part != "clockjump")
    if args.part == "hold":
        hold(args)
    elif args.part == "staged":
        staged(args)
    else:
        clockjump(args)
    return 0


if __name__ == "__main__":
    try:
        code = main(sys.argv[1:])
    except BaseException:
        traceback.print_exc()
        sys.stderr.flush()
        os._exit(1)
    sys.exit(code)
