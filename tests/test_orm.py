"""Row locks (``model_lock``) and fenced writes (``fenced_update``) on real nodes.

The pause scenario (Kleppmann) is run with real locks: holder A takes the row's
lock, its lease runs out while it is "paused", holder B takes the lock with a
newer token and writes; then A resumes and writes what it computed before the
pause. The fenced write is refused and B's data stays; the negative control does
the same with a plain ``update()`` and shows A overwriting B. In the other order
(B has read but not written when A resumes) the write is a compare-and-set on the
token read with the row: A's lands, B's is refused; fenced by the token only, both
land and the last unit sells twice. Two owners are two
threads (or two tasks), each with its own database connection, so those tests use
transactional databases. Run with ``DATABASE_URL=postgres://...`` too: the
concurrent-transaction test needs PostgreSQL's row locks.
"""

from __future__ import annotations

import asyncio
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import pytest
from asgiref.sync import sync_to_async
from django.core.exceptions import FieldError
from django.db import connection, connections, models, transaction
from django.db.migrations.writer import MigrationWriter
from django.db.models import F
from django.test import override_settings
from django.test.utils import isolate_apps

from redlock_django import LockError, LockLostError, Redlock
from redlock_django.checks import E101, E102
from redlock_django.exceptions import MissingFencingTokenError, StaleFencingTokenError
from redlock_django.orm import (
    MAX_PK_LENGTH,
    FencingTokenField,
    afenced_update,
    fenced_update,
    model_lock,
    model_resource,
)
from tests.models import (
    CodedItem,
    Counter,
    FencedItem,
    FencedItemProxy,
    FencedListing,
    SpecialItem,
    TwoFenceItem,
    UUIDItem,
    VersionedItem,
)

#: The lease of a holder that gets "paused" past it.
PAUSE_TTL = 0.3
#: How long that holder stays paused: past its lease, with room for the keys to go.
PAUSE = PAUSE_TTL + 0.1

pytestmark = pytest.mark.usefixtures("redlock_settings")


class Owner:
    """Another thread: the locks it takes belong to it, and it has its own
    database connection (closed when the owner is)."""

    def __init__(self) -> None:
        self._thread = ThreadPoolExecutor(max_workers=1)

    def submit(self, fn: Callable[..., Any], *args: Any) -> Future[Any]:
        return self._thread.submit(fn, *args)

    def run(self, fn: Callable[..., Any], *args: Any) -> Any:
        return self.submit(fn, *args).result(timeout=10)

    def close(self) -> None:
        self._thread.submit(connections.close_all).result(timeout=10)
        self._thread.shutdown(wait=True)


@pytest.fixture
def other() -> Iterator[Owner]:
    owner = Owner()
    try:
        yield owner
    finally:
        owner.close()


@pytest.fixture
async def async_db() -> AsyncIterator[None]:
    """Close the connection the async ORM opened in asgiref's worker thread."""
    yield
    await sync_to_async(connections.close_all)()


# Resource names: no Redis, no database.


def test_model_resource_is_app_label_model_name_and_pk() -> None:
    """An instance and its class with its pk name the same row resource."""
    assert model_resource(FencedItem(pk=42)) == "tests.fenceditem:42"
    assert model_resource(FencedItem, 42) == "tests.fenceditem:42"
    assert model_resource(FencedItem, 43) != model_resource(FencedItem, 42)
    assert model_resource(Counter, 42) == "tests.counter:42"


def test_model_resource_normalises_the_pk_as_the_database_compares_it() -> None:
    """``42`` and ``"42"`` are one row of an integer key; a UUID in any spelling
    is one row; a string key is taken as is."""
    assert model_resource(FencedItem, "42") == model_resource(FencedItem, 42)
    key = uuid.UUID("0f2e0c5e-3b7a-4c1d-9a47-21c3d5e6f7a8")
    expected = f"tests.uuiditem:{key}"
    assert model_resource(UUIDItem, key) == expected
    assert model_resource(UUIDItem, str(key).upper()) == expected
    assert model_resource(UUIDItem, key.hex) == expected
    assert model_resource(UUIDItem(pk=key)) == expected
    assert model_resource(CodedItem, "sku:a/b") == "tests.codeditem:sku:a/b"
    assert model_resource(CodedItem, 42) == "tests.codeditem:42"


def test_proxy_and_multi_table_child_lock_their_base_row() -> None:
    """Every class over one table row gives that row's resource, so they exclude
    each other."""
    assert model_resource(FencedItemProxy(pk=7)) == "tests.fenceditem:7"
    assert model_resource(SpecialItem, 7) == "tests.fenceditem:7"
    assert model_resource(SpecialItem(pk=7)) == "tests.fenceditem:7"


@pytest.mark.parametrize(
    ("model", "pk", "error"),
    [
        (FencedItem, True, ValueError),
        (FencedItem, 4.5, ValueError),
        (FencedItem, 4.0, ValueError),
        (FencedItem, "4.5", ValueError),
        (FencedItem, "42; DROP", ValueError),
        (FencedItem, "*", ValueError),
        (UUIDItem, "not-a-uuid", ValueError),
        (CodedItem, "", ValueError),
        (CodedItem, "a\nb", ValueError),
        (CodedItem, "a\x00b", ValueError),
        (CodedItem, "a\x85b", ValueError),
        (CodedItem, "a\u2028b", ValueError),
        (CodedItem, "a\ud800b", ValueError),
        (CodedItem, "x" * (MAX_PK_LENGTH + 1), ValueError),
        (FencedItem, None, TypeError),
    ],
)
def test_model_resource_rejects_bad_pks(
    model: type[models.Model], pk: object, error: type[Exception]
) -> None:
    """Keys that are not the field's, empty, with control characters or too long
    never become a resource."""
    with pytest.raises(error):
        model_resource(model, pk)


