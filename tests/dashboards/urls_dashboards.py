"""URLconf for the dashboard tests until the lead wires dashboards into abplat/urls.py."""

from django.contrib import admin
from django.urls import include, path

urlpatterns = [
    path("admin/", admin.site.urls),
    path("dashboards/", include("dashboards.urls")),
    path("api/", include("dashboards.api_urls")),
]
