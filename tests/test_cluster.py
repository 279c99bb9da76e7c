"""The cluster run (loadtests/cluster): its checker on recorded states, and a short run.

The checker tests need nothing; the short run (``--duration 40``: every fault of
the schedule, about 115 s) needs root, iproute2, nftables, nginx, PostgreSQL's
initdb and faketime, and skips saying which is missing.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

from loadtests.cluster import checks, run
from loadtests.cluster.checks import Answer, Phase, Sale, Window

ROOT = Path(__file__).resolve().parent.parent


def _names(result: list[checks.Check]) -> dict[str, bool]:
    return {c.name: c.ok for c in result}


def test_windows_pair_grants_and_releases_cut_at_validity(tmp_path: Path) -> None:
    events = [
        {"e": "acq", "r": "p", "t": 1.0, "until": 6.0, "tok": 1},
        {"e": "rel", "r": "p", "t": 2.0, "tok": 1},
        {"e": "acq", "r": "p", "t": 3.0, "until": 4.0, "tok": 2},
        {"e": "rel", "r": "p", "t": 9.0, "tok": 2, "lost": "expired"},
        {"e": "acq", "r": "p", "t": 10.0, "until": 11.0, "tok": 3},
        {"e": "ext", "r": "p", "t": 10.5, "until": 15.0},
        {"e": "acq", "r": "q", "t": 20.0, "until": 25.0, "tok": 4},
    ]
    text = "\n".join(json.dumps(e) for e in events) + '\n{"e": "acq", "r'
    (tmp_path / "app1-7.jsonl").write_text(text)
    windows = checks.read_windows(tmp_path)
    spans = sorted((w.resource, w.start, w.end) for w in windows)
    assert spans == [
        ("p", 1.0, 2.0),
        ("p", 3.0, 4.0),  # paused past its lease: the window ends with validity
        ("p", 10.0, 15.0),  # never released: held until its (extended) validity
        ("q", 20.0, 25.0),
    ]


def test_a_late_release_receiver_does_not_stretch_the_window(tmp_path: Path) -> None:
    # The release began at 1.3 s, 0.3 s into the hold by the lock's own clock; the
    # receiver ran 0.2 s after the release returned (a worker starved of CPU), so
    # "now - elapsed" says 1.5. The earlier of the two bounds is the window's end.
    events = [
        {"e": "acq", "r": "p", "t": 1.0, "until": 6.0, "tok": 1},
        {"e": "rel", "r": "p", "t": 1.5, "tok": 1, "span": 0.3},
        # A grant whose receiver ran late (its lock_acquired after a stall): its
        # "now - elapsed" is the tighter bound.
        {"e": "acq", "r": "p", "t": 2.5, "until": 7.0, "tok": 2},
        {"e": "rel", "r": "p", "t": 2.6, "tok": 2, "span": 0.4},
    ]
    (tmp_path / "app1-7.jsonl").write_text("\n".join(json.dumps(e) for e in events))
    spans = sorted((w.start, w.end) for w in checks.read_windows(tmp_path))
    assert spans == [(1.0, pytest.approx(1.3)), (2.5, 2.6)]


def test_overlaps_on_one_resource_only() -> None:
    a = Window("p", 0.0, 1.0, 1, "app1-1")
    b = Window("p", 0.5, 2.0, 2, "app2-1")  # overlaps a by 0.5 s
    c = Window("q", 0.5, 2.0, 3, "app3-1")  # other resource
    d = Window("p", 2.0, 3.0, 4, "app3-2")  # starts when b ends
    assert checks.overlaps([d, c, b, a]) == [(a, b)]
    assert checks.overlaps([a, d]) == []


def _sale(**changes: object) -> tuple[Sale, list[dict[str, object]], list[Window]]:
    sale = Sale(10, 7, [(1, "a", 1, 5), (2, "b", 1, 6), (3, "c", 1, 9)])
    answers: list[dict[str, object]] = [
        {"c": "a", "s": 201},
        {"c": "b", "s": 201},
        {"c": "c", "s": 0},  # timed out: its order may exist without a 201
        {"c": "d", "s": 503},
    ]
    windows = [Window("p", 0, 1, 5, "x"), Window("p", 1, 2, 6, "y")]
    for key, value in changes.items():
        if key == "sale":
            sale = value  # type: ignore[assignment]
        elif key == "answers":
            answers = value  # type: ignore[assignment]
        elif key == "windows":
            windows = value  # type: ignore[assignment]
    return sale, answers, windows


def test_a_clean_sale_passes() -> None:
    assert all(c.ok for c in checks.check_sale(*_sale()))


@pytest.mark.parametrize(
    ("changes", "broken"),
    [
        ({"sale": Sale(2, -1, [(1, "a", 1, 5), (2, "b", 1, 6), (3, "c", 1, 9)])},
         "units sold <= stock"),
        ({"sale": Sale(10, 8, [(1, "a", 1, 5), (2, "b", 1, 6), (3, "c", 1, 9)])},
         "initial - remaining == units sold (no lost update)"),
        ({"answers": [{"c": "a", "s": 201}, {"c": "b", "s": 201},
                      {"c": "c", "s": 0}, {"c": "e", "s": 201}]},
         "every 201 has its order in PostgreSQL"),
        ({"answers": [{"c": "a", "s": 201}, {"c": "b", "s": 201}]},
         "every order had its 201 or a client timeout"),
        ({"sale": Sale(10, 6, [(1, "a", 1, 5), (2, "b", 1, 6), (3, "c", 1, 9),
                         (4, "a", 1, 10)])},
         "no duplicate customer"),
        ({"sale": Sale(10, 7, [(1, "a", 1, 5), (2, "b", 1, 9), (3, "c", 1, 6)])},
         "orders' fencing tokens increase with the order id"),
        ({"windows": [Window("p", 0, 1, 5, "x"), Window("p", 0.9, 2, 6, "y")]},
         "lock windows never overlap for one resource"),
    ],
)  # fmt: skip
def test_each_violation_is_caught(changes: dict[str, object], broken: str) -> None:
    result = _names(checks.check_sale(*_sale(**changes)))
    assert result[broken] is False
    assert [name for name, ok in result.items() if not ok] == [broken]


def test_an_overlap_within_the_timestamp_tolerance_is_not_a_violation() -> None:
    slight = checks.OVERLAP_TOLERANCE / 2
    windows = [Window("p", 0, 1, 5, "x"), Window("p", 1 - slight, 2, 6, "y")]
    result = checks.check_sale(*_sale(windows=windows))
    overlap = next(c for c in result if c.name.startswith("lock windows"))
    assert overlap.ok and "1 within the timestamps' tolerance" in overlap.detail


def test_liveness_per_phase() -> None:
    phases = [
        Phase("calm", 0, 10),
        Phase("app1 cut from 3 of 5", 10, 20, ("app1",), heal_host="app1"),
        Phase("redis4,5 cut from all", 20, 30),
    ]
    answers = [Answer(t, "app2", 201) for t in range(0, 30, 2)]
    answers += [Answer(12, "app1", 503), Answer(21.5, "app1", 201)]
    ok = checks.check_liveness(phases, answers, ("app1", "app2"))
    assert all(c.ok for c in ok)
    assert phases[1].stats["recovery_s"] == 1.5
    # A 503 from a host that reaches a majority, and a phase without orders.
    bad = checks.check_liveness(
        phases,
        [*answers, Answer(25, "app2", 503)],
        ("app1", "app2"),
    )
    assert [c.name for c in bad if not c.ok] == [
        "503s only from hosts without a majority during redis4,5 cut from all"
    ]
    empty = checks.check_liveness(phases, [Answer(5, "app2", 201)], ("app2",))
    assert [c.name for c in empty if not c.ok] == [
        "orders/s > 0 during app1 cut from 3 of 5",
        "orders/s > 0 during redis4,5 cut from all",
    ]


def test_access_log_lines() -> None:
    text = (
        "1000.500 10.0.0.31:8000 201 0.030\n"
        "1001.000 10.0.0.31:8000, 10.0.0.32:8000 503 0.061\n"
        "1002.000 - 502 1.000\n"
        "garbage\n"
    )
    names = {"10.0.0.31:8000": "app1", "10.0.0.32:8000": "app2"}
    answers = checks.parse_access_log(text, offset=900.0, started=100.0, names=names)
    assert answers == [
        Answer(0.5, "app1", 201, 0.03),
        Answer(1.0, "app2", 503, 0.061),
        Answer(2.0, "-", 502, 1.0),
    ]


def test_bad_duration_is_refused() -> None:
    with pytest.raises(SystemExit):
        run.parse_args(["--duration", "10"])


def test_app_logs_say_why_they_answered_503() -> None:
    line = (
        "POST /shop/products/1/buy/ not run: could not acquire 'shop.product:1': "
        "too few nodes answered: 1/5 nodes, quorum 3 (failed: node[0] redis1:6379: "
        "timed out; node[1] redis2:6379: skipped: connecting timed out {}s ago)"
    )
    logs = [line.format("0.21") + "\nGET / 200\n" + line.format("0.5"), "nothing"]
    [(why, count)] = checks.unavailable_reasons(logs)
    assert count == 2
    assert why.startswith("too few nodes answered: 1/5 nodes, quorum 3")
    assert why.endswith("node[1] redis2:6379: skipped: connecting timed out Ns ago)")
    assert "shop.product" not in why


def test_only_picks_named_faults_in_order_and_refuses_unknown_ones() -> None:
    from loadtests.cluster.nemesis import Step, pick

    def step(name: str) -> Step:
        return Step(name, 1.0, lambda: "", lambda: "")

    steps = [step("a, b"), step("c")]
    assert [s.name for s in pick(steps, "c; a, b;c")] == ["c", "a, b", "c"]
    with pytest.raises(SystemExit, match="no fault named 'd'; the faults are: a, b, c"):
        pick(steps, "c;d")


def _short_run(tmp_path: Path) -> tuple[subprocess.CompletedProcess[str], Path]:
    summary = tmp_path / "summary.json"
    result = subprocess.run(
        [sys.executable, "-m", "loadtests.cluster", "--duration", "40",
         "--run-dir", str(tmp_path / "run"), "--reports-dir", str(tmp_path),
         "--summary-json", str(summary)],
        cwd=ROOT, capture_output=True, text=True, timeout=400,
    )  # fmt: skip
    return result, summary


def _only_liveness_failed(summary: Path) -> bool:
    if not summary.exists():
        return False
    failed = [c for c in json.loads(summary.read_text())["checks"] if not c["ok"]]
    return bool(failed) and all(c["kind"] == "liveness" for c in failed)


#: Runs of the short cluster run when only liveness checks fail (see below).
LIVENESS_TRIES = 3


@pytest.mark.timeout(1300)  # three runs of at most 400 s each
def test_short_cluster_run_passes(tmp_path: Path) -> None:
    """Every fault of the schedule, shortened (about 115 s): the run exits 0.

    A run whose only failures are liveness checks (orders/s, 503s from a host
    with a majority) is run again, up to LIVENESS_TRIES runs in all, each failed
    one's report printed as a warning: those checks measure a 2-core machine's
    throughput phase by phase, and about 3 runs in 14 had one phase go slow
    (docs/deployment.md says where and the likely cause). A safety failure
    (oversold, lost order, overlapping windows) is never run again.
    """
    if os.environ.get("NOX_CURRENT_SESSION"):
        pytest.skip(
            "the cluster run (115 s) runs once, in make test, not in every "
            "version-matrix session: it tests the deployment, not a version"
        )
    why = run.missing_requirements()
    if why is not None:
        pytest.skip(f"the cluster run needs what is missing here: {why}")
    for attempt in range(1, LIVENESS_TRIES + 1):
        result, summary = _short_run(tmp_path / f"run{attempt}")
        if attempt == LIVENESS_TRIES or not (
            result.returncode == 1 and _only_liveness_failed(summary)
        ):
            break
        warnings.warn(
            f"short cluster run {attempt} failed a liveness check only; running it "
            "again. Its report:\n" + result.stdout[-6000:],
            stacklevel=1,
        )
    if result.returncode == run.SKIP_EXIT:
        pytest.skip(result.stdout.strip())
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-3000:]
    report = json.loads(summary.read_text())
    reports = summary.parent
    assert report["ok"] and report["sale"]["orders"] > 0
    assert len(report["faults"]) == 8
    assert (reports / "cluster.png").stat().st_size > 10_000
    assert (reports / "cluster.html").exists()
    assert "LEFT BEHIND" not in result.stdout
