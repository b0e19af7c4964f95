from django.apps import AppConfig


class TracesConfig(AppConfig):
    name = "traces"
    default_auto_field = "django.db.models.BigAutoField"
