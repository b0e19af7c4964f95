"""The SRE weights form in the admin: same validation as set_weights and the API (both go
through ``experiments.weights.publish``), with the moved-users preview before saving.

Hook it into the Experiment admin by mixing ``WeightsAdminMixin`` in first::

    class ExperimentAdmin(WeightsAdminMixin, admin.ModelAdmin):
        readonly_fields = (..., "weights_link")

It adds ``/admin/experiments/experiment/<id>/weights/`` (name
``admin:experiments_experiment_weights``) and a "Traffic weights" link field.
"""

from __future__ import annotations

from django import forms
from django.contrib import admin, messages
from django.core.exceptions import PermissionDenied
from django.shortcuts import get_object_or_404, redirect
from django.template.response import TemplateResponse
from django.urls import path, reverse
from django.utils.html import format_html

from experiments.models import Experiment
from experiments.teams import visible_experiments
from experiments.weights.errors import ConflictError, StoreUnavailable, WeightsError
from experiments.weights.publish import current_weights, preview_move, publish_weights

PERMISSION = "experiments.change_weights"


class WeightsForm(forms.Form):
    reason = forms.CharField(
        max_length=2000, widget=forms.Textarea(attrs={"rows": 2, "cols": 60}), help_text="Why (audit log)"
    )
    expected_revision = forms.IntegerField(min_value=0, widget=forms.HiddenInput)

    def __init__(self, *args, variants: list[str], **kwargs):
        super().__init__(*args, **kwargs)
        self.variants = variants
        for key in variants:
            self.fields[f"weight__{key}"] = forms.IntegerField(
                label=key, min_value=0, max_value=100, help_text="percent of users"
            )

    def weights(self) -> dict[str, int]:
        return {key: self.cleaned_data[f"weight__{key}"] for key in self.variants}

    def add_weights_error(self, exc: WeightsError) -> None:
        """Put 'weights.fp16: ...' on the fp16 field, the rest above the form."""
        for error in exc.errors:
            path, _, message = error.partition(": ")
            variant = path.removeprefix("weights.")
            field = f"weight__{variant}" if path.startswith("weights.") else None
            if field in self.fields:
                self.add_error(field, message)
            elif path == "reason":
                self.add_error("reason", message)
            else:
                self.add_error(None, error)


class WeightsAdminMixin:
    def get_urls(self):
        urls = super().get_urls()
        name = f"{self.opts.app_label}_{self.opts.model_name}_weights"
        view = self.admin_site.admin_view(self.weights_view)
        return [path("<path:object_id>/weights/", view, name=name), *urls]

    @admin.display(description="Traffic weights")
    def weights_link(self, obj):
        if obj is None or obj.pk is None or obj.status in (Experiment.Status.DRAFT,):
            return "published when the experiment starts"
        url = reverse(f"admin:{obj._meta.app_label}_{obj._meta.model_name}_weights", args=[obj.pk])
        return format_html('<a href="{}">change traffic weights (SRE)</a>', url)

    def weights_view(self, request, object_id):
        experiment = get_object_or_404(visible_experiments(request.user), pk=object_id)
        if not request.user.has_perm(PERMISSION):
            raise PermissionDenied(f"changing traffic weights needs the permission {PERMISSION}")
        variants = [v.key for v in experiment.variants.all()]
        try:
            current, revision = current_weights(experiment.key)
        except StoreUnavailable as exc:
            messages.error(request, f"weights store unavailable: {exc}")
            current, revision = None, 0
        shown = dict(current.weights) if current else experiment.weights()
        preview = None
        if request.method == "POST":
            form = WeightsForm(request.POST, variants=variants)
            if form.is_valid():
                args = (experiment.key, form.weights(), request.user, form.cleaned_data["reason"])
                expected = form.cleaned_data["expected_revision"]
                try:
                    if "_save" in request.POST:
                        _, new_revision = publish_weights(*args, expected_revision=expected)
                        messages.success(
                            request, f"{experiment.key}: weights saved at revision {new_revision}"
                        )
                        return redirect(
                            f"admin:{self.opts.app_label}_{self.opts.model_name}_change", experiment.pk
                        )
                    preview = preview_move(*args, expected_revision=expected)
                except WeightsError as exc:
                    form.add_weights_error(exc)
                except ConflictError as exc:
                    form.add_error(None, f"{exc}. The current weights are shown above.")
                except StoreUnavailable as exc:
                    form.add_error(None, f"weights store unavailable, nothing changed: {exc}")
        else:
            initial = {f"weight__{k}": shown.get(k, 0) for k in variants}
            form = WeightsForm(initial={**initial, "expected_revision": revision}, variants=variants)
        context = {
            **self.admin_site.each_context(request),
            "opts": self.opts,
            "title": f"Traffic weights: {experiment.key}",
            "experiment": experiment,
            "current": current,
            "revision": revision,
            "shown": shown,
            "form": form,
            "preview": preview,
            "preview_rows": [(k, preview.move.before.get(k, "-"), v) for k, v in preview.new.weights.items()]
            if preview
            else [],
        }
        return TemplateResponse(request, "admin/experiments/experiment/weights.html", context)
