"""The HTTP answers of ``distributed_lock``: the only place a status code is chosen.

Responses, JSON (``{"error", "resource", "detail"}``) when the request sends JSON
or prefers ``application/json`` over ``text/html`` (a missing ``Accept`` or
``*/*`` counts as JSON), a small HTML page otherwise; both carry ``Vary: Accept``:

- 400 ``bad_resource``: a value cannot be part of a resource name;
- 423 ``locked``: still held by someone else after waiting, with ``Retry-After``
  set to the lock's TTL rounded up: after that long the holder's lease has run
  out unless the holder keeps extending it, so it is the one bound the server
  can promise;
- 503 ``unavailable``: fewer than a quorum of nodes answered, with
  ``Retry-After: UNAVAILABLE_RETRY_AFTER`` (5) seconds: an outage, unrelated to
  any lease.

``on_locked(request, exc)`` and ``on_unavailable(request, exc)`` may return a
response to use instead (or None for the default one); they may be coroutine
functions, also on sync views.
"""

from __future__ import annotations

import math

from django.http import HttpRequest, HttpResponse, JsonResponse
from django.utils.cache import patch_vary_headers
from django.utils.html import escape

from .exceptions import LockContentionError, QuorumUnavailableError
from .resources import RejectedError

__all__ = [
    "UNAVAILABLE_RETRY_AFTER",
    "bad_request",
    "locked",
    "unavailable",
]

#: ``Retry-After`` seconds of the 503 response when too few nodes answer.
UNAVAILABLE_RETRY_AFTER = 5


def _wants_json(request: HttpRequest) -> bool:
    content_type = request.content_type or ""
    if content_type == "application/json" or (
        content_type.startswith("application/") and content_type.endswith("+json")
    ):
        return True
    preferred = request.get_preferred_type(["application/json", "text/html"])
    return preferred == "application/json"


_PAGE = (
    '<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">'
    "<title>{status} {title}</title></head>\n"
    "<body><h1>{title}</h1><p>{detail}</p></body></html>\n"
)


def _error_response(
    request: HttpRequest,
    status: int,
    error: str,
    title: str,
    resource: str | None,
    detail: str,
    retry_after: int | None = None,
) -> HttpResponse:
    response: HttpResponse
    if _wants_json(request):
        body = {"error": error, "resource": resource, "detail": detail}
        response = JsonResponse(body, status=status)
    else:
        page = _PAGE.format(status=status, title=title, detail=escape(detail))
        response = HttpResponse(page, status=status)
    if retry_after is not None:
        response["Retry-After"] = str(retry_after)
    patch_vary_headers(response, ["Accept"])
    return response


def bad_request(request: HttpRequest, rejected: RejectedError) -> HttpResponse:
    """Return the 400 for a request whose values cannot name a resource."""
    return _error_response(
        request,
        400,
        "bad_resource",
        "Bad Request",
        None,
        f"cannot lock this request: {rejected}",
    )


def locked(
    request: HttpRequest, exc: LockContentionError, *, ttl: float
) -> HttpResponse:
    """Return the 423 for a lock still held after the wait, retry after ``ttl``."""
    retry = max(1, math.ceil(ttl))
    return _error_response(
        request,
        423,
        "locked",
        "Locked",
        exc.resource,
        f"{exc.resource!r} is held by another request; retry in {retry} seconds",
        retry_after=retry,
    )


def unavailable(request: HttpRequest, exc: QuorumUnavailableError) -> HttpResponse:
    """Return the 503 for too few nodes answering."""
    return _error_response(
        request,
        503,
        "unavailable",
        "Service Unavailable",
        exc.resource,
        f"too few lock servers answered ({exc.granted} of {exc.nodes} granted, "
        f"{exc.quorum} needed); retry in {UNAVAILABLE_RETRY_AFTER} seconds",
        retry_after=UNAVAILABLE_RETRY_AFTER,
    )
