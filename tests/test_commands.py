"""``manage.py redlock status | list | release``: output and exit codes, real nodes."""

from __future__ import annotations

import contextlib
import getpass
import io
import json
import logging
from collections.abc import Callable
from typing import Any

import pytest
from django.core.management import CommandError, call_command, execute_from_command_line

from harness.held import held_on, lock_key
from harness.nodes import NodeSet
from redlock_django import LockError, Redlock
from redlock_django.management.commands.redlock import JSON_KEYS, Command

PASSWORD = "s3cret-pass"
LOGGER = "redlock_django.management.commands.redlock"


class Terminal(io.StringIO):
    """An interactive stdin: isatty() is true; ``on_read`` runs before a read."""

    def __init__(self, text: str, on_read: Callable[[], None] | None = None):
        super().__init__(text)
        self.on_read = on_read

    def isatty(self) -> bool:
        return True

    def readline(self, size: int | None = -1) -> str:
        if self.on_read is not None:
            self.on_read()
        return super().readline(size)


def run(*args: str, **options: Any) -> tuple[str, str]:
    """Run ``redlock *args``; return (stdout, stderr). CommandError propagates."""
    out, err = io.StringIO(), io.StringIO()
    call_command("redlock", *args, stdout=out, stderr=err, **options)
    return out.getvalue(), err.getvalue()


def run_failing(*args: str, **options: Any) -> tuple[CommandError, str, str]:
    """Run ``redlock *args`` expecting a CommandError; return it with the output."""
    out, err = io.StringIO(), io.StringIO()
    with pytest.raises(CommandError) as info:
        call_command("redlock", *args, stdout=out, stderr=err, **options)
    return info.value, out.getvalue(), err.getvalue()


# --- status -------------------------------------------------------------------------


def test_status_shows_every_node_and_succeeds_with_all_reachable(
    nodes: NodeSet, hold: Callable[..., Redlock]
) -> None:
    """status prints one row per node and the summary; no error raised."""
    hold("counted")
    out, _ = run("status")
    lines = out.splitlines()
    assert lines[0].split() == ["node", "address", "reachable", "latency", "ms",
                                "server", "lock", "keys"]  # fmt: skip
    for index, node in enumerate(nodes):
        cells = lines[1 + index].split()
        assert cells[:3] == [str(index), f"redis://127.0.0.1:{node.port}/0", "yes"]
        assert float(cells[3]) >= 0 and cells[4].count(".") == 2
        assert cells[4].startswith(("redis-", "valkey-"))
        assert cells[5] == "1"
    assert lines[-1] == "5/5 nodes reachable, quorum 3"


def test_status_exit_code_tells_whether_a_quorum_is_reachable(
    nodes: NodeSet, redlock_settings: dict[str, Any]
) -> None:
    """2 of 5 nodes down still has a quorum (ok); 3 down exits 3."""
    nodes[0].stop()
    nodes[1].stop()
    out, _ = run("status")
    assert out.splitlines()[-1] == "3/5 nodes reachable, quorum 3"
    assert out.count(" no ") == 2 and "ConnectionError" in out

    nodes[4].stop()
    error, out, _ = run_failing("status")
    assert error.returncode == 3
    assert out.splitlines()[-1] == "2/5 nodes reachable, quorum 3"
    assert "fewer than a quorum" in str(error)


