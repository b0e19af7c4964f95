"""Traffic weights over HTTP.

GET  /api/experiments/{key}/assign?user_id=U   -> variant and the weights revision used
GET  /api/experiments/{key}/weights            -> the stored weights and their revision
PUT  /api/experiments/{key}/weights            -> change them (permission change_weights: the
     sre role or a superuser); body {"weights": {...}, "reason": "...",
     "expected_revision": N, "dry_run": false}; a stale expected_revision is a 409.
"""

from __future__ import annotations

from django.shortcuts import get_object_or_404
from drf_spectacular.utils import OpenApiParameter, extend_schema
from rest_framework import serializers, status
from rest_framework.response import Response
from rest_framework.views import APIView

from experiments.api.permissions import CanChangeWeights, CanView
from experiments.models import Experiment
from experiments.teams import visible_experiments
from experiments.weights.errors import ConflictError, StoreUnavailable, WeightsError
from experiments.weights.process import live_router
from experiments.weights.publish import (
    UnknownExperimentError,
    current_weights,
    preview_move,
    publish_weights,
    why_not_assigned,
)
from experiments.weights.router import UnknownExperiment

MAX_USER_ID = 512


def field_errors(exc: WeightsError) -> dict[str, list[str]]:
    """'weights.fp16: must be >= 0' -> {"weights.fp16": ["must be >= 0"]}, like DocumentError."""
    out: dict[str, list[str]] = {}
    for error in exc.errors:
        path, sep, message = error.partition(": ")
        if not sep:
            path, message = "non_field_errors", error
        out.setdefault(path, []).append(message)
    return out


class AssignmentSerializer(serializers.Serializer):
    experiment = serializers.CharField()
    user_id = serializers.CharField()
    variant = serializers.CharField()
    revision = serializers.IntegerField(help_text="weights revision used: tag samples with it")
    hash_version = serializers.IntegerField()


class AssignView(APIView):
    permission_classes = [CanView]
    serializer_class = AssignmentSerializer
    # Serving traffic asks this per user: its own rate (API_THROTTLE_ASSIGN), not the user rate.
    throttle_scope = "assign"

    @extend_schema(
        parameters=[OpenApiParameter("user_id", str, required=True)],
        responses=AssignmentSerializer,
    )
    def get(self, request, key: str):
        user_id = request.query_params.get("user_id")
        if not user_id:
            return Response(
                {"user_id": ["required: the id of the user to assign (?user_id=...)"]}, status=400
            )
        if len(user_id) > MAX_USER_ID:
            return Response(
                {"user_id": [f"at most {MAX_USER_ID} characters, got {len(user_id)}"]},
                status=400,
            )
        router = live_router()
        # Another team's experiment is answered as a key the weights store holds nothing for:
        # the same status and words, never its state.
        mine = visible_experiments(request.user).filter(key=key).exists()
        absent = f"no weights for experiment {key!r} in {router.store.description}"
        try:
            result = router.assign(key, user_id)
            if not mine:
                raise UnknownExperiment(absent)
        except UnknownExperiment as exc:
            if not router.snapshot.loaded:
                return Response({"detail": str(exc)}, status=503)
            why = why_not_assigned(key) if mine else None
            if why is not None:
                return Response({"detail": why}, status=status.HTTP_409_CONFLICT)
            return Response({"detail": str(exc) if mine else absent}, status=status.HTTP_404_NOT_FOUND)
        return Response(
            {
                "experiment": result.experiment,
                "user_id": user_id,
                "variant": result.variant,
                "revision": result.revision,
                "hash_version": result.hash_version,
            }
        )


class WeightsChangeSerializer(serializers.Serializer):
    weights = serializers.DictField(child=serializers.JSONField(), help_text="variant -> percent")
    reason = serializers.CharField(max_length=2000)
    expected_revision = serializers.IntegerField(
        min_value=0, help_text="the revision you read (GET); 0 if never published"
    )
    dry_run = serializers.BooleanField(default=False, help_text="preview only, write nothing")


class WeightsSerializer(serializers.Serializer):
    """The weights as stored (the fields after ``weights`` only once published)."""

    experiment = serializers.CharField()
    status = serializers.CharField()
    published = serializers.BooleanField()
    revision = serializers.IntegerField(help_text="send it back as expected_revision to change them")
    weights = serializers.DictField(child=serializers.IntegerField())
    control = serializers.CharField(required=False)
    hash_version = serializers.IntegerField(required=False)
    actor = serializers.CharField(required=False)
    at = serializers.CharField(required=False)
    reason = serializers.CharField(required=False)
    moved_share = serializers.FloatField(required=False, help_text="PUT: share of users moved")
    minimum_share = serializers.FloatField(required=False, help_text="PUT: the least possible")
    moved = serializers.CharField(required=False)
    dry_run = serializers.BooleanField(required=False)


def weights_body(experiment: Experiment) -> dict:
    doc, revision = current_weights(experiment.key)
    body = {
        "experiment": experiment.key,
        "status": experiment.status,
        "published": doc is not None,
        "revision": revision,
    }
    if doc is None:
        # Not in the store yet: the weights the experiment document sets.
        body["weights"] = experiment.weights()
        return body
    body.update(
        weights=dict(doc.weights),
        control=doc.control,
        hash_version=doc.hash_version,
        actor=doc.actor,
        at=doc.at,
        reason=doc.reason,
    )
    return body


class WeightsView(APIView):
    permission_classes = [CanChangeWeights]
    serializer_class = WeightsSerializer

    @extend_schema(responses=WeightsSerializer)
    def get(self, request, key: str):
        experiment = get_object_or_404(visible_experiments(request.user), key=key)
        try:
            return Response(weights_body(experiment))
        except StoreUnavailable as exc:
            return Response({"detail": str(exc)}, status=503)

    @extend_schema(request=WeightsChangeSerializer, responses=WeightsSerializer)
    def put(self, request, key: str):
        get_object_or_404(visible_experiments(request.user), key=key)
        change = WeightsChangeSerializer(data=request.data)
        if not change.is_valid():
            return Response(change.errors, status=400)
        data = change.validated_data
        try:
            plan = preview_move(key, data["weights"], request.user, data["reason"], data["expected_revision"])
            if not data["dry_run"]:
                _, revision = publish_weights(
                    key, data["weights"], request.user, data["reason"], data["expected_revision"]
                )
        except WeightsError as exc:
            return Response(field_errors(exc), status=400)
        except ConflictError as exc:
            return Response({"detail": str(exc), "current_revision": exc.actual_revision}, status=409)
        except UnknownExperimentError as exc:
            return Response({"detail": str(exc)}, status=404)
        except StoreUnavailable as exc:
            return Response({"detail": f"nothing changed: {exc}"}, status=503)
        move = {
            "moved_share": plan.move.moved_share,
            "minimum_share": plan.move.minimum_share,
            "moved": plan.move.describe(),
        }
        if data["dry_run"]:
            return Response(
                {
                    "experiment": key,
                    "dry_run": True,
                    "revision": plan.current_revision,
                    "weights": dict(plan.new.weights),
                    **move,
                }
            )
        body = weights_body(Experiment.objects.get(key=key))
        body.update(move)
        body["revision"] = revision
        body["changed"] = not plan.unchanged
        return Response(body)
