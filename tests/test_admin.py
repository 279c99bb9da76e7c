"""The held-locks admin page against real Redis nodes.

Locks are taken with ``Redlock`` (or, for hundreds and thousands of them, written
straight onto the nodes in the library's layout: a hash with ``token`` and ``meta``
under ``redlock:lock:<resource>``). Pages are fetched with Django's test client as
users holding exactly the permissions under test.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import socket
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import pytest
from django.contrib.admin.models import DELETION, LogEntry
from django.contrib.auth.models import Permission
from django.contrib.contenttypes.models import ContentType
from django.test import Client
from django.urls import reverse

from harness.held import held_on, lock_key, token_on
from harness.nodes import NodeSet, RedisNode
from redlock_django import LockLostError, Redlock
from redlock_django.models import HeldLock

pytestmark = pytest.mark.django_db

LIST_URL = "/admin/redlock_django/heldlock/"
RELEASE_URL = "/admin/redlock_django/heldlock/release/"
PASSWORD = "pa55-w0rd-never-shown"


# --- helpers ------------------------------------------------------------------------


@pytest.fixture(autouse=True)
def fast_passwords(settings: Any) -> None:
    """Hash the test users' passwords cheaply (PBKDF2 costs ~0.2 s per user)."""
    settings.PASSWORD_HASHERS = ["django.contrib.auth.hashers.MD5PasswordHasher"]


@pytest.fixture
def staff(django_user_model: Any) -> Callable[..., Any]:
    """Return ``make(username, *codenames)``: a staff user with just those perms."""

    def make(username: str, *codenames: str) -> Any:
        user = django_user_model.objects.create_user(username=username, is_staff=True)
        permissions = Permission.objects.filter(
            content_type__app_label="redlock_django", codename__in=codenames
        )
        assert permissions.count() == len(codenames)
        user.user_permissions.set(permissions)
        return user

    return make


@pytest.fixture
def releaser(staff: Callable[..., Any]) -> Any:
    """Return a staff user who may view and force-release locks (not a superuser)."""
    return staff("releaser", "view_heldlock", "force_release_lock")


def login(user: Any, **kwargs: Any) -> Client:
    client = Client(**kwargs)
    client.force_login(user)
    return client


def digest(token: bytes) -> str:
    return hashlib.sha1(token).hexdigest()[:12]


def plant(
    nodes: Iterable[RedisNode],
    resources: Sequence[str],
    *,
    token: bytes = b"planted-token",
    ttl_ms: int = 60_000,
) -> None:
    """Write lock hashes for ``resources`` on ``nodes``, pipelined."""
    meta = json.dumps(
        {
            "host": "worker-7",
            "pid": 4242,
            "holder": "MainThread",
            "acquired_at": "2026-01-02T03:04:05.000+00:00",
            "ttl": ttl_ms / 1000,
            "label": "planted",
        }
    )
    for node in nodes:
        pipe = node.client().pipeline(transaction=False)
        for count, resource in enumerate(resources, 1):
            pipe.hset(lock_key(resource), mapping={"token": token, "meta": meta})
            pipe.pexpire(lock_key(resource), ttl_ms)
            if count % 2000 == 0:
                pipe.execute()
        pipe.execute()


def rows(html: str) -> dict[str, str]:
    """Map each listed resource to its table row's HTML."""
    found = {}
    for row in re.findall(r'<tr class="held-lock[^"]*">.*?</tr>', html, re.S):
        match = re.search(
            r'<th scope="row" class="field-resource"><code>(.*?)</code>', row
        )
        assert match is not None
        found[match.group(1)] = row
    return found


def listed(html: str) -> list[str]:
    return list(rows(html))


def messages_of(response: Any) -> list[str]:
    return [str(message) for message in response.context["messages"]]


# --- the admin index and the view permission ----------------------------------------


