"""Admin pages for the shop's products and orders.

A product's stock is written by purchases under its lock, with ``fenced_update``
(shop/views.py). The admin's change form writes it the same way: a POST to the
change view takes the product lock (``distributed_lock``, as a purchase does, so
it waits for the purchase in progress and is released after its commit), and
the edit is compared with the fencing token the form was shown with. An edit of
a product that purchases (or another edit) changed since the form was shown is
refused with a message, instead of writing back a stock they already changed.
"""

from __future__ import annotations

from typing import Any

from django import forms
from django.contrib import admin, messages
from django.http import HttpRequest, HttpResponse, HttpResponseRedirect

from redlock_django import distributed_lock, fenced_update, model_resource

from .models import Order, Product

#: Set on a request whose product edit was refused: no change is logged.
_REFUSED = "_shop_product_edit_refused"


class ProductForm(forms.ModelForm):
    #: The fencing token of the row as the form showed it.
    seen_fence = forms.IntegerField(widget=forms.HiddenInput, required=False)

    class Meta:
        model = Product
        fields = ["name", "initial_stock", "stock"]

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if self.instance.pk is not None:
            self.fields["seen_fence"].initial = self.instance.fence
            self.fields["seen_fence"].required = True


def _product_lock(
    request: HttpRequest, object_id: str, *args: Any, **kwargs: Any
) -> str:
    """The resource of the product a change form edits: the purchases' lock."""
    return model_resource(Product, object_id)


@admin.register(Product)
class ProductAdmin(admin.ModelAdmin):
    form = ProductForm
    list_display = ["id", "name", "initial_stock", "stock", "fence"]
    readonly_fields = ["fence"]

    def change_view(
        self,
        request: HttpRequest,
        object_id: str,
        form_url: str = "",
        extra_context: dict[str, Any] | None = None,
    ) -> HttpResponse:
        if request.method != "POST":
            return super().change_view(request, object_id, form_url, extra_context)
        try:
            model_resource(Product, object_id)
        except (TypeError, ValueError):  # no such product: the admin says so
            return super().change_view(request, object_id, form_url, extra_context)
        parent = super().change_view

        @distributed_lock(_product_lock, fencing=True)
        def change_under_lock(request: HttpRequest, object_id: str) -> HttpResponse:
            return parent(request, object_id, form_url, extra_context)

        return change_under_lock(request, object_id)

    def save_model(
        self, request: HttpRequest, obj: Product, form: forms.ModelForm, change: bool
    ) -> None:
        lock = getattr(request, "redlock", None)
        if not change or lock is None:
            super().save_model(request, obj, form, change)
            return
        fields = [name for name in form.changed_data if name != "seen_fence"]
        if not fields:
            return
        obj.fence = form.cleaned_data["seen_fence"]
        try:
            written = fenced_update(
                obj, lock, **{name: getattr(obj, name) for name in fields}
            )
        except Product.DoesNotExist:
            written = False
        if not written:
            setattr(request, _REFUSED, True)

    def log_change(self, request: HttpRequest, obj: Any, message: Any) -> Any:
        if getattr(request, _REFUSED, False):
            return None
        return super().log_change(request, obj, message)

    def response_change(self, request: HttpRequest, obj: Product) -> HttpResponse:
        if getattr(request, _REFUSED, False):
            self.message_user(
                request,
                "Nothing was saved: the product was changed (a sale, or another "
                "edit) after this form was shown. Check its stock and edit again.",
                messages.ERROR,
            )
            return HttpResponseRedirect(request.path)
        return super().response_change(request, obj)


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
