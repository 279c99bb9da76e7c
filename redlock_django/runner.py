"""``manage.py redlock run``: run a program under a lock (cron jobs, scripts).

The wrapper acquires the lock, starts the program as its child and waits for it,
extending the lease in the background (no cap unless ``max_hold`` is given), then
releases the lock as soon as the job has ended. The job is the child's process
group: off a terminal (cron, systemd) the child leads a group of its own, so the
processes a shell line starts are signalled with it, and the lock is held until
the last of them has exited. On a terminal the child stays in the terminal's
foreground group (so it can read the terminal), where Ctrl-C reaches every process
of the job directly; signals from the wrapper then reach the child alone.
Meanwhile:

- SIGTERM, SIGINT, SIGHUP, SIGQUIT, SIGUSR1 and SIGUSR2 sent to the wrapper are
  forwarded to the job; the wrapper keeps the lock until the job has ended. Sent
  while the wrapper still waits for the lock, they end the wait: the command is
  not started and the run ends with 128+N. One ignored when the wrapper started
  (``nohup``) stays ignored, by the job too.
- The lease lost (the watchdog could not extend it on a quorum in time): the job
  gets SIGTERM, an ERROR log line says why, and the run ends with ``EXIT_LOST``.
- ``max_hold`` reached: the job gets SIGTERM (the lock is still held until it
  ends), a WARNING says so, and the run ends with ``EXIT_MAX_HOLD``.
- Either way, a job still running ``kill_after`` seconds after that SIGTERM gets
  SIGKILL: after a lost lease another run may be under way.
- The wrapper killed with SIGKILL: the child gets SIGTERM from the kernel (Linux,
  ``PR_SET_PDEATHSIG``) and the lock expires within its TTL.

Otherwise the run ends with the child's exit status, or 128+N when a signal N
killed it, as a shell reports it.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import ctypes.util
import logging
import math
import os
import random
import shlex
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from types import FrameType
from typing import Any

from django.core.management.base import CommandError

from . import signals
from .exceptions import LockError, LockLostError, QuorumUnavailableError
from .lock import Redlock

__all__ = [
    "DESCRIPTION",
    "EXIT_ALREADY_RUNNING",
    "EXIT_LOST",
    "EXIT_MAX_HOLD",
    "EXIT_NOT_EXECUTABLE",
    "EXIT_NOT_FOUND",
    "FORWARDED_SIGNALS",
    "MAX_LABEL_LENGTH",
    "USAGE",
    "CommandNotStartedError",
    "Runner",
    "add_arguments",
    "label_for",
    "main",
    "seconds_type",
]

logger = logging.getLogger(__name__)

#: EX_TEMPFAIL (sysexits.h): the lock is held by another run; try again later.
EXIT_ALREADY_RUNNING = 75
#: As ``timeout(1)``: the child ran past ``max_hold`` and was sent SIGTERM.
EXIT_MAX_HOLD = 124
#: The lease was lost while the child ran, so the child was sent SIGTERM.
EXIT_LOST = 125
#: As a shell: the program exists but cannot be executed, or does not exist.
EXIT_NOT_EXECUTABLE = 126
EXIT_NOT_FOUND = 127
#: The ``redlock`` command's own codes: refused (bad input), bad command line,
#: too few nodes answered. The command was not started.
EXIT_REFUSED = 1
EXIT_USAGE = 2
EXIT_NO_QUORUM = 3

#: A run that does not wait (``--wait 0``) and finds the lock held by nobody (a
#: split vote: runs started at the same moment on several servers each took a
#: minority) tries again this many times, a random retry delay apart.
SPLIT_RETRIES = 3
#: Default ``--kill-after``: seconds from the wrapper's own SIGTERM to SIGKILL.
KILL_AFTER = 10.0
#: How often the wrapper looks whether the job's process group has ended, and the
#: longest it waits for the child before looking at its deadlines again.
POLL = 0.05
WAKE = 0.25

USAGE = (
    "%(prog)s RESOURCE [--skip] [--wait SECONDS] [--ttl SECONDS] "
    "[--max-hold SECONDS] [--kill-after SECONDS] -- COMMAND [ARGS...]"
)
DESCRIPTION = f"""\
Acquire the lock on RESOURCE, run COMMAND, release the lock as soon as COMMAND
exits. The lease is extended while COMMAND runs, without a cap (REDLOCK['MAX_HOLD']
does not apply) unless --max-hold is given. Off a terminal, COMMAND runs in a
process group of its own: signals reach every process it started, and the lock is
held until the last of them has exited. SIGTERM, SIGINT, SIGHUP, SIGQUIT, SIGUSR1
and SIGUSR2 are forwarded to COMMAND (sent while waiting for the lock, they end
the wait: exit 128+N, not started). If the lock is lost while COMMAND runs, or
(on Linux) the wrapper is killed, COMMAND gets SIGTERM; still running
--kill-after seconds after a SIGTERM of the wrapper's own (lost lock,
--max-hold), it gets SIGKILL. The admin shows the command line as the lock's
label: keep secrets out of ARGS.

