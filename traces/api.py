"""Traces over the API: sre uploads (multipart) and deletes them; every role reads them."""

from __future__ import annotations

from django.http import Http404
from django.urls import reverse
from drf_spectacular.utils import extend_schema
from rest_framework import generics, serializers, status
from rest_framework.parsers import FormParser, MultiPartParser
from rest_framework.response import Response

from experiments.api.permissions import require
from traces import storage, uploads
from traces.models import Trace

# Uploading is operating replays (sre); reading is every role's (the traces migration grants it).
CanUpload = require("workers.operate_replay", read_perm="traces.view_trace")


class TraceSerializer(serializers.ModelSerializer):
    uploaded_by = serializers.SlugRelatedField(slug_field="username", read_only=True, allow_null=True)
    url = serializers.SerializerMethodField()

    class Meta:
        model = Trace
        fields = [
            "name",
            "sha256",
            "size",
            "format",
            "rows",
            "span_s",
            "rate",
            "uploaded_by",
            "created_at",
            "url",
        ]
        read_only_fields = fields

    def get_url(self, obj: Trace) -> str:
        path = reverse("trace-detail", args=[obj.sha256])
        request = self.context.get("request")
        return request.build_absolute_uri(path) if request else path


class TraceUploadSerializer(serializers.Serializer):
    file = serializers.FileField(
        help_text="the trace: Azure CSV or abplat JSONL (cap: setting TRACE_MAX_BYTES)"
    )
    name = serializers.CharField(
        required=False, max_length=200, help_text="how replays name it (default: the file's name)"
    )
    format = serializers.ChoiceField(
        choices=Trace.Format.choices, required=False, help_text="default: recognized from the first line"
    )


def _refusal(exc: storage.TraceError) -> Response:
    return Response({exc.field: [exc.message]}, status=exc.status)


class TraceListView(generics.ListAPIView):
    permission_classes = [CanUpload]
    serializer_class = TraceSerializer
    parser_classes = [MultiPartParser, FormParser]
    queryset = Trace.objects.select_related("uploaded_by")

    def initialize_request(self, request, *args, **kwargs):
        # Before anything reads the body (authentication's CSRF check reads request.POST).
        self.upload_cap = uploads.install(request) if request.method == "POST" else None
        return super().initialize_request(request, *args, **kwargs)

    @extend_schema(request={"multipart/form-data": TraceUploadSerializer}, responses={201: TraceSerializer})
    def post(self, request):
        body = TraceUploadSerializer(data=request.data)
        if self.upload_cap is not None and self.upload_cap.too_large:
            return _refusal(storage.TraceTooLarge())
        body.is_valid(raise_exception=True)
        data = body.validated_data
        upload = data["file"]
        try:
            trace, created = storage.store(
                upload.chunks(),
                name=data.get("name") or upload.name,
                fmt=data.get("format"),
                user=request.user,
            )
        except storage.TraceError as exc:
            return _refusal(exc)
        out = TraceSerializer(trace, context={"request": request}).data
        # A known content answers with its trace (200), not a second copy.
        return Response(
            out,
            status=status.HTTP_201_CREATED if created else status.HTTP_200_OK,
            headers={"Location": out["url"]},
        )


class TraceDetailView(generics.RetrieveDestroyAPIView):
    permission_classes = [CanUpload]
    serializer_class = TraceSerializer

    def get_object(self) -> Trace:
        trace = storage.find(self.kwargs["ref"])
        if trace is None:
            raise Http404("no such trace")
        self.check_object_permissions(self.request, trace)
        return trace

    def perform_destroy(self, instance: Trace) -> None:
        storage.delete(instance)
