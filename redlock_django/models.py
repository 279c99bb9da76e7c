"""``HeldLock``: an unmanaged model holding the held-locks page's permissions.

It has no table: the admin page reads the locks from the Redis nodes through
``listing.py``. The model exists so that Django creates the permissions the page
needs, ``view_heldlock`` (see the page) and ``force_release_lock`` (release a lock
held by someone else), and so that force releases can be recorded as admin
``LogEntry`` rows with a content type.
"""

from __future__ import annotations

from django.db import models


class HeldLock(models.Model):
    """Stand for one held lock, named by its resource; never saved or queried."""

    resource: models.CharField[str, str] = models.CharField(
        max_length=200, primary_key=True
    )

    class Meta:
        managed = False
        default_permissions = ("view",)
        permissions = [("force_release_lock", "Can force-release a lock")]
        verbose_name = "held lock"
        verbose_name_plural = "held locks"

    def __str__(self) -> str:
        return str(self.resource)