exit codes:
  N      COMMAND's own exit status (0 on success)
  128+N  COMMAND was killed by signal N (as a shell reports it), or the
         wrapper got signal N while waiting for the lock (not started)
  1      bad resource name or settings; COMMAND not started
  2      bad command line (no COMMAND after --); not started
  3      fewer than a quorum of nodes answered; not started
  {EXIT_ALREADY_RUNNING}     another run holds the lock (EX_TEMPFAIL); 0 with --skip
  {EXIT_MAX_HOLD}    COMMAND ran past --max-hold and was sent SIGTERM
  {EXIT_LOST}    the lock was lost while COMMAND ran (no quorum confirmed an
         extension in time), so COMMAND was sent SIGTERM
  {EXIT_NOT_EXECUTABLE}    COMMAND is not executable
  {EXIT_NOT_FOUND}    COMMAND was not found
"""

#: Forwarded signals that stay ignored, by the wrapper and the command, when the
#: wrapper starts with them ignored.
_KEPT_IGNORED = frozenset({signal.SIGHUP, signal.SIGINT, signal.SIGQUIT})
FORWARDED_SIGNALS = (
    signal.SIGTERM,
    signal.SIGINT,
    signal.SIGHUP,
    signal.SIGQUIT,
    signal.SIGUSR1,
    signal.SIGUSR2,
)

#: The admin label (the command line) is cut to this many characters.
MAX_LABEL_LENGTH = 200

_clock = time.monotonic


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the options of ``redlock run`` to its parser (the command follows --)."""
    parser.add_argument("resource", metavar="RESOURCE")
    parser.add_argument(
        "--skip",
        action="store_true",
        help="Exit 0 without running COMMAND when another run holds the lock.",
    )
    parser.add_argument(
        "--wait",
        type=seconds_type(allow_zero=True),
        default=0.0,
        metavar="SECONDS",
        help="Wait up to SECONDS for the lock before giving up (default: 0).",
    )
    parser.add_argument(
        "--ttl",
        type=seconds_type(),
        metavar="SECONDS",
        help="The lease: how long the lock outlives a killed wrapper "
        "(default: REDLOCK['TTL']).",
    )
    parser.add_argument(
        "--max-hold",
        type=seconds_type(),
        metavar="SECONDS",
        help=f"Send COMMAND SIGTERM after SECONDS (exit status {EXIT_MAX_HOLD}); "
        "the lock is held until it exits.",
    )
    parser.add_argument(
        "--kill-after",
        type=seconds_type(),
        default=KILL_AFTER,
        metavar="SECONDS",
        help="Send COMMAND SIGKILL when it still runs SECONDS after the SIGTERM "
        f"of a lost lock or --max-hold (default: {KILL_AFTER:g}).",
    )