def test_admin_index_lists_held_locks_for_staff_with_view_permission(
    staff: Callable[..., Any],
) -> None:
    """The index shows "Redlock" > "Held locks" only to staff who may view them."""
    viewer = staff("viewer", "view_heldlock")
    other = staff("other")

    page = login(viewer).get("/admin/").content.decode()
    assert "Redlock" in page
    assert f'href="{LIST_URL}"' in page
    assert "Held locks" in page

    page = login(other).get("/admin/").content.decode()
    assert "Redlock" not in page
    assert LIST_URL not in page


def test_held_locks_page_needs_the_view_permission(
    redlock_settings: dict[str, Any], staff: Callable[..., Any]
) -> None:
    """Staff without ``view_heldlock`` get 403; anonymous users go to the login."""
    assert login(staff("other")).get(LIST_URL).status_code == 403
    response = Client().get(LIST_URL)
    assert response.status_code == 302
    assert response["Location"].startswith("/admin/login/")
    assert login(staff("viewer", "view_heldlock")).get(LIST_URL).status_code == 200


def test_heldlock_model_has_only_view_and_force_release_permissions() -> None:
    """No add/change/delete permissions exist for the table-less model."""
    content_type = ContentType.objects.get_for_model(HeldLock)
    codenames = set(
        Permission.objects.filter(content_type=content_type).values_list(
            "codename", flat=True
        )
    )
    assert codenames == {"view_heldlock", "force_release_lock"}


# --- listing ------------------------------------------------------------------------


def test_held_lock_is_listed_with_holder_nodes_and_digest(
    redlock_settings: dict[str, Any], nodes: NodeSet, admin_client: Client
) -> None:
    """A lock held by this test shows its holder, 5 of 5 nodes, fence and digest."""
    lock = Redlock("orders:42", fencing=True, label="POST /orders/42/")
    with lock:
        token = token_on(nodes[0], "orders:42")
        assert token is not None
        fence = lock.fencing_token
        assert fence is not None
        response = admin_client.get(LIST_URL)
        html = response.content.decode()

    assert response.status_code == 200
    row = rows(html)["orders:42"]
    assert "5 of 5" in row
    assert "(nodes 0, 1, 2, 3, 4)" in row
    assert socket.gethostname() in row
    assert f"pid {os.getpid()}" in row
    assert threading.current_thread().name in row
    assert "POST /orders/42/" in row
    assert f"<code>{digest(token)}</code>" in row
    assert f'<td class="field-fencing_token">{fence}</td>' in row
    assert "below-quorum" not in row
    assert "Below quorum" not in row
    # The token is a capability: neither it nor its full SHA-1 is ever shown.
    assert token.decode() not in html
    assert hashlib.sha1(token).hexdigest() not in html
    # The node panel: every node reachable, with its version and one lock key.
    assert "Nodes: 5 of 5 reachable, quorum 3" in html
    assert html.count('class="node-up"') == 5
    for node in nodes:
        assert f"127.0.0.1:{node.port}" in html


def test_lock_held_on_a_minority_of_nodes_is_flagged(
    redlock_settings: dict[str, Any], nodes: NodeSet, admin_client: Client
) -> None:
    """A lock left on 2 of 5 nodes is listed, marked below quorum; a full one isn't."""
    # Its holder finds the keys gone from a majority: the lock was lost.
    with pytest.raises(LockLostError), Redlock("leftover"), Redlock("healthy"):
        for node in nodes[:3]:
            node.client().delete(lock_key("leftover"))
        html = admin_client.get(LIST_URL).content.decode()

    found = rows(html)
    assert set(found) == {"healthy", "leftover"}
    assert 'class="held-lock below-quorum"' in found["leftover"]
    assert "2 of 5" in found["leftover"]
    assert "(nodes 3, 4)" in found["leftover"]
    assert "Below quorum (3)" in found["leftover"]
    assert "below-quorum" not in found["healthy"]
    assert "5 of 5" in found["healthy"]


def test_listing_survives_an_unreachable_node(
    redlock_settings: dict[str, Any], nodes: NodeSet, admin_client: Client
) -> None:
    """With a node stopped, the lock is listed from the others; the node shows down."""
    with Redlock("survivor"):
        nodes[4].stop()
        html = admin_client.get(LIST_URL).content.decode()

    assert "4 of 5" in rows(html)["survivor"]
    assert "Nodes: 4 of 5 reachable, quorum 3" in html
    assert html.count('class="node-down"') == 1
    assert "<strong>unreachable</strong>" in html


