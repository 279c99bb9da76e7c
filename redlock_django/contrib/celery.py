"""Celery tasks that run once across workers: the ``RedlockTask`` base class.

::

    @app.task(base=RedlockTask, lock="report:{user_id}", lock_on_contention="skip")
    def build_report(user_id): ...

The lock wraps the task body (``Task.__call__``) in the process that runs it, so it
is released however the body ends: a return, an exception, ``self.retry()`` (the
``Retry`` it raises), a soft time limit (``SoftTimeLimitExceeded``). When the
body's process dies instead (``revoke(terminate=True)``, a hard time limit, a pool
child killed by the OOM killer), the worker's main process releases the lock as
soon as Celery reports it (``task_revoked``; ``task_failure`` with
``TimeLimitExceeded`` or ``WorkerLostError``), once the nodes show the lock still
labelled with this task's id and the process holding it is gone. Celery reports
nothing when it requeues the message instead (``acks_late`` with
``reject_on_worker_lost``): the copy that runs next finds the lock held by its own
task id and releases it when that run's process is gone on this host (same pid
namespace), so the job runs instead of being skipped. A worker killed whole frees
the lock within its TTL: the watchdog extending it dies with it.

The options are task options, so ``@app.task(...)`` keywords or class attributes:

- ``lock``: the resource, a template over the task's arguments (``"report:{user_id}"``,
  ``"export:{obj.pk}"``; a bound task's ``self`` is not one of them) or a callable
  ``(*args, **kwargs) -> str``. Checked when Celery creates the task class: a bad
  template or option raises ``ImproperlyConfigured``, as ``locked()`` does.
- ``lock_on_contention``: ``"wait"`` (up to ``lock_timeout``, then
  ``LockContentionError``), ``"skip"`` (return None without running), ``"raise"``
  (``LockContentionError`` at once) or ``"retry"`` (``self.retry()`` after
  ``lock_retry_countdown`` seconds, up to ``max_retries``; then
  ``LockContentionError``).
- ``lock_timeout``, ``lock_ttl``, ``lock_auto_extend``, ``lock_max_hold``,
  ``lock_fencing``, ``lock_nodes``: as ``locked()``'s ``timeout``, ``ttl``, ...

The admin page labels the lock ``celery <task name> [<task id>]``.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, ClassVar, cast

try:
    from billiard.exceptions import WorkerLostError
    from celery import Task
    from celery.exceptions import TimeLimitExceeded
    from celery.signals import task_failure, task_revoked
except ImportError as exc:  # pragma: no cover - exercised by a subprocess test
    raise ImportError(
        "redlock_django.contrib.celery needs Celery: "
        "pip install 'redlock-django[celery]'"
    ) from exc

from django.core.exceptions import ImproperlyConfigured

from .. import listing, meta
from ..exceptions import LockContentionError
from ..functions import MAX_LABEL_LENGTH, FunctionLock
from ..functions import POLICIES as FUNCTION_POLICIES
from ..interrupts import reraise_interruption
from ..lock import Redlock
from ..nodes import describe

__all__ = ["POLICIES", "RedlockTask", "release_dead_holder", "task_label"]

logger = logging.getLogger(__name__)

#: What a task does when its lock is held: ``locked()``'s policies plus "retry".
POLICIES = (*FUNCTION_POLICIES, "retry")
#: Seconds the worker's main process waits for a killed child to be gone before
#: it releases that child's lock (it never releases a lock a live process holds).
DEAD_HOLDER_WAIT = 2.0


def task_label(name: str, task_id: str | None) -> str:
    """Return the admin label of a task's lock: ``celery <name> [<id>]``.

    A long name is cut before the id: the worker finds a killed task's lock by it.
    An id too long for the label is cut too, at ``MAX_LABEL_LENGTH``, as the
    stored label is (the dead-holder check also asks for the pid to be gone).
    """
    suffix = f" [{task_id or 'called directly'}]"
    room = max(0, MAX_LABEL_LENGTH - len("celery ") - len(suffix))
    return f"celery {name[:room]}{suffix}"[:MAX_LABEL_LENGTH]


class RedlockTask(Task):  # type: ignore[misc]
    """A Celery task whose body runs under a Redlock lock on ``lock``.

    See the module docstring for the options. Without ``lock`` the task runs
    unlocked, so this class can be an app's default ``Task``.
    """

    lock: ClassVar[str | Callable[..., str] | None] = None
    lock_on_contention: ClassVar[str] = "wait"
    lock_retry_countdown: ClassVar[float] = 5.0
    lock_timeout: ClassVar[float | None] = None
    lock_ttl: ClassVar[float | None] = None
    lock_auto_extend: ClassVar[bool] = True
    lock_max_hold: ClassVar[float | None] = None
    lock_fencing: ClassVar[bool] = False
    lock_nodes: ClassVar[Sequence[str] | None] = None

    _function_lock: ClassVar[FunctionLock | None] = None

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        # Celery's @app.task builds a subclass holding the options and ``run``:
        # the template is checked here, when the task is created.
        cls._function_lock = _function_lock_for(cls)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        function_lock = type(self)._function_lock
        if function_lock is None:
            return super().__call__(*args, **kwargs)
        entered = False

        def body() -> Any:
            nonlocal entered
            entered = True
            return super(RedlockTask, self).__call__(*args, **kwargs)

        task_id = self.request.id
        label = task_label(self.name, task_id)

        def reclaim(lock: Redlock) -> bool:
            # A pid is only looked up in a namespace known to be the holder's.
            if meta.pid_namespace() is None:
                return False
            try:
                return _release_if_dead(
                    lock.resource, label, self.name, task_id, wait=0.0
                )
            except Exception as exc:  # a look that failed frees nothing: the policy
                reraise_interruption(exc)  # a soft time limit ends the task
                logger.warning(
                    "redlock %r: could not look for a dead run of task %s[%s]: %s",
                    lock.resource,
                    self.name,
                    task_id,
                    describe(exc),
                )
                return False

        try:
            # The listing reads the nodes of settings.REDLOCK, not lock_nodes.
            mine = task_id and function_lock.nodes is None
            return function_lock.call(
                args, kwargs, body, label=label, reclaim=reclaim if mine else None
            )
        except LockContentionError as exc:
            # Only the task's own lock being held is retried, not a
            # contention the body ran into.
            if entered or self.lock_on_contention != "retry":
                raise
            raise self.retry(exc=exc, countdown=self.lock_retry_countdown) from None


def _function_lock_for(cls: type[RedlockTask]) -> FunctionLock | None:
    """Build the ``FunctionLock`` of a task class, or None if it has no lock."""
    if cls.lock is None:
        return None
    run = _static_attribute(cls, "run")
    if run is None or run is Task.run:
        return None  # an abstract base: its subclasses bring ``run``
    if isinstance(run, staticmethod):
        func, skip = run.__func__, 0  # @app.task without bind=True
    else:
        func, skip = run, 1  # bind=True, or a class-based task's method
    policy = cls.lock_on_contention
    if policy not in POLICIES:
        raise ImproperlyConfigured(
            f"task {cls.__name__}: lock_on_contention must be one of "
            f"{', '.join(map(repr, POLICIES))}, not {policy!r}"
        )
    countdown = cls.lock_retry_countdown
    if isinstance(countdown, bool) or not isinstance(countdown, int | float):
        raise ImproperlyConfigured(
            f"task {cls.__name__}: lock_retry_countdown must be a number of "
            f"seconds, not {countdown!r}"
        )
    if not 0 <= countdown < float("inf"):
        raise ImproperlyConfigured(
            f"task {cls.__name__}: lock_retry_countdown must be >= 0 seconds, "
            f"not {countdown!r}"
        )
    if cls.lock_timeout is not None and policy != "wait":
        raise ImproperlyConfigured(
            f"task {cls.__name__}: lock_timeout applies to "
            f"lock_on_contention='wait' only, not {policy!r}"
        )
    return FunctionLock(
        func,
        cls.lock,
        on_contention="raise" if policy == "retry" else policy,
        timeout=cls.lock_timeout,
        ttl=cls.lock_ttl,
        auto_extend=cls.lock_auto_extend,
        fencing=cls.lock_fencing,
        max_hold=cls.lock_max_hold,
        # A str is left as it is, so that it is refused as one, not split.
        nodes=(
            list(cls.lock_nodes)
            if isinstance(cls.lock_nodes, (list, tuple))
            else cast(Any, cls.lock_nodes)
        ),
        skip_params=skip,
    )


def _static_attribute(cls: type, name: str) -> Any:
    for klass in cls.__mro__:
        if name in vars(klass):
            return vars(klass)[name]
    return None


# The body's process is gone: the worker's main process releases the lock.


def release_dead_holder(
    task: Any,
    task_id: str | None,
    args: Sequence[Any] | None,
    kwargs: Mapping[str, Any] | None,
    *,
    wait: float = DEAD_HOLDER_WAIT,
) -> bool:
    """Release ``task``'s lock taken for ``task_id`` once its process is gone.

    Called in the worker's main process when Celery reports the body's process
    killed. The lock is released only if the nodes show it labelled with this
    task id, taken on this host by another process, and that process has
    exited (waiting up to ``wait`` seconds for it): a live holder, or a lock
    that changed hands, is left alone. The release is the listing's
    compare-and-delete on the token digest just read. Return whether it was
    released on at least one node.
    """
    function_lock = getattr(type(task), "_function_lock", None)
    if not isinstance(task, RedlockTask) or function_lock is None:
        return False
    try:
        resource = function_lock.resource_for(tuple(args or ()), dict(kwargs or {}))
    except (ValueError, TypeError):
        return False  # the body never acquired a lock for these arguments
    label = task_label(task.name, task_id)
    return _release_if_dead(resource, label, task.name, task_id, wait=wait)


def _release_if_dead(
    resource: str, label: str, name: str, task_id: str | None, *, wait: float
) -> bool:
    """Release ``resource``'s lock if it is labelled ``label`` and its process,
    one of this host's and pid namespace's, has exited (waited for up to ``wait``
    seconds; 0: looked at once, and a live holder is no news).

    Two uses: the worker's main process, told that a child died, and a task
    finding its lock held: a message Celery requeued after its run's process
    died (``acks_late`` with ``reject_on_worker_lost``, an OOM kill) finds the
    lock that run took, with nobody told to release it. A holder on another host
    or in another pid namespace is left to its TTL.
    """
    namespace = meta.pid_namespace()
    for held in listing.describe([resource]):
        if held.label != label:
            continue
        pid = held.pid
        if (
            held.host != socket.gethostname()
            or held.ns != namespace
            or pid is None
            or pid == os.getpid()
        ):
            return False  # another host or namespace, or this process: its own
        if not _wait_gone(pid, wait):
            if wait:
                logger.warning(
                    "redlock %r of task %s[%s] left held: its process %d is still "
                    "alive %.1fs after it was reported gone",
                    resource,
                    name,
                    task_id,
                    pid,
                    wait,
                )
            return False
        outcome = listing.force_release(resource, held.token_digest)
        logger.info(
            "redlock %r released for task %s[%s], whose process %d is gone "
            "(released on %d nodes)",
            resource,
            name,
            task_id,
            pid,
            len(outcome.released),
        )
        return bool(outcome.released)
    return False


def _gone(pid: int) -> bool:
    """Whether process ``pid`` has exited (a zombie has)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return True
    except OSError:  # no procfs: ask the kernel; a zombie still counts as alive
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        except PermissionError:
            return False
        return False
    return stat.rsplit(")", 1)[1].split()[0] in ("Z", "X")


