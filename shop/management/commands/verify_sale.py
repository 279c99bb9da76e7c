"""``manage.py verify_sale [--product ID]``: audit a sale.

Prints the audit of each product (one JSON object per line; see
``shop.models.audit``): the product given, or every product. Exit codes: 0 when
nothing was oversold and no customer has two orders; 1 when any product was
oversold or has duplicate customers; 2 when the product does not exist or there
is none.
"""

from __future__ import annotations

import json
import sys
from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser

from shop.models import Product, audit


class Command(BaseCommand):
    help = "Print the audit JSON of a sale; exit 1 on oversell or duplicate orders."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--product", type=int, help="product id (default: all)")

    def handle(self, *args: Any, **options: Any) -> None:
        products = Product.objects.order_by("id")
        if options["product"] is not None:
            products = products.filter(pk=options["product"])
            if not products.exists():
                raise CommandError(
                    f"no product with id {options['product']}", returncode=2
                )
        elif not products.exists():
            raise CommandError("no product: run seed_sale first", returncode=2)
        failed = False
        for product in products:
            report = audit(product)
            self.stdout.write(json.dumps(report))
            if report["oversold"] or report["duplicate_customers"]:
                failed = True
                self.stderr.write(
                    f"product {product.pk}: {report['oversold']} unit(s) oversold, "
                    f"{report['duplicate_customers']} duplicate customer(s)"
                )
        if failed:
            sys.exit(1)
