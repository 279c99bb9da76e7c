"""The holder metadata stored beside each token: who took the lock, where and when.

An acquisition writes it (``encode``) into the lock's hash as ``meta``; the listing
reads it back (``decode``) for the admin page and the ``redlock list`` command. It
is read defensively: a key under the prefix may come from another version of this
library or another writer, so a field that does not parse is None, never an error.
"""

from __future__ import annotations

import functools
import hashlib
import json
import math
import os
import socket
import time
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

__all__ = ["HolderMeta", "as_int", "decode", "encode", "pid_namespace", "printable"]


@dataclass(frozen=True)
class HolderMeta:
    """What a holder wrote about itself; None where a field is missing or unreadable."""

    host: str | None = None
    pid: int | None = None
    holder: str | None = None
    label: str = ""
    acquired_at: datetime | None = None
    ttl: float | None = None
    #: The holder's pid namespace (``pid_namespace()``): its pid names a process
    #: only where this is the same.
    ns: str | None = None


@functools.cache
def _hostname() -> str:
    return socket.gethostname()


@functools.cache
def pid_namespace() -> str | None:
    """Name this process's pid namespace on this boot of its kernel; None if unknown.

    Two containers can share a host name (``--network host``) and two hosts a
    name (cloned machines), each with its own pids: a pid says whether its
    process is alive only where this name is the same. A digest of the kernel's
    boot id and the namespace's inode, 16 hex digits.
    """
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
        inode = os.stat("/proc/self/ns/pid").st_ino
    except (OSError, ValueError):
        return None
    return hashlib.sha256(f"{boot}:{inode}".encode()).hexdigest()[:16]


@functools.lru_cache(maxsize=1024)
def _head(pid: int, holder: str, ttl: float, label: str) -> str:
    """The metadata JSON without its closing brace and acquisition time."""
    fields = {"host": _hostname(), "pid": pid, "ns": pid_namespace()}
    fields = {**fields, "holder": holder, "ttl": ttl, "label": label}
    return json.dumps(fields, separators=(",", ":"))[:-1]


def encode(holder: str, ttl: float, label: str) -> str:
    """Return the metadata (JSON) an acquisition writes beside its token."""
    # The same JSON object as json.dumps of all seven fields, with the fixed
    # part encoded once per (pid, holder, ttl, label): only the time changes.
    head = _head(os.getpid(), holder, ttl, label)
    return f'{head},"acquired_at":"{_now()}"}}'


#: The last whole second formatted, and its text: acquisitions within one second
#: share it and only add their milliseconds. One tuple, replaced whole (threads).
_second: tuple[int, str] = (-1, "")


def _now() -> str:
    """The time as ``isoformat(timespec="milliseconds")`` of an aware UTC datetime.

    Wall-clock time on purpose: it is shown to people (the admin's "Acquired at",
    ``redlock list``) and compared across hosts. No lease is judged by it: validity
    is measured on ``time.monotonic()`` (``lock._clock``).
    """
    global _second
    ms = int(time.time() * 1000)
    whole, frac = divmod(ms, 1000)
    second, text = _second
    if whole != second:
        text = datetime.fromtimestamp(whole, UTC).isoformat()[:-6]  # no "+00:00"
        _second = (whole, text)
    return f"{text}.{frac:03d}+00:00"


# A child made by unshare(CLONE_NEWPID) and fork() is in another namespace.
os.register_at_fork(after_in_child=pid_namespace.cache_clear)


def decode(raw: bytes | None) -> HolderMeta:
    """Read the metadata a node returned; anything unreadable becomes None."""
    fields = _json_object(raw)
    return HolderMeta(
        host=_optional_str(fields.get("host")),
        pid=as_int(fields.get("pid")),
        holder=_optional_str(fields.get("holder")),
        label=_optional_str(fields.get("label")) or "",
        acquired_at=_datetime(fields.get("acquired_at")),
        ttl=_float(fields.get("ttl")),
        ns=_optional_str(fields.get("ns")),
    )


def as_int(value: object) -> int | None:
    """Return ``value`` (an int, or its digits as bytes or str) as an int, else None."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value
    if isinstance(value, bytes | str):
        try:
            return int(value)
        except ValueError:
            return None
    return None


def _json_object(raw: bytes | None) -> dict[str, object]:
    if raw is None:
        return {}
    try:
        fields = json.loads(raw)
    except (ValueError, RecursionError):  # RecursionError: nested too deep
        return {}
    return fields if isinstance(fields, dict) else {}


def _optional_str(value: object) -> str | None:
    return value if isinstance(value, str) else None


def _float(value: object) -> float | None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    number = float(value)
    return number if math.isfinite(number) else None


def _datetime(value: object) -> datetime | None:
    if not isinstance(value, str):
        return None
    try:
        moment = datetime.fromisoformat(value)
        if moment.tzinfo is None:
            moment = moment.replace(tzinfo=UTC)
        return moment.astimezone(UTC)
    except (ValueError, OverflowError):  # OverflowError: out of range in UTC
        return None


def printable(text: str) -> str:
    """``text`` with control characters escaped (``\\n``, ``\\x1b``): labels,
    holder names and an operator's reason are free text, and a newline or an
    escape sequence must not forge a log line or a row, nor drive a terminal."""
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() else ascii(c)[1:-1] for c in text)
