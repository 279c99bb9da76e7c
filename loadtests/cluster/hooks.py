"""Gunicorn hooks for the cluster's app hosts: each worker records its lock windows.

Loaded with ``gunicorn -c python:loadtests.cluster.hooks`` on top of compose's app
command, and only when ``CLUSTER_LOCK_LOG`` names a directory: the shop itself is
unchanged. Each worker connects receivers to the library's public signals and
appends one JSON line per event to ``<dir>/<host>-<pid>.jsonl``:

- ``{"e": "acq", "r": resource, "t": start, "until": valid_until, "tok": token}``
  when a lock is granted (written at once: the nemesis reads it to find a worker
  in the middle of a purchase);
- ``{"e": "rel", "r": resource, "t": end, "span": s, "tok": token, "lost": reason}``
  when it is released (``span``: from the grant's attempt to the release's start,
  by the lock's clock); ``{"e": "ext", "r": resource, "t": now, "until": valid_until}``
  when its lease is extended (the shop does not, a watchdog would).

Times are the kernel's CLOCK_MONOTONIC, one clock for every namespace of the
kernel, read with the raw ``clock_gettime`` system call: on the clock-skewed host
libfaketime moves the C library's clocks, monotonic included (its
``FAKETIME_DONT_FAKE_MONOTONIC=1`` breaks Python's ``time.sleep`` with EINVAL in
0.9.10), but not the system call. Elsewhere it equals ``time.monotonic()``.
A lock's window is from its grant to its release, cut at the end of its validity
(``valid_until``): after that the library no longer claims it is held. Both ends
are upper bounds of the release's start (a receiver runs after the fact): "now -
elapsed" at the release, and the grant's stamp plus ``span``; the checks take the
earlier, so only a worker stalled at both ends stretches a window.
"""

from __future__ import annotations

import ctypes
import json
import os
import platform
import threading
import time
from pathlib import Path
from typing import Any

_SYS_CLOCK_GETTIME = {"x86_64": 228, "aarch64": 113}.get(platform.machine())
_CLOCK_MONOTONIC = 1


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


_libc = ctypes.CDLL(None, use_errno=True)


def kernel_monotonic() -> float:
    """CLOCK_MONOTONIC from the kernel itself (no LD_PRELOAD can move it)."""
    if _SYS_CLOCK_GETTIME is None:
        return time.monotonic()
    spec = _Timespec()
    if _libc.syscall(_SYS_CLOCK_GETTIME, _CLOCK_MONOTONIC, ctypes.byref(spec)) != 0:
        return time.monotonic()
    return float(spec.tv_sec) + float(spec.tv_nsec) / 1e9


_write_lock = threading.Lock()
_file: Any = None


def _record(event: dict[str, Any]) -> None:
    if _file is None:
        return
    line = json.dumps(event, separators=(",", ":")) + "\n"
    with _write_lock:
        _file.write(line)
        _file.flush()


def _acquired(sender: Any, lock: Any, resource: str, **details: Any) -> None:
    now = kernel_monotonic()
    _record(
        {
            "e": "acq",
            "r": resource,
            "t": now,
            "until": now + float(lock.validity),
            "tok": details.get("fencing_token"),
        }
    )


def _extended(sender: Any, lock: Any, resource: str, **details: Any) -> None:
    now = kernel_monotonic()
    until = now + float(details.get("validity") or 0.0)
    _record({"e": "ext", "r": resource, "t": now, "until": until})


def _released(sender: Any, lock: Any, resource: str, **details: Any) -> None:
    # The release began `elapsed` seconds ago: the lock was held until then. A
    # worker starved of CPU may run this receiver long after the release returned,
    # so the hold's own span (grant attempt to release start, by the lock's clock)
    # is recorded too: the checks take whichever bound is earlier.
    elapsed = float(details.get("elapsed") or 0.0)
    end = kernel_monotonic() - elapsed
    _record(
        {
            "e": "rel",
            "r": resource,
            "t": end,
            "span": max(0.0, float(details.get("held") or 0.0) - elapsed),
            "tok": details.get("fencing_token"),
            "lost": None if details.get("lost") is None else str(details["lost"]),
        }
    )


def post_worker_init(worker: Any) -> None:
    """Gunicorn hook: open this worker's log and connect the receivers."""
    global _file
    directory = os.environ.get("CLUSTER_LOCK_LOG")
    if not directory:
        return
    from redlock_django import signals

    name = f"{os.environ.get('CLUSTER_HOST', 'app')}-{os.getpid()}.jsonl"
    _file = (Path(directory) / name).open("a", encoding="utf-8")
    signals.lock_acquired.connect(_acquired, dispatch_uid="cluster-acq")
    signals.lock_extended.connect(_extended, dispatch_uid="cluster-ext")
    signals.lock_released.connect(_released, dispatch_uid="cluster-rel")
