"""One behaviour suite, two drivers: adapters for the blocking and the asyncio API.

Each adapter *is* one owner. ``SyncAPI`` runs every call on one dedicated thread
(as a request thread would); ``AsyncAPI`` runs every call in one dedicated task.
Tests are coroutines and make a second owner by making a second adapter.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from redlock_django import Redlock


class SyncAPI:
    """Drive locks through acquire()/release()/``with`` on one owner thread."""

    mode = "sync"

    def __init__(self) -> None:
        self._thread = ThreadPoolExecutor(max_workers=1)

    async def aclose(self) -> None:
        self._thread.shutdown(wait=True)

    async def _run(self, fn: Callable[[], Any]) -> Any:
        return await asyncio.get_running_loop().run_in_executor(self._thread, fn)

    async def acquire(self, lock: Redlock, **kwargs: Any) -> bool:
        return bool(await self._run(lambda: lock.acquire(**kwargs)))

    async def release(self, lock: Redlock) -> None:
        await self._run(lock.release)

    async def extend(self, lock: Redlock, ttl: float | None = None) -> bool:
        return bool(await self._run(lambda: lock.extend(ttl)))

    async def locked(self, lock: Redlock) -> bool:
        return bool(await self._run(lock.locked))

    async def look(self, lock: Redlock, name: str) -> Any:
        """Read an owner-relative attribute (validity, fencing_token) as the owner."""
        return await self._run(lambda: getattr(lock, name))

    async def enter(self, lock: Redlock) -> None:
        await self._run(lock.__enter__)

    async def exit(self, lock: Redlock, exc: BaseException | None = None) -> None:
        await self._run(
            lambda: lock.__exit__(
                None if exc is None else type(exc),
                exc,
                None if exc is None else exc.__traceback__,
            )
        )

    @contextlib.asynccontextmanager
    async def hold(self, lock: Redlock) -> AsyncIterator[Redlock]:
        """Hold ``lock`` with its context manager around the ``async with`` body."""
        await self.enter(lock)
        try:
            yield lock
        except BaseException as exc:
            await self.exit(lock, exc)
            raise
        await self.exit(lock)


class AsyncAPI(SyncAPI):
    """Drive locks through aacquire()/arelease()/``async with`` in one owner task."""

    mode = "async"

    def __init__(self) -> None:
        self._jobs: asyncio.Queue[
            tuple[Callable[[], Awaitable[Any]], asyncio.Future[Any]]
        ] = asyncio.Queue()
        self._task = asyncio.create_task(self._serve(), name="owner-task")

    async def _serve(self) -> None:
        while True:
            job, future = await self._jobs.get()
            try:
                result = await job()
            except BaseException as exc:
                if not future.cancelled():
                    future.set_exception(exc)
                if isinstance(exc, asyncio.CancelledError):
                    raise
            else:
                if not future.cancelled():
                    future.set_result(result)

    async def aclose(self) -> None:
        self._task.cancel()
        await asyncio.gather(self._task, return_exceptions=True)

    async def _run(self, fn: Callable[[], Any]) -> Any:
        async def job() -> Any:
            result = fn()
            return await result if asyncio.iscoroutine(result) else result

        future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        await self._jobs.put((job, future))
        return await future

    async def acquire(self, lock: Redlock, **kwargs: Any) -> bool:
        return bool(await self._run(lambda: lock.aacquire(**kwargs)))

    async def release(self, lock: Redlock) -> None:
        await self._run(lock.arelease)

    async def extend(self, lock: Redlock, ttl: float | None = None) -> bool:
        return bool(await self._run(lambda: lock.aextend(ttl)))

    async def locked(self, lock: Redlock) -> bool:
        return bool(await self._run(lock.alocked))

    async def enter(self, lock: Redlock) -> None:
        await self._run(lock.__aenter__)

    async def exit(self, lock: Redlock, exc: BaseException | None = None) -> None:
        await self._run(
            lambda: lock.__aexit__(
                None if exc is None else type(exc),
                exc,
                None if exc is None else exc.__traceback__,
            )
        )


def make_api(mode: str) -> SyncAPI:
    return SyncAPI() if mode == "sync" else AsyncAPI()