def test_model_resource_accepts_the_longest_allowed_pk() -> None:
    """The length cap is exactly ``MAX_PK_LENGTH`` (control for the rejection)."""
    pk = "x" * MAX_PK_LENGTH
    assert model_resource(CodedItem, pk) == f"tests.codeditem:{pk}"


def test_model_resource_rejects_unsaved_instances_and_bad_arguments() -> None:
    """An unsaved row has no name; pk goes with a class, not an instance."""
    with pytest.raises(ValueError, match="unsaved"):
        model_resource(FencedItem())
    with pytest.raises(TypeError, match="only with a model class"):
        model_resource(FencedItem(pk=1), 2)
    with pytest.raises(TypeError, match="model instance or a model class"):
        model_resource("tests.fenceditem", 1)  # type: ignore[arg-type]


def test_model_lock_is_a_redlock_on_the_row_with_its_options() -> None:
    """model_lock passes Redlock's options through."""
    lock = model_lock(FencedItem(pk=3), fencing=True, ttl=5.0, label="restock")
    assert isinstance(lock, Redlock)
    assert lock.resource == "tests.fenceditem:3"
    assert (lock.fencing, lock.ttl, lock.label) == (True, 5.0, "restock")


# Row locks exclude other owners.


def test_model_lock_excludes_another_thread_from_the_same_row(other: Owner) -> None:
    """While this thread holds row 5, another cannot take it by instance or by
    class and pk; row 6 stays free."""
    with model_lock(FencedItem(pk=5)):
        assert not other.run(lambda: model_lock(FencedItem, 5).acquire(blocking=False))
        assert not other.run(
            lambda: model_lock(FencedItemProxy, "5").acquire(blocking=False)
        )
        six = model_lock(FencedItem, 6)
        assert other.run(lambda: six.acquire(blocking=False))
        other.run(six.release)
    five = model_lock(FencedItem, 5)
    assert other.run(lambda: five.acquire(blocking=False))
    other.run(five.release)


async def test_model_lock_excludes_another_task_from_the_same_row() -> None:
    """``async with model_lock(...)`` holds the row against other tasks."""
    entered = asyncio.Event()
    done = asyncio.Event()

    async def holder() -> None:
        async with model_lock(FencedItem(pk=5)):
            entered.set()
            await done.wait()

    task = asyncio.create_task(holder())
    await entered.wait()
    try:
        assert not await model_lock(FencedItem, 5).aacquire(blocking=False)
        six = model_lock(FencedItem, 6)
        assert await six.aacquire(blocking=False)
        await six.arelease()
    finally:
        done.set()
        await task
    five = model_lock(FencedItem, 5)
    assert await five.aacquire(blocking=False)
    await five.arelease()


# Fenced writes, one owner.


@pytest.mark.django_db
def test_fenced_update_writes_and_stores_the_token() -> None:
    """A held fencing lock writes the row and its token in one UPDATE; the
    instance shows both."""
    item = FencedItem.objects.create(name="a", stock=10)
    with model_lock(item, fencing=True) as lock:
        token = lock.fencing_token
        assert token is not None and token >= 1
        assert fenced_update(item, lock, stock=9, name="b") is True
    assert (item.stock, item.name, item.fence) == (9, "b", token)
    stored = FencedItem.objects.get(pk=item.pk)
    assert (stored.stock, stored.name, stored.fence) == (9, "b", token)


@pytest.mark.django_db
def test_fenced_update_applies_each_newer_token() -> None:
    """Successive holders each get a newer token and each write."""
    item = FencedItem.objects.create(name="a", stock=10)
    tokens = []
    for stock in (9, 8, 7):
        with model_lock(FencedItem, item.pk, fencing=True) as lock:
            assert fenced_update(item, lock, stock=stock)
            tokens.append(lock.fencing_token)
    assert tokens == sorted(set(tokens))
    assert FencedItem.objects.values_list("stock", "fence").get(pk=item.pk) == (
        7,
        tokens[-1],
    )


@pytest.mark.django_db
def test_fenced_update_refuses_a_second_write_with_the_same_token() -> None:
    """A token writes a row once: the same write replayed is refused, and with
    ``raise_on_stale`` says so with both tokens."""
    item = FencedItem.objects.create(name="a", stock=10)
    with model_lock(item, fencing=True) as lock:
        assert fenced_update(item, lock, stock=9)
        assert fenced_update(item, lock, stock=8) is False
        with pytest.raises(StaleFencingTokenError) as caught:
            fenced_update(item, lock, stock=8, raise_on_stale=True)
    assert isinstance(caught.value, LockError)
    assert caught.value.resource == f"tests.fenceditem:{item.pk}"
    assert caught.value.token == caught.value.stored_token == item.fence
    assert "refused" in str(caught.value)
    assert FencedItem.objects.get(pk=item.pk).stock == 9
    assert item.stock == 9


@pytest.mark.django_db
def test_fenced_update_applies_f_expressions_in_the_database() -> None:
    """``F()`` updates run in the UPDATE; the instance reloads them on access."""
    item = FencedItem.objects.create(name="a", stock=10)
    with model_lock(item, fencing=True) as lock:
        assert fenced_update(item, lock, stock=F("stock") - 4)
        assert "stock" not in item.__dict__  # deferred: computed by the database
        assert item.stock == 6
        assert not fenced_update(item, lock, stock=F("stock") - 4)
    assert FencedItem.objects.get(pk=item.pk).stock == 6


