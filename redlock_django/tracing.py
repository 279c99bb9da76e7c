"""OpenTelemetry spans for locks, fed where the signals are sent, when
opentelemetry-api is there.

Redis auto-instrumentation does not see the blocking driver's traffic (it writes
its own sockets), so these spans are how a trace shows a lock. ``install()``
(called by the app config) attaches one instrument per signal (``signals.attach``,
not a Django receiver); without ``opentelemetry-api`` it attaches nothing, so
locking costs what it did. With the API but no SDK's provider set (the API's
default proxy, whose spans are no-ops) the instruments return at once; spans start
with the first lock after one is set.

Each span is made when its signal arrives, after the fact, with explicit start and
end times (the wait measured on the monotonic clock, placed on OpenTelemetry's
``time.time_ns()`` clock), in the caller's current context: it nests under the
request's or task's span. Watchdog extensions and losses nest there too (the
watchdog runs in a copy of the acquirer's context). Spans:

- ``redlock.acquire``: from the start of the wait to the grant or the give-up;
  ``redlock.outcome`` is ``acquired``, ``contended`` or ``unavailable`` (an error).
- ``redlock.release``: the release on the nodes; outcome ``released`` or ``lost``.
- ``redlock.extend``: the moment a lease was extended (``extend()`` or watchdog).
- ``redlock.lost``: the moment a hold learnt its lease was lost (an error).

No attribute holds a node URL: failed nodes are named by their display, which
masks passwords, and error texts never carry credentials.
"""

from __future__ import annotations

import functools
import logging
import os
import time
from collections.abc import Callable
from typing import Any

from django.dispatch import Signal

from . import signals
from .exceptions import LockError
from .interrupts import reraise_interruption

__all__ = ["install", "installed", "uninstall"]

logger = logging.getLogger(__name__)

#: Attribute names, all in the ``redlock.`` namespace.
RESOURCE = "redlock.resource"
OUTCOME = "redlock.outcome"
WAIT = "redlock.wait_seconds"
ATTEMPTS = "redlock.attempts"
WAKEUPS = "redlock.wakeups"
HANDED = "redlock.handed"
GRANTED = "redlock.granted"
QUORUM = "redlock.quorum"
NODES = "redlock.nodes"
FAILED = "redlock.failed_nodes"
FENCING_TOKEN = "redlock.fencing_token"
HELD = "redlock.held_seconds"
RELEASED = "redlock.released"
VALIDITY = "redlock.validity_seconds"
REASON = "redlock.lost_reason"

_instruments: dict[Signal, Callable[[dict[str, Any]], None]] = {}


def installed() -> bool:
    """Return whether lock spans are being made."""
    return bool(_instruments)


def uninstall() -> None:
    """Detach the span instruments: an explicit opt-out, locks make no spans."""
    for signal, instrument in _instruments.items():
        signals.detach(signal, instrument)
    _instruments.clear()


def _guarded(
    receiver: Callable[..., None], idle: Callable[[], bool]
) -> Callable[[dict[str, Any]], None]:
    """The instrument calling ``receiver`` with a signal's arguments: a tracing
    failure is logged, never raised into the lock's caller.

    While ``idle()`` says no SDK provider would record the span, nothing is made.
    """

    @functools.wraps(receiver)
    def guarded(named: dict[str, Any]) -> None:
        if idle():
            return
        try:
            receiver(**named)
        except Exception as exc:
            reraise_interruption(exc)
            logger.exception("redlock tracing: %s failed", receiver.__name__)

    return guarded


