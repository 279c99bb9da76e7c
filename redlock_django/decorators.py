"""``distributed_lock``: hold a Redlock around a Django view.

Usage::

    @distributed_lock("product:{product_id}", timeout=2)
    def buy(request, product_id): ...

    @distributed_lock("user:{request.user.pk}")
    async def settle(request): ...

    @method_decorator(distributed_lock("report:{pk}"), name="dispatch")
    class ReportView(View): ...

    class ExportView(DistributedLockMixin, View):
        lock_resource = "export:{pk}"

    @distributed_lock("import:{pk}")  # wraps ImportView.dispatch
    class ImportView(View): ...

The resource is a template over the view's URL kwargs (``{product_id}``) and
attributes of the request (``{request.user.pk}``), or a callable
``(request, *args, **kwargs) -> str``. A template that names something a view can
never supply raises ``ImproperlyConfigured``: at decoration time when the template
itself is malformed, from the ``redlock.E020`` system check (see
``check_url_placeholders``) when a URL pattern routes to the view without that
kwarg, and at the request otherwise.

Values from the request are not trusted. Each one must be at most
``MAX_VALUE_LENGTH`` characters of printable text without ``: { } * ? [ ] \\`` or
whitespace, so a kwarg like ``"1:admin"`` cannot name another resource, and the
whole resource at most ``MAX_RESOURCE_LENGTH``. Anything else is refused with a
400 response naming the reason, before any lock is taken.

Responses, JSON (``{"error", "resource", "detail"}``) when the request sends JSON
or prefers ``application/json`` over ``text/html`` (a missing ``Accept`` or
``*/*`` counts as JSON), a small HTML page otherwise; both carry ``Vary: Accept``:

- 400 ``bad_resource``: a value cannot be part of a resource name;
- 423 ``locked``: still held by someone else after waiting, with ``Retry-After``
  set to the lock's TTL rounded up: after that long the holder's lease has run
  out unless the holder keeps extending it, so it is the one bound the server
  can promise;
- 503 ``unavailable``: fewer than a quorum of nodes answered, with
  ``Retry-After: UNAVAILABLE_RETRY_AFTER`` (5) seconds: an outage, unrelated to
  any lease.

``on_locked(request, exc)`` and ``on_unavailable(request, exc)`` may return a
response to use instead (or None for the default one); they may be coroutine
functions, also on sync views.

Release. The lock is released when the view returns or raises; a failed release
is logged and never masks the view's exception. When the view returns inside a
database transaction (``ATOMIC_REQUESTS`` or an outer ``atomic()``), the release
waits for the commit (``transaction.on_commit``): released earlier, the next
holder would read data this one has not committed yet. A rollback drops
on-commit callbacks, so the response also carries a closer that releases when
the response is closed (after the handler's transaction has ended). A COMMIT
that fails (a deferred constraint, a serialization failure) drops that response
for a 500: then ``request_finished``, sent on the view's thread when the 500
closes, releases, unless the transaction the lock waits for is still open.
Whichever comes first releases, exactly once. When the view raises, the lock is
released at once: its transaction rolls back. The lock covers the view call, not
the streaming of a ``StreamingHttpResponse``'s content after it. A blocking lock
is owned by the view's thread, which is where Django's WSGI and ASGI handlers
close responses; a response closed on another thread (Django's test
``AsyncClient`` does that) cannot release, and a WARNING says the lock is left
to its lease. Async views cannot run inside ``atomic()``, so they release when
they return, raise, or are cancelled (Django cancels the view's task when an
ASGI client disconnects).

A lease lost while the view ran (it outlived ``ttl``) is logged at ERROR with the
resource, the time held and the TTL, and the response is still returned: by then
the view's work is done and committed, so a 500 would tell the client it failed
when it did not, and undo nothing. A view that must not commit after losing its
lease checks ``request.redlock.owned()`` (or uses fencing tokens) before writing.

The lock's label, shown in the admin, is the request's method and path without
the query string, which can carry secrets (reset tokens, signed URLs).

Each request is its own owner (``reentrant=False``): a lock left behind by an
earlier request on the same thread is never re-entered, and a view calling
another view locking the same resource waits like any other request.
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import logging
import math
import re
import string
import threading
import time
from collections.abc import Awaitable, Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar, cast

from asgiref.sync import async_to_sync, iscoroutinefunction
from django.core import checks
from django.core.exceptions import ImproperlyConfigured
from django.core.signals import request_finished
from django.db import connections, transaction
from django.http import HttpRequest, HttpResponse, JsonResponse
from django.http.response import HttpResponseBase
from django.urls import URLPattern, URLResolver, get_resolver
from django.utils.cache import patch_vary_headers
from django.utils.html import escape
from django.views import View

from .conf import check_seconds, get_settings
from .exceptions import (
    LockContentionError,
    LockLostError,
    LockNotOwnedError,
    QuorumUnavailableError,
)
from .keys import MAX_RESOURCE_LENGTH
from .lock import Redlock

__all__ = [
    "MAX_VALUE_LENGTH",
    "UNAVAILABLE_RETRY_AFTER",
    "DistributedLockMixin",
    "check_url_placeholders",
    "distributed_lock",
]

logger = logging.getLogger(__name__)

#: Longest value a placeholder may put into a resource name, in characters.
MAX_VALUE_LENGTH = 64
#: ``Retry-After`` seconds of the 503 response when too few nodes answer.
UNAVAILABLE_RETRY_AFTER = 5
#: Longest lock label (method and path), in characters.
MAX_LABEL_LENGTH = 200
#: System check id: a URL pattern routes to a locked view without a kwarg its
#: resource template names.
E020 = "redlock.E020"

# Separators and glob characters: a value holding one could name another resource
# ("1:admin") or a pattern in the admin's SCAN MATCH. Whitespace and anything
# unprintable (control, format, unassigned characters) is refused as well.
_FORBIDDEN = frozenset(":{}*?[]\\")
# The same minus ":", for the literal text of a template and a callable's result.
_FORBIDDEN_IN_NAME = _FORBIDDEN - {":"}
_IDENTIFIER = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")

Hook = Callable[[HttpRequest, Any], Any]
View_ = TypeVar("View_", bound=Callable[..., Any])


def _bad_character(text: str, forbidden: frozenset[str]) -> str | None:
    for char in text:
        if char in forbidden or char.isspace() or not char.isprintable():
            return char
    return None


class _RejectedError(Exception):
    """A value from the request cannot be part of a resource name (HTTP 400)."""


# Templates: parsed and checked once, at decoration time.


@dataclass(frozen=True)
class _Placeholder:
    field: str
    #: The view kwarg it reads, or None for a ``request.`` attribute path.
    kwarg: str | None
    attributes: tuple[str, ...] = ()


@dataclass(frozen=True)
class _Template:
    source: str
    literals: tuple[str, ...]
    placeholders: tuple[_Placeholder, ...]

    @property
    def kwargs(self) -> frozenset[str]:
        return frozenset(p.kwarg for p in self.placeholders if p.kwarg is not None)


def _parse_placeholder(template: str, field: str) -> _Placeholder:
    def bad(why: str) -> ImproperlyConfigured:
        return ImproperlyConfigured(
            f"lock resource {template!r}: placeholder {{{field}}} {why}"
        )

    parts = field.split(".")
    if not all(_IDENTIFIER.match(part) for part in parts):
        raise bad(
            "is not a view kwarg name or a request attribute path: only "
            "{name} and {request.attr.attr} are allowed (no indexing, no positions)"
        )
    if parts[0] != "request":
        if len(parts) > 1:
            raise bad("reads attributes of a view kwarg; only {request.…} may")
        return _Placeholder(field, kwarg=field)
    if len(parts) == 1:
        raise bad("names the whole request; name an attribute, e.g. {request.user.pk}")
    private = [part for part in parts[1:] if part.startswith("_")]
    if private:
        raise bad(f"reads the private attribute {private[0]!r}")
    return _Placeholder(field, kwarg=None, attributes=tuple(parts[1:]))


def _parse_template(template: str) -> _Template:
    try:
        parsed = list(string.Formatter().parse(template))
    except ValueError as exc:
        raise ImproperlyConfigured(f"lock resource {template!r}: {exc}") from exc
    literals: list[str] = []
    placeholders: list[_Placeholder] = []
    literal = ""
    for text, field, spec, conversion in parsed:
        literal += text
        if field is None:
            continue
        if conversion is not None or spec:
            raise ImproperlyConfigured(
                f"lock resource {template!r}: placeholder {{{field}}} has a "
                f"conversion or format spec; write plain {{name}} placeholders"
            )
        placeholders.append(_parse_placeholder(template, field))
        literals.append(literal)
        literal = ""
    literals.append(literal)
    text = "".join(literals)
    char = _bad_character(text, _FORBIDDEN_IN_NAME)
    if char is not None:
        raise ImproperlyConfigured(
            f"lock resource {template!r}: its literal text contains {char!r}; "
            "use no whitespace, control characters or { } * ? [ ] \\"
        )
    if not placeholders and not text:
        raise ImproperlyConfigured("lock resource template is empty")
    if len(text) + len(placeholders) > MAX_RESOURCE_LENGTH:
        raise ImproperlyConfigured(
            f"lock resource {template!r} is longer than {MAX_RESOURCE_LENGTH} "
            "characters even with one-character values"
        )
    return _Template(template, tuple(literals), tuple(placeholders))


def _value(
    placeholder: _Placeholder,
    request: HttpRequest,
    kwargs: dict[str, Any],
    template: _Template,
    view_name: str,
) -> str:
    if placeholder.kwarg is not None:
        if placeholder.kwarg not in kwargs:
            route = getattr(getattr(request, "resolver_match", None), "route", None)
            where = f" by URL pattern {route!r}" if route else ""
            supplied = ", ".join(sorted(kwargs)) or "none"
            raise ImproperlyConfigured(
                f"lock resource {template.source!r} of view {view_name} names "
                f"{{{placeholder.kwarg}}}, which is not among the kwargs passed to "
                f"the view{where} (kwargs: {supplied})"
            )
        value = kwargs[placeholder.kwarg]
    else:
        value = request
        for attribute in placeholder.attributes:
            try:
                value = getattr(value, attribute)
            except AttributeError as exc:
                raise ImproperlyConfigured(
                    f"lock resource {template.source!r} of view {view_name}: "
                    f"placeholder {{{placeholder.field}}} cannot be read: {exc}"
                ) from exc
        if callable(value):
            raise ImproperlyConfigured(
                f"lock resource {template.source!r} of view {view_name}: "
                f"placeholder {{{placeholder.field}}} is a method, not a value"
            )
    if value is None:
        raise _RejectedError(f"{{{placeholder.field}}} has no value")
    text = str(value)
    if not text:
        raise _RejectedError(f"{{{placeholder.field}}} is empty")
    if len(text) > MAX_VALUE_LENGTH:
        raise _RejectedError(
            f"{{{placeholder.field}}} is {len(text)} characters long; "
            f"the limit is {MAX_VALUE_LENGTH}"
        )
    char = _bad_character(text, _FORBIDDEN)
    if char is not None:
        raise _RejectedError(
            f"{{{placeholder.field}}} contains {char!r}, which a resource name "
            "cannot hold"
        )
    return text


def _check_name(resource: str) -> str:
    if not resource:
        raise _RejectedError("the resource name is empty")
    if len(resource) > MAX_RESOURCE_LENGTH:
        raise _RejectedError(
            f"the resource name is {len(resource)} characters long; "
            f"the limit is {MAX_RESOURCE_LENGTH}"
        )
    char = _bad_character(resource, _FORBIDDEN_IN_NAME)
    if char is not None:
        raise _RejectedError(f"the resource name contains {char!r}")
    return resource


# Responses.


def _wants_json(request: HttpRequest) -> bool:
    content_type = request.content_type or ""
    if content_type == "application/json" or (
        content_type.startswith("application/") and content_type.endswith("+json")
    ):
        return True
    preferred = request.get_preferred_type(["application/json", "text/html"])
    return preferred == "application/json"


_PAGE = (
    '<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">'
    "<title>{status} {title}</title></head>\n"
    "<body><h1>{title}</h1><p>{detail}</p></body></html>\n"
)


def _error_response(
    request: HttpRequest,
    status: int,
    error: str,
    title: str,
    resource: str | None,
    detail: str,
    retry_after: int | None = None,
) -> HttpResponse:
    response: HttpResponse
    if _wants_json(request):
        body = {"error": error, "resource": resource, "detail": detail}
        response = JsonResponse(body, status=status)
    else:
        page = _PAGE.format(status=status, title=title, detail=escape(detail))
        response = HttpResponse(page, status=status)
    if retry_after is not None:
        response["Retry-After"] = str(retry_after)
    patch_vary_headers(response, ["Accept"])
    return response


def _bad_request(request: HttpRequest, rejected: _RejectedError) -> HttpResponse:
    return _error_response(
        request,
        400,
        "bad_resource",
        "Bad Request",
        None,
        f"cannot lock this request: {rejected}",
    )


def _locked(
    request: HttpRequest, exc: LockContentionError, *, retry: int
) -> HttpResponse:
    return _error_response(
        request,
        423,
        "locked",
        "Locked",
        exc.resource,
        f"{exc.resource!r} is held by another request; retry in {retry} seconds",
        retry_after=retry,
    )


def _unavailable(request: HttpRequest, exc: QuorumUnavailableError) -> HttpResponse:
    return _error_response(
        request,
        503,
        "unavailable",
        "Service Unavailable",
        exc.resource,
        f"too few lock servers answered ({exc.granted} of {exc.nodes} granted, "
        f"{exc.quorum} needed); retry in {UNAVAILABLE_RETRY_AFTER} seconds",
        retry_after=UNAVAILABLE_RETRY_AFTER,
    )


async def _awaited(awaitable: Awaitable[Any]) -> Any:
    return await awaitable


def _discard(awaitable: Awaitable[Any]) -> None:
    close = getattr(awaitable, "close", None)
    if close is not None:
        close()


def _is_async_dispatch(view: object) -> bool:
    """Tell whether ``view`` is the bound ``dispatch`` of an async ``View``.

    ``method_decorator(..., name="dispatch")`` hands the decorator a partial of
    the bound method at every call. An async View's ``dispatch`` is a plain
    function returning a coroutine, so only the instance tells.
    """
    target = getattr(view, "func", None)
    instance = getattr(target, "__self__", None)
    return isinstance(instance, View) and bool(type(instance).view_is_async)


def _event_loop_running() -> bool:
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return False
    return True


def _set_redlock(request: HttpRequest, lock: Redlock | None) -> Redlock | None:
    """Set ``request.redlock``; return the one it replaces."""
    attributes = request.__dict__
    previous = attributes.get("redlock")
    if lock is not None:
        attributes["redlock"] = lock
    return cast("Redlock | None", previous)


def _view_name(request: HttpRequest, fallback: str) -> str:
    func = getattr(getattr(request, "resolver_match", None), "func", None)
    target = getattr(func, "view_class", func)
    if target is None:
        return fallback
    return f"{target.__module__}.{target.__qualname__}"


def _name_of(view: Any) -> str:
    return (
        f"{getattr(view, '__module__', '?')}."
        f"{getattr(view, '__qualname__', type(view).__qualname__)}"
    )


# Holding and releasing.


# This thread's holds waiting for a commit: released at the latest when the
# request finishes. A thread-local, not one receiver per hold: a weakly connected
# receiver would die with the hold (nothing else refers to it once the response is
# dropped), and a strong one would stay connected when the signal never comes.
_waiting_holds = threading.local()


def _thread_holds() -> list[_Held]:
    holds: list[_Held] | None = getattr(_waiting_holds, "holds", None)
    if holds is None:
        holds = _waiting_holds.holds = []
    return holds


def _release_when_finished(sender: object, **kwargs: Any) -> None:
    """Release this thread's holds whose transactions ended without committing.

    A failed COMMIT (a deferred constraint, a serialization failure) makes Django
    drop the view's response, closer included, and serve a 500; a rollback drops
    the on-commit callbacks. Django's handlers send ``request_finished`` on the
    view's thread when the response that was served closes.
    """
    holds = getattr(_waiting_holds, "holds", None)
    if not holds:
        return
    for held in list(holds):
        if not held.may_still_commit():
            held.release()


request_finished.connect(
    _release_when_finished, dispatch_uid=f"{__name__}._release_when_finished"
)


class _Held:
    """One request's hold: released exactly once, after the commit if any."""

    def __init__(self, lock: Redlock, ttl: float, view_name: str) -> None:
        self.lock = lock
        self.ttl = ttl
        self.view_name = view_name
        self.started = time.monotonic()
        #: The blocking API's owner is the thread that acquired.
        self.thread = threading.current_thread()
        self._done = False
        self._mutex = threading.Lock()
        self._waiting: set[str] = set()
        #: The on-commit callback registered on each database alias.
        self._callbacks: dict[str, Callable[[], None]] = {}

    def _claim(self) -> bool:
        with self._mutex:
            if self._done:
                return False
            self._done = True
            return True

    def _log_failure(self, exc: Exception, raised: bool) -> None:
        resource = self.lock.resource
        outcome = (
            "the view's exception propagates"
            if raised
            else "the response is returned anyway"
        )
        if isinstance(exc, LockLostError):
            logger.error(
                "redlock %r lost while view %s held it: held %.3fs with a ttl of "
                "%.3fs (%s); %s",
                resource,
                self.view_name,
                time.monotonic() - self.started,
                self.ttl,
                exc,
                outcome,
            )
        elif isinstance(exc, LockNotOwnedError):
            logger.warning(
                "redlock %r was already released when view %s finished: %s",
                resource,
                self.view_name,
                exc,
            )
        else:
            logger.error(
                "redlock %r: release after view %s failed; its lease ends within "
                "%.3fs; %s",
                resource,
                self.view_name,
                self.ttl,
                outcome,
                exc_info=exc,
            )

    def release(self, *, raised: bool = False) -> None:
        """Release now, on the acquiring thread; log, never raise."""
        holds = getattr(_waiting_holds, "holds", None)
        if holds and self in holds:
            holds.remove(self)
        if not self._claim():
            return
        if threading.current_thread() is not self.thread:
            # Only the owner can release. Django's handlers close responses on
            # the view's thread; its test AsyncClient does not.
            logger.warning(
                "redlock %r of view %s: the response was closed on another thread "
                "than the view's, so the lock is left to expire within %.3fs",
                self.lock.resource,
                self.view_name,
                self.ttl,
            )
            return
        try:
            self.lock.release()
        except Exception as exc:
            self._log_failure(exc, raised)

    async def arelease(self, *, raised: bool = False) -> None:
        """Release now from the acquiring task; log, never raise."""
        if not self._claim():
            return
        try:
            await self.lock.arelease()
        except Exception as exc:
            self._log_failure(exc, raised)

    def release_after_commit(self, response: object) -> None:
        """Release after the open transactions commit, or when ``response`` closes."""
        aliases = [
            connection.alias
            for connection in connections.all(initialized_only=True)
            if connection.in_atomic_block
        ]
        if not aliases:
            self.release()
            return
        self._waiting = set(aliases)
        for alias in aliases:
            callback = functools.partial(self._committed, alias)
            self._callbacks[alias] = callback
            transaction.on_commit(callback, using=alias)
        # On rollback the on-commit callbacks are dropped; the handler closes the
        # response after its transaction has ended, whichever way it ended. When
        # the COMMIT itself fails, that response is dropped for a 500, whose
        # request_finished releases (_release_when_finished).
        _thread_holds().append(self)
        closers = getattr(response, "_resource_closers", None)
        if isinstance(closers, list):
            closers.append(self.release)
        else:
            logger.warning(
                "redlock %r: view %s returned %r, which has no closer; after a "
                "rollback the lock is held until the request finishes or its "
                "lease ends",
                self.lock.resource,
                self.view_name,
                type(response).__name__,
            )

    def may_still_commit(self) -> bool:
        """Tell whether a transaction this hold waits for is still open.

        Its on-commit callback is still queued until the transaction commits (and
        runs it) or rolls back (and drops it), so a ``request_finished`` of some
        other request sent meanwhile on this thread does not release early.
        """
        for alias, callback in self._callbacks.items():
            queued = getattr(connections[alias], "run_on_commit", ())
            if any(callback in entry for entry in queued):
                return True
        return False

    def _committed(self, alias: str) -> None:
        with self._mutex:
            self._waiting.discard(alias)
            ready = not self._waiting
        if ready:
            self.release()


