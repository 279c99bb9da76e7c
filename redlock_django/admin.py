"""The held-locks admin page, fed by ``listing.py`` (no ORM), and a force release.

``models.HeldLock`` is an unmanaged model with no table; its admin replaces the
changelist with a page that reads the Redis nodes. Both views go through
``admin_site.admin_view`` (staff login, ``csrf_protect``, ``never_cache``):

- ``changelist_view`` (GET) needs ``redlock_django.view_heldlock``. It lists the
  locks of one page only: ``listing.lock_resources()`` SCANs key names on every
  node, the names are paginated, and ``listing.describe()`` fetches the page's
  details, so 10,000 held locks load as fast as 100.
- ``force_release_view`` (POST only) also needs
  ``redlock_django.force_release_lock``. The first POST shows a confirmation page;
  the second (``confirm=yes``) calls ``listing.force_release()``, which deletes a
  key only where it still holds the token whose digest the page showed, so a lock
  that changed hands meanwhile is left alone. A release is recorded as an admin
  ``LogEntry`` and a WARNING log line naming the user.

Only token digests (a short prefix of the token's SHA-1) and masked node addresses
are ever shown: a token is a capability, and node URLs may carry passwords.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any, cast

from django.contrib import admin, messages
from django.contrib.admin.models import DELETION, LogEntry
from django.core.exceptions import PermissionDenied
from django.core.paginator import Paginator
from django.http import (
    HttpRequest,
    HttpResponse,
    HttpResponseNotAllowed,
    HttpResponseRedirect,
    QueryDict,
)
from django.template.response import TemplateResponse
from django.urls import URLPattern, path, reverse

from . import listing
from .conf import get_settings
from .meta import printable
from .models import HeldLock
from .protocol import has_quorum, quorum, unanswered_may_hold

if TYPE_CHECKING:
    _ModelAdmin = admin.ModelAdmin[HeldLock]
else:
    _ModelAdmin = admin.ModelAdmin

__all__ = ["HeldLockAdmin"]

logger = logging.getLogger(__name__)

SEARCH_VAR = "q"
ORDER_VAR = "o"
PAGE_VAR = "p"
REFRESH_VAR = "refresh"
#: Auto-refresh intervals offered on the page, in seconds; 0 turns it off.
REFRESH_CHOICES = (0, 5, 10, 30, 60)
DEFAULT_REFRESH = 10
#: What a token digest from the page looks like: a prefix of a SHA-1 hex digest.
#: A short or empty prefix would match any token, so it is refused.
_DIGEST = re.compile(r"[0-9a-f]{12,40}")
#: Query parameters of the list that survive a force release's redirect.
_LIST_VARS = (SEARCH_VAR, ORDER_VAR, PAGE_VAR, REFRESH_VAR)


@dataclass(frozen=True)
class _Column:
    name: str
    label: str
    # None: the column does not sort; otherwise the key used on the page's locks.
    key: Callable[[listing.ListedLock], Any] | None = None


_EPOCH = datetime.min.replace(tzinfo=UTC)

# "resource" sorts every held lock (by name, before paginating); the others sort
# the locks of the page shown, since their values are only fetched for that page.
_COLUMNS = (
    _Column("resource", "Resource", lambda lock: lock.resource),
    _Column("holder", "Holder", lambda lock: (lock.host or "", lock.pid or 0)),
    _Column("label", "Label", lambda lock: lock.label),
    _Column("acquired_at", "Acquired at", lambda lock: lock.acquired_at or _EPOCH),
    _Column("time_left", "Time left", lambda lock: lock.time_left),
    _Column("fencing_token", "Fencing token", lambda lock: lock.fencing_token or -1),
    _Column("held_on", "Held on", lambda lock: (lock.held_on, lock.nodes)),
    _Column("token_digest", "Token digest"),
)
_SORTABLE = {column.name: column for column in _COLUMNS if column.key is not None}


class HeldLockAdmin(_ModelAdmin):
    """Show the locks held on the Redis nodes; force-release one, with permission."""

    list_per_page = 100
    changelist_template = "admin/redlock_django/held_locks.html"
    confirmation_template = "admin/redlock_django/force_release_confirmation.html"

    # The page is read-only: locks are only ever taken by ``Redlock``.
    def has_add_permission(self, request: HttpRequest) -> bool:
        return False

    def has_change_permission(
        self, request: HttpRequest, obj: HeldLock | None = None
    ) -> bool:
        return False

    def has_delete_permission(
        self, request: HttpRequest, obj: HeldLock | None = None
    ) -> bool:
        return False

    def has_force_release_permission(self, request: HttpRequest) -> bool:
        """Tell whether the user may force-release locks (and see them)."""
        codename = f"{self.opts.app_label}.force_release_lock"
        # The admin's users have has_perm() (PermissionsMixin); the stubs' union
        # type includes AbstractBaseUser, which lacks it.
        return self.has_view_permission(request) and bool(
            request.user.has_perm(codename)  # type: ignore[union-attr]
        )

    def get_urls(self) -> list[URLPattern]:
        """Serve the held-locks page and the force release; no change or add views."""
        info = self.opts.app_label, self.opts.model_name
        wrap = self.admin_site.admin_view
        return [
            path("", wrap(self.changelist_view), name="{}_{}_changelist".format(*info)),
            path(
                "release/",
                wrap(self.force_release_view),
                name="{}_{}_release".format(*info),
            ),
        ]

    # -- the list -------------------------------------------------------------

    def changelist_view(
        self, request: HttpRequest, extra_context: dict[str, Any] | None = None
    ) -> HttpResponse:
        """Render one page of held locks and the node health panel."""
        if not self.has_view_permission(request):
            raise PermissionDenied
        search = request.GET.get(SEARCH_VAR, "").strip()
        order = request.GET.get(ORDER_VAR, "resource")
        descending = order.startswith("-")
        column = _SORTABLE.get(order.removeprefix("-"), _SORTABLE["resource"])
        refresh = _refresh_interval(request)

        settings = get_settings()
        node_count = len(settings.nodes)
        resources = listing.lock_resources(
            search, descending=descending and column.name == "resource"
        )
        paginator = Paginator(resources, self.list_per_page)
        page = paginator.get_page(request.GET.get(PAGE_VAR))
        locks = listing.describe(list(page.object_list))
        if column.name != "resource" and column.key is not None:
            locks.sort(key=column.key, reverse=descending)
        statuses = listing.node_status()
        reachable = sum(status.reachable for status in statuses)

        context = {
            **self.admin_site.each_context(request),
            "opts": self.opts,
            "title": "Held locks",
            "locks": locks,
            "total": paginator.count,
            "page": page,
            "page_links": _page_links(request, page),
            "columns": _headers(request, column.name, descending),
            "search": search,
            "search_var": SEARCH_VAR,
            "hidden_params": [
                (name, request.GET[name])
                for name in (ORDER_VAR, REFRESH_VAR)
                if name in request.GET
            ],
            "refresh": refresh,
            "refresh_links": [
                (seconds, _query(request, **{REFRESH_VAR: str(seconds)}))
                for seconds in REFRESH_CHOICES
            ],
            "statuses": statuses,
            "node_count": node_count,
            "quorum": quorum(node_count),
            "reachable": reachable,
            "nodes_below_quorum": not has_quorum(reachable, node_count),
            "key_prefix": settings.key_prefix,
            "can_release": self.has_force_release_permission(request),
            "list_query": request.GET.urlencode(),
            "release_url": reverse(
                f"admin:{self.opts.app_label}_{self.opts.model_name}_release"
            ),
            **(extra_context or {}),
        }
        request.current_app = self.admin_site.name
        return TemplateResponse(request, self.changelist_template, context)

    # -- force release -----------------------------------------------------------

    def force_release_view(self, request: HttpRequest) -> HttpResponse:
        """Confirm, then force-release one lock held with the token shown."""
        if request.method != "POST":
            return HttpResponseNotAllowed(["POST"])
        if not self.has_force_release_permission(request):
            raise PermissionDenied
        back = self._changelist_url(request.POST.get("list_query", ""))
        resource = request.POST.get("resource", "")
        digest = request.POST.get("token_digest", "")
        if not resource or not _DIGEST.fullmatch(digest):
            self.message_user(
                request, "Choose a lock to release from the list.", messages.ERROR
            )
            return HttpResponseRedirect(back)
        if request.POST.get("confirm") != "yes":
            return self._confirmation(request, resource, digest, back)

        try:
            outcome = listing.force_release(resource, digest)
        except ValueError as exc:
            self.message_user(request, f"Nothing released: {exc}", messages.ERROR)
            return HttpResponseRedirect(back)
        if outcome.changed:
            silent = (
                f"; {len(outcome.failed)} did not answer: {_failures(outcome.failed)}"
                if outcome.failed
                else ""
            )
            self.message_user(
                request,
                f"“{resource}” changed hands since the page was loaded "
                f"(no node that answered holds the token {digest} any more"
                f"{silent}): nothing was released.",
                messages.WARNING,
            )
        elif not outcome.released:
            self.message_user(
                request,
                f"Could not release “{resource}” on any node: "
                f"{_failures(outcome.failed)}.",
                messages.ERROR,
            )
        else:
            self._record(request, resource, digest, outcome)
        return HttpResponseRedirect(back)

    def _confirmation(
        self, request: HttpRequest, resource: str, digest: str, back: str
    ) -> HttpResponse:
        try:
            found = listing.describe([resource])
        except ValueError as exc:
            self.message_user(request, f"Nothing released: {exc}", messages.ERROR)
            return HttpResponseRedirect(back)
        if not found:
            self.message_user(
                request, f"“{resource}” is no longer held.", messages.WARNING
            )
            return HttpResponseRedirect(back)
        lock = found[0]
        context = {
            **self.admin_site.each_context(request),
            "opts": self.opts,
            "title": "Force-release a lock?",
            "lock": lock,
            "digest": digest,
            # The page confirms the holder the user chose; a new holder is not
            # released on that confirmation.
            "changed_hands": lock.token_digest != digest,
            "list_query": request.POST.get("list_query", ""),
            "back": back,
            "release_url": request.path,
        }
        request.current_app = self.admin_site.name
        return TemplateResponse(request, self.confirmation_template, context)

    def _record(
        self,
        request: HttpRequest,
        resource: str,
        digest: str,
        outcome: listing.ForceRelease,
    ) -> None:
        node_count = len(get_settings().nodes)
        released = ", ".join(f"node[{index}]" for index in outcome.released)
        # The silent nodes may be a quorum of their own, still holding the lock
        # (its holder can even extend it there): not a done release.
        unsure = unanswered_may_hold(len(outcome.failed), node_count)
        summary = (
            f"{'Force release tried' if unsure else 'Force-released'} "
            f"(token digest {digest}): "
            f"released on {len(outcome.released)} of {node_count} nodes ({released})"
        )
        if outcome.failed:
            summary += f"; failed on {_failures(outcome.failed)}"
        if unsure:
            summary += (
                f"; the lock may still be held until its lease runs out: "
                f"{len(outcome.failed)} nodes could not be reached"
            )
        # Free text: control characters escaped, so it cannot forge a log line.
        reason = printable(request.POST.get("reason", "").strip()[:500])
        if reason:
            summary += f"; reason: {reason}"
        user = request.user
        LogEntry.objects.log_actions(
            # admin_view let only a logged-in user through: pk is set.
            user_id=cast("int | str", user.pk),
            queryset=[HeldLock(resource=resource)],
            action_flag=DELETION,
            change_message=summary,
            single_object=True,
        )
        logger.warning(
            "lock %r force-released by user %r: %s",
            resource,
            user.get_username(),
            summary,
        )
        if unsure:
            level = messages.ERROR
        else:
            level = messages.WARNING if outcome.failed else messages.SUCCESS
        self.message_user(request, f"“{resource}”: {summary}.", level)

    def _changelist_url(self, list_query: str) -> str:
        url = reverse(f"admin:{self.opts.app_label}_{self.opts.model_name}_changelist")
        # Only the list's own parameters come back: the redirect goes nowhere else.
        given = QueryDict(list_query)
        kept = QueryDict(mutable=True)
        for name in _LIST_VARS:
            if name in given:
                kept[name] = given[name]
        return f"{url}?{kept.urlencode()}" if kept else url


def _failures(failed: dict[str, str]) -> str:
    return "; ".join(f"{address} ({reason})" for address, reason in failed.items())


def _query(request: HttpRequest, **changes: str | None) -> str:
    """Return ``?query`` for the current page with ``changes`` applied."""
    params = request.GET.copy()
    for name, value in changes.items():
        if value is None:
            params.pop(name, None)
        else:
            params[name] = value
    return f"?{params.urlencode()}" if params else "?"


def _refresh_interval(request: HttpRequest) -> int:
    try:
        seconds = int(request.GET.get(REFRESH_VAR, DEFAULT_REFRESH))
    except ValueError:
        return DEFAULT_REFRESH
    return seconds if seconds in REFRESH_CHOICES else DEFAULT_REFRESH


def _headers(request: HttpRequest, current: str, descending: bool) -> list[Any]:
    headers = []
    for column in _COLUMNS:
        sorted_as = None
        if column.name == current:
            sorted_as = "descending" if descending else "ascending"
        toggled = f"-{column.name}" if sorted_as == "ascending" else column.name
        headers.append(
            {
                "name": column.name,
                "label": column.label,
                "sortable": column.key is not None,
                "sorted": sorted_as,
                # A new sort starts from the first page.
                "url": _query(request, **{ORDER_VAR: toggled, PAGE_VAR: None}),
                "whole_list": column.name == "resource",
            }
        )
    return headers


def _page_links(request: HttpRequest, page: Any) -> list[tuple[str, str | None]]:
    if page.paginator.num_pages <= 1:
        return []
    links: list[tuple[str, str | None]] = []
    for number in page.paginator.get_elided_page_range(page.number):
        if number == page.paginator.ELLIPSIS or number == page.number:
            links.append((str(number), None))
        else:
            links.append((str(number), _query(request, **{PAGE_VAR: str(number)})))
    return links


admin.site.register(HeldLock, HeldLockAdmin)
