"""The pytest plugin as a user meets it: a small Django project's own test suite.

Each test writes a tiny project into ``tmp_path`` (settings, urls, a view under
``@distributed_lock``, and tests using the plugin's fixtures) and runs pytest on it
in a subprocess: through the ``pytest11`` entry point declared in pyproject, or with
``-p redlock_django.testing.plugin``. The negative controls run the same user tests
with the lock not held, or without the plugin, and watch them fail.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import textwrap
import tomllib
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
PLUGIN = "redlock_django.testing.plugin"

SETTINGS = """
SECRET_KEY = "plugin-test-only"
INSTALLED_APPS = [
    "django.contrib.contenttypes", "django.contrib.auth", "redlock_django",
]
ROOT_URLCONF = "shopsite.urls"
DATABASES = {"default": {"ENGINE": "django.db.backends.sqlite3", "NAME": ":memory:"}}
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"
USE_TZ = True
# Production nodes; the plugin's redlock_settings points REDLOCK at the test nodes.
REDLOCK = {"NODES": ["redis://10.0.0.1:6379/0"]}
"""

URLS = """
from django.urls import path

from shopsite.views import buy

urlpatterns = [path("buy/<int:product_id>/", buy)]
"""

VIEWS = """
from django.http import JsonResponse

from redlock_django import distributed_lock


@distributed_lock("product:{product_id}", timeout=0.2)
def buy(request, product_id):
    return JsonResponse({"bought": product_id})
"""

# The user's tests, word for word the README's example.
README_EXAMPLE = """
import pytest

from redlock_django import QuorumUnavailableError, Redlock


def test_buying_a_product_someone_holds_answers_423(client, redlock_settings):
    with Redlock("product:42"):  # held by the test, as another server would
        response = client.post("/buy/42/")
    assert response.status_code == 423
    assert "Retry-After" in response.headers
    assert client.post("/buy/42/").status_code == 200


def test_the_lock_holds_with_one_node_of_three_paused(redlock_settings, redlock_nodes):
    redlock_nodes[0].pause()  # SIGSTOP: a frozen node; resumed after the test
    with Redlock("report:daily"):
        key = "redlock:lock:report:daily"
        holding = [node.client().exists(key) for node in redlock_nodes[1:]]
    assert holding == [1, 1]


def test_two_nodes_of_three_down_leave_no_quorum(redlock_settings, redlock_nodes):
    redlock_nodes[0].stop()  # started again before the next test
    redlock_nodes[1].pause()
    with pytest.raises(QuorumUnavailableError):
        Redlock("report:daily").acquire(timeout=0.3)
"""

# The line the negative control takes out: the test no longer holds the lock.
HOLDING = 'with Redlock("product:42"):  # held by the test, as another server would'

USER_TESTS = (
    README_EXAMPLE
    + """

import os


def test_the_nodes_are_real_servers(redlock_nodes):
    assert len(redlock_nodes) == int(os.environ.get("EXPECT_NODES", "3"))
    info = redlock_nodes[0].client().info("server")
    kind = "valkey" if "valkey_version" in info else "redis"
    assert kind == os.environ.get("EXPECT_SERVER", "redis")
    assert info["process_id"] == redlock_nodes[0].pid


def test_each_test_starts_with_every_node_up_and_empty(redlock_nodes):
    for node in redlock_nodes:
        assert node.is_running and not node.is_paused
        assert node.client().dbsize() == 0
"""
)

# A project without pytest-django: Django set up by hand, the plugin falls back to
# django.test.override_settings.
PLAIN_CONFTEST = """
import os

import django

os.environ["DJANGO_SETTINGS_MODULE"] = "shopsite.settings"
django.setup()
"""

PLAIN_TESTS = """
from django.conf import settings
from django.test import Client

from redlock_django import Redlock


def test_redlock_settings_points_at_the_nodes(redlock_settings, redlock_nodes):
    assert settings.REDLOCK["NODES"] == redlock_nodes.urls
    with Redlock("product:7") as lock:
        assert lock.owned()
        assert Client().post("/buy/7/").status_code == 423
    assert Client().post("/buy/7/").status_code == 200


