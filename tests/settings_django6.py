"""Test settings for Django 6's tasks framework: ``tests.settings`` plus a task queue.

Used by ``make test-django6`` (``--ds=tests.settings_django6``) and by the
``db_worker`` processes that ``tests/test_django_tasks.py`` starts. The queue is
django-tasks-db's ``DatabaseBackend`` on the test database; the workers get the
Redis nodes and the lock's timings from ``REDLOCK_TEST_*`` environment variables
(pytest itself points ``REDLOCK`` at its nodes with the ``redlock_settings``
fixture).
"""

import os

from tests.settings import *  # noqa: F403
from tests.settings import INSTALLED_APPS

INSTALLED_APPS = [*INSTALLED_APPS, "django_tasks_db"]
TASKS = {
    "default": {
        "BACKEND": "django_tasks_db.DatabaseBackend",
        "QUEUES": ["default"],
    }
}

if os.environ.get("REDLOCK_TEST_NODES"):
    _TTL = float(os.environ.get("REDLOCK_TEST_TTL", "10"))
    REDLOCK = {
        "NODES": os.environ["REDLOCK_TEST_NODES"].split(","),
        "TTL": _TTL,
        # Two cores shared by the workers, the nodes and pytest: per-node timeouts
        # as generous as W003 allows, short retries so a waiting worker keeps trying.
        "NODE_TIMEOUT": min(0.5, _TTL / 20),
        "RETRY_DELAY": 0.01,
        "RETRY_JITTER": 0.01,
        "WAIT_TIMEOUT": 30.0,
    }

# The workers' log shows the lock's INFO lines ("skipped: held by another").
LOGGING = {
    "version": 1,
    "disable_existing_loggers": False,
    "handlers": {"stderr": {"class": "logging.StreamHandler"}},
    "loggers": {"redlock_django": {"handlers": ["stderr"], "level": "INFO"}},
}
