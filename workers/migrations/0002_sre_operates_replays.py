"""The sre role starts and cancels replays; every role can read them."""

from django.db import migrations

from experiments.roles import grant

GRANTS = {
    "sre": ["operate_replay", "view_replayrun", "view_replayshard"],
    "product": ["view_replayrun", "view_replayshard"],
    "analyst": ["view_replayrun", "view_replayshard"],
}


def grant_replay_roles(apps, schema_editor):
    grant(apps, "workers", GRANTS)


class Migration(migrations.Migration):
    dependencies = [("workers", "0001_initial"), ("experiments", "0002_role_groups")]
    operations = [migrations.RunPython(grant_replay_roles, migrations.RunPython.noop)]
