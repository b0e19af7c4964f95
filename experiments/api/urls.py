from django.urls import path

from experiments.api import views

app_name = "experiments-api"

urlpatterns = [
    path("experiments/", views.ExperimentListView.as_view(), name="experiment-list"),
    path("experiments/<slug:key>/", views.ExperimentDetailView.as_view(), name="experiment-detail"),
    path("experiments/<slug:key>/audit/", views.AuditListView.as_view(), name="experiment-audit"),
    path("audit/", views.AuditListView.as_view(), name="audit"),
]
for _action in ("start", "pause", "resume", "conclude"):
    urlpatterns.append(
        path(
            f"experiments/<slug:key>/{_action}/",
            views.ExperimentActionView.as_view(action_name=_action),
            name=f"experiment-{_action}",
        )
    )
# weights routes
from django.urls import re_path  # noqa: E402

from experiments.api import weights as weights_views  # noqa: E402

urlpatterns += [
    # Clients write these with or without a trailing slash; accept both.
    re_path(
        r"^experiments/(?P<key>[-\w]+)/assign/?$",
        weights_views.AssignView.as_view(),
        name="experiment-assign",
    ),
    re_path(
        r"^experiments/(?P<key>[-\w]+)/weights/?$",
        weights_views.WeightsView.as_view(),
        name="experiment-weights",
    ),
]