@pytest.mark.django_db
def test_queryset_fenced_update_writes_only_rows_with_older_tokens() -> None:
    """A queryset write counts the rows written; a row already fenced by a newer
    token is left alone."""
    a = FencedItem.objects.create(name="a", stock=1)
    b = FencedItem.objects.create(name="b", stock=1)
    newer = FencedItem.objects.create(name="c", stock=1)
    FencedItem.objects.filter(pk=newer.pk).update(fence=1000)
    with Redlock("warehouse", fencing=True) as lock:
        token = lock.fencing_token
        assert FencedItem.objects.all().fenced_update(lock, stock=F("stock") + 5) == 2
        assert fenced_update(FencedItem.objects.all(), lock, stock=0) == 0
        with pytest.raises(TypeError, match="single row"):
            fenced_update(FencedItem.objects.all(), lock, raise_on_stale=True)
    rows = dict(FencedItem.objects.values_list("pk", "stock"))
    assert rows == {a.pk: 6, b.pk: 6, newer.pk: 1}
    assert FencedItem.objects.get(pk=a.pk).fence == token
    assert FencedItem.objects.get(pk=newer.pk).fence == 1000


@pytest.mark.django_db
def test_fenced_update_finds_the_token_field_or_is_told_which() -> None:
    """The model's one FencingTokenField is found; with two, ``field=`` picks one
    and the other is untouched; no field, a non-integer field or writing the
    token by hand is a FieldError."""
    row = TwoFenceItem.objects.create()
    with Redlock("pricing", fencing=True) as lock:
        with pytest.raises(FieldError, match="price_fence, stock_fence"):
            fenced_update(row, lock, price=5)
        assert fenced_update(row, lock, field="price_fence", price=5)
        token = lock.fencing_token
    stored = TwoFenceItem.objects.get(pk=row.pk)
    assert (stored.price, stored.price_fence, stored.stock_fence) == (5, token, 0)

    counter = Counter.objects.create(name="c")
    item = FencedItem.objects.create(name="a")
    with Redlock("other", fencing=True) as lock:
        with pytest.raises(FieldError, match="has no FencingTokenField"):
            fenced_update(counter, lock, value=1)
        with pytest.raises(FieldError, match="cannot hold fencing tokens"):
            fenced_update(item, lock, field="name", stock=1)
        with pytest.raises(FieldError, match="written by fenced_update itself"):
            fenced_update(item, lock, stock=1, fence=10**9)
    assert FencedItem.objects.get(pk=item.pk).fence == 0


@pytest.mark.django_db
def test_a_nullable_field_named_as_the_token_field_is_a_field_error() -> None:
    """A NULL token is never older than the lock's, so ``field=`` naming a
    nullable integer column is refused as the field it is (as the system check
    refuses ``FencingTokenField(null=True)``), not reported as a missing row or
    as 0 rows written, and nothing is written."""
    row = VersionedItem.objects.create(stock=3)
    with Redlock("versioned", fencing=True) as lock:
        for target in (row, VersionedItem.objects.all()):
            with pytest.raises(FieldError, match=r"version cannot hold .*null=True"):
                fenced_update(target, lock, field="version", stock=2)
    stored = VersionedItem.objects.get(pk=row.pk)
    assert (stored.stock, stored.version) == (3, None)


@pytest.mark.django_db
def test_fenced_update_of_a_missing_row_raises_does_not_exist() -> None:
    """A deleted row is not "refused": it raises the model's DoesNotExist; an
    unsaved one is a ValueError."""
    item = FencedItem.objects.create(name="a")
    FencedItem.objects.filter(pk=item.pk).delete()
    with model_lock(item, fencing=True) as lock:
        with pytest.raises(FencedItem.DoesNotExist):
            fenced_update(item, lock, stock=1)
        with pytest.raises(ValueError, match="unsaved"):
            fenced_update(FencedItem(), lock, stock=1)


# Fencing asked of a lock without a token.


@pytest.mark.django_db(transaction=True)
def test_fenced_update_without_a_token_raises_a_clear_error(other: Owner) -> None:
    """No fencing=True, not acquired, held by another thread, or released: each
    raises MissingFencingTokenError naming the resource, and writes nothing."""
    item = FencedItem.objects.create(name="a", stock=10)
    resource = f"tests.fenceditem:{item.pk}"

    plain = model_lock(item)
    with plain, pytest.raises(MissingFencingTokenError, match="fencing=True") as caught:
        fenced_update(item, plain, stock=1)
    assert caught.value.resource == resource
    assert resource in str(caught.value)
    assert isinstance(caught.value, ValueError)
    assert not isinstance(caught.value, LockError)

    fenced = model_lock(item, fencing=True)
    with pytest.raises(MissingFencingTokenError, match="not held"):
        fenced_update(item, fenced, stock=1)
    assert other.run(fenced.acquire)
    with pytest.raises(MissingFencingTokenError, match="not held"):
        fenced_update(item, fenced, stock=1)
    other.run(fenced.release)
    with fenced:
        pass
    with pytest.raises(MissingFencingTokenError, match="not held"):
        fenced_update(FencedItem.objects.all(), fenced, stock=1)
    with pytest.raises(TypeError, match="expected a Redlock"):
        fenced_update(item, "lock", stock=1)  # type: ignore[call-overload]

    assert FencedItem.objects.values_list("stock", "fence").get(pk=item.pk) == (10, 0)


async def test_afenced_update_reads_the_token_of_the_calling_task() -> None:
    """A lock held by one task has no token in another."""
    lock = model_lock(FencedItem, 1, fencing=True)
    assert await lock.aacquire()
    try:

        async def elsewhere() -> None:
            await afenced_update(FencedItem(pk=1), lock, stock=1)

        with pytest.raises(MissingFencingTokenError, match="not held"):
            await asyncio.create_task(elsewhere())
    finally:
        await lock.arelease()


# The pause scenario: real locks, a lease running out, a newer holder.


def _b_sells_three(pk: int) -> int:
    """Holder B: take the row's lock, sell three, return its token."""
    with model_lock(FencedItem, pk, fencing=True) as lock_b:
        row = FencedItem.objects.get(pk=pk)
        assert fenced_update(row, lock_b, stock=row.stock - 3)
        token = lock_b.fencing_token
        assert token is not None
        return token