def main(
    argv: Sequence[str],
    *,
    resource: str,
    skip: bool,
    wait: float,
    ttl: float | None,
    max_hold: float | None,
    kill_after: float = KILL_AFTER,
    **options: Any,
) -> int:
    """Run ``argv`` under the lock on ``resource``; return the exit status.

    Raises ``CommandError`` (with the exit code) when the command was not started.
    """
    if not argv:
        raise CommandError(
            "no command to run: give it after '--', as in "
            f"'redlock run {resource} -- COMMAND ARGS...'",
            returncode=EXIT_USAGE,
        )
    try:
        lock = Redlock(
            resource,
            ttl=ttl,
            auto_extend=True,
            max_hold=math.inf,
            label=label_for(argv),
        )
        work = Runner(lock, argv, max_hold=max_hold, kill_after=kill_after)
    except ValueError as exc:
        raise CommandError(str(exc), returncode=EXIT_REFUSED) from None
    previous: dict[int, Any] = {}
    try:
        work.install_handlers(previous)
        return _acquire_and_run(work, resource, skip, wait)
    except _Interrupted as stop:
        work.let_go()
        name = signal.Signals(stop.signum).name
        raise CommandError(
            f"{name} while waiting for {resource!r}; not running {argv[0]}",
            returncode=128 + stop.signum,
        ) from None
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


def _acquire_and_run(work: Runner, resource: str, skip: bool, wait: float) -> int:
    argv = work.argv
    try:
        try:
            acquired = work.acquire(wait)
        finally:
            work.waiting = False  # from now on, signals wait for the child
    except ValueError as exc:
        raise CommandError(str(exc), returncode=EXIT_REFUSED) from None
    except QuorumUnavailableError as exc:
        raise CommandError(
            f"not running {argv[0]}: {exc}", returncode=EXIT_NO_QUORUM
        ) from None
    if not acquired:
        if skip:
            logger.info("redlock run %r: already running; skipped", resource)
            return 0
        waited = f" after waiting {wait:g}s" if wait else ""
        raise CommandError(
            f"{resource!r} is already running (locked by another run){waited}; "
            f"not running {argv[0]}",
            returncode=EXIT_ALREADY_RUNNING,
        )
    try:
        return work.run()
    except CommandNotStartedError as exc:
        raise CommandError(str(exc), returncode=exc.status) from None


class _Interrupted(BaseException):
    """A forwarded signal came while the wrapper waited for the lock: stop waiting.

    A ``BaseException``, as KeyboardInterrupt is: the lock's flows run their
    clean-ups for it and let it through."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


class CommandNotStartedError(Exception):
    """The program could not be started; ``status`` is the shell's 126 or 127."""

    def __init__(self, message: str, status: int) -> None:
        super().__init__(message)
        self.status = status


def label_for(argv: Sequence[str]) -> str:
    """Return the admin label of a run: its command line, cut to a readable length."""
    line = shlex.join(argv)
    if len(line) > MAX_LABEL_LENGTH:
        line = line[: MAX_LABEL_LENGTH - 3] + "..."
    return line


