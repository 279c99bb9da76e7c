"""``manage.py redlock run`` and ``SingletonCommandMixin``, run as a user runs them.

Every run is a real ``python -m django`` process with a settings module written for
the test (``REDLOCK`` pointed at the test nodes); the program it runs is
``tests/_run_child.py``, which records what happened to it in a directory. Faults
come from outside: signals to the wrapper, SIGKILL, SIGSTOP of a majority of nodes.
"""

from __future__ import annotations

import contextlib
import io
import itertools
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import pytest
from django.core.management import CommandError, call_command
from django.core.management.base import BaseCommand, CommandParser

from harness.held import held_on, lock_key
from harness.nodes import NodeSet
from harness.proxy import FaultProxy
from redlock_django import Redlock, SingletonCommandMixin
from redlock_django.runner import (
    EXIT_ALREADY_RUNNING,
    EXIT_LOST,
    EXIT_MAX_HOLD,
    EXIT_NOT_FOUND,
    FORWARDED_SIGNALS,
)
from tests.management.commands.singleton_job import Command as SingletonJob

REPO = Path(__file__).resolve().parent.parent
CHILD = [sys.executable, str(REPO / "tests" / "_run_child.py")]
#: Bounds every wait on a process: far above what a run takes on a busy CI box.
TIMEOUT = 30.0
RESOURCE = "cron:job"


