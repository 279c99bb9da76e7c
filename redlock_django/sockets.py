"""Closing a connection the driver gave up on, so that nothing it wrote lands later.

A command written into a network partition sits in the kernel's send queue,
unacknowledged, and the kernel retransmits it, even after the socket is closed,
until the peer acknowledges. When the partition heals, a failed attempt's
``SET NX PX`` would then run on the node after the attempt's clean-up, and hold the
lock for a whole TTL for nobody. Closing with ``SO_LINGER`` 0 sends a reset and
discards the queue instead: a command given up on either reached the node while
its attempt waited, or never does.
"""

from __future__ import annotations

import contextlib
import os
import socket
import struct
import sys
from typing import Any

try:  # POSIX only; elsewhere nothing can tell, and unacknowledged() says False
    import fcntl
    import termios
except ImportError:  # pragma: no cover - Windows
    fcntl = termios = None  # type: ignore[assignment]

__all__ = ["reset_on_close", "shut_down", "unacknowledged"]

_LINGER_ZERO = struct.pack("ii", 1, 0)
#: Linux's SIOCOUTQ (the tty's TIOCOUTQ number): bytes written on a TCP socket and
#: not yet acknowledged. Other systems give that number other meanings.
_OUTQ = (
    getattr(termios, "TIOCOUTQ", None)
    if fcntl is not None and sys.platform.startswith("linux")
    else None
)


def reset_on_close(sock: Any) -> None:
    """Make closing ``sock`` a reset that throws away what was not delivered."""
    with contextlib.suppress(OSError, AttributeError, ValueError):
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, _LINGER_ZERO)


def shut_down(sock: Any) -> None:
    """End the connection of ``sock`` for both sides at once, without closing its
    descriptor (its transport does, when collected).

    Through a duplicate of the descriptor: uvloop hands out a ``PseudoSocket``
    whose own ``shutdown()`` raises ``TypeError``; the connection is the same.
    """
    with (
        contextlib.suppress(OSError, AttributeError, TypeError, ValueError),
        socket.socket(fileno=os.dup(sock.fileno())) as duplicate,
    ):
        duplicate.shutdown(socket.SHUT_RDWR)


def unacknowledged(sock: Any) -> bool:
    """Whether bytes written on ``sock`` still wait for the peer's acknowledgement.

    Such a command may not have reached the node yet (its host did not
    acknowledge it): a partition, not a slow server. False where the platform
    cannot tell.
    """
    if _OUTQ is None or sock is None:
        return False
    try:
        out = fcntl.ioctl(sock.fileno(), _OUTQ, b"\0\0\0\0")
    except (OSError, AttributeError, ValueError):
        return False
    queued: int = struct.unpack("i", out)[0]
    return queued > 0
