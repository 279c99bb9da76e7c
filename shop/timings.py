"""Per-phase timings of the locked buy view, written when ``SHOP_TIMINGS_DIR`` is set.

Off by default: with the setting empty nothing is connected and :func:`mark` is
one attribute lookup. With it set (``make demo`` sets it for its locked run),
each buy request records ``time.monotonic()`` at the steps of the purchase and,
from the lock's own signals (``redlock_django.signals``), when the product and
customer locks were granted and released and how long the product lock was held
(the signal's ``held``). After the response is built, the lock already released,
the record is appended as one JSON line to ``<dir>/timings-<pid>.jsonl``, so
writing it costs the critical section nothing. ``loadtests/holds.py`` reads the
files: hot-lock utilization, median hold and where a hold goes.

A record: ``{"pid", "product", "status", "error", "marks": {name: monotonic},
"held", "release_elapsed", "waited", "attempts", "token"}``. The marks are
``start`` (the request entered the view), ``customer_acquired`` /
``customer_released``, ``product_acquired`` / ``product_released`` (the
receivers' clock), ``read`` (the product row read under the lock), ``paid``
(payment done), ``written`` (fenced update and order insert done, before the
commit), ``committed`` and ``end``. All processes of one machine share the
monotonic clock, so records of several app servers can be merged.
"""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path
from typing import Any

from django.conf import settings

from redlock_django import signals as lock_signals

PRODUCT_PREFIX = "shop.product:"
CUSTOMER_PREFIX = "shop:customer:"

_local = threading.local()


def directory() -> str:
    """Return ``SHOP_TIMINGS_DIR``, or "" when timings are off."""
    return str(getattr(settings, "SHOP_TIMINGS_DIR", "") or "")


def _current() -> dict[str, Any] | None:
    record: dict[str, Any] | None = getattr(_local, "record", None)
    return record


def begin(product_id: int) -> None:
    """Start the record of one buy request in this thread (if timings are on)."""
    if not directory():
        _local.record = None
        return
    _local.record = {
        "pid": os.getpid(),
        "product": product_id,
        "marks": {"start": time.monotonic()},
    }


def mark(name: str) -> None:
    """Note the monotonic time of step ``name`` of the current request."""
    record = _current()
    if record is not None:
        record["marks"][name] = time.monotonic()


def finish(status: int, error: str | None = None) -> None:
    """Append the current request's record to this process's file, and drop it."""
    record = _current()
    _local.record = None
    if record is None:
        return
    record["marks"]["end"] = time.monotonic()
    record["status"] = status
    record["error"] = error
    path = Path(directory()) / f"timings-{os.getpid()}.jsonl"
    with path.open("a", encoding="utf-8") as out:
        out.write(json.dumps(record, separators=(",", ":")) + "\n")


def _which(resource: str) -> str | None:
    if resource.startswith(PRODUCT_PREFIX):
        return "product"
    if resource.startswith(CUSTOMER_PREFIX):
        return "customer"
    return None


def _on_acquired(sender: Any, resource: str = "", **info: Any) -> None:
    now = time.monotonic()
    record, which = _current(), _which(resource)
    if record is None or which is None:
        return
    record["marks"][f"{which}_acquired"] = now
    if which == "product":
        record["waited"] = info.get("waited")
        record["attempts"] = info.get("attempts")
        record["token"] = info.get("fencing_token")


def _on_released(sender: Any, resource: str = "", **info: Any) -> None:
    now = time.monotonic()
    record, which = _current(), _which(resource)
    if record is None or which is None:
        return
    record["marks"][f"{which}_released"] = now
    if which == "product":
        record["held"] = info.get("held")
        record["release_elapsed"] = info.get("elapsed")


def connect() -> bool:
    """Connect the signal receivers when timings are on; return whether they are."""
    if not directory():
        return False
    Path(directory()).mkdir(parents=True, exist_ok=True)
    lock_signals.lock_acquired.connect(_on_acquired, dispatch_uid="shop.timings.acq")
    lock_signals.lock_released.connect(_on_released, dispatch_uid="shop.timings.rel")
    return True
