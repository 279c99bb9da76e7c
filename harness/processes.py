"""Child processes that cannot outlive the run: process groups, PR_SET_PDEATHSIG.

The demo, the chaos tool and the tests start app servers, Locust and helpers here,
each in its own process group, and stop them as groups; the same parent-death hook
keeps ``redis-server`` nodes (:mod:`redlock_django.testing.servers`) from outliving
a killed run.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
from pathlib import Path

# Shipped with the package (the pytest plugin's servers use them); kept here by name.
from redlock_django.testing._process import (  # noqa: F401
    die_with_parent,
    process_state,
)

REPO = Path(__file__).resolve().parent.parent
HOST = "127.0.0.1"
PREFERRED_PORTS = range(8001, 8100)
STOP_TIMEOUT = 8.0


def port_is_free(port: int) -> bool:
    """Return whether a TCP port on the loopback address can be bound now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind((HOST, port))
        except OSError:
            return False
        return True


def pick_ports(count: int) -> list[int]:
    """Return ``count`` free ports, 8001, 8002, ... when those are free."""
    ports: list[int] = []
    for port in PREFERRED_PORTS:
        if len(ports) == count:
            break
        if port_is_free(port):
            ports.append(port)
    while len(ports) < count:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.bind((HOST, 0))
            port = sock.getsockname()[1]
        if port not in ports:
            ports.append(port)
    return ports


class Children:
    """Child processes, each in its own process group, stopped as groups."""

    def __init__(self) -> None:
        self.processes: list[tuple[str, subprocess.Popen[bytes]]] = []

    def start(
        self, name: str, command: list[str], env: dict[str, str], log: Path
    ) -> subprocess.Popen[bytes]:
        with log.open("ab") as out:
            process = subprocess.Popen(
                command,
                cwd=REPO,
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                # Own session: a terminal's Ctrl-C reaches only this script,
                # which then stops each group in order.
                start_new_session=True,
                preexec_fn=die_with_parent(),
            )
        self.processes.append((name, process))
        return process

    def stop(self, process: subprocess.Popen[bytes]) -> None:
        """SIGTERM the process's group, SIGKILL it after a while; reap it."""
        group = process.pid  # start_new_session: the group id is the pid
        with contextlib.suppress(ProcessLookupError):
            os.killpg(group, signal.SIGTERM)
        try:
            process.wait(STOP_TIMEOUT)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(group, signal.SIGKILL)
            process.wait(STOP_TIMEOUT)
        # Workers left behind by a master that died first.
        with contextlib.suppress(ProcessLookupError):
            os.killpg(group, signal.SIGKILL)

    def stop_all(self) -> None:
        for _, process in reversed(self.processes):
            self.stop(process)
        self.processes.clear()


def children_of(parent: int) -> list[int]:
    """Return the pids of the direct children of process ``parent`` (Linux)."""
    workers = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        fields = stat.rsplit(")", 1)[1].split()
        if int(fields[1]) == parent:  # fields: state, ppid, ...
            workers.append(int(entry.name))
    return sorted(workers)


def gunicorn_workers(master: int) -> list[int]:
    """Return the pids of the worker processes of a gunicorn master (Linux)."""
    return children_of(master)


def log_tail(path: Path, lines: int = 15) -> str:
    """Return the last ``lines`` lines of a child's log, or say there is none."""
    try:
        text = path.read_text(errors="replace")
    except FileNotFoundError:
        return "(no log)"
    return "\n".join(text.splitlines()[-lines:]) or "(empty log)"