class _Guard:
    """Everything ``distributed_lock`` decides at decoration time."""

    def __init__(
        self,
        resource: str | Callable[..., str],
        *,
        ttl: float | None,
        timeout: float | None,
        blocking: bool,
        auto_extend: bool | None,
        fencing: bool,
        on_locked: Hook | None,
        on_unavailable: Hook | None,
        label: str | Callable[[HttpRequest], str] | None,
    ) -> None:
        if isinstance(resource, str):
            self.template: _Template | None = _parse_template(resource)
            self.resolve: Callable[..., str] | None = None
        elif callable(resource):
            self.template, self.resolve = None, resource
        else:
            raise ImproperlyConfigured(
                "lock resource must be a template string or a callable "
                f"(request, *args, **kwargs) -> str, not {resource!r}"
            )
        if not blocking and timeout is not None:
            raise ImproperlyConfigured(
                "distributed_lock(blocking=False) takes no timeout"
            )
        try:
            check_seconds("timeout", timeout, allow_none=True, wait=True)
        except (TypeError, ValueError) as exc:
            raise ImproperlyConfigured(str(exc)) from exc
        for name, hook in (
            ("on_locked", on_locked),
            ("on_unavailable", on_unavailable),
        ):
            if hook is not None and not callable(hook):
                raise ImproperlyConfigured(f"{name} must be callable, not {hook!r}")
        if label is not None and not (isinstance(label, str) or callable(label)):
            raise ImproperlyConfigured(
                f"label must be a string or a callable, not {label!r}"
            )
        try:
            Redlock(
                "decorator-check", ttl=ttl, auto_extend=auto_extend, fencing=fencing
            )
        except (TypeError, ValueError) as exc:
            raise ImproperlyConfigured(f"distributed_lock: {exc}") from exc
        self.source = resource if isinstance(resource, str) else _name_of(resource)
        self.ttl = ttl
        self.timeout = timeout
        self.blocking = blocking
        self.auto_extend = auto_extend
        self.fencing = fencing
        self.on_locked = on_locked
        self.on_unavailable = on_unavailable
        self.label = label

    # Request-time steps shared by both drivers.

    def resource_for(
        self,
        request: HttpRequest,
        args: Sequence[Any],
        kwargs: dict[str, Any],
        view_name: str,
    ) -> str:
        """Return the resource to lock for this request; raise ``_RejectedError``."""
        if self.resolve is not None:
            resource = self.resolve(request, *args, **kwargs)
            if not isinstance(resource, str):
                raise TypeError(
                    f"lock resource callable {self.source} of view {view_name} "
                    f"returned {type(resource).__name__}, not str"
                )
            return _check_name(resource)
        template = cast(_Template, self.template)
        pieces = [template.literals[0]]
        for placeholder, literal in zip(
            template.placeholders, template.literals[1:], strict=True
        ):
            pieces.append(_value(placeholder, request, kwargs, template, view_name))
            pieces.append(literal)
        return _check_name("".join(pieces))

    def _label(self, request: HttpRequest) -> str:
        if isinstance(self.label, str):
            label = self.label
        elif self.label is not None:
            label = str(self.label(request))
        else:
            # The path without its query string: query strings carry secrets
            # (reset tokens, signed URLs) and the label is shown in the admin.
            label = f"{request.method} {request.path}"
        return label[:MAX_LABEL_LENGTH]

    def _start(
        self,
        request: HttpRequest,
        args: Sequence[Any],
        kwargs: dict[str, Any],
        view_name: str,
    ) -> Redlock | HttpResponse:
        view_name = _view_name(request, view_name)
        try:
            resource = self.resource_for(request, args, kwargs, view_name)
        except _RejectedError as rejected:
            return _bad_request(request, rejected)
        return Redlock(
            resource,
            ttl=self.ttl,
            auto_extend=self.auto_extend,
            fencing=self.fencing,
            label=self._label(request),
            reentrant=False,
        )

    def _held(self, lock: Redlock, view_name: str) -> _Held:
        ttl = self.ttl if self.ttl is not None else get_settings().ttl
        return _Held(lock, ttl, view_name)

    def _locked(self) -> Callable[[HttpRequest, Any], HttpResponseBase]:
        ttl = self.ttl if self.ttl is not None else get_settings().ttl
        return functools.partial(_locked, retry=max(1, math.ceil(ttl)))

    def _acquire_args(self) -> dict[str, Any]:
        if not self.blocking:
            return {"blocking": False}
        return {"blocking": True, "timeout": self.timeout}

    # Blocking driver.

    def _hook(
        self,
        hook: Hook | None,
        request: HttpRequest,
        exc: Exception,
        default: Callable[[HttpRequest, Any], HttpResponseBase],
    ) -> HttpResponseBase:
        response = hook(request, exc) if hook is not None else None
        if inspect.isawaitable(response):
            response = async_to_sync(_awaited)(response)
        return response if response is not None else default(request, exc)

    def call(
        self,
        view: Callable[..., Any],
        request: HttpRequest,
        args: Sequence[Any],
        kwargs: dict[str, Any],
        view_name: str,
        hooks: tuple[Hook | None, Hook | None] | None = None,
    ) -> Any:
        """Run ``view`` under the lock from blocking code."""
        on_locked, on_unavailable = hooks or (self.on_locked, self.on_unavailable)
        lock = self._start(request, args, kwargs, view_name)
        if not isinstance(lock, Redlock):
            return lock
        try:
            lock._acquire(**self._acquire_args(), raise_on_contention=True)
        except LockContentionError as exc:
            return self._hook(on_locked, request, exc, self._locked())
        except QuorumUnavailableError as exc:
            return self._hook(on_unavailable, request, exc, _unavailable)
        held = self._held(lock, _view_name(request, view_name))
        previous = _set_redlock(request, lock)
        try:
            response = view(request, *args, **kwargs)
            if inspect.isawaitable(response):
                _discard(response)
                raise ImproperlyConfigured(
                    f"view {held.view_name} returned an awaitable to "
                    "distributed_lock's blocking path; make it an async def view"
                )
        except BaseException:
            # Nothing the view did will commit: release now.
            held.release(raised=True)
            raise
        finally:
            _set_redlock(request, previous)
        held.release_after_commit(response)
        return response

    # asyncio driver: the same steps with aacquire/arelease, no thread hop.

    async def _ahook(
        self,
        hook: Hook | None,
        request: HttpRequest,
        exc: Exception,
        default: Callable[[HttpRequest, Any], HttpResponseBase],
    ) -> HttpResponseBase:
        response = hook(request, exc) if hook is not None else None
        if inspect.isawaitable(response):
            response = await response
        return response if response is not None else default(request, exc)

    async def acall(
        self,
        view: Callable[..., Any],
        request: HttpRequest,
        args: Sequence[Any],
        kwargs: dict[str, Any],
        view_name: str,
        hooks: tuple[Hook | None, Hook | None] | None = None,
    ) -> Any:
        """Run ``view`` (a coroutine function, or returning an awaitable) locked."""
        on_locked, on_unavailable = hooks or (self.on_locked, self.on_unavailable)
        lock = self._start(request, args, kwargs, view_name)
        if not isinstance(lock, Redlock):
            return lock
        try:
            await lock._aacquire(**self._acquire_args(), raise_on_contention=True)
        except LockContentionError as exc:
            return await self._ahook(on_locked, request, exc, self._locked())
        except QuorumUnavailableError as exc:
            return await self._ahook(on_unavailable, request, exc, _unavailable)
        held = self._held(lock, _view_name(request, view_name))
        previous = _set_redlock(request, lock)
        try:
            response = view(request, *args, **kwargs)
            if inspect.isawaitable(response):
                response = await response
        except BaseException:
            await held.arelease(raised=True)
            raise
        finally:
            _set_redlock(request, previous)
        # Async code cannot run inside atomic(), so there is no commit to wait for.
        await held.arelease()
        return response

    def dispatch(
        self,
        view: Callable[..., Any],
        is_async: bool,
        request: HttpRequest,
        args: Sequence[Any],
        kwargs: dict[str, Any],
        view_name: str,
        hooks: tuple[Hook | None, Hook | None] | None = None,
    ) -> Any:
        """Run a class-based view's ``dispatch``; a coroutine for async views."""
        if is_async:
            return self.acall(view, request, args, kwargs, view_name, hooks)
        return self.call(view, request, args, kwargs, view_name, hooks)


