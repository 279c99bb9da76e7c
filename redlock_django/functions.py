"""``locked``: run a function or coroutine under a Redlock, once across servers.

Usage::

    @locked("report:{user_id}", on_contention="skip")
    def build_report(user_id, *, force=False): ...

    @locked("export:{obj.pk}", on_contention="raise")
    async def export(obj): ...

The resource is a template over the function's parameters (``{user_id}``,
``{obj.pk}``; positional or keyword, defaults applied), parsed by ``resources``
like the view decorator's, or a callable ``(*args, **kwargs) -> str`` given the
call's arguments.

Errors. Everything the decorator can check without a call is checked when the
function is decorated and raises ``ImproperlyConfigured``, as
``distributed_lock`` does for views: a malformed template or one naming no
parameter, an unknown policy, a bad ``ttl``/``timeout``/``max_hold``. These are
mistakes in code, found at import time. A value a call puts into the template
that cannot be part of a resource name (None, empty, too long, ``:`` or other
forbidden characters, an attribute that cannot be read) raises ``ValueError``
naming the placeholder, before anything is sent to the nodes: the value comes
from the caller, as an argument error would.

Policies (``on_contention``) when another owner holds the lock:

- ``"wait"``: wait up to ``timeout`` seconds (default ``WAIT_TIMEOUT``), then
  raise ``LockContentionError``;
- ``"skip"``: do not run; log at INFO on ``redlock_django.functions`` and return
  None;
- ``"raise"``: do not wait; raise ``LockContentionError`` at once.

``QuorumUnavailableError`` (too few nodes answer) always propagates: an outage is
not contention. The lease is auto-extended while the function runs, up to
``max_hold`` (``MAX_HOLD``). The same owner (thread, or asyncio task) calling a
locked function again with the same resource re-enters its hold instead of
waiting for itself.

Lost lease. ``current_lock()`` returns the ``Redlock`` of the innermost locked call
running in this thread or task, so the body can check ``current_lock().lost`` and
stop, or pass it to ``fenced_update`` (with ``fencing=True`` a write after the
lease was lost, once another holder got a newer token, raises
``StaleFencingTokenError``). A lease found lost at release raises
``LockLostError`` after the function returned (its result is dropped: the work may
have overlapped another run); if the function raised, its own exception wins and
the loss is logged at ERROR.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import inspect
import logging
import math
from collections.abc import (
    AsyncIterator,
    Awaitable,
    Callable,
    Iterator,
    Mapping,
    Sequence,
)
from typing import Any, TypeVar, cast

from asgiref.sync import iscoroutinefunction
from django.core.exceptions import ImproperlyConfigured

from .conf import check_seconds
from .exceptions import LockContentionError, QuorumUnavailableError
from .lock import Redlock
from .resources import (
    RejectedError,
    Template,
    check_name,
    parse_template,
    render_arguments,
)

__all__ = [
    "POLICIES",
    "SKIPPED",
    "FunctionLock",
    "current_lock",
    "locked",
]

logger = logging.getLogger(__name__)

#: What ``on_contention`` may be.
POLICIES = ("wait", "skip", "raise")
#: The INFO message logged when ``"skip"`` does not run a call: label, resource.
SKIPPED = "%s skipped: %r is held elsewhere"
#: Longest lock label, in characters (the admin shows it).
MAX_LABEL_LENGTH = 200

F = TypeVar("F", bound=Callable[..., Any])

_current: contextvars.ContextVar[Redlock | None] = contextvars.ContextVar(
    "redlock_django_current_lock", default=None
)


def current_lock() -> Redlock | None:
    """Return the lock of the innermost ``locked`` call running here, or None.

    "Here" is the current thread, or the current asyncio task; ``lost``,
    ``validity`` and ``fencing_token`` answer for that owner only, so check them
    from the locked function's own thread or task.
    """
    return _current.get()


def _name_of(func: Callable[..., Any]) -> str:
    return (
        f"{getattr(func, '__module__', '?')}."
        f"{getattr(func, '__qualname__', type(func).__qualname__)}"
    )


class FunctionLock:
    """Everything ``locked`` decides once per decorated function.

    ``skip_params`` leading parameters of ``func`` are not part of the arguments
    given to ``resource_for``/``call`` (1 drops the ``self`` of a bound Celery
    task); templates cannot name them.
    """

    def __init__(
        self,
        func: Callable[..., Any],
        resource: str | Callable[..., str],
        *,
        on_contention: str = "wait",
        timeout: float | None = None,
        ttl: float | None = None,
        auto_extend: bool = True,
        fencing: bool = False,
        label: str | None = None,
        max_hold: float | None = None,
        nodes: list[str] | tuple[str, ...] | None = None,
        skip_params: int = 0,
    ) -> None:
        self.name = _name_of(func)
        if not callable(func):
            raise ImproperlyConfigured(f"locked() decorates a callable, not {func!r}")
        if inspect.isgeneratorfunction(func) or inspect.isasyncgenfunction(func):
            # The lock would be released before the generator's body runs.
            raise ImproperlyConfigured(
                f"locked() cannot hold a lock around generator {self.name}: the "
                "lock would be released before its body runs"
            )
        if getattr(func, "__code__", None) in _CONTEXT_MANAGER_CODES:
            # @contextmanager: the call returns the manager; its body, the work,
            # runs in the caller's with-block, after the release.
            raise ImproperlyConfigured(
                f"locked() cannot hold a lock around context manager {self.name}: "
                "the lock would be released before its body runs; decorate the "
                "function called inside the with-block, or take the lock in it"
            )
        if on_contention not in POLICIES:
            raise ImproperlyConfigured(
                f"locked({self.name}): on_contention must be one of "
                f"{', '.join(map(repr, POLICIES))}, not {on_contention!r}"
            )
        if on_contention != "wait" and timeout is not None:
            raise ImproperlyConfigured(
                f"locked({self.name}): timeout applies to on_contention='wait' "
                f"only, not {on_contention!r}"
            )
        self.signature = self._signature(func, skip_params)
        if isinstance(resource, str):
            parameters = [
                p.name
                for p in self.signature.parameters.values()
                if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)
            ]
            self.template: Template | None = parse_template(
                resource, parameters, self.name
            )
            self.resolve: Callable[..., str] | None = None
            self.source = resource
        elif callable(resource):
            self.template, self.resolve = None, resource
            self.source = _name_of(resource)
        else:
            raise ImproperlyConfigured(
                f"locked({self.name}): the resource must be a template string or "
                f"a callable (*args, **kwargs) -> str, not {resource!r}"
            )
        try:
            check_seconds("timeout", timeout, allow_none=True, wait=True)
            check_seconds("ttl", ttl, allow_none=True)
            if max_hold != math.inf:  # no cap, as Redlock takes it
                check_seconds("max_hold", max_hold, allow_none=True)
        except (TypeError, ValueError) as exc:
            raise ImproperlyConfigured(f"locked({self.name}): {exc}") from exc
        if nodes is not None and (isinstance(nodes, str) or not nodes):
            # Parsed at the first call: aliases are read from CACHES, and settings
            # are never read at import time.
            raise ImproperlyConfigured(
                f"locked({self.name}): nodes must be a non-empty list of Redis "
                f"URLs or aliases, not {nodes!r}"
            )
        if label is not None and not isinstance(label, str):
            raise ImproperlyConfigured(
                f"locked({self.name}): label must be a string, not {label!r}"
            )
        self.func = func
        self.on_contention = on_contention
        self.timeout = timeout
        self.ttl = ttl
        self.auto_extend = bool(auto_extend)
        self.fencing = bool(fencing)
        self.label = (label if label is not None else self.name)[:MAX_LABEL_LENGTH]
        self.max_hold = max_hold
        self.nodes = None if nodes is None else tuple(nodes)
        self.skip_params = skip_params

    def _signature(self, func: Callable[..., Any], skip: int) -> inspect.Signature:
        try:
            signature = inspect.signature(func)
        except (TypeError, ValueError) as exc:
            raise ImproperlyConfigured(
                f"locked(): cannot read the signature of {self.name}: {exc}"
            ) from exc
        parameters = list(signature.parameters.values())
        if (
            skip < 0
            or skip > len(parameters)
            or any(
                p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD, p.KEYWORD_ONLY)
                for p in parameters[:skip]
            )
        ):
            raise ImproperlyConfigured(
                f"locked({self.name}): cannot skip {skip} leading positional "
                "parameter(s)"
            )
        return signature.replace(parameters=parameters[skip:])

    def __repr__(self) -> str:
        return f"<FunctionLock {self.source!r} of {self.name}>"

    # Call-time steps, shared by both drivers.

    def resource_for(self, args: Sequence[Any], kwargs: Mapping[str, Any]) -> str:
        """Return the resource one call locks.

        Raise ``ValueError`` naming the placeholder for a value that cannot be
        part of a resource name, ``TypeError`` for arguments the function cannot
        take (as calling it would).
        """
        if self.resolve is not None:
            resource = self.resolve(*args, **kwargs)
            if not isinstance(resource, str):
                raise TypeError(
                    f"lock resource callable {self.source} of {self.name} "
                    f"returned {type(resource).__name__}, not str"
                )
            try:
                return check_name(resource)
            except RejectedError as exc:
                raise ValueError(
                    f"lock resource callable {self.source} of {self.name}: {exc}"
                ) from None
        try:
            bound = self.signature.bind(*args, **kwargs)
        except TypeError as exc:
            raise TypeError(f"{self.name}(): {exc}") from None
        bound.apply_defaults()
        try:
            return render_arguments(cast(Template, self.template), bound.arguments)
        except RejectedError as exc:
            raise ValueError(
                f"lock resource {self.source!r} of {self.name}: {exc}"
            ) from exc

    def lock_for(
        self,
        args: Sequence[Any],
        kwargs: Mapping[str, Any],
        *,
        label: str | None = None,
    ) -> Redlock:
        """Return a fresh ``Redlock`` for one call; see ``resource_for``."""
        return Redlock(
            self.resource_for(args, kwargs),
            ttl=self.ttl,
            auto_extend=self.auto_extend,
            fencing=self.fencing,
            nodes=self.nodes,
            label=(self.label if label is None else str(label))[:MAX_LABEL_LENGTH],
            max_hold=self.max_hold,
        )

    def _acquire_args(self) -> dict[str, Any]:
        """Arguments of ``Redlock._acquire``: False back only for ``"skip"``."""
        if self.on_contention == "wait":
            return {
                "blocking": True,
                "timeout": self.timeout,
                "raise_on_contention": True,
            }
        return {
            "blocking": False,
            "raise_on_contention": self.on_contention == "raise",
        }

    def _skipped(self, lock: Redlock) -> None:
        logger.info(SKIPPED, lock.label or self.name, lock.resource)

    def _take(self, lock: Redlock, reclaim: Callable[[Redlock], bool] | None) -> bool:
        """Acquire per the policy; with ``reclaim``, one look first at a lock held.

        A lock found held and not freed by ``reclaim`` is not asked for again
        unless the policy waits: one ``lock_contended``, as without it.
        """
        args = self._acquire_args()
        if reclaim is not None:
            try:
                if lock._acquire(blocking=False, raise_on_contention=True):
                    return True
            except LockContentionError:
                if not reclaim(lock) and not args["blocking"]:
                    if args["raise_on_contention"]:
                        raise
                    return False
            except QuorumUnavailableError:
                pass  # the policy's own acquisition decides what an outage does
        return bool(lock._acquire(**args))

    # Blocking driver.

    def call(
        self,
        args: Sequence[Any],
        kwargs: Mapping[str, Any],
        run: Callable[[], Any],
        *,
        label: str | None = None,
        reclaim: Callable[[Redlock], bool] | None = None,
    ) -> Any:
        """Run ``run()`` under the call's lock, per the policy.

        Return its result, or None when ``"skip"`` found the lock held. With
        ``reclaim``, a lock found held is first shown to ``reclaim(lock)``, which
        may free it (a dead earlier run of this same call's), before the policy
        applies.
        """
        lock = self.lock_for(args, kwargs, label=label)
        if not self._take(lock, reclaim):
            self._skipped(lock)
            return None
        token = _current.set(lock)
        try:
            result = run()
        except BaseException as exc:
            _current.reset(token)
            lock.__exit__(type(exc), exc, exc.__traceback__)
            raise
        _current.reset(token)
        if _deferred(result):
            # Its body runs only when awaited or iterated, after the release: a
            # sync wrapper around an async def, say. Never run it unlocked.
            _discard(result)
            lock.__exit__(None, None, None)
            raise TypeError(
                f"locked({self.name}) returned {type(result).__name__} "
                f"{result!r}, whose body would run after the lock is released; "
                "decorate the async def itself (or make the wrapper async def)"
            )
        lock.__exit__(None, None, None)
        return result

    # asyncio driver: the same steps with the a-prefixed API.

    async def acall(
        self,
        args: Sequence[Any],
        kwargs: Mapping[str, Any],
        run: Callable[[], Awaitable[Any]],
        *,
        label: str | None = None,
    ) -> Any:
        """Await ``run()`` under the call's lock, per the policy; see ``call``."""
        lock = self.lock_for(args, kwargs, label=label)
        if not await lock._aacquire(**self._acquire_args()):
            self._skipped(lock)
            return None
        token = _current.set(lock)
        try:
            result = await run()
        except BaseException as exc:
            _current.reset(token)
            await lock.__aexit__(type(exc), exc, exc.__traceback__)
            raise
        _current.reset(token)
        await lock.__aexit__(None, None, None)
        return result


def locked(
    resource: str | Callable[..., str],
    *,
    on_contention: str = "wait",
    timeout: float | None = None,
    ttl: float | None = None,
    auto_extend: bool = True,
    fencing: bool = False,
    label: str | None = None,
    max_hold: float | None = None,
    nodes: list[str] | tuple[str, ...] | None = None,
) -> Callable[[F], F]:
    """Hold a Redlock on ``resource`` around every call of a function or coroutine.

    ``resource`` is a template over the function's parameters (``"report:{user_id}"``,
    ``"export:{obj.pk}"``) or a callable given the call's arguments.
    ``on_contention`` is ``"wait"`` (up to ``timeout`` seconds, then
    ``LockContentionError``), ``"skip"`` (return None without running) or
    ``"raise"`` (``LockContentionError`` at once). ``label`` is shown in the admin
    (default: the function's ``module.qualname``). ``ttl``, ``auto_extend``,
    ``fencing``, ``max_hold`` and ``nodes`` are the ``Redlock`` options. Errors in
    these arguments raise ``ImproperlyConfigured`` here; bad values in a call
    raise ``ValueError`` before anything is sent to the nodes.
    """

    def decorate(func: F) -> F:
        guard = FunctionLock(
            func,
            resource,
            on_contention=on_contention,
            timeout=timeout,
            ttl=ttl,
            auto_extend=auto_extend,
            fencing=fencing,
            label=label,
            max_hold=max_hold,
            nodes=nodes,
        )
        if is_async_callable(func):

            @functools.wraps(func)
            async def async_wrapper(*args: Any, **kwargs: Any) -> Any:
                return await guard.acall(args, kwargs, lambda: func(*args, **kwargs))

            wrapper: Callable[..., Any] = async_wrapper
        else:

            @functools.wraps(func)
            def sync_wrapper(*args: Any, **kwargs: Any) -> Any:
                return guard.call(args, kwargs, lambda: func(*args, **kwargs))

            wrapper = sync_wrapper
        wrapper.function_lock = guard  # type: ignore[attr-defined]
        return cast(F, wrapper)

    return decorate


def is_async_callable(func: object) -> bool:
    """Whether calling ``func`` gives a coroutine: an ``async def`` function, or an
    object whose ``__call__`` is one."""
    if iscoroutinefunction(func):
        return True
    if inspect.isroutine(func) or isinstance(func, type):
        return False
    call = inspect.getattr_static(type(func), "__call__", None)
    return call is not None and iscoroutinefunction(call)


def _deferred(result: object) -> bool:
    """Whether ``result`` is a body yet to run: a coroutine, awaitable, generator,
    or a ``@contextmanager``'s manager."""
    return (
        inspect.isawaitable(result)
        or inspect.isgenerator(result)
        or inspect.isasyncgen(result)
        or isinstance(result, _GENERATOR_MANAGERS)
    )


def _generator() -> Iterator[None]:
    yield


async def _async_generator() -> AsyncIterator[None]:
    yield


#: The code of the function ``@contextmanager`` (and the async one) returns: every
#: such function shares it.
_CONTEXT_MANAGER_CODES = frozenset(
    {
        contextlib.contextmanager(_generator).__code__,
        contextlib.asynccontextmanager(_async_generator).__code__,
    }
)
#: What those functions return: managers whose body runs in ``__enter__``.
_GENERATOR_MANAGERS = (
    type(contextlib.contextmanager(_generator)()),
    type(contextlib.asynccontextmanager(_async_generator)()),
)


def _discard(result: Any) -> None:
    """Close a coroutine or generator that will never run (no "never awaited")."""
    close = getattr(result, "close", None)
    if callable(close):
        close()
