"""The operator's surface (admin page, ``redlock`` command, checks) under input it
did not write: holder metadata another writer left that does not parse, node URLs
whose unencoded password spills into the path or the query, ACL user names in
node errors, free text with control characters, a force release that only a
minority answered.

Each test reproduces a finding of an adversarial review and failed on the code
before its fix: a 500 on the admin page and a traceback from ``redlock list``;
parts of a password in the E003 message, ``ImproperlyConfigured`` and the error
report's settings; the ACL user name in admin messages, command output and W006;
a forged log line; "Force-released" said of a lock a quorum still held. Nodes are
real ``redis-server`` (or ``valkey-server``) processes.
"""

from __future__ import annotations

import io
import json
import logging
from collections.abc import Iterator
from typing import Any

import pytest
from django.core.exceptions import ImproperlyConfigured
from django.core.management import CommandError, call_command
from django.test import Client

from harness.held import held_on, lock_key
from harness.nodes import NodeSet, RedisNode, find_redis_server
from redlock_django import Redlock, listing
from redlock_django.checks import check_settings
from redlock_django.conf import get_settings

pytestmark = pytest.mark.django_db

LIST_URL = "/admin/redlock_django/heldlock/"
RELEASE_URL = "/admin/redlock_django/heldlock/release/"
SECRET = "Zq9SECRETk4"


@pytest.fixture(autouse=True)
def fast_passwords(settings: Any) -> None:
    settings.PASSWORD_HASHERS = ["django.contrib.auth.hashers.MD5PasswordHasher"]


def plant_meta(nodes: NodeSet, resource: str, meta: str) -> None:
    """Write a lock hash the way another writer (another version) might."""
    for node in nodes:
        with node.client() as client:
            client.hset(
                lock_key(resource), mapping={"token": b"t-foreign", "meta": meta}
            )
            client.pexpire(lock_key(resource), 60_000)


# Metadata that ``meta.decode`` promises to read as "unknown" (None), never an error:
# "a field that does not parse is None, never an error".
BAD_META = {
    "date_before_year_1_in_utc": json.dumps(
        {"host": "w", "pid": 1, "acquired_at": "0001-01-01T00:00:00+01:00"}
    ),
    "date_after_year_9999_in_utc": json.dumps(
        {"host": "w", "pid": 1, "acquired_at": "9999-12-31T23:00:00-05:00"}
    ),
    "deeply_nested_json": "[" * 100_000,
}


@pytest.mark.parametrize("meta", BAD_META.values(), ids=BAD_META.keys())
def test_admin_page_lists_a_lock_whose_metadata_does_not_parse(
    redlock_settings: dict[str, Any], nodes: NodeSet, admin_user: Any, meta: str
) -> None:
    """A lock key with unreadable holder metadata is still listed, not a 500."""
    plant_meta(nodes, "odd-meta", meta)
    client = Client(raise_request_exception=False)
    client.force_login(admin_user)

    response = client.get(LIST_URL, {"refresh": "0"})

    assert response.status_code == 200
    assert "odd-meta" in response.content.decode()


@pytest.mark.parametrize("meta", BAD_META.values(), ids=BAD_META.keys())
def test_redlock_list_and_release_survive_metadata_that_does_not_parse(
    redlock_settings: dict[str, Any], nodes: NodeSet, meta: str
) -> None:
    """``redlock list`` shows the lock, ``release --yes`` releases it."""
    plant_meta(nodes, "odd-meta", meta)
    out = io.StringIO()

    call_command("redlock", "list", stdout=out, stderr=io.StringIO())
    assert "odd-meta" in out.getvalue()

    call_command("redlock", "release", "odd-meta", "--yes", stdout=out, stderr=out)
    assert held_on(nodes, "odd-meta") == 0


# --- credentials in the messages of a malformed node URL -----------------------------

# Passwords written without percent-encoding (the E003 hint asks for it, but a
# generated base64 password holds "/" and "=", others "?" or "://"). The URL is
# refused, rightly, but the message must not carry the password or part of it.
UNENCODED = {
    # urlsplit ends the netloc at "/": the rest of the password becomes the "path".
    "slash_after_digits": f"redis://ops:4711/{SECRET}@redis.example.com:6379/0",
    "slash_after_colon": f"redis://ops:/{SECRET}@redis.example.com:6379/0",
    # "?" starts the query: the rest of the password becomes an option name.
    "question_mark": f"redis://ops:12?{SECRET}=1@redis.example.com:6379/0",
    # _mask() splits at the LAST "://", so what comes before it stays visible.
    "scheme_separator": f"redis://:{SECRET}://x@redis.example.com:99999/0",
}


