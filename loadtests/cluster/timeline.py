"""The run at a glance: orders/s and errors/s per app host, fault phases shaded."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def draw(report: dict[str, Any], path: Path) -> None:
    """Write the timeline PNG of ``report`` (needs matplotlib: the load extra)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    data = report["series"]
    seconds = list(range(data["seconds"]))
    figure, (top, bottom) = plt.subplots(
        2, 1, figsize=(13, 6.5), sharex=True, height_ratios=(3, 2)
    )
    for host in sorted(set(data["orders"]) | set(data["errors"])):
        if host in data["orders"]:
            top.plot(seconds, data["orders"][host], label=host, linewidth=1.2)
        if host in data["errors"]:
            bottom.plot(seconds, data["errors"][host], label=host, linewidth=1.0)
    for axis in (top, bottom):
        for fault in report["faults"]:
            axis.axvspan(
                fault["start"],
                fault["end"],
                color=("#f4b183" if fault["minority_hosts"] else "#bdd7ee"),
                alpha=0.45,
                linewidth=0,
            )
            if axis is top:
                axis.text(
                    (fault["start"] + fault["end"]) / 2,
                    1.0,
                    fault["name"],
                    transform=axis.get_xaxis_transform(),
                    rotation=30,
                    fontsize=7,
                    ha="left",
                    va="bottom",
                )
        axis.grid(alpha=0.3)
        axis.legend(loc="upper right", fontsize=8)
    top.set_ylabel("orders/s (201) per app host")
    bottom.set_ylabel("errors/s (423, 503, 5xx,\nno answer) per host")
    bottom.set_xlabel("seconds since the load began (CLOCK_MONOTONIC)")
    verdict = "OK" if report["ok"] else "VIOLATED"
    title = "negative control" if report["negative_control"] else "nemesis"
    figure.suptitle(f"Flash sale across namespace hosts, {title}: {verdict}", y=0.995)
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=110)
    plt.close(figure)
