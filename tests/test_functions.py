"""``locked``: functions and coroutines run under a Redlock, on five real nodes."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import math
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

import pytest
from django.core.exceptions import ImproperlyConfigured

from harness.held import held_on, lock_key, tokens
from redlock_django import (
    LockContentionError,
    LockLostError,
    QuorumUnavailableError,
    Redlock,
    current_lock,
    locked,
)
from redlock_django.functions import SKIPPED, FunctionLock
from redlock_django.meta import decode
from tests.test_mutex import WORKERS, run_workers

pytestmark = pytest.mark.usefixtures("redlock_settings")


def in_thread(func: Callable[[], Any]) -> Any:
    """Run ``func`` in another thread (another lock owner); return or raise."""
    outcome: dict[str, Any] = {}

    def target() -> None:
        try:
            outcome["result"] = func()
        except BaseException as exc:  # handed back to the caller
            outcome["error"] = exc

    thread = threading.Thread(target=target)
    thread.start()
    thread.join(30)
    assert not thread.is_alive()
    if "error" in outcome:
        raise outcome["error"]
    return outcome["result"]


def key_count(nodes: Any) -> int:
    return sum(node.client().dbsize() for node in nodes)


# Decoration time: mistakes in code are ImproperlyConfigured, before any call.


@pytest.mark.parametrize(
    ("template", "message"),
    [
        ("report:{user}", r"names no parameter of the function \(parameters: "),
        ("report:{user_id[0]}", "no indexing"),
        ("report:{0}", "no indexing, no positions"),
        ("report:{user_id!r}", "conversion or format spec"),
        ("report:{user_id:>4}", "conversion or format spec"),
        ("report:{user_id._secret}", "private attribute '_secret'"),
        ("report:{user_id", "expected '}'"),
        ("report {user_id}", "literal text contains ' '"),
        ("", "empty"),
        ("report:{args}", "names no parameter"),
        # (user_id="1-2", force="3") and ("1", "2-3") would name one resource.
        ("report:{user_id}-{force}", "separate placeholders with text holding ':'"),
        ("report:{user_id}{force}", "separate placeholders with text holding ':'"),
    ],
)
def test_a_bad_template_is_refused_at_decoration(template: str, message: str) -> None:
    def build_report(user_id: int, *args: Any, force: bool = False) -> None: ...

    with pytest.raises(ImproperlyConfigured, match=message):
        locked(template)(build_report)


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"on_contention": "retry"}, "on_contention must be one of 'wait', 'skip'"),
        ({"on_contention": "skip", "timeout": 1}, "timeout applies to"),
        ({"timeout": "soon"}, "timeout must be a number of seconds"),
        ({"timeout": float("nan")}, "timeout must be a number"),
        ({"ttl": 0}, "ttl must be a positive number"),
        ({"ttl": True}, "ttl must be a number of seconds"),
        ({"max_hold": -1}, "max_hold must be a positive number"),
        ({"nodes": "redis://x"}, "nodes must be a non-empty list"),
        ({"nodes": []}, "nodes must be a non-empty list"),
        ({"label": 7}, "label must be a string"),
    ],
)
def test_bad_options_are_refused_at_decoration(
    options: dict[str, Any], message: str
) -> None:
    def build_report(user_id: int) -> None: ...

    with pytest.raises(ImproperlyConfigured, match=message):
        locked("report:{user_id}", **options)(build_report)


def test_a_generator_function_is_refused() -> None:
    def rows(user_id: int) -> Any:
        yield user_id

    with pytest.raises(ImproperlyConfigured, match="generator"):
        locked("rows:{user_id}")(rows)


def test_a_context_manager_function_is_refused() -> None:
    """``@contextmanager`` returns the manager: its body, the work, would run in
    the caller's with-block after the release (it did, on 0 nodes)."""

    @contextlib.contextmanager
    def session(key: str) -> Iterator[None]:
        yield

    @contextlib.asynccontextmanager
    async def asession(key: str) -> AsyncIterator[None]:
        yield

    for manager in (session, asession):
        with pytest.raises(ImproperlyConfigured, match="context manager"):
            locked("session:{key}")(manager)