def _pause_scenario(
    other: Owner, a_writes: Callable[[FencedItem, Redlock, int], object]
) -> tuple[object, int, int, FencedItem]:
    """A reads stock 10 and pauses past its lease; B sells 3; A writes 10 - 1."""
    item = FencedItem.objects.create(name="widget", stock=10)
    lock_a = model_lock(item, fencing=True, ttl=PAUSE_TTL)
    assert lock_a.acquire()
    token_a = lock_a.fencing_token
    assert token_a is not None
    seen = FencedItem.objects.get(pk=item.pk).stock
    assert lock_a.validity > 0  # A checked it held the lock, then...
    time.sleep(PAUSE)  # ...paused (GC, swap): its lease ran out.
    assert lock_a.lost
    token_b = other.run(_b_sells_three, item.pk)
    assert token_b > token_a
    outcome = a_writes(item, lock_a, seen - 1)
    with pytest.raises(LockLostError):
        lock_a.release()
    item.refresh_from_db()
    return outcome, token_a, token_b, item


@pytest.mark.django_db(transaction=True)
def test_stale_holders_fenced_write_is_refused_and_the_newer_write_stays(
    other: Owner,
) -> None:
    """A's write after its lease ran out and B wrote is refused: the row keeps
    B's stock and token."""
    written, _, token_b, item = _pause_scenario(
        other, lambda item, lock, stock: fenced_update(item, lock, stock=stock)
    )
    assert written is False
    assert (item.stock, item.fence) == (7, token_b)


@pytest.mark.django_db(transaction=True)
def test_stale_holder_raise_on_stale_reports_both_tokens(other: Owner) -> None:
    """With raise_on_stale, the refusal is a StaleFencingTokenError carrying A's
    token and the newer one stored by B."""
    outcome, token_a, token_b, item = _pause_scenario(
        other,
        lambda item, lock, stock: _caught(
            lambda: fenced_update(item, lock, stock=stock, raise_on_stale=True)
        ),
    )
    assert isinstance(outcome, StaleFencingTokenError)
    assert (outcome.token, outcome.stored_token) == (token_a, token_b)
    assert (item.stock, item.fence) == (7, token_b)


@pytest.mark.django_db(transaction=True)
def test_negative_control_stale_holders_plain_update_overwrites_the_newer_write(
    other: Owner,
) -> None:
    """Without fencing the same sequence loses B's sale: the stale holder wins."""
    _, _, token_b, item = _pause_scenario(
        other,
        lambda item, lock, stock: FencedItem.objects.filter(pk=item.pk).update(
            stock=stock
        ),
    )
    assert item.stock == 9  # B's sale of three is gone
    assert item.fence == token_b


def _caught(fn: Callable[[], object]) -> object:
    try:
        return fn()
    except Exception as exc:
        return exc


@pytest.mark.django_db(transaction=True)
async def test_stale_tasks_afenced_update_is_refused(async_db: None) -> None:
    """The pause scenario between two tasks, with ``async with`` and
    ``afenced_update``; the negative control's plain ``aupdate`` overwrites."""
    item = await FencedItem.objects.acreate(name="widget", stock=10)
    lock_a = model_lock(item, fencing=True, ttl=PAUSE_TTL)

    async def holder_b() -> int:
        async with model_lock(FencedItem, item.pk, fencing=True) as lock_b:
            row = await FencedItem.objects.aget(pk=item.pk)
            assert await afenced_update(row, lock_b, stock=F("stock") - 3)
            token = lock_b.fencing_token
            assert token is not None
            return token

    assert await lock_a.aacquire()
    token_a = lock_a.fencing_token
    assert token_a is not None
    await asyncio.sleep(PAUSE)
    token_b = await asyncio.create_task(holder_b())
    assert token_b > token_a
    assert await afenced_update(item, lock_a, stock=9) is False
    with pytest.raises(StaleFencingTokenError):
        await afenced_update(item, lock_a, stock=9, raise_on_stale=True)
    qs = FencedItem.objects.filter(pk=item.pk)
    assert await qs.afenced_update(lock_a, stock=9) == 0
    assert await qs.values_list("stock", "fence").aget() == (7, token_b)
    # Negative control: the unfenced write of the same stale holder lands.
    assert await qs.aupdate(stock=9) == 1
    assert await qs.values_list("stock", flat=True).aget() == 9
    with pytest.raises(LockLostError):
        await lock_a.arelease()


@pytest.mark.django_db(transaction=True)
async def test_afenced_update_writes_with_a_held_token(async_db: None) -> None:
    """The async twin writes the row and the token, as the blocking one does."""
    item = await FencedItem.objects.acreate(name="a", stock=10)
    async with model_lock(item, fencing=True) as lock:
        assert await afenced_update(item, lock, stock=F("stock") - 1) is True
        token = lock.fencing_token
        qs = FencedItem.objects.filter(pk=item.pk)
        assert await qs.afenced_update(lock, stock=0) == 0
    row = await FencedItem.objects.aget(pk=item.pk)
    assert (row.stock, row.fence) == (9, token)
    assert item.fence == token


# The pause between read and write: the write is compared with what was read.