@pytest.mark.parametrize("entry", UNENCODED.values(), ids=UNENCODED.keys())
def test_malformed_node_url_message_never_shows_any_part_of_the_password(
    settings: Any, entry: str
) -> None:
    """The E003 check message and the runtime ImproperlyConfigured are masked."""
    settings.REDLOCK = {"NODES": [entry]}

    messages = check_settings()
    assert [m.id for m in messages] == ["redlock.E003"]
    with pytest.raises(ImproperlyConfigured) as excinfo:
        get_settings()

    for text in (messages[0].msg, str(excinfo.value)):
        assert SECRET not in text, text


@pytest.mark.parametrize("entry", UNENCODED.values(), ids=UNENCODED.keys())
def test_error_report_filter_masks_the_password_of_a_url_the_check_refuses(
    entry: str,
) -> None:
    """A refused URL raises ImproperlyConfigured at the first lock: the very
    error whose DEBUG page and e-mail show settings.REDLOCK through the filter."""
    from redlock_django.conf import SafeSettingsReporterFilter, validate

    assert [p.id for p in validate({"NODES": [entry]})] == ["redlock.E003"]
    cleansed = SafeSettingsReporterFilter().cleanse_setting(
        "REDLOCK", {"NODES": [entry]}
    )
    assert SECRET not in cleansed["NODES"][0], cleansed
    assert "redis.example.com" in cleansed["NODES"][0]


# --- ACL user names in node errors ---------------------------------------------------

ACL_USER = f"ops-{SECRET}"


@pytest.fixture
def valkey_acl_nodes(tmp_path: Any) -> Iterator[NodeSet]:
    """Three Valkey servers (Redis >= 7.2 words NOPERM the same way) where
    ``ACL_USER`` may read keys but not run scripts nor INFO."""
    node_set = NodeSet(
        RedisNode(tmp_path / f"node{i}", server=find_redis_server("valkey"))
        for i in range(3)
    )
    node_set.start_all()
    try:
        for node in node_set:
            with node.client() as client:
                client.execute_command(
                    "ACL",
                    "SETUSER",
                    ACL_USER,
                    "on",
                    ">ops-pw",
                    "~*",
                    "+@all",
                    "-eval",
                    "-evalsha",
                    "-info",
                )
        yield node_set
    finally:
        node_set.stop_all()


def acl_settings(node_set: NodeSet) -> dict[str, Any]:
    urls = [f"redis://{ACL_USER}:ops-pw@127.0.0.1:{n.port}/0" for n in node_set]
    return {"NODES": urls, "TTL": 10.0, "NODE_TIMEOUT": 0.2}


