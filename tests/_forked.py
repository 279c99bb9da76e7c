"""Run a piece of a test in a forked child process and get back what it said.

For faults the test process itself must not suffer: signal handlers that raise
at random points (a crash, a hang or a lost interruption stays in the child),
and state a signal handler leaves behind. The child inherits the test's settings
and servers; what ``work()`` returns (picklable) comes back through a pipe.
"""

from __future__ import annotations

import faulthandler
import multiprocessing
import os
import signal
import tempfile
import traceback
from collections.abc import Callable
from typing import Any, NamedTuple

__all__ = ["Report", "in_forked_child"]


class Report(NamedTuple):
    """How a child ended: ``outcome`` is "done" (``value`` is what ``work()``
    returned), "raised" (``value`` is the formatted exception), "silent" (no word
    within the wait: ``value`` is where its threads were then) or "ended" (it died
    without a word, ``exitcode`` says how)."""

    outcome: str
    value: Any
    exitcode: int | None


def _child(work: Callable[[], Any], conn: Any, stacks: Any, wait: float) -> None:
    # A hang is reported with where it hung: every thread's stack, written just
    # before the parent stops waiting.
    faulthandler.dump_traceback_later(max(wait - 1.0, 0.5), file=stacks)
    try:
        result = work()
        signal.setitimer(signal.ITIMER_REAL, 0)
        conn.send(("done", result))
    except BaseException as exc:  # reported to the parent, never swallowed
        signal.setitimer(signal.ITIMER_REAL, 0)
        conn.send(("raised", "".join(traceback.format_exception(exc))))
    finally:
        try:
            conn.close()
        finally:
            os._exit(0)


def in_forked_child(work: Callable[[], Any], wait: float) -> Report:
    """Run ``work()`` in a forked child; wait up to ``wait`` s for its word.

    A child still running after that (a hang) is killed.
    """
    context = multiprocessing.get_context("fork")
    ours, theirs = context.Pipe(duplex=False)
    with tempfile.TemporaryFile("w+") as stacks:
        child = context.Process(target=_child, args=(work, theirs, stacks, wait))
        child.start()
        theirs.close()
        try:
            if ours.poll(wait):
                outcome, value = ours.recv()
            else:
                stacks.seek(0)
                outcome, value = "silent", stacks.read()
        except EOFError:  # it ended without a word
            outcome, value = "ended", None
        finally:
            ours.close()
        child.join(10)
        if child.exitcode is None:
            child.kill()
            child.join()
    return Report(outcome, value, child.exitcode)