@pytest.mark.django_db
def test_fenced_update_refuses_an_instance_read_before_the_row_was_written() -> None:
    """An instance whose row was written since it was read is refused, even under
    a newer token: its values are stale. Reloaded, the same write lands."""
    item = FencedItem.objects.create(name="widget", stock=1)
    read_early = FencedItem.objects.get(pk=item.pk)
    with model_lock(item, fencing=True) as lock:
        assert fenced_update(item, lock, stock=item.stock - 1)
        token_1 = lock.fencing_token
    with model_lock(item, fencing=True) as lock:
        assert fenced_update(read_early, lock, stock=read_early.stock - 1) is False
        with pytest.raises(StaleFencingTokenError) as caught:
            fenced_update(read_early, lock, stock=0, raise_on_stale=True)
        assert FencedItem.objects.get(pk=item.pk).stock == 0
        read_early.refresh_from_db()
        assert fenced_update(read_early, lock, stock=read_early.stock + 5)
        token_2 = lock.fencing_token
    assert token_2 is not None and token_1 is not None and token_2 > token_1
    error = caught.value
    assert (error.token, error.stored_token, error.read_token) == (token_2, token_1, 0)
    assert "read" in str(error) and str(token_1) in str(error)
    assert FencedItem.objects.values_list("stock", "fence").get(pk=item.pk) == (
        5,
        token_2,
    )


@pytest.mark.django_db
def test_fenced_update_of_an_instance_without_its_fence_loaded_is_an_error() -> None:
    """With the token field deferred there is no read to compare with: a
    FieldError, not a write and not a fresh read of the token."""
    item = FencedItem.objects.create(name="widget", stock=1)
    partial = FencedItem.objects.only("stock").get(pk=item.pk)
    lock = model_lock(item, fencing=True)
    with lock, pytest.raises(FieldError, match="fence was not loaded"):
        fenced_update(partial, lock, stock=0)
    assert "fence" not in partial.__dict__
    assert FencedItem.objects.values_list("stock", "fence").get(pk=item.pk) == (1, 0)


def _sell_one(row: FencedItem, lock: Redlock) -> object:
    """The instance write: ``stock - 1`` of the read, compared with the read fence."""
    return _caught(
        lambda: fenced_update(row, lock, stock=row.stock - 1, raise_on_stale=True)
    )


def _sell_one_where_fence_is_as_read(row: FencedItem, lock: Redlock) -> object:
    """The queryset write with the comparison made by hand: ``filter(fence=...)``."""
    rows = FencedItem.objects.filter(pk=row.pk, fence=row.fence)
    return fenced_update(rows, lock, stock=row.stock - 1) == 1


def _sell_one_by_token_only(row: FencedItem, lock: Redlock) -> object:
    """The negative control: fenced by the token only, as the write was before."""
    rows = FencedItem.objects.filter(pk=row.pk)
    return fenced_update(rows, lock, stock=row.stock - 1) == 1


@pytest.mark.parametrize(
    ("write", "sales"),
    [
        (_sell_one, 1),
        (_sell_one_where_fence_is_as_read, 1),
        (_sell_one_by_token_only, 2),
    ],
    ids=["instance", "queryset-filtered-on-the-read-fence", "negative-control"],
)
@pytest.mark.django_db(transaction=True)
def test_a_paused_holder_and_its_successor_cannot_both_sell_the_last_unit(
    other: Owner, write: Callable[[FencedItem, Redlock], object], sales: int
) -> None:
    """A reads the last unit and pauses past its lease; B takes the lock, reads
    the last unit and is still paying when A resumes and writes; then B writes.

    A's write lands (nothing was written since A read), B's is refused: the row
    changed after B read it. The control, fenced by the token only, lets both
    land: two sales of one unit.
    """
    item = FencedItem.objects.create(name="widget", stock=1)
    lock_a = model_lock(item, fencing=True, ttl=PAUSE_TTL)
    assert lock_a.acquire()
    token_a = lock_a.fencing_token
    row_a = FencedItem.objects.get(pk=item.pk)
    time.sleep(PAUSE)  # A pauses (GC, swap): its lease runs out.
    assert lock_a.lost
    b_read, a_wrote = threading.Event(), threading.Event()

    def holder_b() -> tuple[object, int | None]:
        with model_lock(FencedItem, item.pk, fencing=True) as lock_b:
            row_b = FencedItem.objects.get(pk=item.pk)
            b_read.set()
            assert a_wrote.wait(5)  # B's payment, during which A resumes
            return write(row_b, lock_b), lock_b.fencing_token

    b_sells = other.submit(holder_b)
    assert b_read.wait(5)
    a_outcome = write(row_a, lock_a)
    a_wrote.set()
    b_outcome, token_b = b_sells.result(timeout=10)
    with pytest.raises(LockLostError):
        lock_a.release()
    landed = [outcome is True for outcome in (a_outcome, b_outcome)]
    assert landed == ([True, True] if sales == 2 else [True, False])
    stock, fence = FencedItem.objects.values_list("stock", "fence").get(pk=item.pk)
    assert stock == 0
    if sales == 2:
        assert fence == token_b  # B's write landed on top of A's
        return
    assert fence == token_a
    if write is _sell_one:
        assert isinstance(b_outcome, StaleFencingTokenError)
        assert b_outcome.token == token_b
        assert b_outcome.stored_token == token_a == fence
        assert b_outcome.read_token == 0


