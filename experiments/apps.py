from django.apps import AppConfig


class ExperimentsConfig(AppConfig):
    name = "experiments"
    default_auto_field = "django.db.models.BigAutoField"

    def ready(self) -> None:
        from django.contrib.auth import get_user_model
        from django.db.models.signals import m2m_changed

        from experiments import checks  # noqa: F401  (registers the egress system check)
        from experiments.teams import join_default_team

        # Product and analyst users join the default team when given their role.
        m2m_changed.connect(
            join_default_team, sender=get_user_model().groups.through, dispatch_uid="abplat-join-default-team"
        )
