"""Where the hot product lock's time goes: figures from the shop's timing records.

The app servers write one record per buy request when ``SHOP_TIMINGS_DIR`` is set
(``shop/timings.py``). From them, for one product:

- **utilization**: the share of the interval from the first sale to the last (a
  sale's time: its commit) in which the product lock was held: the union of the
  holds (each ``[released - held, released]``, ``held`` from the lock's
  ``lock_released`` signal) clipped to that interval, over its length. 1.0 means
  the lock was never free while the sale ran. ``held`` runs from the start of
  the winning attempt (the library's ``Lease.acquired``, which validity counts
  from), so a hold's first round trip can overlap its predecessor's release: a
  plain sum would count that overlap twice (it read 1.07 once); the union does
  not.
- **work utilization**: the same over the part of each hold between
  ``acquire()`` returning and the release starting (the holder's own work, the
  lock's fan-outs left out): at most 1.0.
- **median hold**: of the holds that overlap that interval, in ms.
- **out of order**: the share of product-lock grants served before a request
  that had started waiting earlier (its ``checked`` mark, taken just before it
  asks for the product lock) and was granted later. With ``fair=True`` the queue
  orders by the ticket a waiter draws, a round trip after ``checked``: requests
  arriving within that round trip of each other may be served either way.
- **phases**: for the purchases that sold, the mean time between consecutive
  marks inside the hold, from the grant (``hold start``) to the release signal.

The payment share measured from outside needs no records: ``(orders - 1) x
payment`` over the time between the first and the last order Locust saw
(:func:`payment_share`). Kept apart from ``demo.py`` so the arithmetic is tested
on recorded data (``tests/test_holds_report.py``).
"""

from __future__ import annotations

import itertools
import json
import statistics
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

#: The marks of a hold, in the order they can happen (see shop/timings.py).
HOLD_ORDER = (
    "hold start",
    "product_acquired",
    "customer_acquired",
    "read",
    "paid",
    "written",
    "committed",
    "customer_released",
    "release start",
    "product_released",
)


def read_records(
    directory: Path, product_id: int | None = None
) -> list[dict[str, Any]]:
    """Return every record under ``directory`` (optionally for one product).

    A last line without its newline is a record still being written, or cut
    short by a killed worker: it is left out.
    """
    records: list[dict[str, Any]] = []
    for path in sorted(directory.glob("timings-*.jsonl")):
        text = path.read_text(encoding="utf-8", errors="replace")
        for line in text.split("\n")[:-1]:  # the part after the last newline: torn
            if not line.strip():
                continue
            record = json.loads(line)
            if product_id is None or record.get("product") == product_id:
                records.append(record)
    return records


def work_interval(record: dict[str, Any]) -> tuple[float, float] | None:
    """Return ``(acquire returned, release started)`` of the product lock, or None.

    The part of a hold its holder spends with the lock in hand, the lock's own
    fan-outs (the winning attempt, the fencing write-back, the release) left out.
    """
    marks = record.get("marks", {})
    start, end = marks.get("product_acquired"), marks.get("product_released")
    elapsed = record.get("release_elapsed")
    if start is None or end is None or elapsed is None:
        return None
    return start, end - float(elapsed)


def hold_interval(record: dict[str, Any]) -> tuple[float, float] | None:
    """Return ``(start, end)`` of the record's product-lock hold, or None."""
    held = record.get("held")
    end = record.get("marks", {}).get("product_released")
    if held is None or end is None:
        return None
    return end - float(held), end


@dataclass
class HoldReport:
    """The figures of one locked run (times in seconds unless named ``_ms``)."""

    sales: int
    holds: int
    window_s: float
    busy_s: float
    utilization: float | None
    median_hold_ms: float | None
    work_utilization: float | None = None
    phases_ms: list[tuple[str, float]] = field(default_factory=list)
    mean_hold_ms: float | None = None
    attempts_per_acquisition: float | None = None
    out_of_order: float | None = None

    def as_json(self) -> dict[str, Any]:
        return {
            "sales": self.sales,
            "holds": self.holds,
            "window_s": round(self.window_s, 4),
            "busy_s": round(self.busy_s, 4),
            "utilization": None
            if self.utilization is None
            else round(self.utilization, 3),
            "work_utilization": _round(self.work_utilization),
            "median_hold_ms": _round(self.median_hold_ms),
            "mean_hold_ms": _round(self.mean_hold_ms),
            "attempts_per_acquisition": _round(self.attempts_per_acquisition),
            "out_of_order": None
            if self.out_of_order is None
            else round(self.out_of_order, 3),
            "phases_ms": [[name, round(ms, 2)] for name, ms in self.phases_ms],
        }


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 2)