@pytest.mark.parametrize("control", [False, True], ids=["instance", "negative-control"])
@pytest.mark.django_db(transaction=True)
async def test_a_paused_task_and_its_successor_cannot_both_sell_the_last_unit(
    async_db: None, control: bool
) -> None:
    """The same interleaving between two tasks with ``afenced_update``: A's write
    lands, B's is refused; fenced by the token only, both land."""
    item = await FencedItem.objects.acreate(name="widget", stock=1)
    b_read, a_wrote = asyncio.Event(), asyncio.Event()

    async def sell_one(row: FencedItem, lock: Redlock) -> bool:
        if control:
            rows = FencedItem.objects.filter(pk=row.pk)
            return await afenced_update(rows, lock, stock=row.stock - 1) == 1
        return await afenced_update(row, lock, stock=row.stock - 1)

    async def holder_b() -> tuple[bool, int | None]:
        async with model_lock(FencedItem, item.pk, fencing=True) as lock_b:
            row_b = await FencedItem.objects.aget(pk=item.pk)
            b_read.set()
            await asyncio.wait_for(a_wrote.wait(), 5)
            return await sell_one(row_b, lock_b), lock_b.fencing_token

    lock_a = model_lock(item, fencing=True, ttl=PAUSE_TTL)
    assert await lock_a.aacquire()
    row_a = await FencedItem.objects.aget(pk=item.pk)
    await asyncio.sleep(PAUSE)
    assert lock_a.lost
    b_sells = asyncio.create_task(holder_b())
    await asyncio.wait_for(b_read.wait(), 5)
    a_outcome = await sell_one(row_a, lock_a)
    a_wrote.set()
    b_outcome, token_b = await b_sells
    with pytest.raises(LockLostError):
        await lock_a.arelease()
    assert (a_outcome, b_outcome) == ((True, True) if control else (True, False))
    qs = FencedItem.objects.filter(pk=item.pk)
    stock, fence = await qs.values_list("stock", "fence").aget()
    assert stock == 0
    assert (fence == token_b) is control


# The refusal happens in the UPDATE itself, not in a read before it.


def _fenced_update(item: FencedItem, lock: Redlock, stock: int) -> bool:
    return fenced_update(item, lock, stock=stock)


def _fenced_queryset_update(item: FencedItem, lock: Redlock, stock: int) -> bool:
    """The queryset form, compared with the token read: ``filter(fence=seen)``."""
    rows = type(item).objects.filter(pk=item.pk, fence=item.fence)
    return bool(fenced_update(rows, lock, stock=stock))


def _naive_fenced_update(item: FencedItem, lock: Redlock, stock: int) -> bool:
    """Read the token, compare in Python, then write: the race fencing must avoid."""
    stored = FencedItem.objects.values_list("fence", flat=True).get(pk=item.pk)
    token = lock.fencing_token
    assert token is not None
    if stored >= token:
        return False
    return bool(FencedItem.objects.filter(pk=item.pk).update(stock=stock, fence=token))


def _signal_when_blocked(pid: int, blocked: threading.Event) -> None:
    """Set ``blocked`` once PostgreSQL backend ``pid`` waits on a lock."""
    deadline = time.monotonic() + 5
    with connection.cursor() as cursor:
        while time.monotonic() < deadline:
            cursor.execute(
                "SELECT wait_event_type FROM pg_stat_activity WHERE pid = %s", [pid]
            )
            row = cursor.fetchone()
            if row is not None and row[0] == "Lock":
                blocked.set()
                return
            time.sleep(0.005)
    raise AssertionError("the stale write never waited for the row lock")


def _fenced_queryset_update_through_a_join(
    item: FencedItem, lock: Redlock, stock: int
) -> bool:
    """The queryset form filtered through another table too (the child's, or its
    absence: the nullable side of an outer join): Django writes ``WHERE pk IN
    (SELECT ... JOIN ...)``, which the database does not re-check after a wait."""
    joined = {"specialitem__isnull": not isinstance(item, SpecialItem)}
    rows = FencedItem.objects.filter(pk=item.pk, fence=item.fence, **joined)
    return bool(fenced_update(rows, lock, stock=stock))


def _stale_write_behind_a_newer_uncommitted_one(
    other: Owner,
    model: Any,
    pk: Any,
    newer: Callable[[Redlock], None],
    stale: Callable[[Redlock], Any],
) -> tuple[Any, int]:
    """A's lease runs out; B writes the row with ``newer`` and keeps its
    transaction open until A's ``stale`` write waits on B's row lock; then B
    commits. Returns what A's write returned, and B's token."""
    lock_a = model_lock(model, pk, fencing=True, ttl=PAUSE_TTL)
    assert lock_a.acquire()
    time.sleep(PAUSE)
    b_wrote, a_blocked = threading.Event(), threading.Event()

    def holder_b() -> int:
        with model_lock(model, pk, fencing=True) as lock_b:
            with transaction.atomic():
                newer(lock_b)
                b_wrote.set()
                assert a_blocked.wait(5)
            token = lock_b.fencing_token
            assert token is not None
            return token

    with connection.cursor() as cursor:
        cursor.execute("SELECT pg_backend_pid()")
        (a_pid,) = cursor.fetchone()
    b = Owner()
    try:
        b_token = b.submit(holder_b)
        assert b_wrote.wait(5)
        watching = other.submit(_signal_when_blocked, a_pid, a_blocked)
        written = stale(lock_a)
        watching.result(timeout=5)
        token_b = b_token.result(timeout=5)
    finally:
        b.close()
    with pytest.raises(LockLostError):
        lock_a.release()
    return written, token_b


needs_postgresql = pytest.mark.skipif(
    "connection.vendor != 'postgresql'",
    reason="needs row locks between connections: set DATABASE_URL",
)


@needs_postgresql
@pytest.mark.parametrize(
    ("write", "stale_wins"),
    [
        (_fenced_update, False),
        (_fenced_queryset_update, False),
        (_fenced_queryset_update_through_a_join, False),
        (_naive_fenced_update, True),
    ],
    ids=["fenced_update", "queryset", "queryset-join", "negative-control"],
)
@pytest.mark.parametrize("model", [FencedItem, SpecialItem], ids=["model", "child"])
@pytest.mark.django_db(transaction=True)
def test_stale_write_waiting_on_the_newer_holders_transaction_is_refused(
    other: Owner, write: Callable[..., bool], stale_wins: bool, model: Any
) -> None:
    """B's fenced write sits uncommitted while A's stale write waits on the row;
    once B commits, the compare is checked again and refuses A. A read-then-write
    check (the control) saw the old token before B committed and overwrites B.

    Through a multi-table child too, whose token field lives on the parent's
    table, and through a queryset filtered on another table: Django writes those
    in steps (an update by key after selecting the keys; ``WHERE pk IN (SELECT
    ...)``), and the stale write landed, the row's token going backwards, until
    such writes locked their rows first."""
    item = model.objects.create(name="widget", stock=10)

    def newer(lock_b: Redlock) -> None:
        assert fenced_update(FencedItem(pk=item.pk), lock_b, stock=7)

    written, token_b = _stale_write_behind_a_newer_uncommitted_one(
        other, model, item.pk, newer, lambda lock_a: write(item, lock_a, 9)
    )
    stock, fence = FencedItem.objects.values_list("stock", "fence").get(pk=item.pk)
    if stale_wins:
        assert (written, stock) == (True, 9)
    else:
        assert (written, stock, fence) == (False, 7, token_b)


