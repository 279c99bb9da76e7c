"""The real-Redis test infrastructure: servers, pauses, crashes and restarts."""

from __future__ import annotations

import signal
import socket
import stat
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import redis

from harness.monitor import monitoring
from harness.nodes import (
    SERVER_ENV,
    NodeSet,
    RedisNode,
    RedisNodeError,
    ServerNotFoundError,
    find_redis_server,
)
from harness.processes import process_state
from redlock_django.testing import servers as node_module


def test_five_nodes_listen_on_distinct_ports_and_answer_ping(nodes: NodeSet) -> None:
    """The session starts five servers, each its own process on its own port."""
    assert len(nodes) == 5
    assert len(set(nodes.ports)) == 5
    assert len({node.pid for node in nodes}) == 5
    for node in nodes:
        assert node.url == f"redis://127.0.0.1:{node.port}/0"
        with node.client() as client:
            assert client.ping() is True
            assert client.info("server")["process_id"] == node.pid


def test_monitoring_lists_every_command_across_quiet_spells(nodes: NodeSet) -> None:
    """A node's MONITOR listing goes on after a spell with no commands, and holds
    every command run before the block ends (a file reader with a timeout would
    have stopped at the first quiet spell)."""
    with nodes[0].client() as client, monitoring(nodes[0]) as lines:
        client.echo("before-quiet")
        time.sleep(0.3)
        client.echo("after-quiet")
    echoed = [line.split('"')[-2] for line in lines if '"ECHO"' in line]
    assert echoed == ["before-quiet", "after-quiet"]


def test_nodes_are_independent_servers(nodes: NodeSet) -> None:
    """A key written on one node is not visible on any other."""
    with nodes[0].client() as client:
        client.set("only-here", b"1")
    for node in nodes[1:]:
        with node.client() as client:
            assert client.exists("only-here") == 0


def test_every_node_starts_each_test_empty(nodes: NodeSet) -> None:
    """The ``nodes`` fixture flushes all nodes, whatever earlier tests wrote."""
    for node in nodes:
        with node.client() as client:
            assert client.dbsize() == 0


def test_paused_node_does_not_answer_until_resumed(nodes: NodeSet) -> None:
    """SIGSTOP makes a command time out; SIGCONT makes the node answer again."""
    node = nodes[0]
    with node.client(socket_timeout=0.2) as client:
        client.set("key", b"before")
        with node.paused():
            assert node.is_paused
            with pytest.raises(redis.TimeoutError):
                client.get("key")
            # The other nodes are unaffected.
            with nodes[1].client() as other:
                assert other.ping() is True
        assert not node.is_paused
        assert client.get("key") == b"before"


def test_pausing_twice_needs_one_resume(nodes: NodeSet) -> None:
    """``pause()`` on a paused node is a no-op, so one ``resume()`` undoes both."""
    node = nodes[1]
    node.pause()
    node.pause()
    node.resume()
    with node.client() as client:
        assert client.ping() is True


def test_killed_node_restarts_on_same_port_without_data(nodes: NodeSet) -> None:
    """After SIGKILL the node refuses connections; restarted, it has no keys."""
    node = nodes[2]
    port, old_pid = node.port, node.pid
    with node.client() as client:
        client.set("key", b"value")

    node.kill()
    assert not node.is_running
    with node.client() as client, pytest.raises(redis.ConnectionError):
        client.ping()

    node.restart()
    assert node.port == port
    assert node.pid != old_pid
    with node.client() as client:
        assert client.get("key") is None


def test_stopped_node_restarts_on_same_port(nodes: NodeSet) -> None:
    """``stop()`` ends the process cleanly; ``start()`` brings it back on its port."""
    node = nodes[3]
    port = node.port
    node.stop()
    assert not node.is_running
    assert node.pid is None
    node.start()
    assert node.port == port
    with node.client() as client:
        assert client.ping() is True


def test_ensure_running_restarts_stopped_and_resumes_paused_nodes(
    make_nodes: Callable[..., NodeSet],
) -> None:
    """``ensure_running()`` heals a set with killed, stopped and paused nodes."""
    node_set = make_nodes(3)
    node_set[0].kill()
    node_set[1].stop()
    node_set[2].pause()

    node_set.ensure_running()

    for node in node_set:
        assert node.is_running and not node.is_paused
        with node.client() as client:
            assert client.ping() is True


def test_stop_terminates_a_paused_node(make_nodes: Callable[..., NodeSet]) -> None:
    """Stopping a SIGSTOPped server does not hang and leaves no process behind."""
    node = make_nodes(1)[0]
    pid = node.pid
    assert pid is not None
    node.pause()
    assert process_state(pid) == "T"

    node.stop(timeout=2.0)

    assert not node.is_running
    assert process_state(pid) is None


def test_appendfsync_always_node_keeps_key_across_kill(
    make_nodes: Callable[..., NodeSet],
) -> None:
    """With ``appendfsync_always`` a write acknowledged before SIGKILL survives."""
    node = make_nodes(1, appendfsync_always=True)[0]
    with node.client() as client:
        client.set("durable", b"value")

    node.kill()
    node.start()

    with node.client() as client:
        assert client.get("durable") == b"value"