def _guards(obj: object) -> tuple[_Guard, ...]:
    return tuple(getattr(obj, "_redlock_guards", ()))


def _decorate_class(guard: _Guard, cls: type[View]) -> type[View]:
    original = cls.dispatch

    def dispatch(self: View, request: HttpRequest, *args: Any, **kwargs: Any) -> Any:
        bound = functools.partial(original, self)
        is_async = bool(getattr(type(self), "view_is_async", False))
        return guard.dispatch(bound, is_async, request, args, kwargs, _name_of(cls))

    functools.update_wrapper(dispatch, original)
    dispatch._redlock_guards = (*_guards(original), guard)  # type: ignore[attr-defined]
    cls.dispatch = dispatch  # type: ignore[method-assign]
    return cls


def distributed_lock(
    resource: str | Callable[..., str],
    *,
    ttl: float | None = None,
    timeout: float | None = None,
    blocking: bool = True,
    auto_extend: bool | None = None,
    fencing: bool = False,
    on_locked: Hook | None = None,
    on_unavailable: Hook | None = None,
    label: str | Callable[[HttpRequest], str] | None = None,
) -> Callable[[View_], View_]:
    """Hold a Redlock on ``resource`` while the decorated view runs.

    ``resource`` is a template such as ``"product:{product_id}"`` or
    ``"user:{request.user.pk}"``, or a callable ``(request, *args, **kwargs) ->
    str``. ``ttl``, ``auto_extend`` and ``fencing`` are passed to ``Redlock``;
    ``timeout`` is how long to wait for the lock (None: ``WAIT_TIMEOUT``), and
    ``blocking=False`` makes a single attempt. ``on_locked(request, exc)`` and
    ``on_unavailable(request, exc)`` return the response for a lock still held
    after the wait (default: 423) and for too few nodes answering (default:
    503). ``label`` (a string, or a callable taking the request) replaces the
    default label, the request's method and path. The view sees the lock as
    ``request.redlock``.

    Decorates sync and async function views, ``dispatch`` through
    ``method_decorator(..., name="dispatch")``, and ``View`` classes themselves
    (wrapping their ``dispatch``). Raises ``ImproperlyConfigured`` at once for a
    malformed template or bad options.
    """
    guard = _Guard(
        resource,
        ttl=ttl,
        timeout=timeout,
        blocking=blocking,
        auto_extend=auto_extend,
        fencing=fencing,
        on_locked=on_locked,
        on_unavailable=on_unavailable,
        label=label,
    )

    def decorator(view: View_) -> View_:
        if isinstance(view, type):
            if not issubclass(view, View):
                raise TypeError(
                    f"distributed_lock decorates views and View classes, not {view!r}"
                )
            return cast(View_, _decorate_class(guard, view))
        name = _name_of(view)

        if iscoroutinefunction(view) or _is_async_dispatch(view):

            @functools.wraps(view)
            async def async_wrapper(
                request: HttpRequest, *args: Any, **kwargs: Any
            ) -> Any:
                return await guard.acall(view, request, args, kwargs, name)

            wrapper: Callable[..., Any] = async_wrapper
        else:

            @functools.wraps(view)
            def sync_wrapper(request: HttpRequest, *args: Any, **kwargs: Any) -> Any:
                # Called from a running event loop, blocking calls are refused:
                # only an awaitable-returning dispatch gets here.
                if _event_loop_running():
                    return guard.acall(view, request, args, kwargs, name)
                return guard.call(view, request, args, kwargs, name)

            wrapper = sync_wrapper
        wrapper._redlock_guards = (*_guards(view), guard)  # type: ignore[attr-defined]
        return cast(View_, wrapper)

    return decorator