@needs_postgresql
@pytest.mark.django_db(transaction=True)
def test_stale_write_of_a_child_with_its_own_token_and_a_parent_field_is_refused(
    other: Owner,
) -> None:
    """A child whose token field is on its own table, written together with a
    field of its parent's table: Django updates the parent by key after selecting
    the keys, so the compare must be checked under a row lock. The stale write
    used to land once the newer one committed, the token going back."""
    item = FencedListing.objects.create(name="w", price=10, stock=10)
    read_by_a = FencedListing.objects.get(pk=item.pk)

    def newer(lock_b: Redlock) -> None:
        row = FencedListing.objects.get(pk=item.pk)
        assert fenced_update(row, lock_b, price=7, stock=7)

    written, token_b = _stale_write_behind_a_newer_uncommitted_one(
        other,
        FencedListing,
        item.pk,
        newer,
        lambda lock_a: fenced_update(read_by_a, lock_a, price=9, stock=9),
    )
    row = FencedListing.objects.values("price", "stock", "fence").get(pk=item.pk)
    assert (written, row) == (False, {"price": 7, "stock": 7, "fence": token_b})


@pytest.mark.django_db
def test_a_fenced_write_filtered_through_a_join_writes_the_rows_it_matches() -> None:
    """The locked path of a joined filter writes what the filter matches, on the
    nullable side of an outer join too, and nothing else."""
    plain = FencedItem.objects.create(name="plain", stock=5)
    child = SpecialItem.objects.create(name="child", stock=5, note="sale")
    with model_lock(plain, fencing=True) as lock:
        rows = FencedItem.objects.filter(pk=plain.pk, specialitem__isnull=True)
        assert fenced_update(rows, lock, stock=4) == 1
        token = lock.fencing_token
    with model_lock(child, fencing=True) as lock:
        rows = FencedItem.objects.filter(specialitem__note="none")
        assert fenced_update(rows, lock, stock=0) == 0
        rows = FencedItem.objects.filter(specialitem__note="sale")
        assert fenced_update(rows, lock, stock=3) == 1
    stocks = dict(FencedItem.objects.values_list("name", "stock"))
    assert stocks == {"plain": 4, "child": 3}
    assert FencedItem.objects.get(pk=plain.pk).fence == token


# The field.


def test_fencing_token_field_is_a_non_null_bigint_defaulting_to_zero() -> None:
    """The column is a BIGINT NOT NULL DEFAULT 0, hidden from forms."""
    field = FencedItem._meta.get_field("fence")
    assert isinstance(field, models.BigIntegerField)
    assert field.get_internal_type() == "BigIntegerField"
    assert (field.null, field.get_default(), field.editable) == (False, 0, False)
    assert FencedItem().fence == 0


def test_fencing_token_field_deconstructs_to_a_bare_call() -> None:
    """Migrations write ``FencingTokenField()``; non-default options survive."""
    name, path, args, kwargs = FencedItem._meta.get_field("fence").deconstruct()
    assert (name, path, args, kwargs) == (
        "fence",
        "redlock_django.orm.FencingTokenField",
        [],
        {},
    )
    text, imports = MigrationWriter.serialize(FencingTokenField())
    assert text == "redlock_django.orm.FencingTokenField()"
    assert imports == {"import redlock_django.orm"}
    custom = FencingTokenField(editable=True, db_index=True, default=-1)
    _, _, _, kwargs = custom.deconstruct()
    assert kwargs == {"editable": True, "db_index": True, "default": -1}
    rebuilt = FencingTokenField(**kwargs)
    assert rebuilt.deconstruct() == custom.deconstruct()


@isolate_apps("tests")
def test_fencing_token_field_checks_flag_null_and_positive_defaults() -> None:
    """null=True (never writable) and a default above 0 are errors; the plain
    field and a default of -1 pass."""

    class Checked(models.Model):
        ok = FencingTokenField()
        negative = FencingTokenField(default=-1)
        nullable = FencingTokenField(null=True)
        ahead = FencingTokenField(default=5)
        boolean = FencingTokenField(default=True)

        class Meta:
            app_label = "tests"

    ids = {
        name: [message.id for message in Checked._meta.get_field(name).check()]
        for name in ("ok", "negative", "nullable", "ahead", "boolean")
    }
    assert ids == {
        "ok": [],
        "negative": [],
        "nullable": [E101],
        "ahead": [E102],
        "boolean": [E102],
    }


@pytest.fixture
def read_replica(transactional_db: None) -> Iterator[str]:
    """A second alias on the same PostgreSQL database, read-only like a replica,
    with the usual primary/replica router (reads there, writes to default)."""
    if connection.vendor != "postgresql":
        pytest.skip("needs PostgreSQL: set DATABASE_URL")
    alias = "review_replica"
    default = connections.settings["default"]
    connections.settings[alias] = {
        **default,
        "OPTIONS": {
            **default.get("OPTIONS", {}),
            "options": "-c default_transaction_read_only=on",
        },
    }
    connections[alias]  # the wrapper, made from those settings...
    # ...then unlisted: Django's test case allows connections it did not list
    # ("dynamically created"), and the ORM finds this one by its alias.
    del connections.settings[alias]

    class PrimaryReplicaRouter:
        def db_for_read(self, model: Any, **hints: Any) -> str:
            return alias

        def db_for_write(self, model: Any, **hints: Any) -> str:
            return "default"

        def allow_relation(self, *args: Any, **hints: Any) -> bool:
            return True

    try:
        with override_settings(DATABASE_ROUTERS=[PrimaryReplicaRouter()]):
            yield alias
    finally:
        connections[alias].close()
        del connections[alias]