def test_make_nodes_starts_extra_servers_apart_from_the_session_ones(
    nodes: NodeSet, make_nodes: Callable[..., NodeSet]
) -> None:
    """``make_nodes(7)`` gives seven more servers on seven more ports."""
    extra = make_nodes(7)
    assert len(extra) == 7
    assert len(set(extra.ports) | set(nodes.ports)) == 12
    assert all(node.client().ping() for node in extra)


def test_slice_of_a_node_set_is_a_node_set(nodes: NodeSet) -> None:
    """Slicing keeps the ``NodeSet`` helpers, so ``nodes[:3].urls`` works."""
    first_three = nodes[:3]
    assert isinstance(first_three, NodeSet)
    assert first_three.urls == nodes.urls[:3]


def test_clog_holds_key_with_foreign_token_and_ttl(nodes: NodeSet) -> None:
    """``clog()`` sets the key to a token no lock owns, with an expiry."""
    node = nodes[4]
    node.clog("redlock:resource", ttl=5.0)
    with node.client() as client:
        assert client.get("redlock:resource") == b"foreign-token"
        assert 0 < client.pttl("redlock:resource") <= 5000


def test_redlock_settings_point_at_the_running_nodes(
    redlock_settings: dict[str, Any], nodes: NodeSet
) -> None:
    """``redlock_settings`` installs ``settings.REDLOCK`` naming the five nodes."""
    from django.conf import settings

    assert redlock_settings == settings.REDLOCK
    assert redlock_settings["NODES"] == nodes.urls
    assert redlock_settings["NODE_TIMEOUT"] < redlock_settings["TTL"]


def test_auto_port_collision_moves_to_another_port(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A picked port that someone else grabbed first is replaced by a free one."""
    with socket.socket() as squatter:
        squatter.bind(("127.0.0.1", 0))
        squatter.listen()
        taken = squatter.getsockname()[1]
        ports = iter([taken])
        real_free_port = node_module.free_port
        monkeypatch.setattr(
            node_module, "free_port", lambda: next(ports, None) or real_free_port()
        )

        node = RedisNode(tmp_path / "node")
        try:
            node.start()
            assert node.port != taken
            assert node.client().ping() is True
        finally:
            node.stop()


def test_fixed_port_collision_fails_with_log_tail(tmp_path: Path) -> None:
    """A pinned port that is taken fails fast, quoting the server's log."""
    with socket.socket() as squatter:
        squatter.bind(("127.0.0.1", 0))
        squatter.listen()
        node = RedisNode(tmp_path / "node", port=squatter.getsockname()[1])
        with pytest.raises(RedisNodeError, match="already in use"):
            node.start()
        assert not node.is_running


@pytest.fixture
def default_server(monkeypatch: pytest.MonkeyPatch) -> None:
    """No ``REDLOCK_TEST_SERVER``: the default choice, even in a Valkey run."""
    monkeypatch.delenv(SERVER_ENV, raising=False)


@pytest.mark.usefixtures("default_server")
def test_find_redis_server_prefers_path(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A ``redis-server`` on PATH is used before the venv's copy."""
    fake = tmp_path / "redis-server"
    fake.write_text("#!/bin/sh\n")
    fake.chmod(fake.stat().st_mode | stat.S_IXUSR)
    monkeypatch.setenv("PATH", str(tmp_path))
    assert find_redis_server() == str(fake)


@pytest.mark.usefixtures("default_server")
def test_find_redis_server_falls_back_to_venv_bin(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Without one on PATH, the binary next to ``sys.executable`` is used."""
    venv_bin = tmp_path / "bin"
    venv_bin.mkdir()
    fake = venv_bin / "redis-server"
    fake.write_text("#!/bin/sh\n")
    fake.chmod(fake.stat().st_mode | stat.S_IXUSR)
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    monkeypatch.setattr(sys, "executable", str(venv_bin / "python"))
    assert find_redis_server() == str(fake)


@pytest.mark.usefixtures("default_server")
def test_find_redis_server_explains_how_to_install_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With no binary anywhere, the error says how to get one."""
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.setattr(sys, "executable", str(tmp_path / "python"))
    with pytest.raises(ServerNotFoundError, match="apt install redis-server"):
        find_redis_server()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG")
def test_server_dies_with_the_process_that_started_it(tmp_path: Path) -> None:
    """A test process killed with SIGKILL takes its redis-servers with it."""
    script = (
        "import os, sys\n"
        "from harness.nodes import RedisNode\n"
        "node = RedisNode(sys.argv[1]); node.start(); node.pause()\n"
        "print(node.pid, flush=True)\n"
        "os.kill(os.getpid(), 9)\n"
    )
    root = Path(__file__).resolve().parent.parent
    result = subprocess.run(
        [sys.executable, "-c", script, str(tmp_path / "orphan")],
        cwd=root,
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert result.returncode == -signal.SIGKILL, result.stderr
    pid = int(result.stdout.strip())
    deadline = time.monotonic() + 5
    while process_state(pid) not in (None, "Z") and time.monotonic() < deadline:
        time.sleep(0.01)
    # "Z": dead, waiting for init to reap it.
    assert process_state(pid) in (None, "Z")