class DistributedLockMixin:
    """Hold a Redlock around ``dispatch`` of a class-based view (sync or async).

    Set ``lock_resource`` (a template or a callable ``(request, *args, **kwargs)
    -> str``) and optionally ``lock_ttl``, ``lock_timeout``, ``lock_blocking``,
    ``lock_auto_extend``, ``lock_fencing`` and ``lock_label``; they mean what the
    ``distributed_lock`` arguments of the same names mean. Override
    ``lock_on_locked(request, exc)`` / ``lock_on_unavailable(request, exc)``
    (plain or ``async def``) to return other responses than 423 / 503. Place the
    mixin after authentication mixins, so anonymous requests never take the lock.
    The template is checked when the class is created.
    """

    lock_resource: str | Callable[..., str] | None = None
    lock_ttl: float | None = None
    lock_timeout: float | None = None
    lock_blocking: bool = True
    lock_auto_extend: bool | None = None
    lock_fencing: bool = False
    lock_label: str | Callable[[HttpRequest], str] | None = None
    _redlock_guard: _Guard | None = None

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if cls.lock_resource is None:
            cls._redlock_guard = None
            return
        cls._redlock_guard = _Guard(
            cls.lock_resource,
            ttl=cls.lock_ttl,
            timeout=cls.lock_timeout,
            blocking=cls.lock_blocking,
            auto_extend=cls.lock_auto_extend,
            fencing=cls.lock_fencing,
            on_locked=None,
            on_unavailable=None,
            label=cls.lock_label,
        )

    def lock_on_locked(self, request: HttpRequest, exc: LockContentionError) -> Any:
        """Return the response when the lock is still held after the wait."""
        return None

    def lock_on_unavailable(
        self, request: HttpRequest, exc: QuorumUnavailableError
    ) -> Any:
        """Return the response when too few nodes answered."""
        return None

    def dispatch(self, request: HttpRequest, *args: Any, **kwargs: Any) -> Any:
        """Run the view's ``dispatch`` while holding the lock."""
        cls = type(self)
        guard = cls._redlock_guard
        if guard is None:
            raise ImproperlyConfigured(
                f"{_name_of(cls)} uses DistributedLockMixin without a lock_resource"
            )
        parent = cast(Any, super()).dispatch
        is_async = bool(getattr(cls, "view_is_async", False))
        hooks = (self.lock_on_locked, self.lock_on_unavailable)
        return guard.dispatch(
            parent, is_async, request, args, kwargs, _name_of(cls), hooks
        )