def _wait_gone(pid: int, wait: float) -> bool:
    deadline = time.monotonic() + wait
    while not _gone(pid):
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.005)
    return True


def _on_revoked(
    sender: Any = None, request: Any = None, terminated: bool = False, **_: Any
) -> None:
    if terminated and request is not None:
        _safely(sender, request.id, request.args, request.kwargs)


def _on_failure(
    sender: Any = None,
    task_id: str | None = None,
    exception: BaseException | None = None,
    args: Sequence[Any] | None = None,
    kwargs: Mapping[str, Any] | None = None,
    **_: Any,
) -> None:
    # Sent by the main process when the pool lost the child (killed, hard time
    # limit); a failure inside the body released the lock on its way out.
    if isinstance(exception, TimeLimitExceeded | WorkerLostError):
        _safely(sender, task_id, args, kwargs)


def _safely(
    task: Any,
    task_id: str | None,
    args: Sequence[Any] | None,
    kwargs: Mapping[str, Any] | None,
) -> None:
    """Release in a thread of its own: the receiver must not block the worker.

    Celery reports a hard time limit before the pool kills the child, from the
    code that kills it next: waiting here for the child to be gone would wait
    for ourselves.
    """

    def release() -> None:
        # The lease expires anyway: a failure here is logged, never raised.
        try:
            release_dead_holder(task, task_id, args, kwargs)
        except Exception:
            logger.exception("redlock: could not release the lock of task %s", task_id)

    threading.Thread(target=release, name="redlock-release", daemon=True).start()


task_revoked.connect(_on_revoked, weak=False, dispatch_uid="redlock_django.revoked")
task_failure.connect(_on_failure, weak=False, dispatch_uid="redlock_django.failure")