def test_the_production_setting_is_back_after_the_test():
    assert settings.REDLOCK == {"NODES": ["redis://10.0.0.1:6379/0"]}
"""


def _project(root: Path, tests: dict[str, str], ini: str = "") -> Path:
    site = root / "shopsite"
    site.mkdir(parents=True)
    (site / "__init__.py").write_text("")
    (site / "settings.py").write_text(textwrap.dedent(SETTINGS))
    (site / "urls.py").write_text(textwrap.dedent(URLS))
    (site / "views.py").write_text(textwrap.dedent(VIEWS))
    (root / "pytest.ini").write_text("[pytest]\n" + ini)
    for name, text in tests.items():
        (root / name).write_text(textwrap.dedent(text))
    return root


def _site(tmp_path: Path, conftest: str = "", tests: str = USER_TESTS) -> Path:
    """The user's project with pytest-django and the locked-view tests."""
    files = {"test_buy.py": tests, "conftest.py": conftest}
    ini = "DJANGO_SETTINGS_MODULE = shopsite.settings\n"
    return _project(tmp_path / "site", files, ini)


def _entry_point_dir(root: Path) -> Path:
    """A distribution declaring pyproject's pytest11 entry point, for the run.

    The checkout's installed metadata may predate the entry point; pytest finds
    plugins through ``importlib.metadata``, which reads this the same way.
    """
    table = tomllib.loads((REPO / "pyproject.toml").read_text())
    points = table["project"]["entry-points"]["pytest11"]
    info = root / "redlock_django_entry_points-0.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(
        "Metadata-Version: 2.1\nName: redlock-django-entry-points\nVersion: 0\n"
    )
    lines = "".join(f"{name} = {target}\n" for name, target in points.items())
    (info / "entry_points.txt").write_text("[pytest11]\n" + lines)
    return root


def _pytest(
    project: Path, *args: str, extra_path: Path | None = None, **env: str
) -> subprocess.CompletedProcess[str]:
    # A user's environment: none of this suite's settings, options or paths.
    clean = {
        key: value
        for key, value in os.environ.items()
        if not key.startswith(("PYTEST", "DJANGO", "PYTHON", "REDLOCK"))
    }
    path = [str(project), str(REPO)] + ([str(extra_path)] if extra_path else [])
    clean.update(PYTHONPATH=os.pathsep.join(path), **env)
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *args],
        cwd=project,
        env=clean,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def _report(result: subprocess.CompletedProcess[str]) -> str:
    return f"exit {result.returncode}\n{result.stdout[-4000:]}\n{result.stderr[-2000:]}"


def test_the_readme_shows_the_tested_example() -> None:
    """The README's example is the user test this file runs, line for line."""
    readme = (REPO / "README.md").read_text()
    assert textwrap.dedent(README_EXAMPLE).strip() in readme
    assert VIEWS.strip() in readme


def test_pyproject_declares_the_plugin_under_its_module_name() -> None:
    """``-p redlock_django.testing.plugin`` and the entry point are one plugin."""
    table = tomllib.loads((REPO / "pyproject.toml").read_text())
    assert table["project"]["entry-points"]["pytest11"] == {PLUGIN: PLUGIN}


def test_a_users_locked_view_tests_pass_through_the_entry_point(
    tmp_path: Path,
) -> None:
    """Installed, the plugin's fixtures just exist: no ``-p``, no conftest."""
    project = _site(tmp_path)
    result = _pytest(project, extra_path=_entry_point_dir(tmp_path / "dist"))
    assert result.returncode == 0, _report(result)
    assert "5 passed" in result.stdout, _report(result)


def test_the_entry_point_and_the_dash_p_option_load_one_plugin(tmp_path: Path) -> None:
    """Installed and named with ``-p`` or ``pytest_plugins`` too: loaded once, no error.

    pytest refuses one module registered under two names; the entry point is named
    like the module so that cannot happen.
    """
    project = _site(tmp_path, conftest=f"pytest_plugins = [{PLUGIN!r}]\n")
    dist = _entry_point_dir(tmp_path / "dist")
    result = _pytest(project, "-p", PLUGIN, "-k", "real_servers", extra_path=dist)
    assert result.returncode == 0, _report(result)
    assert "1 passed" in result.stdout, _report(result)


