"""Models the test suite writes to under a lock (the "tests" app)."""

from __future__ import annotations

from django.db import models


class Counter(models.Model):
    """A named integer that tests read, bump and write back under a lock."""

    name = models.CharField(max_length=100, unique=True)
    value = models.IntegerField(default=0)


# Row locks and fenced writes (redlock_django.orm; tests/test_orm.py).

import uuid  # noqa: E402

from redlock_django.orm import FencedQuerySet, FencingTokenField  # noqa: E402


class FencedItem(models.Model):
    """A stock level written only by fenced updates."""

    name = models.CharField(max_length=100)
    stock = models.IntegerField(default=0)
    fence = FencingTokenField()

    objects = FencedQuerySet.as_manager()


class FencedItemProxy(FencedItem):
    """Another class over FencedItem's rows: it must share their locks."""

    class Meta:
        proxy = True


class SpecialItem(FencedItem):
    """A multi-table child: its rows are FencedItem rows too."""

    note = models.CharField(max_length=100, default="")


class Listing(models.Model):
    """A parent whose child holds its own token field."""

    name = models.CharField(max_length=100)
    price = models.IntegerField(default=0)


class FencedListing(Listing):
    """A multi-table child with its token field on its own table: a write may
    change its parent's fields too."""

    stock = models.IntegerField(default=0)
    fence = FencingTokenField()


class CodedItem(models.Model):
    """A row keyed by a string."""

    code = models.CharField(max_length=150, primary_key=True)


class UUIDItem(models.Model):
    """A row keyed by a UUID."""

    id = models.UUIDField(primary_key=True, default=uuid.uuid4)


class TwoFenceItem(models.Model):
    """Two values fenced by two different locks."""

    price = models.IntegerField(default=0)
    stock = models.IntegerField(default=0)
    price_fence = FencingTokenField()
    stock_fence = FencingTokenField()


class VersionedItem(models.Model):
    """A row with a nullable integer column, named as a token field by ``field=``."""

    stock = models.IntegerField(default=0)
    version = models.BigIntegerField(null=True)
