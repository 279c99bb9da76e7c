"""Child processes that die with the test run: ``PR_SET_PDEATHSIG`` and process states.

Used by :mod:`redlock_django.testing.servers` for the server processes, and by the
project's own harness for the app servers and workers it starts.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any


@functools.cache
def _libc() -> ctypes.CDLL | None:
    name = ctypes.util.find_library("c")
    return ctypes.CDLL(name, use_errno=True) if name else None


def die_with_parent() -> Any:
    """Return a ``preexec_fn`` that makes the child die when this process dies.

    Linux only. ``PR_SET_PDEATHSIG`` fires when the *thread* that forked exits,
    so it is only used from the main thread, which lives as long as the run.
    """
    if not sys.platform.startswith("linux"):
        return None
    if threading.current_thread() is not threading.main_thread():
        return None
    libc = _libc()
    if libc is None:
        return None
    parent = os.getpid()
    pr_set_pdeathsig = 1

    def hook() -> None:
        libc.prctl(pr_set_pdeathsig, signal.SIGKILL)
        # The parent may have died before prctl ran: then nobody would kill us.
        if os.getppid() != parent:
            os._exit(1)

    return hook


def process_state(pid: int) -> str | None:
    """Return the one-letter state of ``pid`` ("T": stopped), or ``None`` if gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        if Path("/proc/self/stat").exists():
            return None
    else:
        return stat.rsplit(")", 1)[1].split()[0]
    # No procfs (macOS): ask ps.
    result = subprocess.run(
        ["ps", "-o", "state=", "-p", str(pid)], capture_output=True, text=True
    )
    return result.stdout.strip()[:1] or None