def _env(tmp_path: Path, urls: list[str], **extra: object) -> dict[str, str]:
    """The environment of a ``python -m django`` process using nodes ``urls``."""
    settings_dir = tmp_path / "settings"
    settings_dir.mkdir(parents=True)
    config = {
        "NODES": urls,
        "TTL": 10.0,
        # Three Django processes and five servers share two cores.
        "NODE_TIMEOUT": 0.2,
        "RETRY_DELAY": 0.02,
        "RETRY_JITTER": 0.02,
        **extra,
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
def env(tmp_path: Path, nodes: NodeSet) -> dict[str, str]:
    """The environment of a ``python -m django`` process using the test nodes."""
    return _env(tmp_path, nodes.urls)


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
            with contextlib.suppress(ProcessLookupError):
                os.kill(process.pid, signal.SIGCONT)
            process.kill()
            process.wait()


def _with_signals(action: str, signums: Iterable[int], *args: str) -> list[str]:
    """``python *args``, started with ``signums`` set to ``signal.<action>``: a
    Python trampoline sets them and execs it (dispositions other than handlers
    survive exec). Not preexec_fn, which may deadlock in the forked child of a
    process with threads (this test run has reader threads)."""
    code = (
        "import os, signal, sys\n"
        f"for s in {[int(s) for s in signums]!r}:\n"
        f"    signal.signal(s, signal.{action})\n"
        "os.execv(sys.executable, [sys.executable, *sys.argv[1:]])\n"
    )
    return [sys.executable, "-c", code, *args]


@pytest.fixture
def start(
    env: dict[str, str], processes: list[subprocess.Popen[str]]
) -> Callable[..., subprocess.Popen[str]]:
    """Return ``start(*args)``: run ``python -m django *args`` in the background
    (with ``environ=``, in that environment)."""

    def spawn(*args: str, environ: dict[str, str] | None = None) -> Any:
        process = subprocess.Popen(
            # As from a terminal or cron, whatever this test run inherited (a
            # shell's background job ignores SIGINT and SIGQUIT): the wrapper
            # leaves a signal ignored at its start ignored.
            _with_signals("SIG_DFL", FORWARDED_SIGNALS, "-m", "django", *args),
            env=environ or env,
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


def _run_ignoring(
    signum: signal.Signals,
    script: str,
    env: dict[str, str],
    processes: list[subprocess.Popen[str]],
) -> subprocess.Popen[str]:
    """``redlock run RESOURCE -- sh -c script``, started with ``signum`` ignored."""
    wrapper = subprocess.Popen(
        _with_signals("SIG_IGN", [signum], "-m", "django", "redlock", "run",
                      RESOURCE, "--", "sh", "-c", script),
        env=env,
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )  # fmt: skip
    processes.append(wrapper)
    return wrapper


def test_a_signal_ignored_when_the_wrapper_started_stays_ignored_for_the_command(
    env: dict[str, str],
    processes: list[subprocess.Popen[str]],
    work: Path,
    nodes: NodeSet,
) -> None:
    """``nohup manage.py redlock run ...``: SIGHUP is ignored when the wrapper
    starts, so the command inherits the ignore and a hang-up (the terminal
    closed) ends neither (old code: the wrapper caught SIGHUP to forward it, the
    command started with the default action and died of the forwarded SIGHUP,
    exit 129)."""
    script = (
        f"grep SigIgn /proc/self/status > {work}/sigign; touch {work}/ready; "
        f"sleep 1.5; echo done > {work}/done"
    )
    wrapper = _run_ignoring(signal.SIGHUP, script, env, processes)
    wait_for((work / "ready").exists)
    ignored = int(lines(work / "sigign")[0].split()[1], 16)
    wrapper.send_signal(signal.SIGHUP)
    code, _, err = finish(wrapper)
    assert ignored & (1 << (signal.SIGHUP - 1)), "the command did not inherit it"
    assert (code, err) == (0, "")
    assert lines(work / "done") == ["done"]
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


def test_a_command_started_under_an_ignored_sigterm_still_dies_with_its_wrapper(
    env: dict[str, str],
    processes: list[subprocess.Popen[str]],
    work: Path,
) -> None:
    """SIGTERM ignored when the wrapper starts (a supervisor's ``trap '' TERM``):
    the command still starts able to get the SIGTERM the wrapper stops it with,
    here the kernel's when the wrapper is killed with SIGKILL (an ignored one
    would leave it running on without the lock)."""
    script = f"echo $$ > {work}/pid; exec sleep 20"
    wrapper = _run_ignoring(signal.SIGTERM, script, env, processes)
    wait_for(lambda: len(lines(work / "pid")) == 1)
    child = int(lines(work / "pid")[0])
    wrapper.kill()
    wrapper.wait(TIMEOUT)

    def gone() -> bool:
        try:
            state = Path(f"/proc/{child}/stat").read_text().split()[2]
        except FileNotFoundError:
            return True
        return state == "Z"

    wait_for(gone, timeout=5.0)


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
        # A bool is an int to isinstance(): it raised a raw TypeError from the lock.
        ("command:ok", {"wait": True}, "--wait must be a finite number"),
    ],
    ids=["empty", "newline", "wait<0", "wait-bool"],
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


# A job as cron runs it: a shell line, the real work the shell's child.


def alive(pid: int) -> bool:
    """Whether process ``pid`` runs (not gone, not a zombie)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] not in ("Z", "X")


def sh_job(work: Path) -> list[str]:
    """``sh -c 'real-work; echo finished'``: the work runs as the shell's child."""
    job = f"{sys.executable} {CHILD[1]} trap {work} >/dev/null 2>&1; echo finished"
    return ["sh", "-c", job]


def test_a_signal_to_the_wrapper_stops_a_shell_lines_work_before_the_lock_is_free(
    start: Callable[..., subprocess.Popen[str]], work: Path, nodes: NodeSet
) -> None:
    """SIGTERM to the wrapper of ``sh -c 'work; echo finished'``: it went to the
    shell alone, the shell died, the lock was released, and the work ran on
    unlocked (never signalled) while a second run took the lock. The job is
    now the child's process group: the work gets the SIGTERM too, and the lock
    is held until it has exited."""
    first = start("redlock", "run", RESOURCE, "--", *sh_job(work))
    wait_for((work / "ready").exists)
    job = int((work / "ready").read_text())
    try:
        first.send_signal(signal.SIGTERM)
        first.wait(TIMEOUT)
        still_running = alive(job)
        second = finish(start("redlock", "run", RESOURCE, "--", "true"))
        assert not still_running, (
            f"the work (pid {job}) still runs ({lines(work / 'signals')}) after its "
            f"wrapper exited; a second run exited {second[0]}"
        )
        assert lines(work / "signals") == ["SIGTERM"]
    finally:
        if alive(job):
            os.kill(job, signal.SIGKILL)


def test_a_lost_lease_stops_the_whole_job_not_just_its_shell(
    start: Callable[..., subprocess.Popen[str]], work: Path, nodes: NodeSet
) -> None:
    """Lease lost under ``sh -c``: only the shell got SIGTERM; the wrapper exited
    125 and the work kept running without the lock."""
    first = start("redlock", "run", RESOURCE, "--ttl", "1.5", "--", *sh_job(work))
    wait_for((work / "ready").exists)
    job = int((work / "ready").read_text())
    try:
        for node in nodes[:3]:
            node.pause()
        assert first.wait(TIMEOUT) == EXIT_LOST
        nodes.resume_all()
        assert (alive(job), lines(work / "signals")) == (False, ["SIGTERM"])
    finally:
        nodes.resume_all()
        if alive(job):
            os.kill(job, signal.SIGKILL)


IGNORES_SIGTERM = (
    "import pathlib, signal, sys, time\n"
    "signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
    "pathlib.Path(sys.argv[1], 'ready').write_text('x')\n"
    "time.sleep(float(sys.argv[2]))\n"
)


def test_a_job_ignoring_sigterm_after_a_lost_lease_gets_sigkill(
    start: Callable[..., subprocess.Popen[str]], work: Path, nodes: NodeSet
) -> None:
    """Lease lost, SIGTERM ignored: the wrapper waited for the job however long
    it ran (25 s here), unlocked all that time. ``--kill-after 2`` sends SIGKILL
    two seconds after the SIGTERM."""
    ttl, runs_for = 1.5, 25.0
    first = start(
        "redlock", "run", RESOURCE, "--ttl", str(ttl), "--kill-after", "2", "--",
        sys.executable, "-c", IGNORES_SIGTERM, str(work), str(runs_for),
    )  # fmt: skip
    wait_for((work / "ready").exists)
    for node in nodes[:3]:
        node.pause()
    paused = time.monotonic()
    try:
        _, err = first.communicate(timeout=runs_for + TIMEOUT)
    finally:
        nodes.resume_all()
    took = time.monotonic() - paused
    assert first.returncode == EXIT_LOST, err
    assert "lost the lock" in err and "sending SIGKILL" in err, err
    assert took < ttl + 2 + 8.0, f"the wrapper waited {took:.1f}s"


def test_ctrl_c_while_waiting_for_the_lock_ends_the_wait_without_a_traceback(
    start: Callable[..., subprocess.Popen[str]],
    nodes: NodeSet,
    work: Path,
    redlock_settings: dict[str, Any],
) -> None:
    """SIGINT during ``--wait``: a KeyboardInterrupt traceback (SIGTERM killed the
    wrapper silently). Now the wait ends: not started, one line, 128+N, and the
    waiter holds nothing."""
    holder = Redlock(RESOURCE, ttl=120)
    assert holder.acquire(blocking=False)
    try:
        watcher = nodes[0].client()
        channel = lock_key(RESOURCE)  # a parked waiter listens for its release
        waiting = start(
            "redlock", "run", RESOURCE, "--wait", "60", "--", *CHILD, "count",
            str(work),
        )  # fmt: skip
        # (Not a count of the node's connections: ones this test process left
        # from earlier tests may close meanwhile and hide the wrapper's.)
        wait_for(lambda: watcher.pubsub_numsub(channel)[0][1] > 0)
        time.sleep(0.2)  # waiting for the lock now
        assert waiting.poll() is None
        waiting.send_signal(signal.SIGINT)
        code, _, err = finish(waiting)
        watcher.close()
        assert "Traceback" not in err, err
        assert code == 128 + signal.SIGINT, err
        assert "SIGINT while waiting for" in err, err
        assert not (work / "runs").exists()
        assert holder.owned()
    finally:
        holder.release()


def test_runs_started_together_during_a_split_vote_run_the_job_once(
    start: Callable[..., subprocess.Popen[str]],
    tmp_path: Path,
    nodes: NodeSet,
    work: Path,
) -> None:
    """Two servers' crontabs start the job at the same minute while one node of
    five is down. Each server's acquisition reaches two nodes before the other's
    (held back there by a proxy per server and node): 2 of 5 each. With the
    default ``--wait 0`` both made their single attempt and exited 75 "already
    running", though nobody held the lock: the job did not run at all. A refusal
    while nobody holds the lock is now tried again: one of them runs it."""
    # Only the acquisition carries the label (the command line) to the nodes.
    acquire = b"_run_child.py count"
    nodes[4].stop()
    # A long NODE_TIMEOUT: the held requests are let go once both servers sent.
    config = {"TTL": 300.0, "NODE_TIMEOUT": 15.0}
    proxies: list[FaultProxy] = []
    held: list[FaultProxy] = []
    environs = []
    try:
        for name, slow in (("a", (2, 3)), ("b", (0, 1))):
            mine = [FaultProxy(node.port).start() for node in nodes]
            proxies += mine
            for i in slow:
                mine[i].hold_request(acquire)
                # Its reply waits too: neither server learns it lost (and cleans
                # up) before the other's late request has run.
                mine[i].hold_reply_to(acquire)
                held.append(mine[i])
            environs.append(_env(tmp_path / name, [p.url for p in mine], **config))
        job = [*CHILD, "count", str(work)]
        runs = [
            start("redlock", "run", RESOURCE, "--", *job, environ=environ)
            for environ in environs
        ]
        for proxy in held:
            assert proxy.wait_for_held(timeout=TIMEOUT)
        for proxy in held:
            proxy.deliver_held()
        for proxy in held:
            proxy.release_held_replies()
        results = [finish(run) for run in runs]
    finally:
        for proxy in proxies:
            proxy.close()
        nodes.start_all()
    codes = sorted(code for code, _, _ in results)
    assert len(lines(work / "runs")) == 1, (codes, [err for _, _, err in results])
    assert codes == [0, EXIT_ALREADY_RUNNING], codes


# SingletonCommandMixin, run again from its own handle(). Found by an adversarial
# review: when the nodes had lost the outer run's lock, the nested run's fresh
# hold overwrote the outer one; the outer release then raised a raw
# LockNotOwnedError and left its watchdog thread running.


class NestedJob(SingletonCommandMixin, BaseCommand):
    """Runs itself again from ``handle()`` (``--depth 0``), as a job calling
    ``call_command`` on itself would; ``--flush`` first makes every node lose its
    data (a restart without persistence), so the outer run's lease is gone."""

    lock_resource = "cmd:nested"
    events: list[Any] = []

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--depth", type=int, default=0)
        parser.add_argument("--flush", action="store_true")

    def handle(self, *args: Any, depth: int, flush: bool, **options: Any) -> None:
        if depth:
            NestedJob.events.append("inner ran")
            return
        if flush:
            for node in NestedJob.nodes:
                with node.client() as client:
                    client.flushall()
        try:
            call_command(NestedJob(), depth=1)
        except CommandError as exc:
            NestedJob.events.append(("inner refused", exc.returncode))
        assert self.lock is not None
        NestedJob.events.append(("outer lost", self.lock.lost))


def watchdogs(resource: str) -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.endswith(resource)]


