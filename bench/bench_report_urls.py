"""URLconf for bench_report.py (the dashboards may not be wired into abplat/urls.py yet)."""

from django.urls import include, path

urlpatterns = [path("dashboards/", include("dashboards.urls"))]
