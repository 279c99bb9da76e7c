"""URLconf of the test suite: the admin, and the views in tests/views.py."""

from __future__ import annotations

from django.contrib import admin
from django.urls import include, path

urlpatterns = [
    path("admin/", admin.site.urls),
    path("views/", include("tests.views")),
    path("shop/", include("shop.shop_urls")),
]
