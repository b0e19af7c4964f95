"""URLconf for bench_report.py: only the dashboards (abplat/urls.py wires them too), so the page
bench needs no other app's routes."""

from django.urls import include, path

urlpatterns = [path("dashboards/", include("dashboards.urls"))]
