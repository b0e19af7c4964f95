"""Granting the role groups their permissions, for data migrations (historical ``apps``)."""

from __future__ import annotations

from django.contrib.auth.management import create_permissions


def grant(apps, app_label: str, grants: dict[str, list[str]]) -> None:
    """Give each group (created if missing) these permission codenames of ``app_label``."""
    # Permissions are normally created after all migrations; make sure they exist now.
    for app_config in apps.get_app_configs():
        app_config.models_module = True
        create_permissions(app_config, apps=apps, verbosity=0)
        app_config.models_module = None
    Group = apps.get_model("auth", "Group")
    Permission = apps.get_model("auth", "Permission")
    for role, codenames in grants.items():
        group, _ = Group.objects.get_or_create(name=role)
        perms = Permission.objects.filter(content_type__app_label=app_label, codename__in=codenames)
        missing = set(codenames) - {p.codename for p in perms}
        if missing:
            raise RuntimeError(f"permissions missing for role {role}: {sorted(missing)}")
        group.permissions.add(*perms)
