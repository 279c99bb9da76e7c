"""The hot-lock figures of ``make demo`` (``loadtests/holds.py``), on recorded data.

The records are written out by hand in the format ``shop/timings.py`` writes, so
every figure can be checked by arithmetic. ``tests/test_loadtest.py`` checks the
same figures on records written by live app servers.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from loadtests import holds
from loadtests.demo import format_table


def record(
    start: float,
    held: float,
    *,
    status: int = 201,
    product: int = 7,
    release: float = 0.001,
    pay: float = 0.005,
    arrived: float | None = None,
) -> dict[str, Any]:
    """A sold hold granted at ``start``: acquire 1 ms, read 1 ms, pay, write 1 ms.

    The request asked for the product lock at ``arrived`` (20 ms before ``start``
    unless given).
    """
    end = start + held
    marks = {
        "start": start - 0.050,
        "checked": start - 0.020 if arrived is None else arrived,
        "product_acquired": start + 0.001,
        "read": start + 0.002,
        "paid": start + 0.002 + pay,
        "written": start + 0.003 + pay,
        "committed": start + 0.0035 + pay,
        "product_released": end,
        "end": end + 0.0001,
    }
    if status != 201:
        for name in ("paid", "written", "committed"):
            del marks[name]
    return {
        "pid": 1,
        "product": product,
        "status": status,
        "error": None,
        "marks": marks,
        "held": held,
        "release_elapsed": release,
        "attempts": 1,
    }


def test_back_to_back_holds_are_fully_utilized() -> None:
    """Three 10 ms holds end to end: the lock is busy the whole sale."""
    records = [record(t, 0.010) for t in (0.0, 0.010, 0.020)]
    report = holds.summarize(records)

    assert report.sales == 3
    # First sale commits at 0.0085, last at 0.0285: a 20 ms window.
    assert report.window_s == pytest.approx(0.020)
    assert report.busy_s == pytest.approx(0.020)
    assert report.utilization == pytest.approx(1.0)
    assert report.median_hold_ms == pytest.approx(10.0)


def test_gaps_between_holds_lower_the_utilization() -> None:
    """10 ms holds every 20 ms: half the window idle (the negative control)."""
    records = [record(t, 0.010) for t in (0.0, 0.020, 0.040)]
    report = holds.summarize(records)

    # Window 0.0085 -> 0.0485 (40 ms); held inside it: 1.5 + 10 + 8.5 ms.
    assert report.window_s == pytest.approx(0.040)
    assert report.busy_s == pytest.approx(0.020)
    assert report.utilization == pytest.approx(0.5)


def test_holds_that_overlap_count_once() -> None:
    """A hold's winning attempt can begin before its predecessor's release ends:
    the time both cover counts once, so utilization never passes 1.0."""
    records = [record(t, 0.012) for t in (0.0, 0.010, 0.020)]
    report = holds.summarize(records)

    assert report.busy_s == pytest.approx(0.020)
    assert report.utilization == pytest.approx(1.0)
    assert holds.covered([(0, 2), (1, 3), (5, 6), (5.5, 5.7)], 0.5, 10) == 3.5


def test_out_of_order_counts_grants_that_overtook_an_earlier_arrival() -> None:
    """Arrivals 0, 1, 2, 3 ms granted in the order 0, 2, 1, 3: one of four grants
    (the second arrival's overtaker) was served before an earlier arrival."""
    granted_as = [0.000, 0.002, 0.001, 0.003]
    records = [
        record(0.1 + 0.01 * k, 0.010, arrived=arrived)
        for k, arrived in enumerate(granted_as)
    ]
    assert holds.summarize(records).out_of_order == pytest.approx(0.25)

    in_order = [record(0.1 + 0.01 * k, 0.01, arrived=k / 1000) for k in range(4)]
    assert holds.summarize(in_order).out_of_order == 0.0
    assert holds.out_of_order([]) is None


def test_holds_outside_the_sale_and_other_products_do_not_count() -> None:
    """A sold-out hold after the last sale, and another product, are left out."""
    records = [
        record(0.0, 0.010),
        record(0.010, 0.010),
        record(0.030, 0.010, status=409),  # after the last sale (0.0185)
        record(0.005, 0.010, product=8),
    ]
    report = holds.summarize([r for r in records if r["product"] == 7])

    assert report.sales == 2
    assert report.holds == 3
    assert report.utilization == pytest.approx(1.0)
    assert report.median_hold_ms == pytest.approx(10.0)


def test_work_utilization_leaves_out_the_lock_fan_outs() -> None:
    """From acquire() returning to the release starting: 1 ms + 1 ms less per hold."""
    records = [record(t, 0.010, release=0.001) for t in (0.0, 0.010, 0.020)]
    report = holds.summarize(records)

    # Work intervals [t + 1 ms, t + 9 ms]; window 8.5 -> 28.5 ms holds
    # 0.5 (first) + 8 (second) + 7.5 (third, to 28.5) ms of work: 16/20.
    assert report.work_utilization == pytest.approx(16 / 20)
    assert report.utilization == pytest.approx(1.0)


def test_phases_are_means_between_consecutive_marks_of_sold_holds() -> None:
    records = [record(0.0, 0.012, pay=0.004), record(0.012, 0.012, pay=0.006)]
    phases = dict(holds.phases(records))

    assert list(phases) == [
        "hold start -> product_acquired",
        "product_acquired -> read",
        "read -> paid",
        "paid -> written",
        "written -> committed",
        "committed -> release start",
        "release start -> product_released",
    ]
    assert phases["read -> paid"] == pytest.approx(5.0)
    assert phases["release start -> product_released"] == pytest.approx(1.0)
    assert phases["committed -> release start"] == pytest.approx(2.5)
    assert sum(phases.values()) == pytest.approx(12.0)


def test_a_hold_with_marks_out_of_order_is_left_out_of_the_phases() -> None:
    """A ``held`` that starts after the acquired signal would mix the labels."""
    odd = record(0.012, 0.012)
    odd["held"] = 0.0105  # hold start now falls after product_acquired and read
    phases = dict(holds.phases([record(0.0, 0.012), odd]))

    starts = [label for label in phases if label.startswith("hold start")]
    assert starts == ["hold start -> product_acquired"]
    assert phases["hold start -> product_acquired"] == pytest.approx(1.0)


def test_under_two_sales_there_is_no_window() -> None:
    report = holds.summarize([record(0.0, 0.010)])
    assert (report.sales, report.utilization, report.median_hold_ms) == (1, None, None)


def test_payment_share_from_outside() -> None:
    """200 orders of 20 ms in 5.97 s: 199 x 20 ms / 5.97 s = 0.667."""
    assert holds.payment_share(200, 20, 5.97) == pytest.approx(199 * 0.020 / 5.97)
    assert holds.payment_share(1, 20, 5.0) is None
    assert holds.payment_share(200, 20, None) is None


def test_records_are_read_per_product_from_every_process(tmp_path: Path) -> None:
    (tmp_path / "timings-1.jsonl").write_text(
        json.dumps(record(0.0, 0.010)) + "\n" + json.dumps(record(0.02, 0.01)) + "\n"
    )
    (tmp_path / "timings-2.jsonl").write_text(
        json.dumps(record(0.01, 0.01, product=8)) + "\n\n"
    )
    (tmp_path / "other.txt").write_text("not a record\n")

    assert len(holds.read_records(tmp_path)) == 3
    assert len(holds.read_records(tmp_path, 7)) == 2


def test_the_demo_table_prints_the_hold_figures() -> None:
    locked = {
        "mode": "locked",
        "endpoint": "buy",
        "holds": {
            "utilization": 0.912,
            "work_utilization": 0.8,
            "median_hold_ms": 7.04,
            "out_of_order": 0.0123,
        },
        "payment_share": 0.7512,
    }
    unsafe = {"mode": "unsafe", "endpoint": "buy-unsafe"}
    table = format_table([unsafe, locked]).splitlines()

    assert table[0].endswith(
        "hold util  work util  hold p50 ms  pay share  out of order"
    )
    assert table[-1].split()[-5:] == ["0.91", "0.80", "7.0", "0.75", "0.012"]
    assert table[-2].split()[-5:] == ["-", "-", "-", "-", "-"]