def test_a_wrapper_returning_a_context_manager_is_a_type_error_and_releases() -> None:
    """A plain wrapper returning a ``@contextmanager``'s manager is caught at the
    call, the lock released, before the body could run unlocked."""

    @contextlib.contextmanager
    def session() -> Iterator[None]:
        raise AssertionError("the body must never run")
        yield

    @locked("session:{key}")
    def open_session(key: str) -> Any:
        return session()

    with pytest.raises(TypeError, match="body would run after the lock is released"):
        open_session("k")
    again = Redlock("session:k")
    assert again.acquire(blocking=False)  # released
    again.release()


def test_a_resource_that_is_neither_template_nor_callable_is_refused() -> None:
    with pytest.raises(ImproperlyConfigured, match="template string or a callable"):
        locked(42)(lambda: None)  # type: ignore[arg-type]


# Call time: bad values are ValueError naming the placeholder; nothing is sent.


class Obj:
    def __init__(self, pk: Any) -> None:
        self.pk = pk

    def method(self) -> str:
        return "x"


@pytest.mark.parametrize(
    ("value", "message"),
    [
        (None, r"\{obj.pk\} has no value"),
        ("", r"\{obj.pk\} is empty"),
        ("x" * 65, r"\{obj.pk\} is 65 characters long; the limit is 64"),
        ("1:admin", r"\{obj.pk\} contains ':'"),
        ("a b", r"\{obj.pk\} contains ' '"),
        ("a*", r"\{obj.pk\} contains '\*'"),
    ],
)
def test_a_bad_value_raises_value_error_and_sends_nothing(
    nodes: Any, value: Any, message: str
) -> None:
    ran = []

    @locked("export:{obj.pk}")
    def export(obj: Obj) -> None:
        ran.append(obj)

    with pytest.raises(ValueError, match=message) as info:
        export(Obj(value))
    assert "'export:{obj.pk}' of tests.test_functions." in str(info.value)
    assert ran == []
    assert key_count(nodes) == 0


def test_an_unreadable_attribute_or_a_method_is_a_value_error(nodes: Any) -> None:
    @locked("export:{obj.pk}")
    def export(obj: Any) -> None: ...

    with pytest.raises(ValueError, match=r"\{obj.pk\} cannot be read"):
        export(object())

    @locked("export:{obj.method}")
    def export_method(obj: Any) -> None: ...

    with pytest.raises(ValueError, match=r"\{obj.method\} is a method, not a value"):
        export_method(Obj(1))
    assert key_count(nodes) == 0


def test_arguments_the_function_cannot_take_are_a_type_error(nodes: Any) -> None:
    @locked("report:{user_id}")
    def build_report(user_id: int) -> None: ...

    with pytest.raises(TypeError, match="build_report"):
        build_report(1, 2)  # type: ignore[call-arg]
    assert key_count(nodes) == 0


def test_a_callable_resource_gets_the_arguments_and_its_result_is_checked(
    nodes: Any,
) -> None:
    seen = []

    @locked(lambda user_id, **kw: f"report:{user_id}:{kw.get('kind', 'all')}")
    def build_report(user_id: int, kind: str = "all") -> str:
        seen.append(current_lock().resource)  # type: ignore[union-attr]
        return "done"

    assert build_report(3, kind="sales") == "done"
    assert seen == ["report:3:sales"]

    bad = locked(lambda user_id: f"report {user_id}")(lambda user_id: None)
    with pytest.raises(ValueError, match="contains ' '"):
        bad(3)
    wrong = locked(lambda user_id: user_id)(lambda user_id: None)
    with pytest.raises(TypeError, match="returned int, not str"):
        wrong(3)
    assert key_count(nodes) == 0


# The template over the parameters: positional, keyword, defaults, attributes.


def test_the_template_reads_positional_keyword_default_and_attribute_values(
    nodes: Any,
) -> None:
    seen: list[tuple[str, list[bytes | None]]] = []

    @locked("report:{user.pk}:{kind}:{year}")
    def build_report(user: Obj, kind: str, *, year: int = 2024) -> None:
        resource = current_lock().resource  # type: ignore[union-attr]
        seen.append((resource, tokens(nodes, resource)))

    build_report(Obj(7), "sales")
    build_report(Obj(7), kind="stock", year=2025)
    assert [resource for resource, _ in seen] == [
        "report:7:sales:2024",
        "report:7:stock:2025",
    ]
    # Held on every node while the body ran, gone after.
    for resource, held in seen:
        assert None not in held
        assert tokens(nodes, resource) == [None] * 5
    assert current_lock() is None


