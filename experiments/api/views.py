"""The experiments API. What a caller reads and acts on is their teams' experiments
(experiments.teams; sre and superusers: all): another team's experiment is a 404, exactly like a
key that does not exist, so its name does not leak."""

from __future__ import annotations

from django.shortcuts import get_object_or_404
from drf_spectacular.utils import OpenApiParameter, extend_schema
from rest_framework import generics, status
from rest_framework.response import Response
from rest_framework.views import APIView

from experiments import lifecycle, services
from experiments.api.permissions import (
    CHANGE,
    CanRunLifecycle,
    CanView,
    ExperimentDocumentPermission,
    ExperimentPermission,
)
from experiments.api.serializers import (
    ActionSerializer,
    AuditEntrySerializer,
    ExperimentDocumentSerializer,
    ExperimentSerializer,
)
from experiments.document import DocumentError
from experiments.models import Experiment
from experiments.teams import visible_audit, visible_experiments


def _document_errors(exc: DocumentError) -> Response:
    return Response(exc.as_dict(), status=status.HTTP_400_BAD_REQUEST)


def _apply(
    request, data, experiment: Experiment | None = None
) -> tuple[services.ApplyResult | None, Response | None]:
    # A webhook URL read redacted and sent back stands for the stored one.
    serializer = ExperimentDocumentSerializer(data=services.restore_webhooks(data, request.user))
    if not serializer.is_valid():
        return None, Response(serializer.errors, status=status.HTTP_400_BAD_REQUEST)
    if experiment is not None and not request.user.has_perm(CHANGE):
        # Here with the traffic permission only (ExperimentDocumentPermission): the plan, no more.
        changed = services.changed_parts(experiment, serializer.validated_data) - {"rollout"}
        if changed:
            return None, Response(
                {
                    "detail": f"changing {', '.join(sorted(changed))} needs the permission {CHANGE} "
                    "(product role); the traffic permission changes the rollout plan only"
                },
                status=status.HTTP_403_FORBIDDEN,
            )
    try:
        return services.apply_document(serializer.validated_data, actor=request.user), None
    except DocumentError as exc:
        return None, _document_errors(exc)


class ExperimentListView(generics.ListAPIView):
    permission_classes = [ExperimentPermission]
    serializer_class = ExperimentSerializer

    def get_queryset(self):
        qs = Experiment.objects.select_related("owner", "team").prefetch_related("variants")
        qs = visible_experiments(self.request.user, qs)
        wanted = self.request.query_params.get("status")
        if wanted:
            qs = qs.filter(status=wanted)
        if team := self.request.query_params.get("team"):
            qs = qs.filter(team__name=team)
        return qs

    @extend_schema(
        parameters=[
            OpenApiParameter("status", str, description="only experiments in this status"),
            OpenApiParameter("team", str, description="only this team's experiments (of those you may read)"),
        ]
    )
    def get(self, request, *args, **kwargs):
        return super().get(request, *args, **kwargs)

    @extend_schema(request=ExperimentDocumentSerializer, responses={201: ExperimentSerializer})
    def post(self, request):
        key = request.data.get("key") if isinstance(request.data, dict) else None
        if isinstance(key, str) and Experiment.objects.filter(key=key).exists():
            if visible_experiments(request.user).filter(key=key).exists():
                message = f"experiment {key!r} already exists; PUT /api/experiments/{key}/ updates it"
            else:  # another team's: taken, and no more is said
                message = f"the key {key!r} is taken; choose another key"
            return Response({"key": [message]}, status=status.HTTP_400_BAD_REQUEST)
        result, error = _apply(request, request.data)
        if error:
            return error
        body = ExperimentSerializer(result.experiment, context={"request": request}).data
        return Response(body, status=status.HTTP_201_CREATED)


class ExperimentDetailView(APIView):
    permission_classes = [ExperimentDocumentPermission]

    def _get(self, key: str) -> Experiment:
        qs = Experiment.objects.select_related("team").prefetch_related("variants")
        return get_object_or_404(visible_experiments(self.request.user, qs), key=key)

    @extend_schema(responses=ExperimentSerializer)
    def get(self, request, key: str):
        return Response(ExperimentSerializer(self._get(key), context={"request": request}).data)

    def _update(self, request, key: str, data):
        experiment = self._get(key)
        if not isinstance(data, dict):
            return Response({"(document)": ["must be a mapping of fields"]}, status=400)
        if data.get("key", key) != key:
            return Response({"key": ["is immutable: it must match the URL"]}, status=400)
        result, error = _apply(request, {**data, "key": key}, experiment)
        if error:
            return error
        body = ExperimentSerializer(result.experiment, context={"request": request}).data
        body["changes"] = result.changes
        return Response(body)

    @extend_schema(request=ExperimentDocumentSerializer, responses=ExperimentSerializer)
    def put(self, request, key: str):
        return self._update(request, key, request.data)

    @extend_schema(request=ExperimentDocumentSerializer(partial=True), responses=ExperimentSerializer)
    def patch(self, request, key: str):
        if not isinstance(request.data, dict):
            return Response({"(document)": ["must be a mapping of fields"]}, status=400)
        merged = {**services.export_document(self._get(key)), **request.data}
        return self._update(request, key, merged)

    @extend_schema(responses={204: None, 409: None})
    def delete(self, request, key: str):
        experiment = self._get(key)
        try:
            services.delete_experiment(experiment, actor=request.user)
        except lifecycle.TransitionError as exc:
            return Response({"detail": str(exc)}, status=status.HTTP_409_CONFLICT)
        return Response(status=status.HTTP_204_NO_CONTENT)


class ExperimentActionView(APIView):
    """POST /api/experiments/{key}/{start|pause|resume|conclude}/"""

    permission_classes = [CanRunLifecycle]
    action_name = ""

    @extend_schema(request=ActionSerializer, responses=ExperimentSerializer)
    def post(self, request, key: str):
        experiment = get_object_or_404(visible_experiments(request.user), key=key)
        body = ActionSerializer(data=request.data)
        body.is_valid(raise_exception=True)
        try:
            services.transition(experiment, self.action_name, request.user, body.validated_data["reason"])
        except (lifecycle.TransitionError, services.ConflictError) as exc:
            return Response({"detail": str(exc)}, status=status.HTTP_409_CONFLICT)
        return Response(ExperimentSerializer(experiment, context={"request": request}).data)


class AuditListView(generics.ListAPIView):
    permission_classes = [CanView]
    serializer_class = AuditEntrySerializer

    def get_queryset(self):
        # The entries the caller may read: of a key, as many as of a key that never existed
        # when the experiment is another team's.
        qs = visible_audit(self.request.user)
        if "key" in self.kwargs:
            qs = qs.filter(experiment_key=self.kwargs["key"])
        return qs
