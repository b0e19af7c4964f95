from functools import partial

from django import forms
from django.conf import settings
from django.contrib import admin, messages
from django.core.exceptions import PermissionDenied
from django.shortcuts import redirect
from django.template.response import TemplateResponse
from django.urls import path
from django.views.decorators.csrf import csrf_exempt, csrf_protect

from traces import storage, uploads
from traces.models import Trace


class UploadTraceForm(forms.Form):
    file = forms.FileField(help_text="Azure CSV (TIMESTAMP,ContextTokens,GeneratedTokens) or abplat JSONL")
    name = forms.CharField(
        required=False, max_length=200, help_text="how replays name it (default: the file's name)"
    )
    format = forms.ChoiceField(
        choices=[("", "recognize from the first line"), *Trace.Format.choices], required=False
    )


@admin.register(Trace)
class TraceAdmin(admin.ModelAdmin):
    list_display = (
        "name",
        "format",
        "rows",
        "span_s",
        "rate",
        "size",
        "short_sha",
        "uploaded_by",
        "created_at",
    )
    list_filter = ("format",)
    search_fields = ("name", "sha256")
    readonly_fields = (
        "name",
        "sha256",
        "size",
        "format",
        "rows",
        "span_s",
        "rate",
        "uploaded_by",
        "created_at",
    )

    @admin.display(description="sha256")
    def short_sha(self, obj: Trace) -> str:
        return obj.sha256[:12]

    def has_upload_permission(self, request) -> bool:
        return request.user.has_perm("workers.operate_replay")

    def get_urls(self):
        # CSRF is checked inside capped_upload_view, after the upload cap is installed: the
        # check reads the body, and with it the whole upload.
        view = self.admin_site.admin_view(csrf_exempt(self.capped_upload_view))
        return [path("upload/", view, name="traces_trace_upload"), *super().get_urls()]

    def changelist_view(self, request, extra_context=None):
        extra_context = {**(extra_context or {}), "can_upload_trace": self.has_upload_permission(request)}
        return super().changelist_view(request, extra_context)

    def capped_upload_view(self, request):
        cap = uploads.install(request)
        if request.method == "POST" and uploads.declared_too_large(request):
            # Refused unread: nothing is stored, so no CSRF token (it is in the body) is needed.
            return self.upload_view(request, too_large=True)
        return csrf_protect(partial(self.upload_view, cap=cap))(request)

    def upload_view(self, request, cap=None, too_large=False):
        """Upload a trace (sre): stored by content hash, checked and counted like the API's."""
        if not self.has_upload_permission(request):
            raise PermissionDenied("uploading a trace needs the permission workers.operate_replay")
        form = UploadTraceForm()
        if not too_large and request.method == "POST":
            form = UploadTraceForm(request.POST, request.FILES)  # the cap stops a body past it
            too_large = cap is not None and cap.too_large
        refusal = storage.TraceTooLarge().message if too_large else ""
        if too_large:
            form = UploadTraceForm()
        elif request.method == "POST" and form.is_valid():
            d = form.cleaned_data
            upload = d["file"]
            try:
                trace, created = storage.store(
                    upload.chunks(), name=d["name"] or upload.name, fmt=d["format"] or None, user=request.user
                )
            except storage.TraceError as exc:
                form.add_error(exc.field if exc.field in form.fields else None, exc.message)
            else:
                said = "uploaded" if created else "already stored (same content)"
                self.message_user(request, f"{trace}: {said}", messages.SUCCESS)
                return redirect("admin:traces_trace_change", trace.pk)
        context = {
            **self.admin_site.each_context(request),
            "opts": self.opts,
            "form": form,
            "title": "Upload a trace",
            "max_bytes": settings.TRACE_MAX_BYTES,
            "refusal": refusal,
        }
        return TemplateResponse(
            request, "admin/traces/trace/upload.html", context, status=413 if too_large else 200
        )

    def has_add_permission(self, request):
        return False  # uploaded with the form above or POST /api/traces/ (checked there)

    def has_change_permission(self, request, obj=None):
        return False

    def has_delete_permission(self, request, obj=None):
        return self.has_upload_permission(request)

    def delete_model(self, request, obj):
        storage.delete(obj)

    def delete_queryset(self, request, queryset):
        for trace in queryset:
            storage.delete(trace)