# System check: a URL pattern routing to a locked view without a needed kwarg.


def _route_names(pattern: Any) -> frozenset[str]:
    regex = getattr(pattern, "regex", None)
    return frozenset(getattr(regex, "groupindex", {}) or {})


def _walk(
    patterns: Sequence[Any], supplied: frozenset[str], prefix: str
) -> Iterator[tuple[URLPattern, frozenset[str], str]]:
    for entry in patterns:
        names = supplied | _route_names(entry.pattern)
        route = prefix + str(entry.pattern)
        if isinstance(entry, URLResolver):
            names |= frozenset(entry.default_kwargs)
            yield from _walk(entry.url_patterns, names, route)
        elif isinstance(entry, URLPattern):
            yield entry, names | frozenset(entry.default_args), route


def _view_guards(callback: Any) -> Iterator[tuple[_Guard, str]]:
    found: list[tuple[_Guard, str]] = []
    view_class = getattr(callback, "view_class", None)
    if view_class is not None:
        name = _name_of(view_class)
        found.extend((g, name) for g in _guards(getattr(view_class, "dispatch", None)))
        mixin_guard = getattr(view_class, "_redlock_guard", None)
        if isinstance(mixin_guard, _Guard):
            found.append((mixin_guard, name))
    found.extend((guard, _name_of(callback)) for guard in _guards(callback))
    # as_view() copies the attributes of dispatch onto the view function.
    seen: set[int] = set()
    for guard, name in found:
        if id(guard) not in seen:
            seen.add(id(guard))
            yield guard, name


def check_url_placeholders(
    app_configs: Any = None, **kwargs: Any
) -> list[checks.CheckMessage]:
    """Report URL patterns routing to a locked view without a kwarg it names.

    Registered by the app under the ``urls`` tag; it reads the root URLconf only.
    """
    try:
        entries = list(_walk(get_resolver().url_patterns, frozenset(), ""))
    except Exception:
        # A broken URLconf is reported by Django's own urls check.
        return []
    errors: list[checks.CheckMessage] = []
    for entry, supplied, route in entries:
        for guard, view_name in _view_guards(entry.callback):
            if guard.template is None:
                continue
            for name in sorted(guard.template.kwargs - supplied):
                errors.append(
                    checks.Error(
                        f"lock resource {guard.template.source!r} of view "
                        f"{view_name} names {{{name}}}, which URL pattern "
                        f"{route!r} never passes to the view",
                        hint=f"Capture <{name}> in the route, pass it in the "
                        "pattern's kwargs, or use a request attribute such as "
                        "{request.user.pk}.",
                        obj=entry,
                        id=E020,
                    )
                )
    return errors
