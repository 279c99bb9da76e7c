"""URLs of the shop app, included under ``/shop/``."""

from django.urls import path

from . import views

app_name = "shop"

urlpatterns = [
    path("", views.storefront, name="storefront"),
    path("products/<int:product_id>/", views.product_detail, name="product"),
    path("products/<int:product_id>/buy/", views.buy, name="buy"),
    path("products/<int:product_id>/buy-unsafe/", views.buy_unsafe, name="buy-unsafe"),
    path("products/<int:product_id>/audit/", views.product_audit, name="audit"),
]
