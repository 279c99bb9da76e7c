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
``(request, *args, **kwargs) -> str``; ``resources`` parses the template once and
checks the values each request puts into it, refusing bad ones with a 400 before
any lock is taken. ``responses`` builds the 400, 423 and 503 answers, and the
``redlock.E020`` check (``checks.check_url_placeholders``) finds URL patterns that
route to a view without a kwarg its template names.

Release. The lock is released when the view returns or raises, after the commit
when the view ran inside a transaction; ``release`` says exactly when, and how a
lease lost while the view ran is logged.

The lock's label, shown in the admin, is the request's method and path without
the query string, which can carry secrets (reset tokens, signed URLs).

Each request is its own owner (``reentrant=False``): a lock left behind by an
earlier request on the same thread is never re-entered, and a view calling
another view locking the same resource waits like any other request.

One idea, read top to bottom (``Guard`` with its sync and async drivers, then the
function, class and mixin doors to it), hence a little over 500 lines.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import inspect
import logging
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, TypeVar, cast

from asgiref.sync import async_to_sync, iscoroutinefunction, sync_to_async
from django.core.exceptions import ImproperlyConfigured
from django.http import HttpRequest, HttpResponse
from django.http.response import HttpResponseBase
from django.views import View

from . import responses
from .conf import check_seconds, get_settings
from .exceptions import LockContentionError, QuorumUnavailableError
from .lock import Redlock
from .release import Held, release_rolled_back
from .resources import RejectedError, Template, check_name, parse_template, render

__all__ = [
    "DistributedLockMixin",
    "distributed_lock",
]

#: Longest lock label (method and path), in characters.
MAX_LABEL_LENGTH = 200

logger = logging.getLogger(__name__)

Hook = Callable[[HttpRequest, Any], Any]
View_ = TypeVar("View_", bound=Callable[..., Any])


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


def _log_unavailable(request: HttpRequest, exc: QuorumUnavailableError) -> None:
    """Say in the log why a view was not run: which nodes failed, and how."""
    logger.warning("%s %s not run: %s", request.method, request.path, exc)


def _view_name(request: HttpRequest, fallback: str) -> str:
    func = getattr(getattr(request, "resolver_match", None), "func", None)
    target = getattr(func, "view_class", func)
    if target is None:
        return fallback
    return f"{target.__module__}.{target.__qualname__}"


def name_of(view: Any) -> str:
    """Return ``module.qualname`` of a view, for messages."""
    return (
        f"{getattr(view, '__module__', '?')}."
        f"{getattr(view, '__qualname__', type(view).__qualname__)}"
    )


class Guard:
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
            self.template: Template | None = parse_template(resource)
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
        self.source = resource if isinstance(resource, str) else name_of(resource)
        self.ttl = ttl
        self.timeout = timeout
        self.blocking = blocking
        self.auto_extend = auto_extend
        self.fencing = fencing
        self.on_locked = on_locked
        self.on_unavailable = on_unavailable
        self.label = label
        # Request attributes (request.user, the session: loaded lazily), attribute
        # paths and callables may query the database, which Django refuses inside
        # an event loop: an async view computes those in a thread.
        self.start_sync_only = (
            self.resolve is not None
            or callable(label)
            or any(
                p.kwarg is None or p.attributes
                for p in cast(Template, self.template).placeholders
            )
        )

    # Request-time steps shared by both drivers.

    def resource_for(
        self,
        request: HttpRequest,
        args: Sequence[Any],
        kwargs: dict[str, Any],
        view_name: str,
    ) -> str:
        """Return the resource to lock for this request; raise ``RejectedError``."""
        if self.resolve is not None:
            resource = self.resolve(request, *args, **kwargs)
            if not isinstance(resource, str):
                raise TypeError(
                    f"lock resource callable {self.source} of view {view_name} "
                    f"returned {type(resource).__name__}, not str"
                )
            return check_name(resource)
        return render(cast(Template, self.template), request, kwargs, view_name)

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
        except RejectedError as rejected:
            return responses.bad_request(request, rejected)
        return Redlock(
            resource,
            ttl=self.ttl,
            auto_extend=self.auto_extend,
            fencing=self.fencing,
            label=self._label(request),
            reentrant=False,
        )

    def _held(self, lock: Redlock, view_name: str) -> Held:
        ttl = self.ttl if self.ttl is not None else get_settings().ttl
        return Held(lock, ttl, view_name)

    def _locked(self) -> Callable[[HttpRequest, Any], HttpResponseBase]:
        ttl = self.ttl if self.ttl is not None else get_settings().ttl
        return functools.partial(responses.locked, ttl=ttl)

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
        # An earlier hold of this thread whose transaction rolled back (a retry
        # loop around atomic()) is released first: it may be this very lock.
        release_rolled_back()
        lock = self._start(request, args, kwargs, view_name)
        if not isinstance(lock, Redlock):
            return lock
        try:
            lock._acquire(**self._acquire_args(), raise_on_contention=True)
        except LockContentionError as exc:
            return self._hook(on_locked, request, exc, self._locked())
        except QuorumUnavailableError as exc:
            _log_unavailable(request, exc)
            return self._hook(on_unavailable, request, exc, responses.unavailable)
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
            held.release_after_raise()
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
        if hook is None:
            response = None
        elif iscoroutinefunction(hook):
            response = await hook(request, exc)
        else:  # a sync hook may use the ORM: not in the event loop
            response = await sync_to_async(hook)(request, exc)
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
        if self.start_sync_only:
            lock = await sync_to_async(self._start)(request, args, kwargs, view_name)
        else:
            lock = self._start(request, args, kwargs, view_name)
        if not isinstance(lock, Redlock):
            return lock
        try:
            await lock._aacquire(**self._acquire_args(), raise_on_contention=True)
        except LockContentionError as exc:
            return await self._ahook(on_locked, request, exc, self._locked())
        except QuorumUnavailableError as exc:
            _log_unavailable(request, exc)
            return await self._ahook(
                on_unavailable, request, exc, responses.unavailable
            )
        held = self._held(lock, _view_name(request, view_name))
        previous = _set_redlock(request, lock)
        try:
            response = view(request, *args, **kwargs)
            if inspect.isawaitable(response):
                response = await response
        except BaseException:
            # Cancelled, or raising after it gave up on an await (wait_for, a
            # task group): work it started in a thread may still run.
            await _threads_finished(held)
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