def test_admin_force_release_refused_by_acl_never_shows_the_acl_user_name(
    settings: Any,
    valkey_acl_nodes: NodeSet,
    admin_client: Client,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The admin says each node refused, without the user name the URL hides."""
    settings.REDLOCK = {
        **acl_settings(valkey_acl_nodes),
        "NODES": valkey_acl_nodes.urls,
    }
    lock = Redlock("stuck")
    assert lock.acquire()
    settings.REDLOCK = acl_settings(valkey_acl_nodes)
    [held] = listing.held_locks()
    form = {"resource": "stuck", "token_digest": held.token_digest, "confirm": "yes"}

    with caplog.at_level(logging.DEBUG):
        done = admin_client.post(RELEASE_URL, form, follow=True)

    page = done.content.decode()
    assert "Could not release" in page and "NoPermissionError" in page
    assert held_on(valkey_acl_nodes, "stuck") == 3
    for text in (page, caplog.text):
        assert SECRET not in text


def test_redlock_release_refused_by_acl_never_shows_the_acl_user_name(
    settings: Any, valkey_acl_nodes: NodeSet, caplog: pytest.LogCaptureFixture
) -> None:
    """``redlock release`` output, its error and its log line omit the user name."""
    settings.REDLOCK = {
        **acl_settings(valkey_acl_nodes),
        "NODES": valkey_acl_nodes.urls,
    }
    lock = Redlock("stuck")
    assert lock.acquire()
    settings.REDLOCK = acl_settings(valkey_acl_nodes)
    out, err = io.StringIO(), io.StringIO()

    with caplog.at_level(logging.DEBUG), pytest.raises(CommandError) as excinfo:
        call_command("redlock", "release", "stuck", "--yes", stdout=out, stderr=err)

    assert "NoPermissionError" in out.getvalue()
    assert held_on(valkey_acl_nodes, "stuck") == 3
    for text in (out.getvalue(), err.getvalue(), str(excinfo.value), caplog.text):
        assert SECRET not in text, text


def test_deploy_check_refused_by_acl_never_shows_the_acl_user_name(
    settings: Any, valkey_acl_nodes: NodeSet
) -> None:
    """W006 names the node by its masked address and says why, user name left out."""
    from redlock_django.checks import W006, check_nodes

    settings.REDLOCK = acl_settings(valkey_acl_nodes)

    messages = check_nodes()

    assert [m.id for m in messages] == [W006] * 3
    for message in messages:
        assert "NoPermissionError" in message.msg
        assert SECRET not in message.msg, message.msg


# --- the force release's reason in the log -------------------------------------------


def test_force_release_reason_cannot_forge_log_lines(
    redlock_settings: dict[str, Any],
    nodes: NodeSet,
    admin_client: Client,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The free-text reason typed in the admin reaches the WARNING log line: its
    newlines and escape sequences must be escaped, as resource names are refused
    for them and ``redlock list`` escapes labels ("would break or disguise logs")."""
    lock = Redlock("nightly-report")
    assert lock.acquire()
    [held] = listing.held_locks()
    reason = (
        "holder stuck\n"
        "2026-01-01 00:00:00 WARNING redlock_django.admin lock 'payroll' "
        "force-released by user 'ceo'\x1b[2K"
    )
    form = {
        "resource": "nightly-report",
        "token_digest": held.token_digest,
        "confirm": "yes",
        "reason": reason,
    }

    with caplog.at_level(logging.WARNING, logger="redlock_django.admin"):
        admin_client.post(RELEASE_URL, form)

    assert held_on(nodes, "nightly-report") == 0
    [record] = [r for r in caplog.records if r.name == "redlock_django.admin"]
    line = record.getMessage()
    assert "holder stuck" in line
    assert "\n" not in line and "\x1b" not in line, line


# --- a force release that only a minority of nodes answered ---------------------------


@pytest.fixture
def proxies(nodes: NodeSet) -> Iterator[list[Any]]:
    """One FaultProxy in front of each node (partitions from outside the library)."""
    from harness.proxy import FaultProxy

    started = [FaultProxy(node.port).start() for node in nodes]
    yield started
    for proxy in started:
        proxy.close()


def test_admin_force_release_answered_by_a_minority_says_the_lock_may_still_be_held(
    settings: Any,
    redlock_settings: dict[str, Any],
    nodes: NodeSet,
    proxies: list[Any],
    admin_client: Client,
) -> None:
    """Released on 2 of 5 while 3 nodes are cut off: the 3 still hold a quorum of
    the lock. ``redlock release`` exits 3 ("the lock may still be held until its
    lease runs out"); the admin words it as a done force release
    ("Force-released ... released on 2 of 5 nodes") and records it so."""
    from django.contrib.messages import get_messages

    settings.REDLOCK = {**redlock_settings, "NODES": [p.url for p in proxies]}
    lock = Redlock("cut-off-majority")
    assert lock.acquire()
    [held] = listing.held_locks()
    form = {
        "resource": "cut-off-majority",
        "token_digest": held.token_digest,
        "confirm": "yes",
    }
    for proxy in proxies[2:]:
        proxy.blackhole()

    response = admin_client.post(RELEASE_URL, form)

    for proxy in proxies[2:]:
        proxy.pass_through()
    [message] = [str(m) for m in get_messages(response.wsgi_request)]
    # The lock is still held on a quorum, by its holder, once the partition heals.
    assert held_on(nodes, "cut-off-majority") == 3
    assert lock.extend()
    assert "may still be held" in message, message
