"""Creates the three role groups and grants their permissions.

product: create, edit, delete (draft) and run the lifecycle of experiments.
sre: change traffic weights (and, with the replay app, start and stop replays).
analyst: read everything, edit nothing.
"""

from django.db import migrations

from experiments.roles import grant

ROLES = {
    "product": [
        "view_experiment",
        "add_experiment",
        "change_experiment",
        "delete_experiment",
        "run_lifecycle",
        "view_variant",
        "add_variant",
        "change_variant",
        "delete_variant",
        "view_auditentry",
    ],
    "sre": ["view_experiment", "view_variant", "view_auditentry", "change_weights"],
    "analyst": ["view_experiment", "view_variant", "view_auditentry"],
}


def create_groups(apps, schema_editor):
    grant(apps, "experiments", ROLES)


def remove_groups(apps, schema_editor):
    apps.get_model("auth", "Group").objects.filter(name__in=ROLES).delete()


class Migration(migrations.Migration):
    dependencies = [
        ("experiments", "0001_initial"),
        ("auth", "0012_alter_user_first_name_max_length"),
        ("contenttypes", "0002_remove_content_type_name"),
    ]
    operations = [migrations.RunPython(create_groups, remove_groups)]
