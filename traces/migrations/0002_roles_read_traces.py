"""Every role reads traces; sre uploads and deletes them (with workers.operate_replay)."""

from django.db import migrations

from experiments.roles import grant

GRANTS = {"sre": ["view_trace"], "product": ["view_trace"], "analyst": ["view_trace"]}


def grant_trace_roles(apps, schema_editor):
    grant(apps, "traces", GRANTS)


class Migration(migrations.Migration):
    dependencies = [("traces", "0001_initial"), ("experiments", "0002_role_groups")]
    operations = [migrations.RunPython(grant_trace_roles, migrations.RunPython.noop)]
