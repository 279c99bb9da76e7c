"""OpenTelemetry spans of real locks on the real nodes, read from the SDK's
in-memory exporter: their names, attributes, timings and parents."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import re
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace import ReadableSpan, SpanProcessor, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import (
    InMemorySpanExporter,
)
from opentelemetry.trace import StatusCode

from harness.held import lock_key
from harness.nodes import NodeSet
from redlock_django import (
    LockLostError,
    QuorumUnavailableError,
    Redlock,
    signals,
    tracing,
)

tracer = trace.get_tracer("tests.test_tracing")


@pytest.fixture(scope="module")
def exporter() -> Iterator[InMemorySpanExporter]:
    """Record every span the process ends from now on, in memory."""
    provider = trace.get_tracer_provider()
    if not isinstance(provider, TracerProvider):
        provider = TracerProvider()
        trace.set_tracer_provider(provider)
    memory = InMemorySpanExporter()
    provider.add_span_processor(SimpleSpanProcessor(memory))
    yield memory
    memory.shutdown()


@pytest.fixture
def spans(
    exporter: InMemorySpanExporter, redlock_settings: dict[str, Any]
) -> Callable[[], list[ReadableSpan]]:
    """Return a function listing the lock spans ended since the test started."""
    assert tracing.installed()
    exporter.clear()

    def finished() -> list[ReadableSpan]:
        return [
            s for s in exporter.get_finished_spans() if s.name.startswith("redlock.")
        ]

    return finished


def seconds(span: ReadableSpan) -> float:
    assert span.start_time is not None and span.end_time is not None
    return (span.end_time - span.start_time) / 1e9


def child_of(span: ReadableSpan, parent: trace.Span) -> bool:
    context = parent.get_span_context()
    return (
        span.parent is not None
        and span.parent.span_id == context.span_id
        and span.context is not None
        and span.context.trace_id == context.trace_id
    )


def test_acquire_and_release_are_spans_under_the_callers_span(
    spans: Callable[[], list[ReadableSpan]],
) -> None:
    """Attributes say who granted, the quorum and the token; the caller's span is
    the parent of both."""
    with (
        tracer.start_as_current_span("request") as request,
        Redlock("traced", fencing=True),
    ):
        time.sleep(0.05)
    acquire, release = spans()
    assert (acquire.name, release.name) == ("redlock.acquire", "redlock.release")
    assert child_of(acquire, request) and child_of(release, request)
    attributes = dict(acquire.attributes or {})
    # A quorum decides: a node answering late is not waited for (protocol.grace).
    assert 3 <= attributes.pop("redlock.granted") <= 5
    assert attributes == {
        "redlock.resource": "traced",
        "redlock.outcome": "acquired",
        "redlock.wait_seconds": pytest.approx(seconds(acquire), abs=1e-6),
        "redlock.attempts": 1,
        "redlock.wakeups": 0,
        "redlock.handed": False,
        "redlock.quorum": 3,
        "redlock.nodes": 5,
        "redlock.fencing_token": 1,
    }
    attributes = release.attributes or {}
    assert attributes["redlock.outcome"] == "released"
    assert 3 <= attributes["redlock.released"] <= 5
    assert attributes["redlock.fencing_token"] == 1
    assert attributes["redlock.held_seconds"] >= 0.05
    assert release.status.status_code is StatusCode.UNSET
    assert acquire.end_time is not None and release.start_time is not None
    assert acquire.end_time <= release.start_time


def test_a_wait_for_another_holder_is_the_acquire_spans_duration(
    spans: Callable[[], list[ReadableSpan]],
) -> None:
    """A thread holds the lock for 0.4 s; the waiter's span covers its wait."""
    held = threading.Event()

    def holder() -> None:
        with Redlock("queue"):
            held.set()
            time.sleep(0.4)

    thread = threading.Thread(target=holder)
    thread.start()
    assert held.wait(5)
    before = time.time_ns()
    with Redlock("queue"):
        after = time.time_ns()
    thread.join()
    waiter = [s for s in spans() if s.name == "redlock.acquire"][-1]
    attributes = waiter.attributes or {}
    assert attributes["redlock.outcome"] == "acquired"
    assert attributes["redlock.attempts"] >= 2
    assert waiter.start_time is not None and waiter.end_time is not None
    assert before <= waiter.start_time and waiter.end_time <= after
    assert 0.25 < seconds(waiter) <= (after - before) / 1e9
    assert attributes["redlock.wait_seconds"] == pytest.approx(seconds(waiter), 1e-3)