def test_the_label_defaults_to_module_and_qualname(nodes: Any) -> None:
    labels = []

    def read_label(resource: str) -> str:
        raw = nodes[0].client().hget(lock_key(resource), "meta")
        return decode(raw).label

    @locked("job:1")
    def job() -> None:
        labels.append(read_label("job:1"))

    @locked("job:2", label="nightly job")
    def labelled() -> None:
        labels.append(read_label("job:2"))

    job()
    labelled()
    assert labels == [
        "tests.test_functions.test_the_label_defaults_to_module_and_qualname."
        "<locals>.job",
        "nightly job",
    ]
    assert job.function_lock.label.endswith(".job")  # type: ignore[attr-defined]


def test_function_lock_skips_a_bound_self() -> None:
    def task(self: Any, user_id: int) -> None: ...

    guard = FunctionLock(task, "task:{user_id}", skip_params=1)
    assert guard.resource_for((5,), {}) == "task:5"
    assert guard.resource_for((), {"user_id": 6}) == "task:6"
    with pytest.raises(ImproperlyConfigured, match="names no parameter"):
        FunctionLock(task, "task:{self.id}", skip_params=1)
    lock = guard.lock_for((5,), {}, label="celery task 5")
    assert isinstance(lock, Redlock)
    assert (lock.resource, lock.label) == ("task:5", "celery task 5")


# Policies when another owner holds the lock.


def test_skip_does_not_run_returns_none_and_logs_at_info(
    hold: Any, caplog: pytest.LogCaptureFixture
) -> None:
    ran = []

    @locked("report:{user_id}", on_contention="skip")
    def build_report(user_id: int) -> str:
        ran.append(user_id)
        return "built"

    hold("report:7")
    caplog.set_level(logging.INFO, logger="redlock_django.functions")
    started = time.monotonic()
    assert in_thread(lambda: build_report(7)) is None
    assert time.monotonic() - started < 1.0
    assert ran == []
    [record] = [r for r in caplog.records if r.name == "redlock_django.functions"]
    assert record.levelno == logging.INFO
    assert record.msg == SKIPPED
    assert "'report:7' is held elsewhere" in record.getMessage()
    assert "build_report skipped" in record.getMessage()
    # Another resource is free: it runs.
    assert in_thread(lambda: build_report(8)) == "built"
    assert ran == [8]


def test_raise_raises_contention_at_once(hold: Any) -> None:
    ran = []

    @locked("report:{user_id}", on_contention="raise")
    def build_report(user_id: int) -> None:
        ran.append(user_id)

    hold("report:7")
    started = time.monotonic()
    with pytest.raises(LockContentionError) as info:
        in_thread(lambda: build_report(7))
    assert time.monotonic() - started < 1.0
    assert info.value.resource == "report:7"
    assert ran == []


def test_wait_waits_for_the_holder_then_runs() -> None:
    held = threading.Event()

    def hold_for_half_a_second() -> None:
        with Redlock("report:7"):
            held.set()
            time.sleep(0.5)

    holder = threading.Thread(target=hold_for_half_a_second)
    holder.start()
    assert held.wait(5)

    @locked("report:{user_id}", timeout=5)
    def build_report(user_id: int) -> float:
        return time.monotonic()

    started = time.monotonic()
    ran_at = build_report(7)
    holder.join()
    assert 0.3 < ran_at - started < 4.0


def test_wait_raises_contention_when_the_timeout_runs_out(hold: Any) -> None:
    @locked("report:{user_id}", timeout=0.5)
    def build_report(user_id: int) -> None: ...

    hold("report:7")
    started = time.monotonic()
    with pytest.raises(LockContentionError):
        in_thread(lambda: build_report(7))
    assert 0.45 < time.monotonic() - started < 3.0


