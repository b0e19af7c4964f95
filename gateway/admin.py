"""The live runs in the admin: read-only, written by the gateways' recorders (gateway.recording)."""

from django.contrib import admin

from gateway.models import LiveRun


@admin.register(LiveRun)
class LiveRunAdmin(admin.ModelAdmin):
    list_display = (
        "run_id",
        "worker",
        "status",
        "started_at",
        "heartbeat_at",
        "recorded",
        "stored",
        "spooled",
        "spool_rows",
        "dropped",
        "rejected",
    )
    list_filter = ("status", "host")
    search_fields = ("worker", "spool")
    readonly_fields = [f.name for f in LiveRun._meta.fields] + ["run_id"]

    @admin.display(description="run id")
    def run_id(self, obj: LiveRun) -> int:
        return obj.run_id

    def has_add_permission(self, request):
        return False

    def has_change_permission(self, request, obj=None):
        return False

    def has_delete_permission(self, request, obj=None):
        return False