def _nothing() -> None:
    """Run in the request's thread-sensitive executor: done once its work is."""


async def _after_the_executor() -> None:
    with contextlib.suppress(Exception):  # an executor shut down: nothing runs
        await sync_to_async(_nothing)()


async def _threads_finished(held: Held) -> None:
    """Wait for the work a view that raised or was cancelled left in threads.

    Cancelling an ``await sync_to_async(...)`` (Django's async ORM) does not stop
    the thread: the write goes on, and the lock must cover it. The request's
    thread-sensitive executor runs one call at a time, so a call queued behind
    it ends once that work has. Further cancellations wait for it too, for one
    TTL at most (an executor shared with a request waiting for this very lock
    would never run it): then the lock is released all the same, with a WARNING.
    """
    loop = asyncio.get_running_loop()
    finished = asyncio.ensure_future(_after_the_executor())
    ends = loop.time() + held.ttl
    while not finished.done():
        left = ends - loop.time()
        if left <= 0:
            logger.warning(
                "redlock %r: view %s left work running in a thread for %.3fs "
                "(its ttl); the lock is released while it runs",
                held.lock.resource,
                held.view_name,
                held.ttl,
            )
            return
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.wait({finished}, timeout=left)


def guards_of(obj: object) -> tuple[Guard, ...]:
    """Return the guards ``distributed_lock`` put on ``obj``, innermost first."""
    return tuple(getattr(obj, "_redlock_guards", ()))


def _decorate_class(guard: Guard, cls: type[View]) -> type[View]:
    original = cls.dispatch

    def dispatch(self: View, request: HttpRequest, *args: Any, **kwargs: Any) -> Any:
        bound = functools.partial(original, self)
        is_async = bool(getattr(type(self), "view_is_async", False))
        return guard.dispatch(bound, is_async, request, args, kwargs, name_of(cls))

    functools.update_wrapper(dispatch, original)
    dispatch._redlock_guards = (*guards_of(original), guard)  # type: ignore[attr-defined]
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
    guard = Guard(
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
        name = name_of(view)

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
        wrapper._redlock_guards = (*guards_of(view), guard)  # type: ignore[attr-defined]
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
    _redlock_guard: Guard | None = None

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if cls.lock_resource is None:
            cls._redlock_guard = None
            return
        cls._redlock_guard = Guard(
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
                f"{name_of(cls)} uses DistributedLockMixin without a lock_resource"
            )
        parent = cast(Any, super()).dispatch
        is_async = bool(getattr(cls, "view_is_async", False))
        hooks = (self.lock_on_locked, self.lock_on_unavailable)
        return guard.dispatch(
            parent, is_async, request, args, kwargs, name_of(cls), hooks
        )
