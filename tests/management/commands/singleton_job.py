"""A management command made a singleton by ``SingletonCommandMixin``, for tests.

It appends its pid to ``DIR/runs`` and, with ``--hold``, waits for ``DIR/go``
before returning, so a test can keep it running while another run starts.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

from django.core.management.base import BaseCommand, CommandParser

from redlock_django import SingletonCommandMixin


class Command(SingletonCommandMixin, BaseCommand):
    help = "Record a run in DIR; with --hold, wait for DIR/go."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("directory", type=Path)
        parser.add_argument("--hold", action="store_true")

    def handle(self, *args: Any, directory: Path, hold: bool, **options: Any) -> None:
        with (directory / "runs").open("a") as runs:
            runs.write(f"{os.getpid()}\n")
        if hold:
            deadline = time.monotonic() + 60.0
            while not (directory / "go").exists() and time.monotonic() < deadline:
                time.sleep(0.02)
        assert self.lock is not None and self.lock.owned()
        self.stdout.write("done")
