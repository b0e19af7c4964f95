"""The sre role starts and cancels replays; every role can read them."""

from django.contrib.auth.management import create_permissions
from django.db import migrations

GRANTS = {
    "sre": ["operate_replay", "view_replayrun", "view_replayshard"],
    "product": ["view_replayrun", "view_replayshard"],
    "analyst": ["view_replayrun", "view_replayshard"],
}


def grant(apps, schema_editor):
    for app_config in apps.get_app_configs():
        app_config.models_module = True
        create_permissions(app_config, apps=apps, verbosity=0)
        app_config.models_module = None
    Group = apps.get_model("auth", "Group")
    Permission = apps.get_model("auth", "Permission")
    for role, codenames in GRANTS.items():
        group, _ = Group.objects.get_or_create(name=role)
        perms = Permission.objects.filter(content_type__app_label="workers", codename__in=codenames)
        missing = set(codenames) - {p.codename for p in perms}
        if missing:
            raise RuntimeError(f"permissions missing for role {role}: {sorted(missing)}")
        group.permissions.add(*perms)


class Migration(migrations.Migration):
    dependencies = [("workers", "0001_initial"), ("experiments", "0002_role_groups")]
    operations = [migrations.RunPython(grant, migrations.RunPython.noop)]
