"""``manage.py seed_sale --stock 200 [--name NAME]``: open a flash sale.

Creates the product named NAME, or resets it when it exists: its orders are
deleted, its initial and current stock set to ``--stock`` and its fencing token
set back to 0 (the lock servers may be new, so their fencing counters may start
again at 1: a stored token from an earlier sale would refuse every write). Run it
only while no sale of that product is in progress. The last line printed is
``product_id=<id>``, for scripts.
"""

from __future__ import annotations

from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser
from django.db import connection, transaction

from shop.models import Product

DEFAULT_NAME = "Flash sale"


#: The largest stock a PositiveIntegerField holds on every database Django supports.
MAX_STOCK = 2147483647


class Command(BaseCommand):
    help = "Create or reset a product on sale and print product_id=<id>."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument(
            "--stock", type=int, default=200, help="units on sale (default 200)"
        )
        parser.add_argument(
            "--name",
            default=DEFAULT_NAME,
            help=f"product name (default {DEFAULT_NAME!r})",
        )

    def handle(self, *args: Any, **options: Any) -> None:
        stock: int = options["stock"]
        name: str = options["name"]
        if stock < 0:
            raise CommandError("--stock must be 0 or more", returncode=2)
        # A PositiveIntegerField: the range Django calls safe on every database
        # it supports (PostgreSQL's integer column holds no more).
        most = min(
            connection.ops.integer_field_range("PositiveIntegerField")[1] or MAX_STOCK,
            MAX_STOCK,
        )
        if stock > most:
            raise CommandError(f"--stock must be at most {most}", returncode=2)
        if not name or len(name) > 100:
            raise CommandError("--name must be 1-100 characters", returncode=2)
        with transaction.atomic():
            product = Product.objects.filter(name=name).order_by("id").first()
            if product is None:
                product = Product.objects.create(
                    name=name, initial_stock=stock, stock=stock
                )
                action = "created"
            else:
                deleted, _ = product.orders.all().delete()
                product.initial_stock = product.stock = stock
                product.fence = 0
                product.save(update_fields=["initial_stock", "stock", "fence"])
                action = f"reset ({deleted} order(s) deleted)"
        self.stdout.write(f"{name!r} {action}: {stock} units on sale")
        self.stdout.write(f"product_id={product.pk}")