def test_contention_is_an_acquire_span_with_its_outcome(
    spans: Callable[[], list[ReadableSpan]], nodes: NodeSet
) -> None:
    """The wait ran out: outcome contended, the two free nodes granted (below
    the quorum), no error status."""
    for node in nodes[:3]:
        node.clog(lock_key("busy"))
    with tracer.start_as_current_span("request") as request:
        assert not Redlock("busy").acquire(timeout=0.3)
    (span,) = spans()
    attributes = span.attributes or {}
    assert child_of(span, request)
    assert attributes["redlock.outcome"] == "contended"
    assert (attributes["redlock.granted"], attributes["redlock.quorum"]) == (2, 3)
    assert 0.3 <= seconds(span) < 1.5
    assert span.status.status_code is StatusCode.UNSET


def test_a_majority_paused_is_an_unavailable_span_with_an_error(
    spans: Callable[[], list[ReadableSpan]], nodes: NodeSet
) -> None:
    """Three of five nodes SIGSTOPped: outcome unavailable, the failed nodes named
    by their displays, the error's message as the status."""
    for node in nodes[:3]:
        node.pause()
    with pytest.raises(QuorumUnavailableError) as raised:
        Redlock("down").acquire()
    (span,) = spans()
    attributes = span.attributes or {}
    assert attributes["redlock.outcome"] == "unavailable"
    assert attributes["redlock.quorum"] == 3
    assert attributes["redlock.granted"] == raised.value.granted <= 2
    assert set(attributes["redlock.failed_nodes"]) == {
        f"redis://127.0.0.1:{node.port}/0" for node in nodes[:3]
    }
    assert span.status.status_code is StatusCode.ERROR
    assert span.status.description == str(raised.value)
    assert [event.name for event in span.events] == ["exception"]


def test_extend_and_the_watchdogs_extensions_are_spans_under_the_acquirer(
    spans: Callable[[], list[ReadableSpan]],
) -> None:
    """extend() in the caller, and the watchdog's from its own thread: both nest
    under the span that was current when the lock was acquired."""
    with tracer.start_as_current_span("request") as request:
        lock = Redlock("stretched", ttl=0.3)
        with lock:
            assert lock.extend(1.0)
        with Redlock("watched", ttl=0.3, auto_extend=True):
            time.sleep(0.5)
    extends = [s for s in spans() if s.name == "redlock.extend"]
    assert len(extends) >= 2
    assert all(child_of(span, request) for span in extends)
    first = extends[0].attributes or {}
    assert first["redlock.resource"] == "stretched"
    assert 0.9 < first["redlock.validity_seconds"] <= 1.0
    assert {(s.attributes or {})["redlock.resource"] for s in extends[1:]} == {
        "watched"
    }


def test_a_lease_lost_under_a_watchdog_is_a_lost_span_and_a_lost_release(
    spans: Callable[[], list[ReadableSpan]], nodes: NodeSet
) -> None:
    """A majority SIGSTOPped past the TTL: the watchdog's thread reports the loss
    under the acquirer's span, and the release says lost."""
    with tracer.start_as_current_span("request") as request:
        lock = Redlock("lost", ttl=0.3, auto_extend=True, fencing=True)
        lock.acquire()
        for node in nodes[:3]:
            node.pause()
        try:
            time.sleep(0.6)
        finally:
            nodes.resume_all()
        with pytest.raises(LockLostError):
            lock.release()
    # A slow pause may leave time for one extension first: not what is tested.
    named = {span.name: span for span in spans() if span.name != "redlock.extend"}
    assert set(named) == {"redlock.acquire", "redlock.lost", "redlock.release"}
    lost, release = named["redlock.lost"], named["redlock.release"]
    assert all(child_of(span, request) for span in named.values())
    attributes = lost.attributes or {}
    assert attributes["redlock.fencing_token"] == 1
    assert attributes["redlock.held_seconds"] >= 0.25
    # The watchdog's own verdict: what its last extension got, or the lease's end.
    assert re.fullmatch(
        r"extension confirmed by [0-2]/5 nodes, quorum 3|its lease ran out .*",
        attributes["redlock.lost_reason"],
    )
    assert lost.status.status_code is StatusCode.ERROR
    assert (release.attributes or {})["redlock.outcome"] == "lost"
    assert release.status.status_code is StatusCode.ERROR