def test_an_instance_read_from_a_replica_is_written_to_the_primary(
    read_replica: str,
) -> None:
    """With a primary/replica router, an instance read from the replica is written
    where ``Model.save()`` writes it: the router's database for writes."""
    FencedItem.objects.create(name="widget", stock=10)
    FencedItem.objects.get(name="widget").save()  # control: save() goes to default
    item = FencedItem.objects.get(name="widget")
    assert item._state.db == read_replica
    with model_lock(item, fencing=True) as lock:
        assert fenced_update(item, lock, stock=9)  # raises: the replica is read-only
    assert FencedItem.objects.using("default").get(pk=item.pk).stock == 9


@pytest.mark.parametrize("inside_atomic", [False, True], ids=["autocommit", "atomic"])
@pytest.mark.parametrize("rows", ["joined-filter", "child-writes-parent"])
def test_a_queryset_written_in_steps_is_written_to_the_primary(
    read_replica: str, rows: str, inside_atomic: bool
) -> None:
    """The step-by-step write (a filter through another table; a multi-table
    child's queryset writing its parent's field) locks and writes where
    ``update()`` writes: the router's database for writes, in one transaction
    there (old code: the transaction was opened on the read alias, so the
    ``SELECT ... FOR UPDATE`` ran outside any transaction and raised, or, in the
    caller's ``atomic()``, the ``UPDATE`` went to the read-only replica)."""
    item = SpecialItem.objects.create(name="widget", stock=10, note="sale")
    parent = FencedItem.objects.using("default").get(pk=item.pk)
    queryset = (
        FencedItem.objects.filter(specialitem__note="sale")
        if rows == "joined-filter"
        else SpecialItem.objects.filter(pk=item.pk)
    )
    with model_lock(parent, fencing=True) as lock:
        if inside_atomic:
            with transaction.atomic():
                written = fenced_update(queryset, lock, stock=4)
        else:
            written = fenced_update(queryset, lock, stock=4)
    assert written == 1
    assert FencedItem.objects.using("default").get(pk=item.pk).stock == 4


@pytest.mark.django_db
def test_field_naming_the_primary_key_is_a_field_error_and_writes_nothing() -> None:
    """The primary key is an integer field, but a fenced write would overwrite it
    with the token (once the token passed the key): ``field=`` naming it is refused."""
    item = FencedItem.objects.create(name="widget", stock=10)
    original_pk = item.pk
    with Redlock("pk-as-token", fencing=True) as lock:
        token = lock.fencing_token
        assert token is not None
    while token <= original_pk:  # a token above the pk: the UPDATE then matches
        with Redlock("pk-as-token", fencing=True) as lock:
            token = lock.fencing_token
            assert token is not None
    with Redlock("pk-as-token", fencing=True) as lock:
        token = lock.fencing_token
        try:
            outcome: object = fenced_update(item, lock, field="id", stock=1)
        except FieldError as exc:
            outcome = exc
    rows = list(FencedItem.objects.values_list("pk", "stock"))
    assert isinstance(outcome, FieldError), (
        f"fenced_update returned {outcome!r}; row was (pk {original_pk}, stock 10), "
        f"now (pk, stock) = {rows}; the lock's token was {token}"
    )
    assert rows == [(original_pk, 10)]


@pytest.mark.django_db
def test_a_multi_table_child_writes_its_own_and_its_parents_fields_with_the_token() -> (
    None
):
    """A child's fenced write sets the parent's fields, the token (on the parent's
    table) and the child's own fields; as a queryset too; a stale one writes none."""
    item = SpecialItem.objects.create(name="w", stock=10, note="")
    with model_lock(item, fencing=True) as lock:
        assert fenced_update(item, lock, stock=9, note="first")
        token = lock.fencing_token
    row = SpecialItem.objects.get(pk=item.pk)
    assert (row.stock, row.note, row.fence) == (9, "first", token)
    with model_lock(item, fencing=True) as lock:
        rows = SpecialItem.objects.filter(pk=item.pk)
        assert fenced_update(rows, lock, stock=F("stock") - 1, note="second") == 1
        newer = lock.fencing_token
    stale = SpecialItem.objects.get(pk=item.pk)
    stale.fence = token  # as read before the second write
    with model_lock(item, fencing=True) as lock:
        assert not fenced_update(stale, lock, stock=0, note="stale")
    row = SpecialItem.objects.get(pk=item.pk)
    assert (row.stock, row.note, row.fence) == (8, "second", newer)


@pytest.mark.django_db
def test_a_fenced_update_filtered_through_a_join_takes_a_values_queryset_too() -> None:
    """The locked path reads the rows as instances, whatever ``values()`` the
    queryset was given (it raised TypeError from ``only()``; ``update()`` ignores
    the selection as well). A ``distinct()`` one cannot be locked: a clear
    TypeError, before any query."""
    item = SpecialItem.objects.create(name="a", stock=1, note="n")
    rows = FencedItem.objects.filter(specialitem__note="n").values("name")
    with model_lock(item, fencing=True) as lock:
        assert fenced_update(rows, lock, stock=5) == 1
        with pytest.raises(TypeError, match="distinct"):
            fenced_update(rows.distinct(), lock, stock=6)
    assert FencedItem.objects.get(pk=item.pk).stock == 5
