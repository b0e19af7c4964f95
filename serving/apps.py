from django.apps import AppConfig


class ServingConfig(AppConfig):
    """Child servers; a Django app only for its management commands (serve_variant, simulator)."""

    name = "serving"
    default_auto_field = "django.db.models.BigAutoField"
