"""The package as users install it: a built wheel in a fresh virtualenv, no checkout.

The sdist and wheel are built from a copy of the project, checked with ``twine
check``, and the wheel is installed into a new virtualenv that has never seen this
checkout. A minimal Django project there adds the app, passes ``check --deploy``
and ``migrate``, takes a lock on real nodes and opens the admin's held-locks page.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
import zipfile
from collections.abc import Callable
from email.parser import Parser
from pathlib import Path

import pytest

from harness.nodes import NodeSet

REPO = Path(__file__).resolve().parent.parent
#: What the copy for the build leaves out: local state, never part of a release.
_NOT_SOURCES = shutil.ignore_patterns(
    ".git",
    ".venv*",
    ".nox",
    "build",
    "dist",
    "*.egg-info",
    "__pycache__",
    ".demo",
    "reports",
    ".pytest_cache",
    ".mypy_cache",
    ".ruff_cache",
    "*.sqlite3",
)


def _run(
    args: list[str], cwd: Path | None = None, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    result = subprocess.run(
        args, cwd=cwd, env=env, capture_output=True, text=True, timeout=300, check=False
    )
    assert result.returncode == 0, (
        f"{' '.join(map(str, args))} exited {result.returncode}\n"
        f"{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
    )
    return result


@pytest.fixture(scope="module")
def dist(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Build the sdist and the wheel from a copy of the project."""
    source = tmp_path_factory.mktemp("source") / "redlock-django"
    shutil.copytree(REPO, source, ignore=_NOT_SOURCES)
    out = source / "dist"
    # Isolated, as a release is built: the setuptools [build-system] asks for.
    _run([sys.executable, "-m", "build", "--outdir", str(out)], cwd=source)
    return out


def _wheel(dist: Path) -> Path:
    [wheel] = dist.glob("redlock_django-*.whl")
    return wheel


def test_sdist_and_wheel_pass_twine_check(dist: Path) -> None:
    files = sorted(dist.iterdir())
    assert sorted(f.suffix for f in files) == [".gz", ".whl"]
    _run([sys.executable, "-m", "twine", "check", "--strict", *map(str, files)])


def test_wheel_holds_the_templates_migrations_and_type_marker_and_no_sample_code(
    dist: Path,
) -> None:
    names = set(zipfile.ZipFile(_wheel(dist)).namelist())
    for required in (
        "redlock_django/py.typed",
        "redlock_django/templates/admin/redlock_django/held_locks.html",
        "redlock_django/migrations/0001_initial.py",
        "redlock_django/management/commands/redlock.py",
        "redlock_django/testing/plugin.py",
    ):
        assert required in names
    [entry_points] = [n for n in names if n.endswith(".dist-info/entry_points.txt")]
    with zipfile.ZipFile(_wheel(dist)) as wheel:
        declared = wheel.read(entry_points).decode()
    # The pytest plugin users' suites load (README: "Testing your code").
    assert "[pytest11]" in declared
    assert "redlock_django.testing.plugin" in declared
    tops = {name.split("/")[0] for name in names}
    assert not tops & {"shop", "tests", "harness", "loadtests", "benchmarks"}


def test_wheel_requires_only_what_the_library_imports(dist: Path) -> None:
    """The shop's and the tests' dependencies are extras, never installed by default."""
    with zipfile.ZipFile(_wheel(dist)) as wheel:
        [metadata] = [n for n in wheel.namelist() if n.endswith(".dist-info/METADATA")]
        fields = Parser().parsestr(wheel.read(metadata).decode())
    plain = [r for r in fields.get_all("Requires-Dist") if "extra ==" not in r]
    assert sorted(r.split(">")[0].split("[")[0].lower() for r in plain) == [
        "django",
        "redis",
    ]
    assert "Framework :: Django :: 5.2" in fields.get_all("Classifier")


SETTINGS = """
import json, os
SECRET_KEY = "wheel-test-only"
DEBUG = False
ALLOWED_HOSTS = ["testserver"]
INSTALLED_APPS = [
    "django.contrib.admin", "django.contrib.auth", "django.contrib.contenttypes",
    "django.contrib.sessions", "django.contrib.messages", "redlock_django",
]
MIDDLEWARE = [
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.middleware.csrf.CsrfViewMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
    "django.contrib.messages.middleware.MessageMiddleware",
]
TEMPLATES = [{
    "BACKEND": "django.template.backends.django.DjangoTemplates",
    "APP_DIRS": True,
    "OPTIONS": {"context_processors": [
        "django.template.context_processors.request",
        "django.contrib.auth.context_processors.auth",
        "django.contrib.messages.context_processors.messages",
    ]},
}]
ROOT_URLCONF = "site_urls"
DATABASES = {"default": {"ENGINE": "django.db.backends.sqlite3", "NAME": "db.sqlite3"}}
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"
USE_TZ = True
REDLOCK = {"NODES": json.loads(os.environ["NODES"])}
"""

URLS = """
from django.contrib import admin
from django.urls import path
urlpatterns = [path("admin/", admin.site.urls)]
"""

# Runs inside the fresh virtualenv: where Django found the app, a lock held on the
# nodes, and the admin page that lists it.
VISIT = """
import json
import django
django.setup()
import redlock_django
from django.contrib.auth.models import User
from django.test import Client
from redlock_django import Redlock

lock = Redlock("wheel:check", ttl=30)
assert lock.acquire(blocking=False)
user = User.objects.create_superuser("admin", "admin@example.com", "pw")
client = Client()
client.force_login(user)
page = client.get("/admin/redlock_django/heldlock/")
lock.release()
print(json.dumps({
    "module": redlock_django.__file__,
    "status": page.status_code,
    "listed": "wheel:check" in page.content.decode(),
}))
"""


def test_installed_wheel_runs_in_a_fresh_project(
    dist: Path, tmp_path: Path, make_nodes: Callable[..., NodeSet]
) -> None:
    # Nothing of the checkout may leak in: no PYTHONPATH, the project as cwd. Not
    # while installing either: pip would take the checkout's egg-info on a
    # PYTHONPATH for an installed redlock-django and skip the wheel.
    env = {
        key: value
        for key, value in os.environ.items()
        if not key.startswith(("PYTHON", "DJANGO", "VIRTUAL_ENV"))
    }
    venv = tmp_path / "venv"
    _run([sys.executable, "-m", "venv", str(venv)], env=env)
    python = str(venv / "bin" / "python")
    _run([python, "-m", "pip", "install", "--quiet", str(_wheel(dist))], env=env)

    project = tmp_path / "site"
    project.mkdir()
    (project / "site_settings.py").write_text(textwrap.dedent(SETTINGS))
    (project / "site_urls.py").write_text(textwrap.dedent(URLS))
    nodes = make_nodes(3)
    env.update(
        DJANGO_SETTINGS_MODULE="site_settings",
        PYTHONPATH=str(project),
        NODES=json.dumps(nodes.urls),
    )

    def django(*args: str) -> subprocess.CompletedProcess[str]:
        return _run([python, "-m", "django", *args], cwd=project, env=env)

    checked = django("check", "--deploy")
    assert "redlock.W007" in checked.stderr + checked.stdout  # the deploy checks ran
    django("migrate", "--no-input")
    visit = _run([python, "-c", VISIT], cwd=project, env=env)
    seen = json.loads(visit.stdout.strip().splitlines()[-1])
    assert seen["module"].startswith(str(venv))
    assert seen["status"] == 200
    assert seen["listed"] is True
