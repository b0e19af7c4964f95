from django.urls import path

from dashboards.api import ExperimentReport

urlpatterns = [
    path("experiments/<slug:key>/report", ExperimentReport.as_view(), name="experiment-report"),
]