def test_without_the_held_lock_the_users_423_test_fails(tmp_path: Path) -> None:
    """Negative control: not holding the lock, the view answers 200, not 423."""
    assert HOLDING in USER_TESTS
    unheld = USER_TESTS.replace(HOLDING, "with contextlib.nullcontext():")
    project = _site(tmp_path, tests="import contextlib\n" + unheld)
    result = _pytest(project, "-p", PLUGIN, "-k", "423")
    assert result.returncode == 1, _report(result)
    assert "assert 200 == 423" in result.stdout, _report(result)
    assert "1 failed" in result.stdout, _report(result)


def test_without_the_plugin_the_fixtures_do_not_exist(tmp_path: Path) -> None:
    """Negative control: the fixtures come from the plugin, not from the project."""
    project = _site(tmp_path)
    result = _pytest(project, "-p", f"no:{PLUGIN}", "-k", "real_servers")
    assert result.returncode == 1, _report(result)
    assert "fixture 'redlock_nodes' not found" in result.stdout, _report(result)


def test_options_choose_five_valkey_nodes(tmp_path: Path) -> None:
    """``--redlock-nodes 5 --redlock-server valkey`` start five valkey-servers."""
    project = _site(tmp_path)
    args = ["-p", PLUGIN, "--redlock-nodes", "5", "--redlock-server", "valkey"]
    result = _pytest(
        project,
        *args,
        "-k",
        "real_servers or 423 or empty",
        EXPECT_NODES="5",
        EXPECT_SERVER="valkey",
    )
    assert result.returncode == 0, _report(result)
    assert "3 passed" in result.stdout, _report(result)


def test_without_pytest_django_settings_are_overridden_and_restored(
    tmp_path: Path,
) -> None:
    """No pytest-django: ``redlock_settings`` uses ``override_settings``."""
    project = _project(
        tmp_path / "plain",
        {"conftest.py": PLAIN_CONFTEST, "test_plain.py": PLAIN_TESTS},
        "redlock_nodes = 3\n",
    )
    result = _pytest(project, "-p", PLUGIN, "-p", "no:django")
    assert result.returncode == 0, _report(result)
    assert "2 passed" in result.stdout, _report(result)


def test_unused_the_plugin_starts_nothing_and_needs_no_server(tmp_path: Path) -> None:
    """A suite that asks for no fixture runs with no server binary anywhere."""
    project = tmp_path / "other"
    project.mkdir()
    (project / "test_other.py").write_text("def test_other():\n    assert True\n")
    result = _pytest(
        project,
        "-p",
        PLUGIN,
        "-p",
        "no:django",
        PATH=str(tmp_path / "empty"),
        REDLOCK_TEST_SERVER=str(tmp_path / "no-such-server"),
    )
    assert result.returncode == 0, _report(result)
    assert "1 passed" in result.stdout, _report(result)


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["--redlock-server", "/no/such/redis-server"], "is neither 'redis', 'valkey'"),
        (["--redlock-nodes", "zero"], "must be a whole number >= 1, got 'zero'"),
        (["--redlock-nodes", "0"], "must be a whole number >= 1, got '0'"),
    ],
)
def test_bad_options_fail_with_a_clear_message(
    tmp_path: Path, args: list[str], expected: str
) -> None:
    """A wrong server or node count is named in the error; no test passes."""
    project = tmp_path / "other"
    project.mkdir()
    (project / "test_nodes.py").write_text(
        "def test_nodes(redlock_nodes):\n    assert redlock_nodes\n"
    )
    result = _pytest(project, "-p", PLUGIN, "-p", "no:django", *args)
    assert result.returncode != 0, _report(result)
    assert expected in result.stdout + result.stderr, _report(result)
    assert " passed" not in result.stdout, _report(result)


