"""What the chaos run watches while Locust runs: the sale's audit and probe purchases.

Each runs in a thread of its own, about once a second, and keeps what it saw for
the timeline and the per-phase refusal reasons of the report.
"""

from __future__ import annotations

import contextlib
import json
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field

from loadtests.demo import get_json


@dataclass
class Sample:
    at: float
    orders: int
    stock: int


@dataclass
class Sampler:
    """Read the sale's audit about once a second, in a thread, for the timeline."""

    url: str
    started: float
    samples: list[Sample] = field(default_factory=list)
    stop: threading.Event = field(default_factory=threading.Event)

    def run(self) -> None:
        while not self.stop.is_set():
            with contextlib.suppress(OSError, ValueError, KeyError):
                audit = get_json(self.url, timeout=3.0)
                self.samples.append(
                    Sample(
                        time.monotonic() - self.started,
                        int(audit["orders"]),
                        int(audit["stock"]),
                    )
                )
            self.stop.wait(1.0)

    def latest(self) -> Sample | None:
        return self.samples[-1] if self.samples else None

    def orders_at(self, at: float) -> int | None:
        before = [s for s in self.samples if s.at <= at]
        return before[-1].orders if before else None


@dataclass
class Probe:
    at: float
    status: int
    answer: str


@dataclass
class Prober:
    """Buy once a second as a fresh customer and keep the answers, 503 reasons too.

    Locust counts answers by status and error name only; these probes keep the
    ``detail`` text, which says why a purchase was refused during a fault.
    """

    hosts: list[str]
    product_id: int
    started: float
    probes: list[Probe] = field(default_factory=list)
    stop: threading.Event = field(default_factory=threading.Event)

    def run(self) -> None:
        number = 0
        while not self.stop.is_set():
            host = self.hosts[number % len(self.hosts)]
            number += 1
            url = f"{host}/shop/products/{self.product_id}/buy/"
            body = json.dumps({"customer": f"probe-{number}", "quantity": 1})
            request = urllib.request.Request(
                url,
                data=body.encode(),
                headers={"Content-Type": "application/json"},
                method="POST",
            )
            try:
                with urllib.request.urlopen(request, timeout=15.0) as reply:
                    status, text = reply.status, reply.read().decode()
            except urllib.error.HTTPError as exc:
                status, text = exc.code, exc.read().decode(errors="replace")
            except OSError as exc:
                status, text = 0, f"connection error: {exc}"
            at = time.monotonic() - self.started
            self.probes.append(Probe(round(at, 2), status, _answer(status, text)))
            self.stop.wait(1.0)


def _answer(status: int, text: str) -> str:
    """Return the error and detail of a refusal, or "order" for a 201."""
    if status == 201:
        return "order"
    try:
        body = json.loads(text)
    except ValueError:
        return text.strip()[:160]
    if not isinstance(body, dict):
        return text.strip()[:160]
    return f"{body.get('error')}: {body.get('detail')}"[:200]