def test_wait_defaults_to_the_wait_timeout_setting(
    hold: Any, redlock_settings: dict[str, Any], settings: Any
) -> None:
    settings.REDLOCK = {**redlock_settings, "WAIT_TIMEOUT": 0.3}

    @locked("report:{user_id}")
    def build_report(user_id: int) -> None: ...

    hold("report:7")
    started = time.monotonic()
    with pytest.raises(LockContentionError):
        in_thread(lambda: build_report(7))
    assert 0.25 < time.monotonic() - started < 2.0


@pytest.mark.parametrize("policy", ["wait", "skip", "raise"])
def test_quorum_unavailable_propagates_under_every_policy(
    nodes: Any, policy: str
) -> None:
    ran = []

    @locked("report:{user_id}", on_contention=policy)
    def build_report(user_id: int) -> None:
        ran.append(user_id)

    for node in nodes[:3]:
        node.pause()
    with pytest.raises(QuorumUnavailableError):
        build_report(7)
    assert ran == []


def test_an_exception_in_the_function_releases_the_lock(nodes: Any) -> None:
    @locked("report:{user_id}")
    def build_report(user_id: int) -> None:
        raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        build_report(7)
    assert tokens(nodes, "report:7") == [None] * 5
    assert current_lock() is None


def test_the_same_owner_re_enters_instead_of_waiting_for_itself() -> None:
    @locked("report:{user_id}", on_contention="raise")
    def build_report(user_id: int, depth: int = 0) -> int:
        if depth < 2:
            return build_report(user_id, depth + 1)
        return depth

    assert build_report(7) == 2


# Coroutines: the same policies through the asyncio API.


async def test_async_skip_raise_and_wait(
    nodes: Any, caplog: pytest.LogCaptureFixture
) -> None:
    ran = []

    async def body(user_id: int) -> str:
        ran.append(user_id)
        return "built"

    skip = locked("report:{user_id}", on_contention="skip")(body)
    fail = locked("report:{user_id}", on_contention="raise")(body)
    wait = locked("report:{user_id}", timeout=5)(body)

    holder = Redlock("report:7")
    assert await holder.aacquire()
    caplog.set_level(logging.INFO, logger="redlock_django.functions")
    assert await asyncio.create_task(skip(7)) is None
    assert "'report:7' is held elsewhere" in caplog.text
    with pytest.raises(LockContentionError):
        await asyncio.create_task(fail(7))
    assert ran == []

    waiting = asyncio.create_task(wait(7))
    await asyncio.sleep(0.3)
    assert not waiting.done()
    await holder.arelease()
    assert await asyncio.wait_for(waiting, 5) == "built"
    assert ran == [7]
    assert tokens(nodes, "report:7") == [None] * 5


async def test_async_bad_value_is_a_value_error_with_nothing_sent(nodes: Any) -> None:
    @locked("export:{obj.pk}", on_contention="skip")
    async def export(obj: Obj) -> None: ...

    with pytest.raises(ValueError, match=r"\{obj.pk\} contains ':'"):
        await export(Obj("1:admin"))
    assert key_count(nodes) == 0


async def test_async_current_lock_is_the_running_calls_lock() -> None:
    @locked("export:{obj.pk}")
    async def export(obj: Obj) -> tuple[str, bool, bool]:
        lock = current_lock()
        assert lock is not None
        return lock.resource, lock.owned(), lock.lost

    assert await export(Obj(3)) == ("export:3", True, False)
    assert current_lock() is None


# Mutual exclusion: a GET-then-SET counter stays exact only under the lock.


def increment(client: Any, name: str) -> None:
    """Add one to ``counter`` by GET then SET, 2 ms apart: a lost-update race."""
    value = int(client.get("counter") or 0)
    time.sleep(0.002)
    client.set("counter", value + 1)


