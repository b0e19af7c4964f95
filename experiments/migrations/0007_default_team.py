"""Upgrading to teams: every experiment made before them, and every audit entry, goes to the
default team (ABPLAT_DEFAULT_TEAM, "default" when that is empty), and every user in the product
or analyst role joins it, so each of them acts on and reads what they did before. sre users and
superusers act on every team's experiments and join no team.

Reversed, experiments and entries leave their team (0006, reversed next, drops the column and
the teams).
"""

from django.conf import settings
from django.db import migrations

# The roles whose users act within teams (experiments/teams.py, TEAM_ROLES).
TEAM_ROLES = ("product", "analyst")


def default_team_name() -> str:
    return getattr(settings, "DEFAULT_TEAM", "") or "default"


def join_default_team(apps, schema_editor):
    Team = apps.get_model("experiments", "Team")
    team, _ = Team.objects.get_or_create(
        name=default_team_name(), defaults={"description": "every experiment made before teams"}
    )
    apps.get_model("experiments", "Experiment").objects.filter(team__isnull=True).update(team=team)
    apps.get_model("experiments", "AuditEntry").objects.filter(team__isnull=True).update(team=team)
    User = apps.get_model(*settings.AUTH_USER_MODEL.split("."))
    team.members.add(*User.objects.filter(groups__name__in=TEAM_ROLES).distinct())


def leave_teams(apps, schema_editor):
    apps.get_model("experiments", "Experiment").objects.update(team=None)
    apps.get_model("experiments", "AuditEntry").objects.update(team=None)


class Migration(migrations.Migration):
    dependencies = [("experiments", "0006_teams"), ("auth", "0012_alter_user_first_name_max_length")]
    operations = [migrations.RunPython(join_default_team, leave_teams)]
