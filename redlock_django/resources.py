"""Resource templates of ``distributed_lock`` and ``locked``: parsed once, rendered
per request or call.

A template is checked once, when the view or function is decorated; the values a
request or a call puts into it are checked every time, since they come from
outside. This module owns both checks and the characters a resource name may hold.

A template is literal text with ``{name}`` placeholders over the view's URL kwargs
and ``{request.attr.attr}`` placeholders over attributes of the request (no
indexing, positions, conversions or format specs, no private attributes, no
methods). A template that names something a view can never supply raises
``ImproperlyConfigured``: at decoration time when the template itself is
malformed, from the ``redlock.E020`` system check (``checks.check_url_placeholders``)
when a URL pattern routes to the view without that kwarg, and at the request
otherwise.

Values from the request are not trusted. Each one must be at most
``MAX_VALUE_LENGTH`` characters of printable text without ``: { } * ? [ ] \\`` or
whitespace, so a kwarg like ``"1:admin"`` cannot name another resource, and the
whole resource at most ``MAX_RESOURCE_LENGTH``. Anything else raises
``RejectedError``, which the decorator answers with a 400 before any lock is taken.

Function templates (``parse_template(template, parameters=...)``, used by
``functions.locked``) have ``{param}`` and ``{param.attr.attr}`` placeholders over
the function's parameters, with the same limits (no private attributes, no
methods); ``render_arguments`` renders them from the bound arguments of a call,
refusing bad values with the same ``RejectedError``.
"""

from __future__ import annotations

import re
import string
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from typing import Any

from django.core.exceptions import ImproperlyConfigured
from django.http import HttpRequest

from .keys import MAX_RESOURCE_LENGTH, check_not_hashed

__all__ = [
    "MAX_VALUE_LENGTH",
    "Placeholder",
    "RejectedError",
    "Template",
    "check_name",
    "parse_template",
    "render",
    "render_arguments",
]

#: Longest value a placeholder may put into a resource name, in characters.
MAX_VALUE_LENGTH = 64

# Separators and glob characters: a value holding one could name another resource
# ("1:admin") or a pattern in the admin's SCAN MATCH. Whitespace and anything
# unprintable (control, format, unassigned characters) is refused as well.
_FORBIDDEN = frozenset(":{}*?[]\\")
# The same minus ":", for the literal text of a template and a callable's result.
_FORBIDDEN_IN_NAME = _FORBIDDEN - {":"}
_IDENTIFIER = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")


def _bad_character(text: str, forbidden: frozenset[str]) -> str | None:
    for char in text:
        if char in forbidden or char.isspace() or not char.isprintable():
            return char
    return None


class RejectedError(Exception):
    """A value from the request cannot be part of a resource name (HTTP 400)."""


# Templates: parsed and checked once, at decoration time.


@dataclass(frozen=True)
class Placeholder:
    """One ``{field}`` of a template: a view kwarg or a request attribute path,
    or in a function template a parameter and an attribute path on it."""

    field: str
    #: The view kwarg (function parameter) it reads, or None for a ``request.``
    #: attribute path.
    kwarg: str | None
    attributes: tuple[str, ...] = ()


@dataclass(frozen=True)
class Template:
    """A parsed template: ``literals`` around ``placeholders``, one more literal."""

    source: str
    literals: tuple[str, ...]
    placeholders: tuple[Placeholder, ...]

    @property
    def kwargs(self) -> frozenset[str]:
        return frozenset(p.kwarg for p in self.placeholders if p.kwarg is not None)


def _parse_parameter(
    template: str, field: str, parameters: Collection[str], owner: str
) -> Placeholder:
    def bad(why: str) -> ImproperlyConfigured:
        return ImproperlyConfigured(
            f"lock resource {template!r}{owner}: placeholder {{{field}}} {why}"
        )

    parts = field.split(".")
    if not all(_IDENTIFIER.match(part) for part in parts):
        raise bad(
            "is not a parameter name or an attribute path: only {param} and "
            "{param.attr.attr} are allowed (no indexing, no positions)"
        )
    if parts[0] not in parameters:
        known = ", ".join(parameters) or "none"
        raise bad(f"names no parameter of the function (parameters: {known})")
    private = [part for part in parts[1:] if part.startswith("_")]
    if private:
        raise bad(f"reads the private attribute {private[0]!r}")
    return Placeholder(field, kwarg=parts[0], attributes=tuple(parts[1:]))