class Runner:
    """Run ``argv`` as a child process while holding ``lock`` (auto-extended).

    ``install_handlers()`` and ``acquire()`` first (it returns False when another
    run holds the lock; a forwarded signal during it raises ``_Interrupted``), then
    ``run()``, which returns the exit status and always releases the lock.
    ``max_hold`` is a deadline in seconds from the start of the child, or None;
    ``kill_after`` the seconds from the wrapper's own SIGTERM to SIGKILL.
    """

    def __init__(
        self,
        lock: Redlock,
        argv: Sequence[str],
        max_hold: float | None = None,
        kill_after: float = KILL_AFTER,
    ) -> None:
        if not argv:
            raise ValueError("no command to run")
        self.lock = lock
        self.argv = list(argv)
        self.max_hold = max_hold
        self.kill_after = kill_after
        self.child: subprocess.Popen[bytes] | None = None
        #: Whether the child leads a process group of its own (off a terminal).
        self.own_group = not _on_terminal()
        #: Why the lease was lost, once the watchdog (or the release) says so.
        self.lost: str | None = None
        self.timed_out = False
        #: While True, a forwarded signal ends the wait for the lock.
        self.waiting = True
        #: When the job gets SIGKILL (after a SIGTERM of the wrapper's own).
        self._kill_at = math.inf
        self._pending: list[int] = []

    def acquire(self, wait: float) -> bool:
        """Acquire the lock, waiting up to ``wait`` seconds (0: do not wait).

        Not waiting, a refusal while nobody holds the lock is a split vote (runs
        started at once on several servers, each with a minority): it is tried
        again a few times, a random retry delay apart, so one of them runs.
        """
        if wait > 0:
            return self.lock.acquire(timeout=wait)
        for _ in range(SPLIT_RETRIES):
            if self.lock.acquire(blocking=False):
                return True
            if self.lock.locked():
                return False
            spec = self.lock._resolve().spec
            time.sleep(spec.retry_delay * random.random() + spec.retry_jitter)
        return self.lock.acquire(blocking=False)

    def let_go(self) -> None:
        """Release the lock if this wrapper holds it (an interrupted wait)."""
        with contextlib.suppress(LockError):
            while self.lock.depth:
                self.lock.release()

    def run(self) -> int:
        """Run the child under the held lock; return the exit status to exit with."""
        self.waiting = False
        signals.lock_lost.connect(self._on_lost, weak=False)
        try:
            if self._pending:
                # Told to stop before the child started: do not start it.
                return 128 + self._pending[0]
            if self.lost is None and self.lock.lost:
                self.lost = "the lease ran out before the command started"
            if self.lost is not None:
                return EXIT_LOST
            self.child = self._spawn()
            for signum in self._pending:
                self._signal(signum)
            if self.lost is not None:
                # Lost while the child was being started: the receiver missed it.
                self._terminate()
            status = self._wait(self.child)
        finally:
            signals.lock_lost.disconnect(self._on_lost)
            self._release()
        if self.lost is not None:
            return EXIT_LOST
        if self.timed_out:
            return EXIT_MAX_HOLD
        return status

    # The child.

    def _spawn(self) -> subprocess.Popen[bytes]:
        program = self.argv[0]
        try:
            return subprocess.Popen(
                self.argv,
                preexec_fn=_die_with_parent(),
                process_group=0 if self.own_group else None,
            )
        except FileNotFoundError:
            raise CommandNotStartedError(
                f"command not found: {program}", EXIT_NOT_FOUND
            ) from None
        except PermissionError:
            raise CommandNotStartedError(
                f"command not executable: {program}", EXIT_NOT_EXECUTABLE
            ) from None
        except OSError as exc:
            raise CommandNotStartedError(
                f"cannot run {program}: {exc.strerror or exc}", EXIT_NOT_EXECUTABLE
            ) from None

    def _wait(self, child: subprocess.Popen[bytes]) -> int:
        """Wait for the child, then for the rest of its group; return its status.

        Wakes at least every ``WAKE`` seconds for the deadlines: ``max_hold``, and
        the SIGKILL due ``kill_after`` a SIGTERM of the wrapper's own (the lease
        lost is noticed on the watchdog's thread).
        """
        deadline = math.inf if self.max_hold is None else _clock() + self.max_hold
        status: int | None = None
        while True:
            now = _clock()
            if now >= deadline and not self.timed_out:
                self.timed_out = True
                logger.warning(
                    "redlock run %r: the command ran past --max-hold=%gs; sending "
                    "SIGTERM to %s (pid %d), the lock is held until it exits "
                    "(exit status %d)",
                    self.lock.resource,
                    self.max_hold,
                    self.argv[0],
                    child.pid,
                    EXIT_MAX_HOLD,
                )
                self._terminate()
            if now >= self._kill_at:
                self._kill_at = math.inf
                logger.error(
                    "redlock run %r: %s (pid %d) still runs %gs after SIGTERM; "
                    "sending SIGKILL",
                    self.lock.resource,
                    self.argv[0],
                    child.pid,
                    self.kill_after,
                )
                self._signal(signal.SIGKILL)
            left = min(deadline if not self.timed_out else math.inf, self._kill_at)
            pause = max(0.0, min(left - _clock(), WAKE))
            if status is None:
                try:
                    code = child.wait(pause)
                except subprocess.TimeoutExpired:
                    continue
                # Killed by signal N: negative N from Popen, 128+N from a shell.
                status = 128 - code if code < 0 else code
                pause = 0.0
            if not (self.own_group and _group_alive(child.pid)):
                return status
            time.sleep(min(pause, POLL) if pause else POLL)

    def _terminate(self) -> None:
        """SIGTERM the job; SIGKILL follows after ``kill_after`` if it still runs."""
        self._signal(signal.SIGTERM)
        self._kill_at = min(self._kill_at, _clock() + self.kill_after)

    def _signal(self, signum: int) -> None:
        """Send ``signum`` to the job: the child's group, or the child alone."""
        child = self.child
        if child is None:
            return
        with contextlib.suppress(ProcessLookupError):
            if self.own_group:
                os.killpg(child.pid, signum)
            elif child.returncode is None:
                child.send_signal(signum)

    def _release(self) -> None:
        try:
            self.lock.release()
        except LockLostError as exc:
            if self.lost is None:
                self.lost = str(exc)
                logger.error(
                    "redlock run %r: the lock was lost while the command ran: %s "
                    "(exit status %d)",
                    self.lock.resource,
                    exc,
                    EXIT_LOST,
                )

    # Signals: forwarded to the child, and the lease lost.

    def install_handlers(self, previous: dict[int, Any]) -> None:
        """Catch the forwarded signals; note the handlers they replace in
        ``previous`` one by one (a signal may come half-way)."""
        for signum in FORWARDED_SIGNALS:
            if signum in _KEPT_IGNORED and signal.getsignal(signum) == signal.SIG_IGN:
                # Ignored when this process started (nohup; SIGINT and SIGQUIT
                # of a background job): the command inherits the ignore, as a
                # shell's command would, and neither is ended by it. Not SIGTERM:
                # the wrapper stops the command with it (a lost lock, the
                # wrapper's death), so the command must start able to get it.
                continue
            previous[signum] = signal.signal(signum, self._forward)

    def _forward(self, signum: int, frame: FrameType | None) -> None:
        if self.waiting:
            self.waiting = False  # once: the wait's clean-up is not cut short
            raise _Interrupted(signum)
        if self.child is None:
            self._pending.append(signum)
        else:
            self._signal(signum)

    def _on_lost(self, sender: type, lock: Redlock, reason: str, **kwargs: Any) -> None:
        """``lock_lost`` receiver (the watchdog's thread): stop the child."""
        if lock is not self.lock or self.lost is not None:
            return
        self.lost = reason
        child = self.child
        if child is None:
            return
        logger.error(
            "redlock run %r: lost the lock (%s); another run may start now, so "
            "sending SIGTERM to %s (pid %d) (exit status %d)",
            self.lock.resource,
            reason,
            self.argv[0],
            child.pid,
            EXIT_LOST,
        )
        self._terminate()


