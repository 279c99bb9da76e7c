"""The one place the headless Locust command line is built.

``make demo``, ``make chaos`` and the load tests all run ``loadtests/locustfile.py``
the same way: bounded users, spawn rate and run time, loopback app servers, a JSON
summary to check the sale against.
"""

from __future__ import annotations

import sys
from collections.abc import Iterable, Mapping
from pathlib import Path

from harness.processes import REPO

LOCUSTFILE = REPO / "loadtests" / "locustfile.py"


def locust_env(env: Mapping[str, str]) -> dict[str, str]:
    """Return ``env`` without ``LOCUST_*`` variables, which would override the flags."""
    return {k: v for k, v in env.items() if not k.startswith("LOCUST_")}


def locust_command(
    *,
    hosts: Iterable[str],
    product_id: int,
    scenario: str,
    users: int,
    spawn_rate: float,
    run_time: int,
    summary_json: Path,
    html: Path | None = None,
    stop_after_sold_out: float | None = None,
    expect_oversell: str | None = None,
) -> list[str]:
    """Return the ``python -m locust`` command of one headless run of the locustfile.

    ``scenario`` is the locustfile's ``--scenario`` (``locked``, ``unsafe``,
    ``double-click``, ... comma-separated); ``run_time`` is in seconds. Optional
    flags are left out when ``None``, so the locustfile's defaults apply.
    """
    command = [
        sys.executable, "-m", "locust",
        "-f", str(LOCUSTFILE),
        "--headless",
        "-u", str(users),
        "-r", str(spawn_rate),
        "-t", f"{run_time}s",
    ]  # fmt: skip
    if html is not None:
        command += ["--html", str(html)]
    command += [
        "--only-summary",
        "--app-hosts", ",".join(hosts),
        "--product-id", str(product_id),
        "--scenario", scenario,
    ]  # fmt: skip
    if stop_after_sold_out is not None:
        command += ["--stop-after-sold-out", str(stop_after_sold_out)]
    if expect_oversell is not None:
        command += ["--expect-oversell", expect_oversell]
    command += ["--summary-json", str(summary_json)]
    return command