def install(tracer_provider: Any = None) -> bool:
    """Attach the span instruments to the signals; False without opentelemetry-api.

    Spans go to ``tracer_provider``, by default the global one (as set by the
    SDK's ``trace.set_tracer_provider()``, before or after this call). Already
    installed, nothing changes: ``uninstall()`` first to switch providers.
    """
    if _instruments:
        return True
    try:
        from opentelemetry import trace
        from opentelemetry.trace import (
            NoOpTracerProvider,
            ProxyTracerProvider,
            Status,
            StatusCode,
        )
    except ImportError:
        return False
    from . import __version__

    # The global provider's is a proxy until an SDK's provider is set.
    tracer = trace.get_tracer(
        "redlock_django", __version__, tracer_provider=tracer_provider
    )
    error = Status(StatusCode.ERROR)
    no_sdk = (ProxyTracerProvider, NoOpTracerProvider)
    # A provider given, or named by this variable (loaded at the first span).
    given = tracer_provider is not None
    always = given or "OTEL_PYTHON_TRACER_PROVIDER" in os.environ
    missing = object()

    def idle() -> bool:
        """Whether every span would be a no-op: no SDK provider is set globally
        (yet). Spans cost a tenth of a lock cycle even then, so none is made."""
        if always:
            return False
        # The global, read directly: get_tracer_provider() looks the variable up
        # in os.environ on every call, a KeyError raised and caught each time.
        provider = getattr(trace, "_TRACER_PROVIDER", missing)
        if provider is missing:  # the API's internals moved: ask the public way
            provider = trace.get_tracer_provider()
        return provider is None or isinstance(provider, no_sdk)

    def span(name: str, seconds: float, resource: str) -> Any:
        """Start a span that began ``seconds`` ago, in the current context."""
        end = time.time_ns()
        started = tracer.start_span(
            name, start_time=end - max(0, int(seconds * 1e9)), record_exception=False
        )
        started.set_attribute(RESOURCE, resource)
        return started, end

    def failure(started: Any, exc: LockError) -> None:
        started.set_attributes({GRANTED: exc.granted, QUORUM: exc.quorum})
        started.set_attribute(NODES, exc.nodes)
        failed = list(exc.failed)  # display names: passwords masked
        if failed:
            started.set_attribute(FAILED, failed)

    def on_acquired(resource: str, waited: float, **kwargs: Any) -> None:
        started, end = span("redlock.acquire", waited, resource)
        if started.is_recording():
            started.set_attributes(
                {
                    OUTCOME: "acquired",
                    WAIT: waited,
                    ATTEMPTS: kwargs.get("attempts", 1),
                    WAKEUPS: kwargs.get("wakeups", 0),
                    HANDED: bool(kwargs.get("handed", False)),
                    GRANTED: kwargs.get("granted", 0),
                    QUORUM: kwargs.get("quorum", 0),
                    NODES: kwargs.get("nodes", 0),
                }
            )
            token = kwargs.get("fencing_token")
            if token is not None:
                started.set_attribute(FENCING_TOKEN, token)
        started.end(end)

    def on_contended(resource: str, waited: float, **kwargs: Any) -> None:
        started, end = span("redlock.acquire", waited, resource)
        if started.is_recording():
            started.set_attributes({OUTCOME: "contended", WAIT: waited})
            exc = kwargs.get("error")
            if exc is not None:
                failure(started, exc)
        started.end(end)

    def on_unavailable(resource: str, waited: float, **kwargs: Any) -> None:
        started, end = span("redlock.acquire", waited, resource)
        if started.is_recording():
            started.set_attributes({OUTCOME: "unavailable", WAIT: waited})
            exc = kwargs.get("error")
            if exc is not None:
                failure(started, exc)
                started.record_exception(exc)
                started.set_status(Status(StatusCode.ERROR, str(exc)))
            else:
                started.set_status(error)
        started.end(end)

    def on_released(resource: str, held: float, **kwargs: Any) -> None:
        started, end = span("redlock.release", kwargs.get("elapsed", 0.0), resource)
        if started.is_recording():
            lost = kwargs.get("lost")
            started.set_attributes(
                {
                    OUTCOME: "released" if lost is None else "lost",
                    HELD: held,
                    RELEASED: kwargs.get("released", 0),
                }
            )
            token = kwargs.get("fencing_token")
            if token is not None:
                started.set_attribute(FENCING_TOKEN, token)
            if lost is not None:
                started.set_attribute(REASON, lost)
                started.set_status(Status(StatusCode.ERROR, f"lost: {lost}"))
        started.end(end)

    def on_extended(resource: str, validity: float, **kwargs: Any) -> None:
        started, end = span("redlock.extend", 0.0, resource)
        if started.is_recording():
            started.set_attributes({OUTCOME: "extended", VALIDITY: validity})
        started.end(end)

    def on_lost(resource: str, held: float, reason: str, **kwargs: Any) -> None:
        started, end = span("redlock.lost", 0.0, resource)
        if started.is_recording():
            started.set_attributes({OUTCOME: "lost", HELD: held, REASON: reason})
            token = kwargs.get("fencing_token")
            if token is not None:
                started.set_attribute(FENCING_TOKEN, token)
            started.set_status(Status(StatusCode.ERROR, f"lost: {reason}"))
        started.end(end)

    made: dict[Signal, Callable[..., None]] = {
        signals.lock_acquired: on_acquired,
        signals.lock_contended: on_contended,
        signals.lock_unavailable: on_unavailable,
        signals.lock_released: on_released,
        signals.lock_extended: on_extended,
        signals.lock_lost: on_lost,
    }
    for signal, receiver in made.items():
        guarded = _guarded(receiver, idle)
        signals.attach(signal, guarded)
        _instruments[signal] = guarded
    return True
