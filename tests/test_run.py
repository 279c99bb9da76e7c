"""``manage.py redlock run`` and ``SingletonCommandMixin``, run as a user runs them.

Every run is a real ``python -m django`` process with a settings module written for
the test (``REDLOCK`` pointed at the test nodes); the program it runs is
``tests/_run_child.py``, which records what happened to it in a directory. Faults
come from outside: signals to the wrapper, SIGKILL, SIGSTOP of a majority of nodes.
"""

from __future__ import annotations

import io
import itertools
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from django.core.management import CommandError, call_command

from harness.held import held_on
from harness.nodes import NodeSet
from redlock_django import Redlock
from redlock_django.runner import (
    EXIT_ALREADY_RUNNING,
    EXIT_LOST,
    EXIT_MAX_HOLD,
    EXIT_NOT_FOUND,
)
from tests.management.commands.singleton_job import Command as SingletonJob

REPO = Path(__file__).resolve().parent.parent
CHILD = [sys.executable, str(REPO / "tests" / "_run_child.py")]
#: Bounds every wait on a process: far above what a run takes on a busy CI box.
TIMEOUT = 30.0
RESOURCE = "cron:job"


@pytest.fixture
def env(tmp_path: Path, nodes: NodeSet) -> dict[str, str]:
    """The environment of a ``python -m django`` process using the test nodes."""
    settings_dir = tmp_path / "settings"
    settings_dir.mkdir()
    config = {
        "NODES": nodes.urls,
        "TTL": 10.0,
        # Three Django processes and five servers share two cores.
        "NODE_TIMEOUT": 0.2,
        "RETRY_DELAY": 0.02,
        "RETRY_JITTER": 0.02,
    }
    (settings_dir / "run_settings.py").write_text(
        f"from tests.settings import *  # noqa: F403\n\nREDLOCK = {config!r}\n"
    )
    path = [str(settings_dir), str(REPO), os.environ.get("PYTHONPATH", "")]
    return dict(
        os.environ,
        PYTHONPATH=os.pathsep.join(filter(None, path)),
        DJANGO_SETTINGS_MODULE="run_settings",
    )


@pytest.fixture
def work(tmp_path: Path) -> Path:
    """The directory where the child records its runs, counter and signals."""
    directory = tmp_path / "work"
    directory.mkdir()
    return directory


@pytest.fixture
def processes() -> Iterator[list[subprocess.Popen[str]]]:
    """Processes a test starts; any still running at its end are killed."""
    started: list[subprocess.Popen[str]] = []
    yield started
    for process in started:
        if process.poll() is None:
            process.kill()
            process.wait()


