"""Locks for Django's tasks framework (``django.tasks``, Django 6.0+).

``locked_task`` is ``django.tasks.task`` with a lock around the task's function,
so a task runs once at a time per resource across every worker::

    from redlock_django.contrib.tasks import locked_task

    @locked_task("report:{user_id}", on_contention="skip")
    def build_report(user_id: int) -> None: ...

    build_report.enqueue(user_id=7)

The resource template, the policies (``"wait"``, ``"skip"``, ``"raise"``) and the
auto-extension are those of :func:`redlock_django.locked` (the same
``FunctionLock`` underneath); ``locked_task`` adds what a task needs: the
template ranges over the task's arguments without ``context`` (for
``takes_context=True``), and the admin labels the lock
``task <module.name> [<result id>]``. The id comes from the task context when the
task takes it, else from the ``task_started`` signal the worker sends on the same
thread just before the call (the built-in backends and django-tasks-db's
``db_worker`` send it).

The lock is held while the function runs in the worker, not while the task waits
in the queue: enqueueing never blocks. ``"skip"`` makes the run succeed with
``None``; ``"raise"`` makes it fail with ``LockContentionError`` (django.tasks
does not retry); ``"wait"`` keeps the worker busy waiting, up to ``timeout``.

Importing this module below Django 6.0 raises ``ImportError``: there is no
``django.tasks`` to integrate with.
"""

from __future__ import annotations

import django

if django.VERSION < (6, 0):
    raise ImportError(
        "redlock_django.contrib.tasks: django.tasks needs Django 6.0 or later; "
        f"this is Django {django.get_version()}"
    )

import functools
import inspect
from collections.abc import Callable, Sequence
from contextvars import ContextVar
from typing import Any, cast

from django.tasks import Task, TaskContext, task
from django.tasks.base import DEFAULT_TASK_BACKEND_ALIAS, DEFAULT_TASK_PRIORITY
from django.tasks.signals import task_finished, task_started

from ..functions import FunctionLock

__all__ = ["locked_task"]

#: (module path, result id) of the task this worker thread is running now, set by
#: ``task_started`` and cleared by ``task_finished``.
_running: ContextVar[tuple[str, str] | None] = ContextVar(
    "redlock_django_task_running", default=None
)


def _started(sender: Any, task_result: Any, **kwargs: Any) -> None:
    _running.set((task_result.task.module_path, str(task_result.id)))


def _finished(sender: Any, task_result: Any, **kwargs: Any) -> None:
    _running.set(None)


task_started.connect(_started, dispatch_uid="redlock_django.contrib.tasks.started")
task_finished.connect(_finished, dispatch_uid="redlock_django.contrib.tasks.finished")


def _label(module_path: str, args: Sequence[Any], takes_context: bool) -> str:
    """Return the admin label of one run: ``task <module.name> [<result id>]``."""
    result_id = None
    if takes_context and args and isinstance(args[0], TaskContext):
        result_id = str(args[0].task_result.id)
    else:
        running = _running.get()
        if running is not None and running[0] == module_path:
            result_id = running[1]
    return f"task {module_path} [{result_id}]" if result_id else f"task {module_path}"


def locked_task(
    resource: str | Callable[..., str],
    *,
    on_contention: str = "wait",
    timeout: float | None = None,
    ttl: float | None = None,
    auto_extend: bool = True,
    fencing: bool = False,
    max_hold: float | None = None,
    nodes: list[str] | tuple[str, ...] | None = None,
    priority: int = DEFAULT_TASK_PRIORITY,
    queue_name: str | None = None,
    backend: str = DEFAULT_TASK_BACKEND_ALIAS,
    takes_context: bool = False,
) -> Callable[[Callable[..., Any]], Task[..., Any]]:
    """Return a decorator making a function a ``django.tasks`` task run under a lock.

    ``resource`` is a template over the function's arguments (``context`` left
    out when ``takes_context``) or a callable taking the same arguments; the lock
    options are :func:`redlock_django.locked`'s, checked when the task is
    defined; ``priority``, ``queue_name``, ``backend`` and ``takes_context`` go to
    ``django.tasks.task``. Put it in place of ``@task``, not on top of one: the
    lock must wrap the function before the task is built around it.
    """
    task_options: dict[str, Any] = {
        "priority": priority,
        "backend": backend,
        "takes_context": takes_context,
    }
    if queue_name is not None:
        task_options["queue_name"] = queue_name

    def decorate(func: Callable[..., Any]) -> Task[..., Any]:
        if isinstance(func, Task):
            raise TypeError(
                f"locked_task() goes in place of @task, not on top of one: "
                f"{func.module_path} is already a task"
            )
        if not inspect.isfunction(func):
            raise TypeError(f"locked_task() needs a function, not {func!r}")
        # The context is the worker's, not the caller's: no part of the resource.
        skip = 1 if takes_context else 0
        guard = FunctionLock(
            func,
            resource,
            on_contention=on_contention,
            timeout=timeout,
            ttl=ttl,
            auto_extend=auto_extend,
            fencing=fencing,
            max_hold=max_hold,
            nodes=nodes,
            skip_params=skip,
        )
        module_path = f"{func.__module__}.{func.__qualname__}"
        run: Callable[..., Any]
        if inspect.iscoroutinefunction(func):

            @functools.wraps(func)
            async def run(*args: Any, **kwargs: Any) -> Any:
                return await guard.acall(
                    args[skip:],
                    kwargs,
                    functools.partial(func, *args, **kwargs),
                    label=_label(module_path, args, takes_context),
                )

        else:

            @functools.wraps(func)
            def run(*args: Any, **kwargs: Any) -> Any:
                return guard.call(
                    args[skip:],
                    kwargs,
                    functools.partial(func, *args, **kwargs),
                    label=_label(module_path, args, takes_context),
                )

        run.lock = guard  # type: ignore[attr-defined]
        built: Task[..., Any] = cast(Any, task)(run, **task_options)
        return built

    return decorate
