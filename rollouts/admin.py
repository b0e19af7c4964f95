"""The rollout state in the admin, read-only: the controller alone writes it (rollouts/service.py);
people act on the weights, which makes the controller yield."""

from django.contrib import admin
from django.urls import reverse
from django.utils.html import format_html

from rollouts.models import RolloutState


@admin.register(RolloutState)
class RolloutStateAdmin(admin.ModelAdmin):
    list_display = (
        "experiment",
        "status",
        "step",
        "last_seen_revision",
        "decisions",
        "updated_at",
        "timeline",
    )
    list_filter = ("status",)
    search_fields = ("experiment__key",)

    def timeline(self, obj: RolloutState) -> str:
        return format_html(
            '<a href="{}">timeline</a>', reverse("rollouts:timeline", args=[obj.experiment.key])
        )

    def has_add_permission(self, request) -> bool:
        return False

    def has_change_permission(self, request, obj=None) -> bool:
        return False

    def has_delete_permission(self, request, obj=None) -> bool:
        return False
