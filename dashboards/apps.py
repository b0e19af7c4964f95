from django.apps import AppConfig


class DashboardsConfig(AppConfig):
    name = "dashboards"
    default_auto_field = "django.db.models.BigAutoField"