def covered(intervals: Iterable[tuple[float, float]], lo: float, hi: float) -> float:
    """Return the length of ``[lo, hi]`` covered by the union of ``intervals``."""
    total, reach = 0.0, lo
    for start, end in sorted(intervals):
        start, end = max(start, reach), min(end, hi)
        if end > start:
            total += end - start
            reach = end
    return total


def out_of_order(records: Iterable[dict[str, Any]]) -> float | None:
    """Return the share of grants served before an earlier arrival (see above)."""
    grants = sorted(
        (r["marks"]["product_acquired"], r["marks"]["checked"])
        for r in records
        if "product_acquired" in r.get("marks", {}) and "checked" in r["marks"]
    )
    if not grants:
        return None
    overtaking, earliest_later = 0, float("inf")
    for _, arrived in reversed(grants):
        overtaking += earliest_later < arrived
        earliest_later = min(earliest_later, arrived)
    return overtaking / len(grants)


def phases(records: Iterable[dict[str, Any]]) -> list[tuple[str, float]]:
    """Return ``[(from -> to, mean ms)]`` between consecutive marks of sold holds."""
    sums: dict[str, float] = {}
    counts: dict[str, int] = {}
    order: dict[str, int] = {}
    for record in records:
        interval = hold_interval(record)
        if record.get("status") != 201 or interval is None:
            continue
        marks = {"hold start": interval[0], **record["marks"]}
        if record.get("release_elapsed") is not None:
            marks["release start"] = interval[1] - float(record["release_elapsed"])
        inside = sorted(
            (
                (marks[name], name)
                for name in HOLD_ORDER
                if name in marks and interval[0] <= marks[name] <= interval[1]
            ),
        )
        ranks = [HOLD_ORDER.index(name) for _, name in inside]
        inside_names = [name for _, name in inside]
        if ranks != sorted(ranks) or "product_acquired" not in inside_names:
            # A hold whose marks are out of order (its ``held`` shorter than the
            # time between its own acquired and released signals: about 1 in
            # 2,000 records) would mix labels; it is left out of the means.
            continue
        for (before, a), (after, b) in itertools.pairwise(inside):
            label = f"{a} -> {b}"
            sums[label] = sums.get(label, 0.0) + (after - before)
            counts[label] = counts.get(label, 0) + 1
            order.setdefault(label, HOLD_ORDER.index(a))
    labels = sorted(sums, key=lambda label: (order[label], label))
    return [(label, 1000 * sums[label] / counts[label]) for label in labels]


def summarize(records: list[dict[str, Any]]) -> HoldReport:
    """Return the hot-lock figures of one run's records (one product)."""
    sale_times = sorted(
        r["marks"]["committed"]
        for r in records
        if r.get("status") == 201 and "committed" in r.get("marks", {})
    )
    intervals = [i for i in map(hold_interval, records) if i is not None]
    attempts = [r["attempts"] for r in records if r.get("attempts") is not None]
    per_acq = sum(attempts) / len(attempts) if attempts else None
    if len(sale_times) < 2:
        return HoldReport(
            len(sale_times), len(intervals), 0.0, 0.0, None, None,
            attempts_per_acquisition=per_acq, out_of_order=out_of_order(records),
        )  # fmt: skip
    first, last = sale_times[0], sale_times[-1]
    window = last - first
    busy = covered(intervals, first, last)
    works = [i for i in map(work_interval, records) if i is not None]
    work = covered(works, first, last)
    during = [end - start for start, end in intervals if end >= first and start <= last]
    median = 1000 * statistics.median(during) if during else None
    mean = 1000 * statistics.fmean(during) if during else None
    return HoldReport(
        sales=len(sale_times),
        holds=len(intervals),
        window_s=window,
        busy_s=busy,
        utilization=busy / window if window > 0 else None,
        median_hold_ms=median,
        work_utilization=work / window if window > 0 else None,
        phases_ms=phases(records),
        mean_hold_ms=mean,
        attempts_per_acquisition=per_acq,
        out_of_order=out_of_order(records),
    )


def payment_share(orders: int, work_ms: float, span_s: float | None) -> float | None:
    """Return ``(orders - 1) x work_ms`` over the first-to-last order span."""
    if orders < 2 or not span_s or span_s <= 0:
        return None
    return (orders - 1) * work_ms / 1000 / span_s


def format_phases(report: HoldReport) -> str:
    """Return the phase table of the sold holds (means, ms)."""
    if not report.phases_ms:
        return "  (no sold holds recorded)"
    width = max(len(name) for name, _ in report.phases_ms)
    total = sum(ms for _, ms in report.phases_ms)
    lines = [f"  {name.ljust(width)}  {ms:7.2f} ms" for name, ms in report.phases_ms]
    lines.append(f"  {'sum (mean hold of a sale)'.ljust(width)}  {total:7.2f} ms")
    return "\n".join(lines)
