"""The flash-sale shop app: products sold under a Redlock, and their orders."""

from django.apps import AppConfig


class ShopConfig(AppConfig):
    name = "shop"
    verbose_name = "Flash-sale shop"
    default_auto_field = "django.db.models.BigAutoField"

    def ready(self) -> None:
        from . import timings

        timings.connect()