def race(nodes: Any, step: Callable[[Any, str], None], iterations: int) -> int:
    """Run ``step`` ``iterations`` times in each of two threads started together;
    return the counter they left (and reset it)."""
    start = threading.Barrier(2)
    errors: list[BaseException] = []

    def loop(name: str) -> None:
        with nodes[0].client() as client:
            try:
                start.wait(10)
                for _ in range(iterations):
                    step(client, name)
            except BaseException as exc:
                errors.append(exc)

    threads = [threading.Thread(target=loop, args=(f"t{i}",)) for i in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert not errors, errors
    with nodes[0].client() as client:
        return int(client.getset("counter", 0) or 0)


def test_two_threads_lose_updates_without_the_lock_and_none_with_it(
    nodes: Any,
) -> None:
    """The negative control first: the same body without ``@locked`` loses counts."""
    iterations = 40
    unlocked = race(nodes, increment, iterations)
    print(f"threads without the lock: {unlocked}/{2 * iterations}")
    assert unlocked < 2 * iterations, unlocked

    locked_run = race(nodes, locked("counter:all", timeout=10)(increment), iterations)
    assert locked_run == 2 * iterations


def test_processes_lose_updates_without_the_lock_and_none_with_locked(
    nodes: Any,
) -> None:
    """4 processes x 50 increments, 1 ms between GET and SET (``tests/_workers.py``):
    plain calls lose updates, ``@locked`` functions and coroutines lose none."""
    iterations = 50
    expected = WORKERS * iterations
    unlocked = run_workers(nodes, mode="none", iterations=iterations, gap=0.001)
    print(f"processes without the lock: {unlocked.counter}/{expected}")
    assert unlocked.overlaps > 0
    assert unlocked.counter < expected

    for mode in ("locked", "alocked"):
        outcome = run_workers(nodes, mode=mode, iterations=iterations, gap=0.001)
        assert outcome.counter == expected, (mode, outcome.results)
        assert outcome.overlaps == 0
        assert outcome.handoffs >= 10, (mode, outcome.handoffs)


# Lease: extended while the function runs, capped by max_hold; a lost lease shows.


def contend(resource: str) -> bool:
    """Try ``resource`` once from another thread; True if it was free."""

    def attempt() -> bool:
        lock = Redlock(resource)
        if not lock.acquire(blocking=False):
            return False
        lock.release()
        return True

    return bool(in_thread(attempt))


def test_auto_extension_keeps_a_call_longer_than_the_ttl_held(nodes: Any) -> None:
    seen = []

    @locked("slow:{n}", ttl=0.5)
    def slow(n: int) -> None:
        time.sleep(1.2)
        seen.append(contend(f"slow:{n}"))
        seen.append(current_lock().lost)  # type: ignore[union-attr]

    slow(1)
    assert seen == [False, False]
    assert tokens(nodes, "slow:1") == [None] * 5


def test_without_auto_extension_the_lease_runs_out_under_a_long_call(
    nodes: Any,
) -> None:
    """The negative control: ``auto_extend=False`` and a call longer than the TTL
    lets another owner in, and the call ends with ``LockLostError``."""
    seen = []

    @locked("slow:{n}", ttl=0.5, auto_extend=False)
    def slow(n: int) -> None:
        time.sleep(1.2)
        seen.append(current_lock().lost)  # type: ignore[union-attr]
        seen.append(contend(f"slow:{n}"))

    with pytest.raises(LockLostError):
        slow(1)
    assert seen == [True, True]


def test_max_hold_caps_the_extension(nodes: Any) -> None:
    seen = []

    @locked("slow:{n}", ttl=0.5, max_hold=0.8)
    def slow(n: int) -> None:
        lock = current_lock()
        assert lock is not None
        deadline = time.monotonic() + 5
        while not lock.lost and time.monotonic() < deadline:
            time.sleep(0.02)
        seen.append(lock.lost)

    started = time.monotonic()
    with pytest.raises(LockLostError):
        slow(1)
    assert seen == [True]
    assert time.monotonic() - started < 2.5


def test_current_lock_lost_turns_true_when_a_majority_stalls(
    nodes: Any, caplog: pytest.LogCaptureFixture
) -> None:
    """3 of 5 nodes SIGSTOPped past the TTL: the watchdog cannot extend, the body
    sees ``current_lock().lost`` within the TTL and stops; the call raises
    ``LockLostError`` at release."""
    seen: dict[str, Any] = {}

    @locked("job:{n}", ttl=0.6)
    def job(n: int) -> None:
        lock = current_lock()
        assert lock is not None and not lock.lost
        paused = time.monotonic()
        for node in nodes[:3]:
            node.pause()
        try:
            while not lock.lost and time.monotonic() - paused < 5:
                time.sleep(0.01)
            seen["lost_after"] = time.monotonic() - paused
            seen["lost"] = lock.lost
        finally:
            for node in nodes[:3]:
                node.resume()

    with pytest.raises(LockLostError):
        job(1)
    assert seen["lost"] is True
    assert seen["lost_after"] < 0.6 + 0.3, seen


@pytest.mark.django_db(transaction=True)
def test_with_fencing_the_next_write_after_a_lost_lease_raises(nodes: Any) -> None:
    """The lease is lost (majority stalled past the TTL) and another call takes
    the lock and writes: the first call's next fenced write raises, and its
    exception, not the loss, is what the caller sees."""
    from redlock_django import StaleFencingTokenError, fenced_update
    from tests.models import FencedItem

    item = FencedItem.objects.create(name="stock", stock=10)
    order = []

    @locked("item:{item_id}", ttl=0.6, fencing=True)
    def sell(item_id: int, stall: bool) -> None:
        lock = current_lock()
        assert lock is not None
        row = FencedItem.objects.get(pk=item_id)
        if stall:
            for node in nodes[:3]:
                node.pause()
            try:
                while not lock.lost:
                    time.sleep(0.01)
            finally:
                for node in nodes[:3]:
                    node.resume()
            in_thread(lambda: sell(item_id, stall=False))
        fenced_update(row, lock, stock=row.stock - 1, raise_on_stale=True)
        order.append("stalled" if stall else "fresh")

    with pytest.raises(StaleFencingTokenError):
        sell(item.pk, stall=True)
    assert order == ["fresh"]
    item.refresh_from_db()
    assert item.stock == 9


def _traced(func: Any) -> Any:
    """A common hand-written decorator: a sync wrapper returning what func returns."""

    @functools.wraps(func)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        return func(*args, **kwargs)

    return wrapper


class _Exporter:
    """A callable object whose ``__call__`` is a coroutine function."""

    def __init__(self, nodes: Any, seen: list[int]) -> None:
        self.nodes, self.seen = nodes, seen

    async def __call__(self, key: str) -> None:
        self.seen.append(held_on(self.nodes, f"export:{key}"))


def test_an_object_with_an_async_call_is_locked_while_its_body_runs(nodes: Any) -> None:
    """An object whose ``__call__`` is ``async def`` gets the async driver: its
    body runs under the lock (it took the lock, made the coroutine and released,
    and the body ran on a free lock)."""
    seen: list[int] = []
    export = locked("export:{key}")(_Exporter(nodes, seen))
    asyncio.run(export("k"))
    assert seen == [5]
    assert held_on(nodes, "export:k") == 0


def test_a_sync_callable_returning_a_coroutine_is_refused_and_never_runs(
    nodes: Any,
) -> None:
    """A sync wrapper around an ``async def`` returns the coroutine after the call:
    its body would run after the release. It is closed unrun and the call raises
    TypeError (it ran unlocked), with the lock released."""
    seen: list[int] = []

    async def export(key: str) -> None:
        seen.append(held_on(nodes, f"export:{key}"))

    wrapped = locked("export:{key}")(_traced(export))
    with pytest.raises(TypeError, match="would run after the lock is released"):
        wrapped("k")
    assert seen == [] and held_on(nodes, "export:k") == 0


def test_current_lock_stays_lost_after_a_reentrant_call_replaced_its_hold(
    nodes: Any,
) -> None:
    """The outer call's lease ran out; the body calls the locked function again,
    which re-acquires afresh and releases. The outer body's ``current_lock().lost``
    stays True (it read False again), and the call ends with LockLostError."""
    seen: dict[str, Any] = {}

    @locked("job:{n}", ttl=0.3, auto_extend=False)
    def job(n: int, depth: int = 0) -> str:
        if depth:
            return "inner"
        lock = current_lock()
        assert lock is not None
        time.sleep(0.5)  # the lease runs out
        seen["before"] = lock.lost
        job(n, depth=1)
        seen["after"] = lock.lost
        return "outer"

    with pytest.raises(LockLostError):
        job(1)
    assert seen == {"before": True, "after": True}


def test_locked_takes_max_hold_inf_as_redlock_does() -> None:
    """``math.inf``: no cap, whatever ``MAX_HOLD`` says (it was refused)."""

    def job() -> None: ...

    guarded = locked("job", max_hold=math.inf)(job)
    assert guarded.function_lock.max_hold == math.inf  # type: ignore[attr-defined]
