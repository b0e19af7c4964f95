from django.apps import AppConfig


class ExperimentsConfig(AppConfig):
    name = "experiments"
    default_auto_field = "django.db.models.BigAutoField"

    def ready(self) -> None:
        from experiments import checks  # noqa: F401  (registers the egress system check)
