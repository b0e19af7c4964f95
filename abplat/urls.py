from django.contrib import admin
from django.urls import include, path
from drf_spectacular.views import SpectacularAPIView, SpectacularSwaggerView

from abplat.api import limit_login
from abplat.health import healthz
from abplat.metrics import metrics_view

urlpatterns = [
    path("healthz", healthz, name="healthz"),
    # Prometheus: loopback or ABPLAT_METRICS_ALLOWED_CIDRS / a bearer token (docs/metrics.md).
    path("metrics", metrics_view, name="metrics"),
    # The admin's own login view, with at most API_THROTTLE_LOGIN attempts per client address.
    path("admin/login/", limit_login(admin.site.login)),
    path("admin/", admin.site.urls),
    path("api/", include("experiments.api.urls")),
    path("api/", include("workers.api_urls")),
    path("api/", include("traces.urls")),
    path("api/", include("dashboards.api_urls")),
    path("api/", include("capacity.api_urls")),
    path("dashboards/", include("dashboards.urls")),
    path("rollouts/", include("rollouts.urls")),  # the rollout timeline (docs/rollouts.md)
    path("capacity/", include("capacity.urls")),  # SLA capacity per variant (docs/capacity.md)
    path("api/schema/", SpectacularAPIView.as_view(), name="schema"),
    path("api/docs/", SpectacularSwaggerView.as_view(url_name="schema"), name="api-docs"),
]
