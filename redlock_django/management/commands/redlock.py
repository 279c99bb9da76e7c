"""``manage.py redlock status | list | release | run``: locks from a shell.

``run`` lives in ``redlock_django.runner``; this file parses its command line.
"""

from __future__ import annotations

import argparse
import getpass
import json
import logging
import math
import sys
from collections.abc import Sequence
from typing import Any, TextIO

from django.core.exceptions import ImproperlyConfigured
from django.core.management.base import (
    BaseCommand,
    CommandError,
    CommandParser,
    DjangoHelpFormatter,
)

from redlock_django import listing, runner
from redlock_django.conf import get_settings
from redlock_django.keys import MAX_NAME_LENGTH, check_resource
from redlock_django.meta import printable
from redlock_django.protocol import has_quorum, quorum, unanswered_may_hold

logger = logging.getLogger(__name__)

#: Exit codes a script can rely on (1 is also Django's code for any CommandError).
EXIT_OK = 0
EXIT_REFUSED = 1
EXIT_NO_QUORUM = 3
EXIT_NOT_HELD = 4

EXIT_CODES = """\
exit codes:
  0  success
  1  error or refusal: bad settings or resource name, or a release not
     confirmed (no --yes while stdin is not a terminal, or an answer other than yes)
  2  bad command line
  3  fewer than a quorum of nodes answered: status; list, which then cannot
     show the locks held on the others; or release, which then cannot tell
     whether the lock is still held (it ends when its lease runs out); or run,
     which then did not start the command
  4  release found nothing to release: no lock on RESOURCE, or it changed
     hands or ended between being shown and being released
"""

# Written as the JSON keys of `list --json`, in this order: a stable interface.
JSON_KEYS = (
    "resource",
    "held_on",
    "node_count",
    "quorum",
    "below_quorum",
    "nodes",
    "other_tokens",
    "token_digest",
    "host",
    "pid",
    "holder",
    "label",
    "acquired_at",
    "ttl",
    "time_left",
    "fencing_token",
)


