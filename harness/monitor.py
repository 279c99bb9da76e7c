"""The commands a Redis node runs, read from its MONITOR stream, for assertions.

The stream is read from the raw socket, never through a file object with a
timeout: a ``socket.makefile()`` reader refuses every read after its first
timeout, so a quiet spell would silently end the listing.
"""

from __future__ import annotations

import contextlib
import secrets
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any


@contextlib.contextmanager
def monitoring(node: Any) -> Iterator[list[str]]:
    """Yield the list of MONITOR lines of what ``node`` runs while the block runs.

    The list fills from a reader thread. On leaving the block a marker command
    is sent and waited for, so every command the node ran before is listed.
    """
    lines: list[str] = []
    sock = socket.create_connection(("127.0.0.1", node.port), timeout=2.0)
    sock.sendall(b"MONITOR\r\n")
    ready = b""
    while b"\r\n" not in ready:
        data = sock.recv(65536)
        if not data:
            raise ConnectionError("the node closed the MONITOR connection")
        ready += data
    first, _, pending_start = ready.partition(b"\r\n")
    if first != b"+OK":
        raise ConnectionError(f"MONITOR refused: {first!r}")
    sock.settimeout(None)

    def read() -> None:
        pending = pending_start
        *complete, pending = pending.split(b"\r\n")
        lines.extend(line.decode(errors="replace") for line in complete)
        with contextlib.suppress(OSError):
            while data := sock.recv(65536):
                *complete, pending = (pending + data).split(b"\r\n")
                lines.extend(line.decode(errors="replace") for line in complete)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        yield lines
    finally:
        marker = f"monitoring-end-{secrets.token_hex(8)}"
        with contextlib.suppress(OSError):
            with socket.create_connection(("127.0.0.1", node.port), timeout=2.0) as c:
                c.sendall(f"ECHO {marker}\r\n".encode())
                c.recv(256)
            deadline = time.monotonic() + 2.0
            while time.monotonic() < deadline and not any(
                marker in line for line in lines[-50:]
            ):
                time.sleep(0.005)
        with contextlib.suppress(OSError):
            sock.shutdown(socket.SHUT_RDWR)
        reader.join(2)
        sock.close()
        lines[:] = [line for line in lines if marker not in line]
