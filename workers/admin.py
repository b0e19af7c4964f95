from django.contrib import admin, messages

from workers.models import ReplayRun, ReplayShard
from workers.runs import cancel_run


class ReplayShardInline(admin.TabularInline):
    model = ReplayShard
    extra = 0
    can_delete = False
    fields = ("index", "status", "attempts", "worker", "planned", "sent", "recorded", "lag_p50_ms",
              "lag_p99_ms", "lag_max_ms", "started_at", "finished_at", "error")  # fmt: skip
    readonly_fields = fields

    def has_add_permission(self, request, obj=None):
        return False


@admin.action(description="Cancel selected replays", permissions=["operate"])
def cancel_replays(modeladmin, request, queryset):
    for run in queryset:
        if cancel_run(run, actor=request.user):
            modeladmin.message_user(request, f"run {run.pk}: cancelling", messages.SUCCESS)
        else:
            modeladmin.message_user(request, f"run {run.pk}: already {run.status}", messages.WARNING)


@admin.register(ReplayRun)
class ReplayRunAdmin(admin.ModelAdmin):
    list_display = ("id", "experiment", "status", "mode", "total_requests", "samples_recorded",
                    "started_by", "created_at", "finished_at")  # fmt: skip
    list_filter = ("status", "mode", "experiment")
    search_fields = ("experiment__key", "source")
    inlines = [ReplayShardInline]
    actions = [cancel_replays]

    def has_operate_permission(self, request):
        return request.user.has_perm("workers.operate_replay")

    def has_add_permission(self, request):
        return False  # started with the replay command or POST /api/replays/ (validated there)

    def has_change_permission(self, request, obj=None):
        return False

    def has_delete_permission(self, request, obj=None):
        return False