async def test_async_locks_make_the_same_spans_under_the_tasks_span(
    spans: Callable[[], list[ReadableSpan]],
) -> None:
    """async with, aextend and the watchdog task nest under the current span."""
    with tracer.start_as_current_span("request") as request:
        lock = Redlock("async-traced", ttl=0.3, auto_extend=True)
        async with lock:
            assert await lock.aextend(0.3)
            await asyncio.sleep(0.3)
    found = spans()
    names = [span.name for span in found]
    assert names[0] == "redlock.acquire" and names[-1] == "redlock.release"
    assert names.count("redlock.extend") >= 2
    assert all(child_of(span, request) for span in found)


def test_no_password_in_any_span_of_nodes_behind_requirepass(
    spans: Callable[[], list[ReadableSpan]],
    settings: Any,
    make_nodes: Callable[..., NodeSet],
) -> None:
    """Login URLs for the nodes (one with a wrong password): no span attribute,
    status or event holds the password, in success and in failure."""
    secret = "tr4ce-pa55-never-shown"
    secured = make_nodes(3)
    urls = secured.require_password(secret, user="default")
    urls[2] = f"redis://:wrong-{secret}@127.0.0.1:{secured[2].port}/0"
    settings.REDLOCK = {"NODES": urls, "NODE_TIMEOUT": 0.2, "WAIT_TIMEOUT": 0.2}
    lock = Redlock("secret", fencing=True, auto_extend=True, ttl=0.3)
    with lock:
        assert lock.extend()
        time.sleep(0.15)
    with secured[1].paused(), pytest.raises(QuorumUnavailableError):
        Redlock("secret").acquire()
    found = spans()
    names = [span.name for span in found]
    assert names[0] == names[-1] == "redlock.acquire"
    assert {"redlock.extend", "redlock.release"} <= set(names)
    texts = [span.to_json() for span in found]
    assert f"127.0.0.1:{secured[2].port}" in texts[-1]  # the failed nodes are named
    assert all(secret not in text for text in texts)


def test_uninstalled_receivers_make_no_spans(
    spans: Callable[[], list[ReadableSpan]], nodes: NodeSet
) -> None:
    """The control: the same locks, acquired, contended and unavailable, with the
    receivers disconnected, leave no span; connected again, they do."""

    def locks() -> None:
        with Redlock("control"):
            pass
        nodes[0].clog(lock_key("control-busy"))
        nodes[1].clog(lock_key("control-busy"))
        nodes[2].clog(lock_key("control-busy"))
        assert not Redlock("control-busy").acquire(blocking=False)

    tracing.uninstall()
    try:
        assert not tracing.installed()
        locks()
        assert spans() == []
    finally:
        assert tracing.install()
    nodes.flush_all()
    locks()
    assert [span.name for span in spans()] == [
        "redlock.acquire",
        "redlock.release",
        "redlock.acquire",
    ]


@pytest.fixture
def installed_with() -> Iterator[Callable[[TracerProvider], None]]:
    """Return ``use(provider)``: the receivers send to ``provider`` for the test."""

    def use(provider: TracerProvider) -> None:
        tracing.uninstall()
        assert tracing.install(tracer_provider=provider)

    yield use
    tracing.uninstall()
    assert tracing.install()


def test_spans_go_to_the_tracer_provider_given_to_install(
    spans: Callable[[], list[ReadableSpan]],
    installed_with: Callable[[TracerProvider], None],
) -> None:
    """A provider of its own (not the global one) gets the spans, the global none."""
    own = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(own))
    installed_with(provider)
    with Redlock("own-provider"):
        pass
    assert [span.name for span in own.get_finished_spans()] == [
        "redlock.acquire",
        "redlock.release",
    ]
    assert spans() == []


