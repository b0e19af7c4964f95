from django.urls import path

from dashboards import views

app_name = "dashboards"

urlpatterns = [
    path("assets/plotly-<str:version>.min.js", views.plotly_js, name="plotly"),
    path("<slug:key>/", views.experiment, name="experiment"),
    path("<slug:key>/export/<slug:table>.csv", views.export_csv, name="export"),
]
