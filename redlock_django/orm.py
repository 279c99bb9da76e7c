"""Locks named after model rows, and writes fenced by the lock's token.

``model_lock(product)`` is a ``Redlock`` whose resource is derived from the row:
``"shop.product:42"``, so every code path that locks a row agrees on its name.

``fenced_update(product, lock, stock=product.stock - 1)`` is the database half
of fencing (Kleppmann), and a compare-and-set on what was read: one ``UPDATE ...
SET stock = ..., fence = :token WHERE pk = 42 AND fence = :read AND fence <
:token``, where ``:read`` is the token the instance was loaded with, in the same
query as its stock. The model keeps the token of the last write in a
``FencingTokenField``::

    class Product(models.Model):
        stock = models.IntegerField()
        fence = FencingTokenField()

    with model_lock(product, fencing=True) as lock:
        product.refresh_from_db()  # the stock and its fence, in one query
        if not fenced_update(product, lock, stock=product.stock - 1):
            ...  # refused: the row was written since it was read

The write lands only if no fenced write reached the row since the instance was
read, and the lock's token is newer than the row's. A holder paused past its
lease (GC, swap, SIGSTOP) cannot undo or repeat what its successor did: if the
successor wrote first, the old token is refused; if the successor has only read,
the first of the two to write lands and the other one's read no longer matches.
Either way one read-modify-write lands per read, so the last unit sells once.
The refused write reports it (``False``, or ``StaleFencingTokenError`` with
``raise_on_stale=True``); read again under a lock to retry. No local validity
check is made first: the pause can fall between such a check and the write, and
a holder whose lease ran out while nobody else touched the row still writes
safely.

What is compared is the instance's token field as loaded (a query,
``refresh_from_db()``, ``save()``, or this function's last write). An instance
read before the lock was taken is compared too, and refused if the row changed
since. One loaded without its token field (``only()``, ``defer()``) raises
``FieldError``: there is no read to compare with. ``Model(pk=...)`` never read
carries the field's default, so it writes only a row no fenced write has reached.
A queryset write compares only the token (``fence < :token``): a blind write,
right for ``F()`` expressions that depend on no read; to compare with a read,
filter on its token, ``Product.objects.filter(pk=42, fence=seen)``.

Tokens are ordered only within one resource: every fenced writer of a row must
take its token from locks on the same resource (``model_lock`` of that row, or
one coarser lock used everywhere). Each token writes a row at most once, so put
every field of one change in one call; a replay of the same write is refused.
Writes that bypass ``fenced_update`` (``update()``, ``save()`` of other fields)
leave the token as it is, unseen by the comparison: write fenced fields only
through it. A plain ``save()`` (or ``bulk_update()``) writes every field as the
instance holds it, the token too: a stale instance saved takes the row's token
back to the one it was read with. Never ``save()`` a fenced row without
``update_fields`` that leave the token out.

Errors::

    MissingFencingTokenError (ValueError)   the lock has no fencing token: made
                                            without fencing=True, or not held by
                                            the current owner
    StaleFencingTokenError (LockError)      raise_on_stale=True and the row holds
                                            a token equal to or newer than the
                                            lock's, or was written since the
                                            instance was read
    FieldError                              no usable token field, the token in
                                            the updates, or an instance without
                                            its token loaded

One idea, read top to bottom (the field, the row's lock, the fenced write and its
queryset form), hence a little over 500 lines.
"""

from __future__ import annotations

import uuid
from typing import TYPE_CHECKING, Any, NamedTuple, TypeVar, overload

from asgiref.sync import sync_to_async
from django.core import checks
from django.core.exceptions import FieldError, ValidationError
from django.db import connections, models, router, transaction
from django.db.models.expressions import Combinable

from .checks import fencing_token_default, fencing_token_null
from .exceptions import MissingFencingTokenError, StaleFencingTokenError
from .lock import Redlock

__all__ = [
    "MAX_PK_LENGTH",
    "FencedQuerySet",
    "FencingTokenField",
    "afenced_update",
    "fenced_update",
    "model_lock",
    "model_resource",
]

_M = TypeVar("_M", bound=models.Model)

