"""Models the test suite writes to under a lock (the "tests" app)."""

from __future__ import annotations

from django.db import models


class Counter(models.Model):
    """A named integer that tests read, bump and write back under a lock."""

    name = models.CharField(max_length=100, unique=True)
    value = models.IntegerField(default=0)
