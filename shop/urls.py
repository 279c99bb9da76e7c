"""URL configuration for the sample shop."""

from django.contrib import admin
from django.urls import include, path
from django.views.generic import RedirectView

urlpatterns = [
    path("", RedirectView.as_view(url="/shop/", permanent=False)),
    path("admin/", admin.site.urls),
    path("shop/", include("shop.shop_urls")),
]