#: Longest primary key, once rendered, that ``model_resource`` accepts.
MAX_PK_LENGTH = 100


if TYPE_CHECKING:
    _BigIntegerField = models.BigIntegerField[int | Combinable, int]
else:  # Django's fields are not subscriptable at runtime.
    _BigIntegerField = models.BigIntegerField


class FencingTokenField(_BigIntegerField):
    """The fencing token of the last fenced write of the row (0: never written).

    A non-null ``BIGINT`` defaulting to 0, not editable in forms; written only
    by ``fenced_update``.
    """

    description = "Fencing token of the last fenced write"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("default", 0)
        kwargs.setdefault("editable", False)
        super().__init__(*args, **kwargs)

    def deconstruct(self) -> Any:
        """Omit the arguments that are this field's defaults, for clean migrations."""
        name, path, args, kwargs = super().deconstruct()
        if kwargs.get("default") == 0 and type(kwargs["default"]) is int:
            del kwargs["default"]
        if kwargs.get("editable") is False:
            del kwargs["editable"]
        else:
            kwargs["editable"] = True
        return name, path, args, kwargs

    def check(self, **kwargs: Any) -> list[checks.CheckMessage]:
        """Flag settings that would make every fenced write of a row be refused."""
        errors = super().check(**kwargs)
        if self.null:
            errors.append(fencing_token_null(self))
        default = self.default
        if self.has_default() and not callable(default) and not _below_tokens(default):
            errors.append(fencing_token_default(self, default))
        return errors


