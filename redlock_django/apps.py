"""Django app configuration for redlock_django."""

from __future__ import annotations

from django.apps import AppConfig
from django.core import checks


class RedlockConfig(AppConfig):
    """Register the ``redlock`` system checks when Django starts."""

    name = "redlock_django"
    label = "redlock_django"
    verbose_name = "Redlock"

    def ready(self) -> None:
        """Register the checks; the settings receivers need no registering.

        ``conf`` and ``nodes`` each connect their ``setting_changed`` receiver when
        imported (with a ``dispatch_uid``), so cached settings and node clients are
        reset when a test changes ``REDLOCK`` or ``CACHES``, even where this app is
        not installed.
        """
        from . import checks as redlock_checks
        from . import metrics, tracing

        checks.register(redlock_checks.check_settings, redlock_checks.TAG)
        checks.register(
            redlock_checks.check_nodes,
            redlock_checks.TAG,
            redlock_checks.NODES_TAG,
            deploy=True,
        )
        # Templates naming a URL kwarg that no route to the view supplies.
        checks.register(redlock_checks.check_url_placeholders, checks.Tags.urls)
        # Recorded whenever prometheus_client is installed; a no-op otherwise.
        metrics.install()
        # Spans whenever opentelemetry-api is installed; nothing attached otherwise.
        tracing.install()
