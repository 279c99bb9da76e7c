"""Settings for the sample shop, read from the environment (12-factor).

The defaults are for local development only: set ``SECRET_KEY``, ``DEBUG=0`` and
``ALLOWED_HOSTS`` anywhere else.
"""

import os
from pathlib import Path

import dj_database_url
from django.core.exceptions import ImproperlyConfigured

BASE_DIR = Path(__file__).resolve().parent.parent


def _env_bool(name: str, default: bool) -> bool:
    value = os.environ.get(name)
    if value is None:
        return default
    return value.strip().lower() in {"1", "true", "yes", "on"}


def _env_number(name: str, default: str, kind: type, minimum: float) -> float:
    """A number from the environment, at least ``minimum``; a clear error otherwise."""
    raw = os.environ.get(name, default)
    try:
        value = kind(raw)
    except ValueError:
        word = "an integer" if kind is int else "a number"
        raise ImproperlyConfigured(f"{name} must be {word}, not {raw!r}") from None
    if value < minimum:
        raise ImproperlyConfigured(f"{name} must be at least {minimum}, not {raw!r}")
    return value


def _env_list(name: str, default: str) -> list[str]:
    items = (item.strip() for item in os.environ.get(name, default).split(","))
    return [item for item in items if item]


SECRET_KEY = os.environ.get("SECRET_KEY", "dev-only-insecure-secret-key")
DEBUG = _env_bool("DEBUG", True)
ALLOWED_HOSTS = _env_list("ALLOWED_HOSTS", "127.0.0.1,localhost")

INSTALLED_APPS = [
    "django.contrib.admin",
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "django.contrib.messages",
    "django.contrib.staticfiles",
    "redlock_django",
    "shop",
]

MIDDLEWARE = [
    "django.middleware.security.SecurityMiddleware",
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.middleware.common.CommonMiddleware",
    "django.middleware.csrf.CsrfViewMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
    "django.contrib.messages.middleware.MessageMiddleware",
    "django.middleware.clickjacking.XFrameOptionsMiddleware",
]

ROOT_URLCONF = "shop.urls"

TEMPLATES = [
    {
        "BACKEND": "django.template.backends.django.DjangoTemplates",
        "DIRS": [],
        "APP_DIRS": True,
        "OPTIONS": {
            "context_processors": [
                "django.template.context_processors.request",
                "django.contrib.auth.context_processors.auth",
                "django.contrib.messages.context_processors.messages",
            ],
        },
    },
]

WSGI_APPLICATION = "shop.wsgi.application"
ASGI_APPLICATION = "shop.asgi.application"

DATABASES = {
    # Persistent connections (checked before reuse): a request does not open its
    # own, which on PostgreSQL costs a server process per request; 0 turns it off.
    "default": dj_database_url.config(
        default=f"sqlite:///{BASE_DIR / 'db.sqlite3'}",
        conn_max_age=int(_env_number("CONN_MAX_AGE", "60", int, 0)),
        conn_health_checks=True,
    )
}
# Requests run in a transaction; the shop's own views opt out (see shop/views.py:
# they must open their transaction only after taking the lock) and the lock
# decorator releases after the commit of any view that does run in one.
DATABASES["default"]["ATOMIC_REQUESTS"] = True
if DATABASES["default"]["ENGINE"] == "django.db.backends.sqlite3":
    # Several gunicorn processes share the file. WAL lets readers run while one
    # connection writes; IMMEDIATE transactions take the write lock at BEGIN, so a
    # writer waits (up to the busy timeout) instead of failing with "database is
    # locked" when it upgrades a read transaction that another writer overtook.
    DATABASES["default"].setdefault("OPTIONS", {}).update(
        {
            "timeout": 20,
            "transaction_mode": "IMMEDIATE",
            "init_command": "PRAGMA journal_mode=WAL; PRAGMA synchronous=NORMAL;",
        }
    )

REDLOCK = {
    "NODES": _env_list("REDLOCK_NODES", "redis://127.0.0.1:6379/0"),
    # A product lock's lease, and how long a buyer waits for it before a 423.
    "TTL": _env_number("REDLOCK_TTL", "5", float, 0),
    "WAIT_TIMEOUT": _env_number("REDLOCK_WAIT_TIMEOUT", "2", float, 0),
    # First come, first served: buyers waiting for a product are granted it in
    # the order they asked, and a release wakes only the next one
    # (docs/fairness.md). REDLOCK_FAIR=0 for the barging lock, to compare.
    "FAIR": _env_bool("REDLOCK_FAIR", True),
}
# REDLOCK_NODES may carry passwords: Django's own filter would print them in error
# reports (settings are hidden by name only); this one masks URL passwords.
DEFAULT_EXCEPTION_REPORTER_FILTER = "redlock_django.conf.SafeSettingsReporterFilter"

# Simulated "payment" time spent inside both buy views' critical sections, so the
# locked and unsafe endpoints are compared doing the same work.
SHOP_WORK_SECONDS = _env_number("SHOP_WORK_MS", "5", int, 0) / 1000
# A directory: when set, the buy view writes per-phase timings of each purchase
# there (shop/timings.py; ``make demo`` sets it for its locked run).
SHOP_TIMINGS_DIR = os.environ.get("SHOP_TIMINGS_DIR", "")
# Most units one order may buy.
SHOP_MAX_PER_ORDER = int(_env_number("SHOP_MAX_PER_ORDER", "5", int, 1))

LANGUAGE_CODE = "en-us"
TIME_ZONE = "UTC"
USE_I18N = True
USE_TZ = True

STATIC_URL = "static/"

DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"