def _parse_placeholder(template: str, field: str) -> Placeholder:
    def bad(why: str) -> ImproperlyConfigured:
        return ImproperlyConfigured(
            f"lock resource {template!r}: placeholder {{{field}}} {why}"
        )

    parts = field.split(".")
    if not all(_IDENTIFIER.match(part) for part in parts):
        raise bad(
            "is not a view kwarg name or a request attribute path: only "
            "{name} and {request.attr.attr} are allowed (no indexing, no positions)"
        )
    if parts[0] != "request":
        if len(parts) > 1:
            raise bad("reads attributes of a view kwarg; only {request.…} may")
        return Placeholder(field, kwarg=field)
    if len(parts) == 1:
        raise bad("names the whole request; name an attribute, e.g. {request.user.pk}")
    private = [part for part in parts[1:] if part.startswith("_")]
    if private:
        raise bad(f"reads the private attribute {private[0]!r}")
    return Placeholder(field, kwarg=None, attributes=tuple(parts[1:]))


def parse_template(
    template: str, parameters: Collection[str] | None = None, owner: str = ""
) -> Template:
    """Parse and check ``template``; raise ``ImproperlyConfigured`` if malformed.

    With ``parameters`` (a function's parameter names) it is a function template:
    each placeholder must start with one of them; ``owner`` names the function
    in messages.
    """
    where = f" of {owner}" if owner else ""
    if not isinstance(template, str):
        raise ImproperlyConfigured(f"lock resource{where} must be a string")
    try:
        parsed = list(string.Formatter().parse(template))
    except ValueError as exc:
        raise ImproperlyConfigured(f"lock resource {template!r}: {exc}") from exc
    literals: list[str] = []
    placeholders: list[Placeholder] = []
    literal = ""
    for text, field, spec, conversion in parsed:
        literal += text
        if field is None:
            continue
        if conversion is not None or spec:
            raise ImproperlyConfigured(
                f"lock resource {template!r}: placeholder {{{field}}} has a "
                f"conversion or format spec; write plain {{name}} placeholders"
            )
        if parameters is None:
            placeholders.append(_parse_placeholder(template, field))
        else:
            placeholders.append(_parse_parameter(template, field, parameters, where))
        literals.append(literal)
        literal = ""
    literals.append(literal)
    for between in literals[1:-1]:
        if ":" not in between:
            # Values may hold anything but ":": "{a}-{b}" names (a="1-2", b="3")
            # and (a="1", b="2-3") alike, and two different calls would share
            # one lock.
            raise ImproperlyConfigured(
                f"lock resource {template!r}: separate placeholders with text "
                "holding ':' (values never contain one), e.g. "
                "'report:{user_id}:{month}': otherwise two different calls can "
                "name the same resource"
            )
    text = "".join(literals)
    char = _bad_character(text, _FORBIDDEN_IN_NAME)
    if char is not None:
        raise ImproperlyConfigured(
            f"lock resource {template!r}: its literal text contains {char!r}; "
            "use no whitespace, control characters or { } * ? [ ] \\"
        )
    if not placeholders and not text:
        raise ImproperlyConfigured("lock resource template is empty")
    if len(text) + len(placeholders) > MAX_RESOURCE_LENGTH:
        raise ImproperlyConfigured(
            f"lock resource {template!r} is longer than {MAX_RESOURCE_LENGTH} "
            "characters even with one-character values"
        )
    return Template(template, tuple(literals), tuple(placeholders))


# Values: checked at every request and call.


def _read(placeholder: Placeholder, value: Any) -> Any:
    """Follow ``placeholder``'s attribute path from ``value``.

    Raise ``AttributeError`` when an attribute is missing, ``TypeError`` when
    the path ends on a method.
    """
    for attribute in placeholder.attributes:
        value = getattr(value, attribute)
    if placeholder.attributes and callable(value):
        raise TypeError("is a method, not a value")
    return value