@pytest.fixture
def start(
    env: dict[str, str], processes: list[subprocess.Popen[str]]
) -> Callable[..., subprocess.Popen[str]]:
    """Return ``start(*args)``: run ``python -m django *args`` in the background."""

    def spawn(*args: str) -> subprocess.Popen[str]:
        process = subprocess.Popen(
            [sys.executable, "-m", "django", *args],
            env=env,
            cwd=REPO,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        processes.append(process)
        return process

    return spawn


def finish(process: subprocess.Popen[str]) -> tuple[int, str, str]:
    """Wait for ``process``; return its exit status, stdout and stderr."""
    out, err = process.communicate(timeout=TIMEOUT)
    return process.returncode, out, err


def lines(path: Path) -> list[str]:
    return path.read_text().splitlines() if path.exists() else []


def wait_for(condition: Callable[[], object], timeout: float = TIMEOUT) -> float:
    """Wait until ``condition()`` is true; return the seconds it took."""
    started = time.monotonic()
    while not condition():
        assert time.monotonic() - started < timeout, "timed out"
        time.sleep(0.01)
    return time.monotonic() - started


def intervals(work: Path) -> list[tuple[float, float]]:
    """The (start, end) wall-clock times of each count run, sorted."""
    starts = {pid: float(t) for pid, t in (ln.split() for ln in lines(work / "runs"))}
    ends = {pid: float(t) for pid, t in (ln.split() for ln in lines(work / "ends"))}
    return sorted((starts[pid], ends[pid]) for pid in starts)


def overlaps(spans: list[tuple[float, float]]) -> int:
    return sum(later[0] < earlier[1] for earlier, later in itertools.pairwise(spans))


# --- one run at a time --------------------------------------------------------------


def test_three_runs_started_together_run_the_command_once(
    start: Callable[..., subprocess.Popen[str]], work: Path, nodes: NodeSet
) -> None:
    """One wrapper runs the command; the other two exit 75 with one line each."""
    count = [*CHILD, "count", str(work), "0.1", "--hold"]
    runs = [start("redlock", "run", RESOURCE, "--", *count) for _ in range(3)]
    # The winner's command stays inside until both others have given up.
    wait_for(lambda: sum(run.poll() is not None for run in runs) == 2)
    losers = [run for run in runs if run.poll() is not None]
    for loser in losers:
        code, out, err = finish(loser)
        assert code == EXIT_ALREADY_RUNNING
        assert out == ""
        assert err.strip().splitlines() == [
            f"CommandError: '{RESOURCE}' is already running (locked by another "
            f"run); not running {sys.executable}"
        ]
    (work / "go").touch()
    (winner,) = [run for run in runs if run not in losers]
    assert finish(winner)[0] == 0
    assert len(lines(work / "runs")) == 1
    # Released before the wrapper exited, not left to expire.
    assert held_on(nodes, RESOURCE) == 0


def test_without_the_lock_three_runs_overlap_and_lose_updates(work: Path) -> None:
    """The negative control: the same command started three times, unlocked."""
    children = [subprocess.Popen([*CHILD, "count", str(work), "0.5"]) for _ in range(3)]
    assert [child.wait(TIMEOUT) for child in children] == [0, 0, 0]
    assert len(lines(work / "runs")) == 3
    assert overlaps(intervals(work)) >= 1
    assert int((work / "counter").read_text()) < 3


def test_waiting_runs_take_turns_and_lose_no_update(
    start: Callable[..., subprocess.Popen[str]], work: Path, nodes: NodeSet
) -> None:
    """With --wait the three runs all happen, one after the other."""
    count = [*CHILD, "count", str(work), "0.5"]
    runs = [
        start("redlock", "run", RESOURCE, "--wait", "60", "--", *count)
        for _ in range(3)
    ]
    assert [finish(run)[0] for run in runs] == [0, 0, 0]
    assert int((work / "counter").read_text()) == 3
    assert overlaps(intervals(work)) == 0
    assert held_on(nodes, RESOURCE) == 0


# --- exit status --------------------------------------------------------------------


def test_the_commands_exit_status_is_passed_through(
    start: Callable[..., subprocess.Popen[str]], nodes: NodeSet
) -> None:
    """0, the command's own status, 128+N when killed by signal N, 127 not found."""
    cases = [
        ("exit 0", 0),
        ("exit 3", 3),
        ("kill -TERM $$", 128 + signal.SIGTERM),
        ("kill -KILL $$", 128 + signal.SIGKILL),
    ]
    for script, expected in cases:
        code, _, err = finish(
            start("redlock", "run", RESOURCE, "--", "sh", "-c", script)
        )
        assert (script, code, err) == (script, expected, "")
        assert held_on(nodes, RESOURCE) == 0
    code, _, err = finish(start("redlock", "run", RESOURCE, "--", "no-such-program-x"))
    assert code == EXIT_NOT_FOUND
    assert err.strip() == "CommandError: command not found: no-such-program-x"
    assert held_on(nodes, RESOURCE) == 0


def test_a_held_lock_exits_75_skips_or_waits(
    start: Callable[..., subprocess.Popen[str]],
    hold: Callable[..., Redlock],
    work: Path,
    nodes: NodeSet,
) -> None:
    """Held elsewhere: 75 at once; 0 with --skip; 75 after --wait; runs once freed."""
    # Four Django processes start before the release: on a loaded machine that
    # can outlast the default 10 s lease, which would free the lock early.
    holder = hold(RESOURCE, ttl=120)
    count = [*CHILD, "count", str(work)]
    code, out, err = finish(start("redlock", "run", RESOURCE, "--", *count))
    assert (code, out) == (EXIT_ALREADY_RUNNING, "")
    assert len(err.strip().splitlines()) == 1
    assert finish(start("redlock", "run", RESOURCE, "--skip", "--", *count)) == (
        0,
        "",
        "",
    )
    before = time.monotonic()
    code, _, err = finish(
        start("redlock", "run", RESOURCE, "--wait", "1", "--", *count)
    )
    assert code == EXIT_ALREADY_RUNNING
    assert "after waiting 1s" in err
    assert time.monotonic() - before >= 1.0
    assert not (work / "runs").exists()

    waiting = start("redlock", "run", RESOURCE, "--wait", "30", "--", *count)
    time.sleep(2.0)
    assert waiting.poll() is None and not (work / "runs").exists()
    holder.release()
    assert finish(waiting)[0] == 0
    assert len(lines(work / "runs")) == 1


# --- signals and the lease ----------------------------------------------------------


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_to_the_wrapper_is_forwarded_to_the_command(
    start: Callable[..., subprocess.Popen[str]],
    work: Path,
    nodes: NodeSet,
    signum: signal.Signals,
) -> None:
    """The command gets the signal, its status (7) is the run's; lock freed at once."""
    wrapper = start("redlock", "run", RESOURCE, "--", *CHILD, "trap", str(work))
    wait_for((work / "ready").exists)
    assert held_on(nodes, RESOURCE) == len(nodes)
    wrapper.send_signal(signum)
    code, _, err = finish(wrapper)
    assert (code, err) == (7, "")
    assert lines(work / "signals") == [signum.name]
    assert held_on(nodes, RESOURCE) == 0


def test_after_kill_9_of_the_wrapper_the_command_gets_sigterm_and_the_lock_expires(
    start: Callable[..., subprocess.Popen[str]], work: Path, nodes: NodeSet
) -> None:
    """The kernel tells the command (PR_SET_PDEATHSIG); the lease ends within TTL."""
    ttl = 2.0
    wrapper = start(
        "redlock", "run", RESOURCE, "--ttl", str(ttl), "--", *CHILD, "trap", str(work)
    )
    wait_for((work / "ready").exists)
    wrapper.kill()
    killed = time.monotonic()
    wrapper.wait(TIMEOUT)
    assert held_on(nodes, RESOURCE) == len(nodes)  # nobody released it
    wait_for(lambda: lines(work / "signals") == ["SIGTERM"], timeout=5.0)
    wait_for(lambda: held_on(nodes, RESOURCE) == 0, timeout=ttl + 1.0)
    assert time.monotonic() - killed <= ttl + 0.5


def test_a_lost_lease_sends_sigterm_to_the_command(
    start: Callable[..., subprocess.Popen[str]], work: Path, nodes: NodeSet
) -> None:
    """A majority of nodes frozen past the TTL: SIGTERM, a log line, exit 125."""
    ttl = 1.5
    wrapper = start(
        "redlock", "run", RESOURCE, "--ttl", str(ttl), "--", *CHILD, "trap", str(work)
    )
    wait_for((work / "ready").exists)
    for node in nodes[:3]:
        node.pause()
    paused = time.monotonic()
    code, _, err = finish(wrapper)
    took = time.monotonic() - paused
    assert code == EXIT_LOST
    assert lines(work / "signals") == ["SIGTERM"]
    assert f"redlock run '{RESOURCE}': lost the lock" in err
    assert "sending SIGTERM" in err
    # The watchdog gives up when the lease runs out, not later.
    assert took < ttl + 2.0
    # What the SIGTERM guards against: the lock is free for another run now.
    nodes.resume_all()
    other = Redlock(RESOURCE, nodes=nodes.urls)
    assert other.acquire(blocking=False)
    other.release()


def test_past_max_hold_the_command_gets_sigterm_and_the_run_exits_124(
    start: Callable[..., subprocess.Popen[str]], work: Path, nodes: NodeSet
) -> None:
    wrapper = start(
        "redlock", "run", RESOURCE, "--max-hold", "1", "--", *CHILD, "trap", str(work)
    )
    code, _, err = finish(wrapper)
    assert code == EXIT_MAX_HOLD
    assert lines(work / "signals") == ["SIGTERM"]
    assert "ran past --max-hold=1s" in err
    assert held_on(nodes, RESOURCE) == 0


def test_the_admin_label_is_the_command_line(
    start: Callable[..., subprocess.Popen[str]], work: Path, env: dict[str, str]
) -> None:
    wrapper = start("redlock", "run", RESOURCE, "--", *CHILD, "trap", str(work))
    wait_for((work / "ready").exists)
    listed = subprocess.run(
        [sys.executable, "-m", "django", "redlock", "list", "--json"],
        env=env,
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
    )
    wrapper.terminate()
    finish(wrapper)
    assert f'"label": "{sys.executable} {CHILD[1]} trap {work}"' in listed.stdout


# --- bad input ----------------------------------------------------------------------


@pytest.fixture
def commands_processed(nodes: NodeSet) -> Iterator[Callable[[], list[int]]]:
    """Return a function reading each node's count of commands processed.

    It reads over the same open connections every time: a new connection would
    send CLIENT SETINFO. The first INFO is counted by the second.
    """
    clients = [node.client() for node in nodes]

    def read() -> list[int]:
        return [int(c.info("stats")["total_commands_processed"]) for c in clients]

    yield read
    for client in clients:
        client.close()


@pytest.mark.parametrize(
    ("args", "code", "message"),
    [
        (["run", "bad\x01name", "--", "true"], 1, "contains control characters"),
        (["run", "x" * 2000, "--", "true"], 1, "the limit is"),
        (["run", RESOURCE, "--wait", "-1", "--", "true"], 2, "--wait: must be"),
        (["run", RESOURCE, "--ttl", "0", "--", "true"], 2, "--ttl: must be"),
        (["run", RESOURCE], 2, "no command to run: give it after '--'"),
        (["run", RESOURCE, "--"], 2, "no command to run"),
        (["list", "--", "true"], 2, "only for 'run', not 'list'"),
    ],
    ids=["control-char", "too-long", "wait<0", "ttl=0", "no-command", "empty", "list"],
)
def test_bad_input_is_refused_before_anything_reaches_the_nodes(
    start: Callable[..., subprocess.Popen[str]],
    commands_processed: Callable[[], list[int]],
    args: list[str],
    code: int,
    message: str,
) -> None:
    before = commands_processed()
    status, _, err = finish(start("redlock", *args))
    assert (status, message in err) == (code, True), err
    # The only command in between is the first INFO itself.
    assert commands_processed() == [total + 1 for total in before]


# --- SingletonCommandMixin ----------------------------------------------------------


def test_two_processes_of_a_singleton_command_run_it_once(
    start: Callable[..., subprocess.Popen[str]], work: Path, nodes: NodeSet
) -> None:
    runs = [start("singleton_job", str(work), "--hold") for _ in range(2)]
    wait_for(lambda: any(run.poll() is not None for run in runs))
    (loser,) = [run for run in runs if run.poll() is not None]
    code, _, err = finish(loser)
    assert code == EXIT_ALREADY_RUNNING
    assert err.strip() == (
        "CommandError: 'command:singleton_job' is already running (locked by "
        "another run)"
    )
    (work / "go").touch()
    (winner,) = [run for run in runs if run is not loser]
    assert finish(winner)[:2] == (0, "done\n")
    assert len(lines(work / "runs")) == 1
    assert held_on(nodes, "command:singleton_job") == 0


def test_a_singleton_command_skips_quietly_if_running(
    start: Callable[..., subprocess.Popen[str]],
    hold: Callable[..., Redlock],
    work: Path,
) -> None:
    hold("command:singleton_job")
    assert finish(start("singleton_job", str(work), "--skip-if-running")) == (0, "", "")
    assert not (work / "runs").exists()


def call(command: Any, *args: str, **options: Any) -> str:
    out = io.StringIO()
    call_command(command, *args, stdout=out, **options)
    return out.getvalue()


def test_a_singleton_command_holds_its_lock_while_handle_runs(
    redlock_settings: dict[str, Any], work: Path, nodes: NodeSet
) -> None:
    assert call("singleton_job", str(work)) == "done\n"
    assert len(lines(work / "runs")) == 1
    assert held_on(nodes, "command:singleton_job") == 0


def test_a_singleton_command_already_running_raises_75_or_waits(
    hold: Callable[..., Redlock], work: Path
) -> None:
    hold("command:singleton_job", ttl=1.0)
    with pytest.raises(CommandError) as info:
        call("singleton_job", str(work))
    assert info.value.returncode == EXIT_ALREADY_RUNNING
    assert call("singleton_job", str(work), skip_if_running=True) == ""
    assert not (work / "runs").exists()
    # The holder's lease (1 s, not extended) runs out during the wait.
    assert call("singleton_job", str(work), wait=5.0) == "done\n"


@pytest.mark.parametrize(
    ("resource", "options", "message"),
    [
        ("", {}, "resource must be a non-empty string"),
        ("bad\nname", {}, "contains control characters"),
        ("command:ok", {"wait": -1}, "--wait must be a finite number"),
    ],
    ids=["empty", "newline", "wait<0"],
)
def test_a_singleton_command_refuses_bad_input_before_the_nodes(
    redlock_settings: dict[str, Any],
    commands_processed: Callable[[], list[int]],
    work: Path,
    resource: str,
    options: dict[str, Any],
    message: str,
) -> None:
    command = SingletonJob()
    command.lock_resource = resource
    before = commands_processed()
    with pytest.raises(CommandError, match=message):
        call(command, str(work), **options)
    assert commands_processed() == [total + 1 for total in before]
    assert not (work / "runs").exists()


def test_a_valid_singleton_command_does_reach_the_nodes(
    redlock_settings: dict[str, Any],
    commands_processed: Callable[[], list[int]],
    work: Path,
) -> None:
    """Negative control of the two tables above: the count does see a real run."""
    before = commands_processed()
    call("singleton_job", str(work))
    after = commands_processed()
    assert all(a - b > 1 for a, b in zip(after, before, strict=True))


def test_a_singleton_command_sees_a_lost_lease_and_ends_with_125(
    redlock_settings: dict[str, Any], nodes: NodeSet, work: Path
) -> None:
    """handle() reads self.lock.lost; the run then fails with returncode 125."""
    seen: list[bool] = []

    class Frozen(SingletonJob):
        lock_ttl = 1.0

        def handle(self, *args: Any, **options: Any) -> None:
            assert self.lock is not None
            seen.append(self.lock.lost)
            for node in nodes[:3]:
                node.pause()
            wait_for(lambda: self.lock is not None and self.lock.lost, timeout=5.0)
            seen.append(self.lock.lost)
            nodes.resume_all()

    with pytest.raises(CommandError, match="was lost while held") as info:
        call(Frozen(), str(work))
    assert info.value.returncode == EXIT_LOST
    assert seen == [False, True]
