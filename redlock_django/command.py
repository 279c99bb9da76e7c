"""``SingletonCommandMixin``: one run of a management command at a time, anywhere.

The lock is taken before the command's checks and ``handle()`` run, extended while
they run (no cap unless ``lock_max_hold`` is set) and released when ``execute()``
returns or raises. Another run holding it: ``CommandError`` with exit status 75
(EX_TEMPFAIL), or a quiet skip with ``--skip-if-running``, after ``--wait``.
"""

from __future__ import annotations

import logging
import math
from typing import Any

from django.core.management.base import CommandError, CommandParser

from .exceptions import LockLostError, QuorumUnavailableError
from .lock import Redlock
from .runner import (
    EXIT_ALREADY_RUNNING,
    EXIT_LOST,
    EXIT_NO_QUORUM,
    EXIT_REFUSED,
    seconds_type,
)

__all__ = ["SingletonCommandMixin"]

logger = logging.getLogger(__name__)


class SingletonCommandMixin:
    """Make a management command run on one server at a time.

    Put it before ``BaseCommand``: ``class Command(SingletonCommandMixin,
    BaseCommand)``. ``lock_resource`` names the lock (default
    ``"command:<name>"``), ``lock_ttl`` is its lease (how long it outlives a
    killed process; default ``REDLOCK["TTL"]``) and ``lock_max_hold`` caps the
    extensions (default: none; past the cap the lease runs out while
    ``handle()`` goes on). ``handle()`` can read ``self.lock.lost`` to stop early
    when the lease was lost; a lost lease ends the run with ``CommandError``
    (exit status 125) once ``handle()`` returns.
    """

    lock_resource: str | None = None
    lock_ttl: float | None = None
    lock_max_hold: float = math.inf
    #: The held lock while ``handle()`` runs.
    lock: Redlock | None = None

    def get_lock_resource(self) -> str:
        """Return the resource to lock: ``lock_resource`` or ``command:<name>``."""
        if self.lock_resource is not None:
            return self.lock_resource
        return f"command:{type(self).__module__.rsplit('.', 1)[-1]}"

    def create_parser(
        self, prog_name: str, subcommand: str, **kwargs: Any
    ) -> CommandParser:
        parser: CommandParser = super().create_parser(  # type: ignore[misc]
            prog_name, subcommand, **kwargs
        )
        parser.add_argument(
            "--skip-if-running",
            action="store_true",
            help="Exit 0 without running when another run holds the lock "
            f"(otherwise exit {EXIT_ALREADY_RUNNING}).",
        )
        parser.add_argument(
            "--wait",
            type=seconds_type(allow_zero=True),
            default=0.0,
            metavar="SECONDS",
            help="Wait up to SECONDS for another run to finish (default: 0).",
        )
        return parser

    def execute(self, *args: Any, **options: Any) -> Any:
        wait = options.get("wait") or 0.0
        # call_command() passes options without the parser's type checks.
        if (
            isinstance(wait, bool)
            or not isinstance(wait, int | float)
            or not 0 <= wait < math.inf
        ):
            raise CommandError(
                f"--wait must be a finite number of seconds >= 0, not {wait!r}",
                returncode=EXIT_REFUSED,
            )
        lock = self._make_lock()
        try:
            acquired = (
                lock.acquire(timeout=wait) if wait else lock.acquire(blocking=False)
            )
        except (TypeError, ValueError) as exc:
            raise CommandError(str(exc), returncode=EXIT_REFUSED) from None
        except QuorumUnavailableError as exc:
            raise CommandError(str(exc), returncode=EXIT_NO_QUORUM) from None
        if not acquired:
            if options.get("skip_if_running"):
                logger.info("%r is already running; skipped", lock.resource)
                return None
            raise CommandError(
                f"{lock.resource!r} is already running (locked by another run)",
                returncode=EXIT_ALREADY_RUNNING,
            )
        self.lock = lock
        failed = True
        try:
            result = super().execute(*args, **options)  # type: ignore[misc]
            failed = False
        finally:
            self.lock = None
            try:
                lock.release()
            except LockLostError as exc:
                if not failed:
                    raise CommandError(str(exc), returncode=EXIT_LOST) from None
                logger.error("%s", exc)
        return result

    def _make_lock(self) -> Redlock:
        try:
            return Redlock(
                self.get_lock_resource(),
                ttl=self.lock_ttl,
                auto_extend=True,
                max_hold=self.lock_max_hold,
                # One run at a time, even one started from the same thread.
                reentrant=False,
                label=f"manage.py {type(self).__module__.rsplit('.', 1)[-1]}",
            )
        except (TypeError, ValueError) as exc:
            raise CommandError(
                f"{type(self).__module__}: {exc}", returncode=EXIT_REFUSED
            ) from None