class _HelpFormatter(DjangoHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """Keep the line breaks of the exit-code table in ``--help``."""


class Command(BaseCommand):
    help = (
        "Inspect and operate Redlock locks:\n"
        "  status            the health of every node, and whether a quorum answers\n"
        "  list              the locks held now, merged across the nodes\n"
        "  release RESOURCE  force-release one lock, after confirmation\n"
        "  run RESOURCE -- COMMAND [ARGS...]  run a program while holding the lock\n\n"
        + EXIT_CODES
    )
    # A file-like object with isatty() and readline(), for tests; sys.stdin otherwise.
    stealth_options = ("stdin",)

    def create_parser(
        self, prog_name: str, subcommand: str, **kwargs: Any
    ) -> CommandParser:
        kwargs.setdefault("formatter_class", _HelpFormatter)
        return super().create_parser(prog_name, subcommand, **kwargs)

    def add_arguments(self, parser: CommandParser) -> None:
        verbs = parser.add_subparsers(dest="verb", metavar="VERB", required=True)
        status = verbs.add_parser(
            "status",
            help="Show each node's health and whether a quorum is reachable.",
            description=(
                "Show every node: masked address, reachable or not, PING latency, "
                "server (Redis or Valkey) and version, and lock keys. Exit 0 when "
                f"at least a quorum of nodes is reachable, {EXIT_NO_QUORUM} otherwise."
            ),
        )
        status.set_defaults(run=self.handle_status)
        list_locks = verbs.add_parser(
            "list",
            help="List the locks held now, merged across the nodes.",
            description=(
                "List the held locks: on how many (and which) nodes, the holder, "
                "when acquired, time left, fencing token and token digest. A lock "
                "held on fewer than a quorum of nodes is flagged. Exit 0, or 3 "
                "when the nodes that did not answer could hold locks of their own "
                "(a quorum of them): no list can be trusted then."
            ),
        )
        list_locks.add_argument(
            "--prefix",
            default="",
            metavar="TEXT",
            help="Only resources whose name starts with TEXT.",
        )
        list_locks.add_argument(
            "--json",
            action="store_true",
            help="Print a JSON array of objects (keys: " + ", ".join(JSON_KEYS) + ").",
        )
        list_locks.set_defaults(run=self.handle_list)
        release = verbs.add_parser(
            "release",
            help="Force-release one lock, whoever holds it.",
            formatter_class=argparse.RawDescriptionHelpFormatter,
            description=(
                "Show the lock on RESOURCE, ask for confirmation, then delete it on\n"
                "every node where it is still held by the token shown: a lock that\n"
                "changed hands meanwhile is left alone. The holder is not told; its\n"
                "next extend or release fails. Logged as a WARNING with the OS user.\n"
                "\n" + EXIT_CODES
            ),
        )
        release.add_argument("resource", metavar="RESOURCE")
        release.add_argument(
            "--yes",
            action="store_true",
            help="Do not ask for confirmation (required when stdin is not a terminal).",
        )
        release.set_defaults(run=self.handle_release)
        run = verbs.add_parser(
            "run",
            help="Run a program while holding the lock; 75 if already running.",
            usage=runner.USAGE,
            formatter_class=argparse.RawDescriptionHelpFormatter,
            description=runner.DESCRIPTION,
        )
        runner.add_arguments(run)
        run.set_defaults(run=self.handle_run)
        for verb in (status, list_locks, release, run):
            _accept_base_options(verb)

    def run_from_argv(self, argv: list[str]) -> None:
        # argparse cannot tell a subcommand's options from the program's after
        # "--", so the program's command line is split off first; release keeps
        # its "--", which ends its options (a resource named "-x:job").
        if "--" in argv and not _names_verb(argv[: argv.index("--")], "release"):
            at = argv.index("--")
            argv, self._command_line = argv[:at], argv[at + 1 :]
        super().run_from_argv(argv)

    def handle(self, *args: Any, **options: Any) -> None:
        try:
            get_settings()
        except ImproperlyConfigured as exc:
            raise CommandError(str(exc), returncode=EXIT_REFUSED) from None
        if getattr(self, "_command_line", None) and options["verb"] != "run":
            raise CommandError(
                f"'--' and a command line are only for 'run', not {options['verb']!r}",
                returncode=runner.EXIT_USAGE,
            )
        options["run"](**options)

    # --- status ---------------------------------------------------------------------

    def handle_status(self, **options: Any) -> None:
        statuses = listing.node_status()
        rows = [
            [
                str(status.index),
                status.address,
                "yes" if status.reachable else "no",
                "-" if status.latency_ms is None else f"{status.latency_ms:.2f}",
                status.server_version or "-",
                _lock_keys(status.lock_keys),
                status.error or "",
            ]
            for status in statuses
        ]
        self._table(
            ["node", "address", "reachable", "latency ms", "server", "lock keys", ""],
            rows,
        )
        reachable = sum(status.reachable for status in statuses)
        needed = quorum(len(statuses))
        summary = f"{reachable}/{len(statuses)} nodes reachable, quorum {needed}"
        if not has_quorum(reachable, len(statuses)):
            self.stdout.write(self.style.ERROR(summary))
            raise CommandError(
                f"fewer than a quorum of nodes reachable ({summary}): locks cannot "
                "be acquired",
                returncode=EXIT_NO_QUORUM,
            )
        self.stdout.write(self.style.SUCCESS(summary))

    # --- list -----------------------------------------------------------------------

    def handle_list(self, *, prefix: str, **options: Any) -> None:
        failed: dict[str, str] = {}
        resources = [
            resource
            for resource in listing.lock_resources(prefix, failed=failed)
            if resource.startswith(prefix)
        ]
        held = listing.describe(resources, failed=failed)
        for address, reason in failed.items():
            # stderr, so that --json output stays parseable.
            self.stderr.write(
                f"warning: {address} did not answer ({reason}); "
                "the listing shows the other nodes"
            )
        count = len(get_settings().nodes)
        # The silent nodes could hold a quorum of their own: "no locks" or a
        # short list would be a claim nobody can make.
        unsure = unanswered_may_hold(len(failed), count)
        if options["json"]:
            self.stdout.write(_dumps([_as_json(lock) for lock in held]))
        elif held:
            self._locks(held)
            below = sum(lock.below_quorum for lock in held)
            self.stdout.write(
                f"{len(held)} lock(s) held"
                + (f", {below} below quorum" if below else "")
            )
        elif not unsure:
            self.stdout.write("no locks held")
        if unsure:
            raise CommandError(
                f"cannot tell which locks are held: {len(failed)}/{count} nodes did "
                f"not answer ({_reasons(failed)}); locks held on them are not listed",
                returncode=EXIT_NO_QUORUM,
            )

    def _locks(self, held: Sequence[listing.ListedLock]) -> None:
        rows = [
            [
                lock.resource,
                f"{lock.held_on}/{lock.node_count}",
                ",".join(map(str, lock.nodes)),
                _holder(lock),
                lock.label,
                _when(lock),
                _seconds(lock.time_left),
                "-" if lock.fencing_token is None else str(lock.fencing_token),
                lock.token_digest,
                _flags(lock),
            ]
            for lock in held
        ]
        self._table(
            [
                "resource",
                "held",
                "nodes",
                "holder",
                "label",
                "acquired at (UTC)",
                "time left",
                "fence",
                "token",
                "",
            ],
            rows,
        )

    # --- release --------------------------------------------------------------------

    def handle_release(self, *, resource: str, yes: bool, **options: Any) -> None:
        try:
            check_resource(resource, MAX_NAME_LENGTH)
        except ValueError as exc:
            raise CommandError(str(exc), returncode=EXIT_REFUSED) from None
        failed: dict[str, str] = {}
        shown = listing.describe([resource], failed=failed)
        if not shown:
            count = len(get_settings().nodes)
            if unanswered_may_hold(len(failed), count):
                raise CommandError(
                    f"cannot tell whether {resource!r} is locked: {len(failed)}/"
                    f"{count} nodes did not answer ({_reasons(failed)})",
                    returncode=EXIT_NO_QUORUM,
                )
            raise CommandError(
                f"no lock held on {resource!r}: nothing to release"
                + (f" (did not answer: {_reasons(failed)})" if failed else ""),
                returncode=EXIT_NOT_HELD,
            )
        (lock,) = shown
        self._locks(shown)
        if not yes:
            self._confirm(lock, options.get("stdin") or sys.stdin)

        outcome = listing.force_release(resource, lock.token_digest)
        conf = get_settings()
        for node in conf.nodes:
            if node.display in outcome.failed:
                result = self.style.ERROR(f"failed: {outcome.failed[node.display]}")
            elif node.index in outcome.released:
                result = self.style.SUCCESS("released")
            else:
                result = f"not held by token {lock.token_digest}"
            self.stdout.write(f"node[{node.index}] {node.display}: {result}")
        logger.warning(
            "redlock force release of %r (token %s) by OS user %s: "
            "released on nodes %s, failed on %s",
            resource,
            lock.token_digest,
            _os_user(),
            list(outcome.released) or "none",
            ", ".join(outcome.failed) or "none",
        )

        count = len(conf.nodes)
        if outcome.changed:
            raise CommandError(
                f"nothing released: the lock on {resource!r} changed hands or ended "
                "after it was shown",
                returncode=EXIT_NOT_HELD,
            )
        if unanswered_may_hold(len(outcome.failed), count):
            raise CommandError(
                f"released {resource!r} on {len(outcome.released)}/{count} nodes, but "
                f"{len(outcome.failed)} could not be reached: the lock may still be "
                "held until its lease runs out",
                returncode=EXIT_NO_QUORUM,
            )
        self.stdout.write(
            self.style.SUCCESS(
                f"released {resource!r} on {len(outcome.released)}/{count} nodes"
            )
        )

    # --- run ----------------------------------------------------------------------

    def handle_run(self, **options: Any) -> None:
        status = runner.main(getattr(self, "_command_line", []), **options)
        if status:
            raise SystemExit(status)

    def _confirm(self, lock: listing.ListedLock, stdin: TextIO) -> None:
        if not stdin.isatty():
            raise CommandError(
                f"not releasing {lock.resource!r}: stdin is not a terminal to "
                "confirm on; pass --yes to release without confirmation",
                returncode=EXIT_REFUSED,
            )
        self.stdout.write(
            f"Force-release {lock.resource!r} (token {lock.token_digest}, held on "
            f"{lock.held_on}/{lock.node_count} nodes)? Its holder is not told. "
            "Type 'yes' to release: ",
            ending="",
        )
        self.stdout.flush()
        answer = stdin.readline().strip().lower()
        if answer not in ("y", "yes"):
            raise CommandError(
                f"not releasing {lock.resource!r}: not confirmed",
                returncode=EXIT_REFUSED,
            )

    # --- output ---------------------------------------------------------------------

    def _table(self, header: list[str], rows: list[list[str]]) -> None:
        rows = [[printable(cell) for cell in row] for row in rows]
        widths = [
            max(len(row[column]) for row in [header, *rows])
            for column in range(len(header))
        ]
        for row in [header, *rows]:
            line = "  ".join(
                cell.ljust(width) for cell, width in zip(row, widths, strict=True)
            )
            self.stdout.write(line.rstrip())


def _names_verb(argv: Sequence[str], verb: str) -> bool:
    """Whether ``verb`` is the first verb named in ``argv`` (program and command
    name first)."""
    verbs = ("status", "list", "release", "run")
    return next((arg for arg in argv[2:] if arg in verbs), None) == verb


def _accept_base_options(parser: argparse.ArgumentParser) -> None:
    """Let Django's common options follow the verb too: ``redlock status -v 0``.

    Defaults are suppressed, so an option given before the verb is not reset by the
    verb's parser; the options are documented once, in the command's own help.
    """
    hidden = argparse.SUPPRESS
    parser.add_argument(
        "-v", "--verbosity", type=int, choices=[0, 1, 2, 3], default=hidden, help=hidden
    )
    for name in ("--settings", "--pythonpath"):
        parser.add_argument(name, default=hidden, help=hidden)
    for name in ("--traceback", "--no-color", "--force-color", "--skip-checks"):
        parser.add_argument(name, action="store_true", default=hidden, help=hidden)


def _lock_keys(count: int | None) -> str:
    if count is None:
        return "-"
    # The count stops at SCAN_CAP: say "at least".
    return f">={count}" if count >= listing.SCAN_CAP else str(count)


def _holder(lock: listing.ListedLock) -> str:
    where = lock.host or "?"
    if lock.pid is not None:
        where += f":{lock.pid}"
    return f"{where} {lock.holder}" if lock.holder else where


def _when(lock: listing.ListedLock) -> str:
    if lock.acquired_at is None:
        return "-"
    return lock.acquired_at.strftime("%Y-%m-%d %H:%M:%S")


def _seconds(value: float) -> str:
    return "no expiry" if math.isinf(value) else f"{value:.1f}s"


def _flags(lock: listing.ListedLock) -> str:
    flags = []
    if lock.below_quorum:
        flags.append(f"BELOW QUORUM ({lock.quorum})")
    if lock.other_tokens:
        flags.append(f"{lock.other_tokens} node(s) with another token")
    return "; ".join(flags)


def _as_json(lock: listing.ListedLock) -> dict[str, object]:
    values: dict[str, object] = {
        "resource": lock.resource,
        "held_on": lock.held_on,
        "node_count": lock.node_count,
        "quorum": lock.quorum,
        "below_quorum": lock.below_quorum,
        "nodes": list(lock.nodes),
        "other_tokens": lock.other_tokens,
        "token_digest": lock.token_digest,
        "host": lock.host,
        "pid": lock.pid,
        "holder": lock.holder,
        "label": lock.label,
        "acquired_at": (
            None if lock.acquired_at is None else lock.acquired_at.isoformat()
        ),
        "ttl": lock.ttl,
        # JSON has no infinity: a key without expiry is null.
        "time_left": None if math.isinf(lock.time_left) else round(lock.time_left, 3),
        "fencing_token": lock.fencing_token,
    }
    return {name: values[name] for name in JSON_KEYS}


def _reasons(failed: dict[str, str]) -> str:
    return "; ".join(f"{address}: {reason}" for address, reason in failed.items())


def _dumps(value: object) -> str:
    return json.dumps(value, indent=2, ensure_ascii=False)


def _os_user() -> str:
    try:
        return getpass.getuser()
    except (OSError, KeyError):  # no login name and no passwd entry (containers)
        return "unknown"
