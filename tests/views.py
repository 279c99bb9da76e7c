"""Views decorated by the test suite (filled in with the decorator tests)."""

from __future__ import annotations

from django.urls import URLPattern

urlpatterns: list[URLPattern] = []