def test_search_and_pagination_over_250_locks(
    redlock_settings: dict[str, Any], nodes: NodeSet, admin_client: Client
) -> None:
    """Search matches resource substrings; 100 locks a page; sorting covers all."""
    jobs = [f"job:{n:03d}" for n in range(250)]
    plant(nodes, [*jobs, "report:daily", "weird*[glob]"])

    first = admin_client.get(LIST_URL, {"q": "job:"}).content.decode()
    assert listed(first) == jobs[:100]
    assert "250 held locks" in first
    assert "page 1 of 3" in first
    assert 'href="?q=job%3A&amp;p=2"' in first

    third = admin_client.get(LIST_URL, {"q": "job:", "p": "3"}).content.decode()
    assert listed(third) == jobs[200:]

    # Descending by resource sorts every lock, not just the page.
    newest = admin_client.get(LIST_URL, {"q": "job:", "o": "-resource"})
    assert listed(newest.content.decode()) == jobs[::-1][:100]

    assert listed(admin_client.get(LIST_URL, {"q": "daily"}).content.decode()) == [
        "report:daily"
    ]
    # Glob characters match literally, not as patterns.
    assert listed(admin_client.get(LIST_URL, {"q": "*[glob]"}).content.decode()) == [
        "weird*[glob]"
    ]
    assert listed(admin_client.get(LIST_URL, {"q": "job:1*"}).content.decode()) == []
    everything = admin_client.get(LIST_URL).content.decode()
    assert "252 held locks" in everything
    assert len(listed(everything)) == 100


def test_page_columns_sort_the_page_shown(
    redlock_settings: dict[str, Any], nodes: NodeSet, admin_client: Client
) -> None:
    """Sorting by time left orders the page's locks by their remaining lease."""
    plant(nodes, ["a-long"], ttl_ms=50_000)
    plant(nodes, ["b-short"], ttl_ms=5_000)
    plant(nodes, ["c-middle"], ttl_ms=20_000)

    assert listed(admin_client.get(LIST_URL).content.decode()) == [
        "a-long",
        "b-short",
        "c-middle",
    ]
    by_time = admin_client.get(LIST_URL, {"o": "time_left"}).content.decode()
    assert listed(by_time) == ["b-short", "c-middle", "a-long"]
    assert 'aria-sort="ascending"' in by_time
    reverse_time = admin_client.get(LIST_URL, {"o": "-time_left"}).content.decode()
    assert listed(reverse_time) == ["a-long", "c-middle", "b-short"]


def test_page_refreshes_itself_unless_turned_off(
    redlock_settings: dict[str, Any], admin_client: Client
) -> None:
    """A meta refresh reloads the page every 10 s by default; ``refresh=0`` stops it."""
    default = admin_client.get(LIST_URL, {"q": "x"}).content.decode()
    assert '<meta http-equiv="refresh" content="10">' in default
    assert 'href="?q=x&amp;refresh=0"' in default

    off = admin_client.get(LIST_URL, {"q": "x", "refresh": "0"}).content.decode()
    assert 'http-equiv="refresh"' not in off
    assert "Automatic refresh is off." in off
    # The search form keeps the choice.
    assert '<input type="hidden" name="refresh" value="0">' in off


def test_ten_thousand_locks_page_loads_fast(
    redlock_settings: dict[str, Any], nodes: NodeSet, admin_client: Client
) -> None:
    """With 10,000 locks on each of 5 nodes the page loads well under 5 seconds."""
    resources = [f"bulk:{n:05d}" for n in range(10_000)]
    plant(nodes, resources)
    admin_client.get(LIST_URL)  # warm the connection pools

    started = time.perf_counter()
    response = admin_client.get(LIST_URL, {"p": "57"})
    elapsed = time.perf_counter() - started

    html = response.content.decode()
    assert listed(html) == resources[5600:5700]
    assert "10000 held locks" in html
    assert html.count("<td>10000</td>") == 5  # lock keys per node in the panel
    print(f"\n10,000-lock page load: {elapsed * 1000:.0f} ms")
    assert elapsed < 5.0