def test_status_exit_code_reaches_the_shell(
    nodes: NodeSet,
    redlock_settings: dict[str, Any],
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Run as manage.py, a missing quorum exits the process with status 3."""
    for node in nodes[:3]:
        node.stop()
    with pytest.raises(SystemExit) as info:
        execute_from_command_line(["manage.py", "redlock", "status", "--skip-checks"])
    assert info.value.code == 3
    captured = capsys.readouterr()
    assert "2/5 nodes reachable, quorum 3" in captured.out
    assert "CommandError: fewer than a quorum" in captured.err


def test_help_documents_the_exit_codes() -> None:
    """--help lists every exit code a script can rely on."""
    text = Command().create_parser("manage.py", "redlock").format_help()
    for line in ["0  success", "1  error or refusal", "2  bad command line",
                 "3  fewer than a quorum", "4  release found nothing"]:  # fmt: skip
        assert line in text


def test_invalid_settings_are_a_command_error(settings: Any) -> None:
    """A broken REDLOCK setting exits 1 with the check id, for every verb."""
    settings.REDLOCK = {"NODES": []}
    for verb in (["status"], ["list"], ["release", "x", "--yes"]):
        error, _, _ = run_failing(*verb)
        assert error.returncode == 1 and "redlock.E002" in str(error)


# --- list ---------------------------------------------------------------------------


def test_list_shows_held_locks_with_holder_and_flags_a_minority(
    nodes: NodeSet, hold: Callable[..., Redlock]
) -> None:
    """Each lock is a row: k/N, nodes, holder, label, fence, digest, flags."""
    fenced = hold("order:1", label="POST /pay", fencing=True)
    hold("order:2")
    for node in nodes[:3]:
        with node.client() as client:
            client.delete(lock_key("order:2"))
    out, err = run("list")
    assert err == ""
    lines = out.splitlines()
    assert lines[0].split()[:3] == ["resource", "held", "nodes"]
    first, second = lines[1], lines[2]
    assert first.startswith("order:1") and " 5/5 " in first and "0,1,2,3,4" in first
    assert "POST /pay" in first and f" {fenced.fencing_token} " in first
    assert "BELOW QUORUM" not in first
    assert second.startswith("order:2") and " 2/5 " in second and " 3,4 " in second
    assert "BELOW QUORUM (3)" in second
    assert lines[-1] == "2 lock(s) held, 1 below quorum"


def test_list_json_is_an_array_with_stable_keys(
    nodes: NodeSet, hold: Callable[..., Redlock]
) -> None:
    """--json prints a JSON array; every object has the documented keys, in order."""
    lock = hold("job:7", label="nightly", fencing=True)
    nodes[0].clog(lock_key("job:7"))  # node 0 now holds a foreign value instead
    out, err = run("list", "--json")
    assert err == ""
    (row,) = json.loads(out)
    assert list(row) == list(JSON_KEYS)
    assert row["resource"] == "job:7"
    assert (row["held_on"], row["node_count"], row["quorum"]) == (4, 5, 3)
    assert row["nodes"] == [1, 2, 3, 4] and row["other_tokens"] == 1
    assert row["below_quorum"] is False
    assert row["label"] == "nightly" and row["fencing_token"] == lock.fencing_token
    assert row["acquired_at"].endswith("+00:00")
    assert 0 < row["time_left"] <= 10 and row["ttl"] == 10.0
    assert len(row["token_digest"]) == 12

    assert json.loads(run("list", "--json", "--prefix", "nothing")[0]) == []


def test_list_prefix_matches_the_start_of_names_literally(
    hold: Callable[..., Redlock],
) -> None:
    """--prefix keeps names starting with the text; glob characters are literal."""
    for name in ["order:1", "order:2", "reorder:1", "order*x", "orders"]:
        hold(name)

    def listed(*args: str) -> list[str]:
        return [row["resource"] for row in json.loads(run("list", "--json", *args)[0])]

    assert listed("--prefix", "order:") == ["order:1", "order:2"]
    assert listed("--prefix", "order*") == ["order*x"]
    assert listed("--prefix", "*") == []
    assert len(listed()) == 5


def test_list_says_so_when_nothing_is_held(redlock_settings: dict[str, Any]) -> None:
    """With no locks, list prints one line (and --json an empty array)."""
    assert run("list") == ("no locks held\n", "")
    assert json.loads(run("list", "--json")[0]) == []


def test_list_warns_on_stderr_about_a_node_that_did_not_answer(
    nodes: NodeSet, hold: Callable[..., Redlock]
) -> None:
    """A stopped node is named on stderr; stdout stays valid JSON."""
    hold("still-listed")
    nodes[2].stop()
    out, err = run("list", "--json")
    assert [row["nodes"] for row in json.loads(out)] == [[0, 1, 3, 4]]
    assert f"redis://127.0.0.1:{nodes[2].port}/0 did not answer" in err


# --- release ------------------------------------------------------------------------


def test_release_with_yes_releases_everywhere_and_logs_the_os_user(
    nodes: NodeSet,
    hold: Callable[..., Redlock],
    caplog: pytest.LogCaptureFixture,
) -> None:
    """--yes releases at once, prints each node's outcome, logs a WARNING."""
    lock = hold("stuck")
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        out, _ = run("release", "stuck", "--yes")
    assert not lock.locked()
    for index, node in enumerate(nodes):
        assert f"node[{index}] redis://127.0.0.1:{node.port}/0: released" in out
    assert out.splitlines()[-1] == "released 'stuck' on 5/5 nodes"
    (record,) = [r for r in caplog.records if r.name == LOGGER]
    assert record.levelno == logging.WARNING
    assert "'stuck'" in record.getMessage()
    assert f"by OS user {getpass.getuser()}" in record.getMessage()


def test_release_without_yes_refuses_when_stdin_is_not_a_terminal(
    hold: Callable[..., Redlock],
) -> None:
    """No --yes and no terminal: refused (exit 1), even if 'yes' could be read."""
    lock = hold("guarded")
    error, out, _ = run_failing("release", "guarded", stdin=io.StringIO("yes\n"))
    assert error.returncode == 1
    assert "pass --yes" in str(error)
    assert out.startswith("resource") and "guarded" in out  # the lock was shown
    assert lock.locked()


@pytest.mark.parametrize(("answer", "released"), [("yes\n", True), ("y\n", True),
                         ("no\n", False), ("\n", False), ("", False)])  # fmt: skip
def test_release_asks_on_a_terminal_and_releases_only_on_yes(
    hold: Callable[..., Redlock], answer: str, released: bool
) -> None:
    """On a terminal the command asks; anything but yes leaves the lock (exit 1)."""
    lock = hold("asked")
    if released:
        out, _ = run("release", "asked", stdin=Terminal(answer))
        assert "Type 'yes' to release: " in out
    else:
        error, out, _ = run_failing("release", "asked", stdin=Terminal(answer))
        assert error.returncode == 1 and "not confirmed" in str(error)
    assert lock.locked() is not released


def test_release_leaves_a_lock_that_changed_hands_during_the_prompt(
    nodes: NodeSet, hold: Callable[..., Redlock]
) -> None:
    """The lock shown was released and re-acquired before 'yes': exit 4, kept."""
    first = hold("handover")
    second = Redlock("handover")

    def hand_over() -> None:
        first.release()
        assert second.acquire(blocking=False)

    try:
        error, out, _ = run_failing(
            "release", "handover", stdin=Terminal("yes\n", on_read=hand_over)
        )
        assert error.returncode == 4 and "changed hands" in str(error)
        assert out.count("not held by token") == 5
        assert second.owned() and second.locked()
    finally:
        second.release()


def test_release_of_a_lock_nobody_holds_exits_4(
    redlock_settings: dict[str, Any],
) -> None:
    """Nothing to release is an error a script can tell apart (exit 4)."""
    error, out, _ = run_failing("release", "nobody", "--yes")
    assert error.returncode == 4 and "no lock held on 'nobody'" in str(error)
    assert out == ""


def test_release_exit_code_depends_on_how_many_nodes_answered(
    nodes: NodeSet, hold: Callable[..., Redlock]
) -> None:
    """One node down: released (exit 0); a quorum down: exit 3."""
    hold("one-down")
    nodes[0].stop()
    out, _ = run("release", "one-down", "--yes")
    assert f"node[0] redis://127.0.0.1:{nodes[0].port}/0: failed: " in out
    assert out.splitlines()[-1] == "released 'one-down' on 4/5 nodes"

    nodes[0].start()
    hold("many-down")
    for node in nodes[:3]:
        node.stop()
    error, out, _ = run_failing("release", "many-down", "--yes")
    assert error.returncode == 3
    assert "released 'many-down' on 2/5 nodes" in str(error)
    assert "may still be held" in str(error)
    assert out.count(": released") == 2 and out.count(": failed: ") == 3

    error, _, _ = run_failing("release", "unknown", "--yes")
    assert error.returncode == 3 and "cannot tell whether 'unknown'" in str(error)


@pytest.mark.parametrize("resource", ["bad\nname", "x" * 1001])
def test_release_rejects_an_invalid_resource_name(
    redlock_settings: dict[str, Any], resource: str
) -> None:
    """A name no lock can have is refused before any node is asked (exit 1)."""
    error, _, _ = run_failing("release", resource, "--yes")
    assert error.returncode == 1


def test_release_takes_any_name_a_lock_can_have(
    nodes: NodeSet, hold: Callable[..., Redlock]
) -> None:
    """Redlock and ``redlock run`` take names up to 1000 characters: so does
    release (it refused anything over 200 with exit 1)."""
    name = "report:" + "x" * 300
    hold(name)
    run("release", name, "--yes")
    assert held_on(nodes, name) == 0


def test_release_after_double_dash_takes_a_resource_starting_with_a_dash(
    nodes: NodeSet, hold: Callable[..., Redlock]
) -> None:
    """``--`` ends release's options, so "-x:job" can be named (it was taken for
    run's command line: exit 2)."""
    hold("-x:job")
    execute_from_command_line(["manage.py", "redlock", "release", "--yes", "--",
                               "-x:job"])  # fmt: skip
    assert held_on(nodes, "-x:job") == 0


def test_release_of_a_lock_that_changed_hands_while_a_node_is_down_exits_4(
    nodes: NodeSet, hold: Callable[..., Redlock]
) -> None:
    """The four nodes that answer are enough to say nothing of that token is left:
    exit 4, the new holder's lock untouched (it printed "released ... on 0/5
    nodes" and exited 0)."""
    first = hold("handover")
    second = Redlock("handover")

    def hand_over_and_lose_a_node() -> None:
        first.release()
        assert second.acquire(blocking=False)
        nodes[0].stop()

    stdin = Terminal("yes\n", on_read=hand_over_and_lose_a_node)
    error, out, _ = run_failing("release", "handover", stdin=stdin)
    assert error.returncode == 4 and "changed hands" in str(error)
    assert "failed: " in out
    assert held_on(nodes[1:], "handover") == 4
    second.release()


def test_list_says_it_cannot_tell_when_too_few_nodes_answered(
    nodes: NodeSet, hold: Callable[..., Redlock]
) -> None:
    """With three of five nodes silent, the locks they hold cannot be listed: no
    "no locks held" and no bare ``[]`` with exit 0, but exit 3 (as status and
    release); the table and the JSON show what the others hold."""
    hold("held-while-down")
    for node in nodes[:3]:
        node.stop()
    for args in (("list",), ("list", "--json")):
        error, out, _ = run_failing(*args)
        assert error.returncode == 3, args
        assert "cannot tell which locks are held: 3/5" in str(error)
        assert "no locks held" not in out
    assert json.loads(run_failing("list", "--json")[1])[0]["held_on"] == 2


def test_list_escapes_control_characters_of_labels(
    hold: Callable[..., Redlock],
) -> None:
    """Labels are free text (``redlock run`` makes one of any command line): a
    newline must not forge a table row, nor an escape sequence reach the terminal."""
    hold("nightly", label="sh -c 'a\nevil      5/5   0,1,2,3,4'\x1b[2J")
    out, _ = run("list")
    assert "\x1b" not in out
    assert len(out.splitlines()) == 3, out  # the header, one row, the summary
    assert "sh -c 'a\\nevil" in out and "\\x1b[2J" in out


def test_passwords_never_appear_in_any_command_output(
    settings: Any,
    make_nodes: Callable[..., NodeSet],
    redlock_settings: dict[str, Any],
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Password URLs are shown masked in status, list and release, and in logs."""
    secured = make_nodes(3)
    urls = secured.require_password(PASSWORD)
    urls[2] = f"redis://user:wrong-{PASSWORD}@127.0.0.1:{secured[2].port}/0"
    settings.REDLOCK = {**redlock_settings, "NODES": urls}
    lock = Redlock("secret-lock")
    assert lock.acquire(blocking=False)
    texts: list[str] = []
    with caplog.at_level(logging.DEBUG):
        texts += run("status")
        texts += run("list")
        texts += run("list", "--json")
        texts += run("release", "secret-lock", "--yes")
    with contextlib.suppress(LockError):
        lock.release()
    text = "".join(texts) + caplog.text
    assert f"redis://127.0.0.1:{secured[0].port}/0" in text
    assert "2/3 nodes reachable, quorum 2" in text
    assert "released 'secret-lock' on 2/3 nodes" in text
    assert PASSWORD not in text and "user:" not in text