def seconds_type(*, allow_zero: bool = False) -> Callable[[str], float]:
    """Return an argparse ``type`` for a number of seconds (finite, > 0 or >= 0)."""

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"must be a number of seconds, not {text!r}"
            ) from None
        low_ok = value >= 0 if allow_zero else value > 0
        if not (math.isfinite(value) and low_ok):
            bound = ">= 0" if allow_zero else "> 0"
            raise argparse.ArgumentTypeError(
                f"must be a finite number of seconds {bound}, not {text}"
            )
        return value

    return parse


def _on_terminal() -> bool:
    """Whether the wrapper runs in its terminal's foreground process group."""
    try:
        return os.tcgetpgrp(sys.stdin.fileno()) == os.getpgrp()
    except (OSError, ValueError, AttributeError):
        return False


def _group_alive(pgid: int) -> bool:
    """Whether process group ``pgid`` still has a process; reaps those that are
    the wrapper's children (it may have inherited them)."""
    with contextlib.suppress(ChildProcessError):
        while os.waitpid(-pgid, os.WNOHANG)[0]:
            pass
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _die_with_parent() -> Callable[[], None] | None:
    """Return a ``preexec_fn`` that has the kernel SIGTERM the child if we die.

    Linux only (``PR_SET_PDEATHSIG``). It fires when the forking *thread* ends,
    so it is set only from the main thread, which lives as long as the wrapper.
    """
    if not sys.platform.startswith("linux"):
        return None
    if threading.current_thread() is not threading.main_thread():
        return None
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    prctl = ctypes.CDLL(name, use_errno=True).prctl
    parent = os.getpid()
    pr_set_pdeathsig = 1
    sigterm = int(signal.SIGTERM)

    def hook() -> None:
        prctl(pr_set_pdeathsig, sigterm)
        # The wrapper may have died before prctl ran: then nobody would tell us.
        if os.getppid() != parent:
            os._exit(EXIT_LOST)

    return hook
