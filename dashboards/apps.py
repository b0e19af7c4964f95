from django.apps import AppConfig


class DashboardsConfig(AppConfig):
    name = "dashboards"
    default_auto_field = "django.db.models.BigAutoField"

    def ready(self) -> None:
        # Imported here, not at the top: receivers import models, which only load once the
        # app registry is ready (Django's documented place to connect signals).
        from dashboards import receivers
        from samples.signals import replay_finished

        replay_finished.connect(receivers.build_rollup, dispatch_uid="dashboards.build_rollup")
