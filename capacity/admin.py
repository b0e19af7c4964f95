from django.contrib import admin

from capacity.models import CapacitySearch


@admin.register(CapacitySearch)
class CapacitySearchAdmin(admin.ModelAdmin):
    """Read-only: searches are started by the command line or the API (README, "Capacity")."""

    list_display = ("id", "experiment", "status", "summary", "created_at", "finished_at")
    list_filter = ("status",)
    search_fields = ("experiment__key",)
    readonly_fields = (
        "experiment",
        "status",
        "params",
        "result",
        "error",
        "started_by",
        "created_at",
        "finished_at",
    )

    @admin.display(description="capacity (req/s)")
    def summary(self, obj: CapacitySearch) -> str:
        parts = [f"{v}: {r.get('capacity_rps') or '-'}" for v, r in (obj.result or {}).items()]
        return ", ".join(parts) or "-"

    def has_add_permission(self, request) -> bool:
        return False

    def has_change_permission(self, request, obj=None) -> bool:
        return False
