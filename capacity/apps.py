from django.apps import AppConfig


class CapacityConfig(AppConfig):
    name = "capacity"
    default_auto_field = "django.db.models.BigAutoField"

    def ready(self) -> None:
        # Imported here, not at the top: the receiver reads models, which load once the app
        # registry is ready. The report names capacity steps' runs by it (capacity.labels).
        from capacity import labels
        from dashboards.reports import run_labels

        run_labels.connect(labels.step_run_labels, dispatch_uid="capacity.step_run_labels")