def test_a_nested_run_of_a_singleton_command_is_refused_with_75(
    redlock_settings: dict[str, Any], nodes: NodeSet
) -> None:
    """Pins the re-entrancy answer: the nested run is refused at once, no deadlock."""
    NestedJob.events, NestedJob.nodes = [], nodes
    call_command(NestedJob())
    assert NestedJob.events == [
        ("inner refused", EXIT_ALREADY_RUNNING),
        ("outer lost", False),
    ]
    assert held_on(nodes, "cmd:nested") == 0


def test_an_outer_run_whose_lock_a_nested_run_retook_ends_with_125(
    redlock_settings: dict[str, Any], nodes: NodeSet
) -> None:
    """The nodes lose the outer run's lock; a nested run of the same command then
    takes the lock afresh (reentrant=False: a hold of its own) and ends. The
    outer run's lease was lost, so it must end like any lost lease: a
    ``CommandError`` with returncode 125, its watchdog stopped. The nested
    acquisition overwrote the outer hold in the owner's registry instead, so the
    outer release raises a raw ``LockNotOwnedError`` and leaves its watchdog
    thread running."""
    NestedJob.events, NestedJob.nodes = [], nodes
    try:
        call_command(NestedJob(), flush=True)
    except CommandError as exc:
        outcome: Any = ("CommandError", exc.returncode)
    except Exception as exc:
        outcome = (type(exc).__name__, str(exc))
    else:
        outcome = "returned"
    time.sleep(0.3)
    leaked = watchdogs("cmd:nested")
    assert NestedJob.events[0] == "inner ran"
    assert (outcome, leaked) == (("CommandError", EXIT_LOST), [])
