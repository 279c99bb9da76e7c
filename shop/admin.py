"""Admin pages for the shop's products and orders."""

from django.contrib import admin

from .models import Order, Product


@admin.register(Product)
class ProductAdmin(admin.ModelAdmin):
    list_display = ["id", "name", "initial_stock", "stock", "fence"]
    readonly_fields = ["fence"]


@admin.register(Order)
class OrderAdmin(admin.ModelAdmin):
    list_display = [
        "id",
        "product",
        "customer",
        "quantity",
        "fencing_token",
        "created_at",
    ]
    list_filter = ["product"]
    search_fields = ["customer"]
    readonly_fields = ["fencing_token", "created_at"]