def _bare(root: Path, tests: str, ini: str = "") -> Path:
    """A project with no Django: one test file and a pytest.ini."""
    root.mkdir(parents=True)
    (root / "pytest.ini").write_text("[pytest]\n" + ini)
    (root / "test_user.py").write_text(textwrap.dedent(tests))
    return root


NO_DJANGO = ("-p", PLUGIN, "-p", "no:django")


@pytest.mark.parametrize("how", ["option", "ini"])
def test_a_relative_server_path_is_the_projects_and_starts_the_nodes(
    tmp_path: Path, how: str
) -> None:
    """``--redlock-server bin/redis-server`` (a binary built in the project), or the
    same in the ini file: the nodes start (each runs in its own directory, where
    the relative path named nothing: every test asking for nodes errored)."""
    from redlock_django.testing import find_redis_server

    tests = "def test_nodes(redlock_nodes):\n    assert len(redlock_nodes) == 3\n"
    ini = "redlock_server = bin/redis-server\n" if how == "ini" else ""
    project = _bare(tmp_path / "site", tests, ini)
    (project / "bin").mkdir()
    shutil.copy(find_redis_server("redis"), project / "bin" / "redis-server")
    args = ["--redlock-server", "bin/redis-server"] if how == "option" else []
    result = _pytest(project, *NO_DJANGO, *args)
    assert result.returncode == 0, _report(result)
    assert "1 passed" in result.stdout, _report(result)


@pytest.mark.parametrize("how", ["option", "ini"])
def test_a_bad_server_value_stops_pytest_before_any_test(
    tmp_path: Path, how: str
) -> None:
    """A server that is neither redis, valkey nor a binary is a usage error before
    any test runs (it was found only when a test first asked for nodes, after the
    others had run)."""
    tests = """
    def test_plain():
        assert True

    def test_nodes(redlock_nodes):
        assert redlock_nodes
    """
    ini = "redlock_server = no-such-server\n" if how == "ini" else ""
    project = _bare(tmp_path / "site", tests, ini)
    args = ["--redlock-server", "no-such-server"] if how == "option" else []
    result = _pytest(project, *NO_DJANGO, *args)
    assert "is neither 'redis', 'valkey'" in result.stdout + result.stderr
    assert result.returncode == pytest.ExitCode.USAGE_ERROR, _report(result)
    assert " passed" not in result.stdout, _report(result)


def test_a_restarted_node_whose_port_was_taken_fails_instead_of_moving(
    tmp_path: Path,
) -> None:
    """A node keeps its port for every restart: when something took it meanwhile
    (another xdist worker's server), start() fails loudly; it came back on another
    port, and settings built from the old URL pointed at the squatter."""
    from redlock_django.testing import NodeSet, RedisNodeError

    node_set = NodeSet.create(1, tmp_path)
    [node] = node_set
    try:
        node_set.start_all()
        port = node.port
        node.stop()
        with socket.socket() as squatter:
            squatter.bind(("127.0.0.1", port))
            squatter.listen()
            with pytest.raises(RedisNodeError):
                node.start()
        assert node.port == port
        node.start()  # the port is free again
        assert node.port == port and node.client().ping()
    finally:
        node_set.stop_all()


def test_a_password_a_test_set_on_the_nodes_is_gone_for_the_next_test(
    tmp_path: Path,
) -> None:
    """``redlock_nodes`` gives each test its servers running and empty whatever an
    earlier test did: a node behind ``require_password`` is restarted (the next
    test's setup could not FLUSHALL, and every later test errored in setup)."""
    tests = """
    def test_with_a_password(redlock_nodes):
        redlock_nodes.require_password("pw")

    def test_after(redlock_nodes):
        assert redlock_nodes[0].client().ping()

    def test_after_that(redlock_nodes):
        assert redlock_nodes[0].client().ping()
    """
    result = _pytest(_bare(tmp_path / "site", tests), *NO_DJANGO)
    assert result.returncode == 0, _report(result)
    assert "3 passed" in result.stdout, _report(result)
