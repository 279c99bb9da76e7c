"""Products on sale and their orders.

``Product.fence`` holds the fencing token of the lock holder that last wrote the
row's stock through ``fenced_update``. The write compares it with the token read
with the stock: a holder whose lease ran out is refused once a newer holder has
written the row, and of two holders that read the same stock only the first to
write sells. ``Order`` rows are unique per (product, customer): the database
itself forbids a second order by the same customer for the same product.
"""

from __future__ import annotations

from typing import Any

from django.db import models
from django.db.models import Count, Sum

from redlock_django import FencedQuerySet, FencingTokenField


class Product(models.Model):
    name = models.CharField(max_length=100)
    initial_stock = models.PositiveIntegerField()
    stock = models.IntegerField()
    fence = FencingTokenField()

    objects = FencedQuerySet.as_manager()

    class Meta:
        ordering = ["id"]

    def __str__(self) -> str:
        return f"{self.name} ({self.stock}/{self.initial_stock})"

    def as_json(self) -> dict[str, Any]:
        return {
            "id": self.pk,
            "name": self.name,
            "initial_stock": self.initial_stock,
            "stock": self.stock,
        }


class Order(models.Model):
    product = models.ForeignKey(
        Product, on_delete=models.CASCADE, related_name="orders"
    )
    customer = models.CharField(max_length=64)
    quantity = models.PositiveIntegerField()
    #: The product lock's fencing token; NULL for orders made by ``buy-unsafe``.
    fencing_token = models.BigIntegerField(null=True, blank=True)
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["id"]
        constraints = [
            models.UniqueConstraint(
                fields=["product", "customer"], name="shop_order_one_per_customer"
            )
        ]

    def __str__(self) -> str:
        return f"{self.customer} x{self.quantity} of product {self.product_id}"

    def as_json(self) -> dict[str, Any]:
        return {
            "id": self.pk,
            "product": self.product_id,
            "customer": self.customer,
            "quantity": self.quantity,
            "fencing_token": self.fencing_token,
        }


def audit(product: Product) -> dict[str, Any]:
    """Return the audit of one product's sale, from the database as it is now.

    - ``orders``: how many orders the product has; ``units_sold``: their
      quantities summed.
    - ``expected_stock``: ``initial_stock - units_sold``, what ``stock`` must be
      if every sale was recorded exactly once.
    - ``oversold``: the units sold or still on offer beyond the initial stock,
      ``max(0, units_sold - initial_stock, units_sold + stock - initial_stock,
      -stock)``. It is 0 for a correct sale at any moment. It counts units sold
      past the initial stock (the race once stock ran out), units still on offer
      that do not exist (a lost update: two buyers read the same stock and both
      wrote ``stock - 1``, so one sale is not reflected in ``stock``; they will
      be oversold when the sale runs out), and a negative stock.
    - ``duplicate_customers``: how many customers have more than one order for
      the product (0 while the unique constraint holds, computed anyway).
    """
    orders = Order.objects.filter(product=product)
    totals = orders.aggregate(count=Count("id"), units=Sum("quantity"))
    units_sold = int(totals["units"] or 0)
    duplicates = (
        orders.values("customer").annotate(n=Count("id")).filter(n__gt=1).count()
    )
    # The stock is read after the orders (not with the instance, read earlier):
    # a sale committed in between then shows as an order with its stock still
    # on offer, never as an order whose unit is counted twice. Stock only falls,
    # so units read first plus stock read later never exceed the initial stock.
    row = Product.objects.filter(pk=product.pk).values("initial_stock", "stock")
    current = row.first() or {"initial_stock": product.initial_stock, "stock": 0}
    initial, stock = int(current["initial_stock"]), int(current["stock"])
    oversold = max(0, units_sold - initial, units_sold + stock - initial, -stock)
    return {
        "product": product.pk,
        "initial_stock": initial,
        "stock": stock,
        "orders": int(totals["count"]),
        "units_sold": units_sold,
        "expected_stock": initial - units_sold,
        "oversold": oversold,
        "duplicate_customers": duplicates,
    }