def _checked(placeholder: Placeholder, value: Any) -> str:
    """Return ``value`` as text for ``placeholder``; raise ``RejectedError``."""
    if value is None:
        raise RejectedError(f"{{{placeholder.field}}} has no value")
    text = str(value)
    if not text:
        raise RejectedError(f"{{{placeholder.field}}} is empty")
    if len(text) > MAX_VALUE_LENGTH:
        raise RejectedError(
            f"{{{placeholder.field}}} is {len(text)} characters long; "
            f"the limit is {MAX_VALUE_LENGTH}"
        )
    char = _bad_character(text, _FORBIDDEN)
    if char is not None:
        raise RejectedError(
            f"{{{placeholder.field}}} contains {char!r}, which a resource name "
            "cannot hold"
        )
    return text


def _value(
    placeholder: Placeholder,
    request: HttpRequest,
    kwargs: dict[str, Any],
    template: Template,
    view_name: str,
) -> str:
    if placeholder.kwarg is not None:
        if placeholder.kwarg not in kwargs:
            route = getattr(getattr(request, "resolver_match", None), "route", None)
            where = f" by URL pattern {route!r}" if route else ""
            supplied = ", ".join(sorted(kwargs)) or "none"
            raise ImproperlyConfigured(
                f"lock resource {template.source!r} of view {view_name} names "
                f"{{{placeholder.kwarg}}}, which is not among the kwargs passed to "
                f"the view{where} (kwargs: {supplied})"
            )
        value = kwargs[placeholder.kwarg]
    else:
        try:
            value = _read(placeholder, request)
        except (AttributeError, TypeError) as exc:
            raise ImproperlyConfigured(
                f"lock resource {template.source!r} of view {view_name}: "
                f"placeholder {{{placeholder.field}}} "
                f"{'cannot be read: ' if isinstance(exc, AttributeError) else ''}"
                f"{exc}"
            ) from exc
    return _checked(placeholder, value)


def check_name(resource: str) -> str:
    """Return ``resource`` if it can name a lock; raise ``RejectedError``."""
    if not resource:
        raise RejectedError("the resource name is empty")
    if len(resource) > MAX_RESOURCE_LENGTH:
        raise RejectedError(
            f"the resource name is {len(resource)} characters long; "
            f"the limit is {MAX_RESOURCE_LENGTH}"
        )
    char = _bad_character(resource, _FORBIDDEN_IN_NAME)
    if char is not None:
        raise RejectedError(f"the resource name contains {char!r}")
    try:
        # Values that are each fine may together spell a hashed long name's form.
        return check_not_hashed(resource)
    except ValueError as exc:
        raise RejectedError(str(exc)) from None


def render(
    template: Template,
    request: HttpRequest,
    kwargs: dict[str, Any],
    view_name: str,
) -> str:
    """Return the resource ``template`` names for this request.

    Raise ``RejectedError`` for a value the request must not put into a name,
    ``ImproperlyConfigured`` for a placeholder the view does not supply.
    """
    pieces = [template.literals[0]]
    for placeholder, literal in zip(
        template.placeholders, template.literals[1:], strict=True
    ):
        pieces.append(_value(placeholder, request, kwargs, template, view_name))
        pieces.append(literal)
    return check_name("".join(pieces))


def render_arguments(template: Template, arguments: Mapping[str, Any]) -> str:
    """Return the resource a function ``template`` names for one call.

    ``arguments`` are the call's bound arguments, defaults applied. Raise
    ``RejectedError`` naming the placeholder for a value that cannot be read or
    cannot be part of a resource name.
    """
    pieces = [template.literals[0]]
    for placeholder, literal in zip(
        template.placeholders, template.literals[1:], strict=True
    ):
        try:
            value = _read(placeholder, arguments[placeholder.kwarg or ""])
        except AttributeError as exc:
            raise RejectedError(
                f"{{{placeholder.field}}} cannot be read: {exc}"
            ) from exc
        except TypeError as exc:
            raise RejectedError(f"{{{placeholder.field}}} {exc}") from exc
        pieces.append(_checked(placeholder, value))
        pieces.append(literal)
    return check_name("".join(pieces))