class _Broken(SpanProcessor):
    """A span processor that fails on every span, as a buggy exporter might."""

    def on_end(self, span: ReadableSpan) -> None:
        raise RuntimeError("exporter down")


def test_a_failing_span_processor_never_fails_the_lock(
    spans: Callable[[], list[ReadableSpan]],
    installed_with: Callable[[TracerProvider], None],
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The lock is taken and released as usual; the failure is logged."""
    provider = TracerProvider()
    provider.add_span_processor(_Broken())
    installed_with(provider)
    lock = Redlock("robust")
    with caplog.at_level(logging.ERROR, logger="redlock_django.tracing"), lock:
        assert lock.owned()
    assert not lock.locked()
    assert [record.getMessage() for record in caplog.records] == [
        "redlock tracing: on_acquired failed",
        "redlock tracing: on_released failed",
    ]


def test_without_opentelemetry_no_instrument_is_attached() -> None:
    """A process where opentelemetry cannot be imported (as without the extra)
    starts the app with no tracing instrument; the same process with it has six,
    one per signal, and none of them is a Django receiver."""
    program = """
import json, sys
if sys.argv[1] == "absent":
    sys.modules["opentelemetry"] = None  # 'import opentelemetry' raises ImportError
import django
from django.conf import settings
settings.configure(
    INSTALLED_APPS=["redlock_django"], REDLOCK={"NODES": ["redis://127.0.0.1:1/0"]}
)
django.setup()
from redlock_django import signals, tracing
every = [getattr(signals, name) for name in signals.__all__]
attached = [i for signal in every for i in signals.instruments(signal)]
ours = sum(i.__module__ == "redlock_django.tracing" for i in attached)
connected = sum(len(signal.receivers) for signal in every)
print(json.dumps([tracing.installed(), ours, connected]))
"""
    results = {}
    for case in ("absent", "present"):
        done = subprocess.run(
            [sys.executable, "-c", program, case],
            capture_output=True,
            text=True,
            timeout=60,
            env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
            check=True,
        )
        results[case] = json.loads(done.stdout)
    assert results == {
        "absent": [False, 0, 0],
        "present": [True, len(signals.__all__), 0],
    }


def test_spans_start_with_the_first_lock_after_a_provider_is_set(
    nodes: NodeSet,
) -> None:
    """With the API but no SDK's provider the receivers make nothing (every span
    would be a no-op); the lock taken just after ``set_tracer_provider()`` is
    traced, and so is one in a process whose provider comes from its environment."""
    program = """
import json, sys
import django
from django.conf import settings
settings.configure(
    INSTALLED_APPS=["redlock_django"], REDLOCK={"NODES": [sys.argv[1]]}
)
django.setup()
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import (
    InMemorySpanExporter,
)
from redlock_django import Redlock, tracing
assert tracing.installed()
with Redlock("before-the-sdk"):
    pass
memory = InMemorySpanExporter()
if sys.argv[2] == "set":
    provider = TracerProvider()
    trace.set_tracer_provider(provider)
else:
    provider = trace.get_tracer_provider()  # loaded from the environment
provider.add_span_processor(SimpleSpanProcessor(memory))
with Redlock("after-the-sdk"):
    pass
spans = memory.get_finished_spans()
print(json.dumps([[s.name, s.attributes["redlock.resource"]] for s in spans]))
"""
    expected = [
        ["redlock.acquire", "after-the-sdk"],
        ["redlock.release", "after-the-sdk"],
    ]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    for case, extra in (
        ("set", {}),
        ("env", {"OTEL_PYTHON_TRACER_PROVIDER": "sdk_tracer_provider"}),
    ):
        done = subprocess.run(
            [sys.executable, "-c", program, nodes.urls[0], case],
            capture_output=True,
            text=True,
            timeout=60,
            env={**env, **extra},
        )
        assert done.returncode == 0, done.stderr
        assert json.loads(done.stdout) == expected, case