def _below_tokens(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value <= 0


# Row locks.


def _model_of(instance_or_model: models.Model | type[models.Model]) -> type[Any]:
    if isinstance(instance_or_model, type) and issubclass(
        instance_or_model, models.Model
    ):
        return instance_or_model
    if isinstance(instance_or_model, models.Model):
        return type(instance_or_model)
    raise TypeError(
        f"expected a model instance or a model class, not {instance_or_model!r}"
    )


def _root_model(model: type[Any]) -> type[Any]:
    """Return the model whose table holds the row: proxies and multi-table
    children share their base row's lock."""
    model = model._meta.concrete_model
    while True:
        remote = model._meta.pk.remote_field
        if remote is None or not getattr(remote, "parent_link", False):
            return model
        model = remote.model._meta.concrete_model


def _render_pk(model: type[Any], pk: object) -> str:
    field = model._meta.pk
    if isinstance(pk, bool) or pk is None:
        raise ValueError(f"{pk!r} is not a primary key of {model._meta.label}")
    if isinstance(field, models.CompositePrimaryKey):
        raise TypeError(
            f"{model._meta.label} has a composite primary key; name the lock "
            f"yourself with Redlock(...)"
        )
    try:
        # What filter(pk=...) would compare: 42 and "42" name the same row.
        value = field.to_python(pk)
    except ValidationError:
        raise ValueError(
            f"{pk!r} is not a primary key of {model._meta.label}"
        ) from None
    # int(4.5) == 4: never round a key into another row's.
    if value is None or (isinstance(value, int) and not isinstance(pk, int | str)):
        raise ValueError(f"{pk!r} is not a primary key of {model._meta.label}")
    if isinstance(value, int | uuid.UUID):
        text = str(value)
    elif isinstance(value, str):
        if not value:
            raise ValueError(
                f"an empty primary key cannot name a row lock of {model._meta.label}"
            )
        if not value.isprintable():
            raise ValueError(
                f"primary key {value!r} of {model._meta.label} contains control or "
                f"unprintable characters"
            )
        text = value
    else:
        raise TypeError(
            f"{model._meta.label} primary keys of type {type(value).__name__} "
            f"cannot name a lock; only integer, string and UUID keys can (name "
            f"the lock yourself with Redlock(...))"
        )
    if len(text) > MAX_PK_LENGTH:
        raise ValueError(
            f"primary key of {model._meta.label} is {len(text)} characters long; "
            f"a row lock allows {MAX_PK_LENGTH}"
        )
    return text


def model_resource(
    instance_or_model: models.Model | type[models.Model], pk: object = None
) -> str:
    """Return the lock resource of a row: ``"<app_label>.<model_name>:<pk>"``.

    Pass a saved instance, or a model class and ``pk``. The key is normalised by
    the primary key field (``42`` and ``"42"`` name the same row of an integer
    key), and proxies and multi-table children name their base model's row, so
    every way of naming one row gives one resource. The key is everything after
    the first colon, so keys containing colons stay unambiguous. Raises
    ``ValueError`` for an unsaved instance and for keys that are empty, contain
    unprintable characters, are longer than ``MAX_PK_LENGTH`` or are not valid
    for the field; ``TypeError`` for key types other than integers, strings and
    UUIDs.
    """
    model = _model_of(instance_or_model)
    if isinstance(instance_or_model, models.Model):
        if pk is not None:
            raise TypeError("pass pk only with a model class, not with an instance")
        pk = instance_or_model.pk
        if pk is None:
            raise ValueError(
                f"cannot name a lock for an unsaved {model._meta.label} (no pk)"
            )
    elif pk is None:
        raise TypeError(f"model_resource({model.__name__}) needs a pk")
    root = _root_model(model)
    return f"{root._meta.label_lower}:{_render_pk(root, pk)}"


def model_lock(
    instance_or_model: models.Model | type[models.Model],
    pk: object = None,
    **options: Any,
) -> Redlock:
    """Return a ``Redlock`` on one row, named by ``model_resource()``.

    ``model_lock(product)`` or ``model_lock(Product, 42)``; ``options`` are
    ``Redlock``'s (``ttl``, ``fencing``, ``auto_extend``, ...). Use it with
    ``with`` or ``async with``. No query is made.
    """
    return Redlock(model_resource(instance_or_model, pk), **options)


# Fenced writes.


def _token(lock: Redlock) -> int:
    """Return the current owner's fencing token, or explain why there is none."""
    if not isinstance(lock, Redlock):
        raise TypeError(f"expected a Redlock, not {lock!r}")
    if not lock.fencing:
        raise MissingFencingTokenError(
            f"lock {lock.resource!r} has no fencing token: create it with "
            f"fencing=True (Redlock(..., fencing=True) or "
            f"model_lock(..., fencing=True))",
            resource=lock.resource,
        )
    token = lock.fencing_token
    if token is None:
        raise MissingFencingTokenError(
            f"lock {lock.resource!r} is not held by the current thread or task, so "
            f"it has no fencing token: write inside 'with lock:' / 'async with "
            f"lock:', in the owner that acquired it",
            resource=lock.resource,
        )
    return token


def _fence_field(model: type[Any], field: str | None) -> str:
    """Return the attname of the model's fencing token field."""
    opts = model._meta
    if field is None:
        found = [f for f in opts.concrete_fields if isinstance(f, FencingTokenField)]
        if not found:
            raise FieldError(
                f"{opts.label} has no FencingTokenField; add one "
                f"(fence = FencingTokenField()) or pass field="
            )
        if len(found) > 1:
            names = ", ".join(f.name for f in found)
            raise FieldError(
                f"{opts.label} has several FencingTokenFields ({names}); pass "
                f"field= to say which one this lock fences"
            )
        target = found[0]
    else:
        target = opts.get_field(field)
        if not isinstance(target, models.IntegerField) or not target.concrete:
            raise FieldError(
                f"{opts.label}.{field} cannot hold fencing tokens: use a "
                f"FencingTokenField (or another integer field)"
            )
    if target.primary_key:
        raise FieldError(
            f"{opts.label}.{target.name} cannot hold fencing tokens: it is the "
            f"primary key, which a fenced write would overwrite with the token"
        )
    if target.null:
        # As check E101 says of FencingTokenField(null=True): a row holding NULL
        # could never be written, and would be reported as missing.
        raise FieldError(
            f"{opts.label}.{target.name} cannot hold fencing tokens: it is "
            f"null=True, and a NULL token is never older than the lock's; make it "
            f"non-null with a default of 0 (a FencingTokenField is)"
        )
    return str(target.attname)


def _prepare(
    model: type[Any], lock: Redlock, field: str | None, updates: dict[str, Any]
) -> tuple[int, str, dict[str, Any]]:
    token = _token(lock)
    attname = _fence_field(model, field)
    name = model._meta.get_field(attname).name
    if name in updates or attname in updates:
        raise FieldError(
            f"{model._meta.label}.{name} is written by fenced_update itself; "
            f"remove it from the updates"
        )
    return token, attname, {**updates, attname: token}


def _read_token(instance: models.Model, attname: str) -> Any:
    """Return the token the instance was loaded with: what its write is compared to."""
    if attname in instance.get_deferred_fields():
        raise FieldError(
            f"{instance._meta.label}.{attname} was not loaded with the instance "
            f"(only()/defer()): fenced_update compares the row's token with the one "
            f"read with its values; load it (refresh_from_db()) or write through a "
            f"queryset"
        )
    return getattr(instance, attname)


def _write_base(instance: models.Model) -> models.QuerySet[Any]:
    """The rows of the instance's model where its fenced write goes, unfiltered."""
    if instance.pk is None:
        raise ValueError(f"cannot update an unsaved {instance._meta.label} (no pk)")
    model = type(instance)
    # Where Model.save() writes: the router's choice for writes (an instance read
    # from a replica is written to the primary), else the instance's database;
    # and the base manager, as save() uses: a default manager's filter must not
    # hide the row.
    db = router.db_for_write(model, instance=instance)
    return model._base_manager.using(db)


def _after_write(instance: models.Model, changes: dict[str, Any]) -> None:
    """Mirror a successful write on the instance, as far as it can be known."""
    for key, value in changes.items():
        field = instance._meta.get_field(key)
        if hasattr(value, "resolve_expression"):
            # Computed by the database: defer it, so the next access reloads it.
            instance.__dict__.pop(field.attname, None)  # type: ignore[union-attr]
            if field.is_relation and field.is_cached(instance):  # type: ignore[union-attr]
                field.delete_cached_value(instance)  # type: ignore[union-attr]
        else:
            setattr(instance, key, value)


def _update(rows: models.QuerySet[Any], attname: str, changes: dict[str, Any]) -> int:
    """``rows.update(**changes)``, with the token compare in ``rows`` checked by the
    write itself, after any wait for a row another transaction is writing.

    One ``UPDATE`` of one table whose conditions are all on that table does that:
    the database re-checks them on the row it waited for. Django writes any other
    update in steps: a filter through another table becomes ``WHERE pk IN
    (SELECT ...)`` (or a SELECT of the keys first), and a change of a parent's
    field (a multi-table child, its token field on either table) an update by key
    after selecting the keys. The compare would then be checked only against the
    rows as they were before the wait, so an older holder's write, queued behind a
    newer holder's uncommitted one, would land once that commits. Such writes
    first lock the rows and the token field's row (``SELECT ... FOR UPDATE``
    re-checks the compare after a wait), then write them by key, in one
    transaction.
    """
    model = rows.model
    concrete = model._meta.concrete_model
    own_table = all(
        model._meta.get_field(name).model._meta.concrete_model is concrete
        for name in changes
    )
    if own_table and rows.query.count_active_tables() <= 1:
        return rows.update(**changes)
    if rows.query.is_sliced:
        raise TypeError("Cannot update a query once a slice has been taken.")
    if rows.query.distinct or rows.query.group_by is not None:
        raise TypeError(
            "fenced_update() of a queryset filtered through another table cannot "
            "lock a distinct() or aggregated queryset's rows (SELECT ... FOR UPDATE "
            "refuses them): filter without distinct() or annotations"
        )
    # Where update() would write (a router's database for writes, not the one it
    # reads from): the lock, the keys and the write in one transaction there.
    chosen = getattr(rows, "_db", None)  # using(): Django's own attribute
    rows = rows.using(
        chosen or router.db_for_write(model, **getattr(rows, "_hints", {}))
    )
    with transaction.atomic(using=rows.db):
        locked = _model_rows(rows).select_for_update(**_lock_of(rows, attname))
        keys = {row.pk for row in locked.only(attname)}
        if not keys:
            return 0
        model._base_manager.using(rows.db).filter(pk__in=keys).update(**changes)
    return len(keys)


def _model_rows(rows: models.QuerySet[Any]) -> models.QuerySet[Any]:
    """``rows`` as model instances, whatever ``values()`` it was given: the same
    filters (``update()`` ignores the selected fields as well)."""
    if getattr(rows, "_fields", None) is None:
        return rows
    query = rows.query.chain()
    query.clear_select_fields()
    query.default_cols = True
    instances: models.QuerySet[Any] = rows.model._base_manager.using(rows.db).all()
    instances.query = query
    return instances


def _lock_of(rows: models.QuerySet[Any], attname: str) -> dict[str, Any]:
    """``select_for_update()``'s ``of``: the rows' table and the token field's.

    Only these are locked: a row a filter joins may be absent (the nullable side
    of an outer join, which PostgreSQL cannot lock), and every fenced write of the
    row locks its token field's row, which is what orders them. Without ``of``
    (SQLite ignores the lock; MariaDB cannot name tables) every table is locked.
    """
    if not connections[rows.db].features.has_select_for_update_of:
        return {}
    model = rows.model
    owner = model._meta.get_field(attname).model._meta.concrete_model
    if owner is model._meta.concrete_model:
        return {"of": ("self",)}
    path = model._meta.get_path_to_parent(owner)
    return {"of": ("self", "__".join(step.join_field.name for step in path))}


class _InstanceWrite(NamedTuple):
    """One instance's fenced write, prepared: ``target`` is the row as read."""

    token: int
    attname: str
    read: Any
    changes: dict[str, Any]
    base: models.QuerySet[Any]
    pk: Any
    target: models.QuerySet[Any]

    @property
    def rows(self) -> models.QuerySet[Any]:
        """The row, whatever it holds now: asked only once a write was refused."""
        return self.base.filter(pk=self.pk)


def _instance_write(
    instance: models.Model, lock: Redlock, field: str | None, updates: dict[str, Any]
) -> _InstanceWrite:
    token, attname, changes = _prepare(type(instance), lock, field, updates)
    read = _read_token(instance, attname)
    base = _write_base(instance)
    # One filter() for the key and the compare: each call clones the queryset
    # (the row alone is only needed for a refusal's report: ``rows``).
    pk = instance.pk
    target = base.filter(pk=pk, **{attname: read, f"{attname}__lt": token})
    return _InstanceWrite(token, attname, read, changes, base, pk, target)


def _refusal(
    instance: models.Model, lock: Redlock, write: _InstanceWrite, stored: int | None
) -> StaleFencingTokenError:
    token, read = write.token, write.read
    if stored is None:
        raise type(instance).DoesNotExist(
            f"{instance._meta.label} with pk {instance.pk!r} does not exist"
        )
    row = f"{instance._meta.label_lower}:{instance.pk}"
    if stored >= token:
        why = (
            f"its fencing token is {stored}, lock {lock.resource!r} holds {token} "
            f"(a newer holder wrote it, or this token already did)"
        )
    else:
        why = (
            f"it was written with fencing token {stored} after this instance was "
            f"read with token {read}, so the values the write was computed from "
            f"are stale (lock {lock.resource!r} holds {token}); read it again"
        )
    return StaleFencingTokenError(
        f"write to {row} refused: {why}",
        resource=lock.resource,
        token=token,
        stored_token=stored,
        read_token=read,
    )


@overload
def fenced_update(
    target: models.QuerySet[Any],
    lock: Redlock,
    *,
    field: str | None = None,
    **updates: Any,
) -> int: ...
@overload
def fenced_update(
    target: models.Model,
    lock: Redlock,
    *,
    field: str | None = None,
    raise_on_stale: bool = False,
    **updates: Any,
) -> bool: ...
def fenced_update(
    target: models.Model | models.QuerySet[Any],
    lock: Redlock,
    *,
    field: str | None = None,
    raise_on_stale: bool = False,
    **updates: Any,
) -> bool | int:
    """Write ``updates`` where the stored fencing token is older than ``lock``'s
    and, for an instance, is still the one the instance was read with.

    One ``UPDATE`` sets the fields (values or ``F()`` expressions) and stores the
    token. For a model instance it is ``WHERE <field> = <read> AND <field> <
    token``, a compare-and-set on the token loaded with the instance: return True
    when the row was written (the instance then shows the new values and token;
    ``F()`` fields are reloaded on next access) and False when it was refused
    because the row holds an equal or newer token or was written since it was
    read; ``raise_on_stale=True`` raises ``StaleFencingTokenError`` instead, a
    deleted row raises the model's ``DoesNotExist``, and an instance whose token
    field was not loaded raises ``FieldError``. For a queryset it is ``WHERE
    <field> < token``: return how many rows were written, as ``update()`` does
    (filter on the token read to compare with a read).

    ``field`` names the token field when the model has several. Raises
    ``MissingFencingTokenError`` when the lock was made without ``fencing=True``
    or is not held by the current thread or task. Whether the lease ran out is
    not checked: the database decides, by the token.
    """
    if isinstance(target, models.QuerySet):
        if raise_on_stale:
            raise TypeError(_NO_RAISE_FOR_QUERYSETS)
        token, attname, changes = _prepare(target.model, lock, field, updates)
        return _update(target.filter(**{f"{attname}__lt": token}), attname, changes)
    if not isinstance(target, models.Model):
        raise TypeError(f"expected a model instance or a queryset, not {target!r}")
    write = _instance_write(target, lock, field, updates)
    if _update(write.target, write.attname, write.changes):
        _after_write(target, write.changes)
        return True
    stored = write.rows.values_list(write.attname, flat=True).first()
    error = _refusal(target, lock, write, stored)
    if raise_on_stale:
        raise error
    return False


@overload
async def afenced_update(
    target: models.QuerySet[Any],
    lock: Redlock,
    *,
    field: str | None = None,
    **updates: Any,
) -> int: ...
@overload
async def afenced_update(
    target: models.Model,
    lock: Redlock,
    *,
    field: str | None = None,
    raise_on_stale: bool = False,
    **updates: Any,
) -> bool: ...
async def afenced_update(
    target: models.Model | models.QuerySet[Any],
    lock: Redlock,
    *,
    field: str | None = None,
    raise_on_stale: bool = False,
    **updates: Any,
) -> bool | int:
    """Do ``fenced_update()`` from a coroutine, in the task that holds ``lock``."""
    if isinstance(target, models.QuerySet):
        if raise_on_stale:
            raise TypeError(_NO_RAISE_FOR_QUERYSETS)
        token, attname, changes = _prepare(target.model, lock, field, updates)
        rows = target.filter(**{f"{attname}__lt": token})
        return await sync_to_async(_update)(rows, attname, changes)
    if not isinstance(target, models.Model):
        raise TypeError(f"expected a model instance or a queryset, not {target!r}")
    # The token is the current task's: read it here, not in a worker thread.
    write = _instance_write(target, lock, field, updates)
    if await sync_to_async(_update)(write.target, write.attname, write.changes):
        _after_write(target, write.changes)
        return True
    stored = await write.rows.values_list(write.attname, flat=True).afirst()
    error = _refusal(target, lock, write, stored)
    if raise_on_stale:
        raise error
    return False


_NO_RAISE_FOR_QUERYSETS = (
    "raise_on_stale is for a single row (a model instance); a queryset write "
    "returns how many rows were written"
)


class FencedQuerySet(models.QuerySet[_M]):
    """A QuerySet with ``fenced_update()``: ``objects = FencedQuerySet.as_manager()``.

    ``Product.objects.filter(pk=42).fenced_update(lock, stock=F("stock") - 1)``
    returns how many rows were written. It compares only the token; to write
    what was computed from a read, filter on the token read with it too
    (``filter(pk=42, fence=seen)``).
    """

    def fenced_update(
        self, lock: Redlock, *, field: str | None = None, **updates: Any
    ) -> int:
        """Update the rows whose token is older than ``lock``'s; return how many.

        See ``redlock_django.orm.fenced_update``.
        """
        return fenced_update(self, lock, field=field, **updates)

    async def afenced_update(
        self, lock: Redlock, *, field: str | None = None, **updates: Any
    ) -> int:
        """Do ``fenced_update()`` from a coroutine."""
        return await afenced_update(self, lock, field=field, **updates)
