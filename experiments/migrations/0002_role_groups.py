"""Creates the three role groups and grants their permissions.

product: create, edit, delete (draft) and run the lifecycle of experiments.
sre: change traffic weights (and, with the replay app, start and stop replays).
analyst: read everything, edit nothing.
"""

from django.contrib.auth.management import create_permissions
from django.db import migrations

ROLES = {
    "product": [
        "view_experiment", "add_experiment", "change_experiment", "delete_experiment",
        "run_lifecycle", "view_variant", "add_variant", "change_variant", "delete_variant",
        "view_auditentry",
    ],
    "sre": ["view_experiment", "view_variant", "view_auditentry", "change_weights"],
    "analyst": ["view_experiment", "view_variant", "view_auditentry"],
}  # fmt: skip


def create_groups(apps, schema_editor):
    # Permissions are normally created after all migrations; make sure ours exist now.
    for app_config in apps.get_app_configs():
        app_config.models_module = True
        create_permissions(app_config, apps=apps, verbosity=0)
        app_config.models_module = None
    Group = apps.get_model("auth", "Group")
    Permission = apps.get_model("auth", "Permission")
    for role, codenames in ROLES.items():
        group, _ = Group.objects.get_or_create(name=role)
        perms = Permission.objects.filter(content_type__app_label="experiments", codename__in=codenames)
        missing = set(codenames) - {p.codename for p in perms}
        if missing:
            raise RuntimeError(f"permissions missing for role {role}: {sorted(missing)}")
        group.permissions.add(*perms)


def remove_groups(apps, schema_editor):
    apps.get_model("auth", "Group").objects.filter(name__in=ROLES).delete()


class Migration(migrations.Migration):
    dependencies = [
        ("experiments", "0001_initial"),
        ("auth", "0012_alter_user_first_name_max_length"),
        ("contenttypes", "0002_remove_content_type_name"),
    ]
    operations = [migrations.RunPython(create_groups, remove_groups)]