# --- credentials ----------------------------------------------------------------------


def test_node_passwords_never_appear_on_any_page(
    settings: Any,
    make_nodes: Callable[..., NodeSet],
    admin_client: Client,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Nodes behind requirepass show as host:port only, even a wrong-password one."""
    protected = make_nodes(3)
    urls = protected.require_password(PASSWORD)
    wrong = "not-the-" + PASSWORD
    urls[2] = f"redis://:{wrong}@127.0.0.1:{protected[2].port}/0"
    settings.REDLOCK = {"NODES": urls, "TTL": 10.0, "NODE_TIMEOUT": 0.2}

    pages = []
    with (
        pytest.raises(LockLostError),  # force-released under its holder
        caplog.at_level(logging.DEBUG),
        Redlock("secret-stuff") as lock,
    ):
        assert lock.owned()
        listing = admin_client.get(LIST_URL)
        pages.append(listing.content.decode())
        row = rows(pages[0])["secret-stuff"]
        token_digest = re.search(r"<code>([0-9a-f]{12})</code>", row)
        assert token_digest is not None
        form = {"resource": "secret-stuff", "token_digest": token_digest.group(1)}
        confirmation = admin_client.post(RELEASE_URL, form)
        pages.append(confirmation.content.decode())
        done = admin_client.post(RELEASE_URL, {**form, "confirm": "yes"}, follow=True)
        pages.append(done.content.decode())

    assert "Nodes: 2 of 3 reachable, quorum 2" in pages[0]
    assert "2 of 3" in row
    assert "Yes, release it" in pages[1]
    assert "released on 2 of 3 nodes" in pages[2]
    for node in protected:
        assert f"redis://127.0.0.1:{node.port}/0" in pages[0]
    for text in [
        *pages,
        caplog.text,
        *(e.change_message for e in LogEntry.objects.all()),
    ]:
        assert PASSWORD not in text
        assert wrong not in text


# --- force release: permissions, CSRF, GET ------------------------------------


def test_staff_without_release_permission_gets_403_even_posting_directly(
    redlock_settings: dict[str, Any], nodes: NodeSet, staff: Callable[..., Any]
) -> None:
    """View-only staff see no release button and their direct POSTs are refused."""
    viewer = login(staff("viewer", "view_heldlock"))
    with Redlock("precious") as lock:
        page = viewer.get(LIST_URL).content.decode()
        assert "precious" in rows(page)
        assert "Force release" not in page
        assert RELEASE_URL not in page
        token = token_on(nodes[0], "precious")
        assert token is not None
        form = {"resource": "precious", "token_digest": digest(token)}
        assert viewer.post(RELEASE_URL, form).status_code == 403
        confirmed = viewer.post(RELEASE_URL, {**form, "confirm": "yes"})
        assert confirmed.status_code == 403
        assert held_on(nodes, "precious") == 5
        assert lock.owned()
    assert LogEntry.objects.count() == 0


def test_release_permission_alone_does_not_show_the_page(
    redlock_settings: dict[str, Any], nodes: NodeSet, staff: Callable[..., Any]
) -> None:
    """``force_release_lock`` without ``view_heldlock`` releases nothing (403)."""
    blind = login(staff("blind", "force_release_lock"))
    with Redlock("precious"):
        token = token_on(nodes[0], "precious")
        assert token is not None
        form = {"resource": "precious", "token_digest": digest(token), "confirm": "yes"}
        assert blind.get(LIST_URL).status_code == 403
        assert blind.post(RELEASE_URL, form).status_code == 403
        assert held_on(nodes, "precious") == 5


def test_post_without_csrf_token_is_refused(
    redlock_settings: dict[str, Any], nodes: NodeSet, releaser: Any
) -> None:
    """A release POST lacking the CSRF token is refused; with it, it goes through."""
    browser = login(releaser, enforce_csrf_checks=True)
    with pytest.raises(LockLostError), Redlock("guarded"):
        page = browser.get(LIST_URL).content.decode()
        token = token_on(nodes[0], "guarded")
        assert token is not None
        form = {"resource": "guarded", "token_digest": digest(token), "confirm": "yes"}

        refused = browser.post(RELEASE_URL, form)
        assert refused.status_code == 403
        assert b"CSRF" in refused.content
        assert held_on(nodes, "guarded") == 5

        # Negative control: the same POST with the page's CSRF token releases it.
        csrf = re.search(r'name="csrfmiddlewaretoken" value="([^"]+)"', page)
        assert csrf is not None
        accepted = browser.post(
            RELEASE_URL, {**form, "csrfmiddlewaretoken": csrf.group(1)}
        )
        assert accepted.status_code == 302
        assert held_on(nodes, "guarded") == 0


def test_get_on_the_release_url_changes_nothing(
    redlock_settings: dict[str, Any], nodes: NodeSet, admin_client: Client
) -> None:
    """The release URL answers GET with 405 and the lock stays held."""
    with Redlock("sticky"):
        token = token_on(nodes[0], "sticky")
        assert token is not None
        query = {"resource": "sticky", "token_digest": digest(token), "confirm": "yes"}
        assert admin_client.get(RELEASE_URL, query).status_code == 405
        assert held_on(nodes, "sticky") == 5


# --- force release: the flow ---------------------------------------------------------


def test_force_release_confirms_then_releases_everywhere_and_logs(
    redlock_settings: dict[str, Any],
    nodes: NodeSet,
    releaser: Any,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """First POST shows the lock; the confirmation deletes it and records who did it."""
    browser = login(releaser)
    # The evicted holder learns it at release: LockLostError.
    with pytest.raises(LockLostError), Redlock("stuck:job", label="nightly export"):
        token = token_on(nodes[0], "stuck:job")
        assert token is not None
        page = browser.get(LIST_URL, {"q": "stuck"}).content.decode()
        assert f'name="token_digest" value="{digest(token)}"' in page
        form = {
            "resource": "stuck:job",
            "token_digest": digest(token),
            "list_query": "q=stuck&evil=https://example.com",
        }

        confirmation = browser.post(RELEASE_URL, form)
        html = confirmation.content.decode()
        assert confirmation.status_code == 200
        assert "Are you sure you want to force-release “stuck:job”?" in html
        assert "nightly export" in html
        assert digest(token) in html
        assert '<input type="hidden" name="confirm" value="yes">' in html
        assert held_on(nodes, "stuck:job") == 5  # nothing happens before confirming

        with caplog.at_level(logging.WARNING, logger="redlock_django.admin"):
            done = browser.post(
                RELEASE_URL, {**form, "confirm": "yes", "reason": "worker died"}
            )
        assert held_on(nodes, "stuck:job") == 0

    assert done.status_code == 302
    # Back to the list the user came from, and nowhere else.
    assert done["Location"] == f"{LIST_URL}?q=stuck"
    listing = browser.get(done["Location"])
    assert listed(listing.content.decode()) == []
    [message] = messages_of(listing)
    assert "released on 5 of 5 nodes" in message
    assert digest(token) in message

    entry = LogEntry.objects.get()
    assert entry.user == releaser
    assert entry.content_type == ContentType.objects.get_for_model(HeldLock)
    assert entry.object_id == entry.object_repr == "stuck:job"
    assert entry.action_flag == DELETION
    assert entry.change_message == (
        f"Force-released (token digest {digest(token)}): released on 5 of 5 nodes "
        "(node[0], node[1], node[2], node[3], node[4]); reason: worker died"
    )
    [record] = [r for r in caplog.records if r.name == "redlock_django.admin"]
    assert record.levelno == logging.WARNING
    assert "'stuck:job'" in record.getMessage()
    assert "'releaser'" in record.getMessage()
    assert token.decode() not in record.getMessage()


def test_minority_leftover_can_be_force_released(
    redlock_settings: dict[str, Any], nodes: NodeSet, admin_client: Client
) -> None:
    """A lock on 2 of 5 nodes is released on those 2 and the page says so."""
    plant(nodes[3:], ["leftover"], token=b"left-behind")
    form = {"resource": "leftover", "token_digest": digest(b"left-behind")}
    response = admin_client.post(RELEASE_URL, {**form, "confirm": "yes"}, follow=True)
    [message] = messages_of(response)
    assert "released on 2 of 5 nodes (node[3], node[4])" in message
    assert held_on(nodes, "leftover") == 0


def test_stale_digest_releases_nothing_and_says_the_lock_changed_hands(
    redlock_settings: dict[str, Any], nodes: NodeSet, admin_client: Client
) -> None:
    """A digest from before the lock changed hands leaves the new holder alone."""
    with Redlock("hot"):
        old = token_on(nodes[0], "hot")
    assert old is not None
    with Redlock("hot"):
        new = token_on(nodes[0], "hot")
        assert new is not None and new != old
        form = {"resource": "hot", "token_digest": digest(old)}

        confirmation = admin_client.post(RELEASE_URL, form).content.decode()
        assert "changed hands since the list was loaded" in confirmation
        assert "Yes, release it" not in confirmation

        response = admin_client.post(
            RELEASE_URL, {**form, "confirm": "yes"}, follow=True
        )
        [message] = messages_of(response)
        assert "changed hands" in message
        assert "nothing was released" in message
        assert held_on(nodes, "hot") == 5
        assert token_on(nodes[0], "hot") == new
    assert LogEntry.objects.count() == 0


def test_a_lock_that_changed_hands_while_a_node_is_down_is_reported_as_changed(
    redlock_settings: dict[str, Any], nodes: NodeSet, admin_client: Client
) -> None:
    """With one node of five down, the four that answer are enough to say the lock
    changed hands (it was reported as a failure to release, blaming the node)."""
    with Redlock("hot-down"):
        old = token_on(nodes[1], "hot-down")
    assert old is not None
    with Redlock("hot-down"):
        nodes[0].stop()
        form = {"resource": "hot-down", "token_digest": digest(old), "confirm": "yes"}
        response = admin_client.post(RELEASE_URL, form, follow=True)
        [message] = messages_of(response)
        assert "changed hands" in message and "nothing was released" in message
        assert "1 did not answer" in message
        assert held_on(nodes[1:], "hot-down") == 4


def test_release_of_a_lock_gone_meanwhile_says_so(
    redlock_settings: dict[str, Any], admin_client: Client
) -> None:
    """Confirming a lock that is no longer held goes back to the list with a notice."""
    form = {"resource": "vanished", "token_digest": digest(b"whatever")}
    response = admin_client.post(RELEASE_URL, form, follow=True)
    assert messages_of(response) == ["“vanished” is no longer held."]


@pytest.mark.parametrize(
    "form",
    [
        {"resource": "x", "token_digest": ""},
        {"resource": "x", "token_digest": "abc"},
        {"resource": "x", "token_digest": "*" * 12},
        {"resource": "", "token_digest": "a" * 12},
    ],
)
def test_release_refuses_a_missing_or_short_digest(
    redlock_settings: dict[str, Any],
    nodes: NodeSet,
    admin_client: Client,
    form: dict[str, str],
) -> None:
    """A digest that could match any token (empty, short, not hex) releases nothing."""
    plant(nodes, ["x"])
    response = admin_client.post(RELEASE_URL, {**form, "confirm": "yes"}, follow=True)
    assert messages_of(response) == ["Choose a lock to release from the list."]
    assert held_on(nodes, "x") == 5


def test_release_url_is_named_in_the_admin_namespace() -> None:
    """``admin:redlock_django_heldlock_release`` resolves to the release view."""
    assert reverse("admin:redlock_django_heldlock_release") == RELEASE_URL
    assert reverse("admin:redlock_django_heldlock_changelist") == LIST_URL
