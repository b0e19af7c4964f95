"""Variant credentials by name: the auth_secret field, and endpoints without
credentials.

An endpoint stored as ``http://user:key@host`` kept its key in the database, showed it to
analysts and sent it on; validation now refuses such URLs. This migration strips the
``user:key@`` part from the endpoints already stored (the rest of the URL is kept): the
operator gives such a variant a secret file and ``auth: {secret: NAME}``. Audit entries are
append-only and are not rewritten.
"""

from urllib.parse import urlsplit, urlunsplit

from django.db import migrations, models


def strip_credentials(apps, schema_editor):
    Variant = apps.get_model("experiments", "Variant")
    for variant in Variant.objects.filter(endpoint__contains="@").only("pk", "endpoint"):
        parts = urlsplit(variant.endpoint)
        if "@" not in parts.netloc:
            continue
        netloc = parts.netloc.rsplit("@", 1)[1]
        variant.endpoint = urlunsplit(parts._replace(netloc=netloc))
        variant.save(update_fields=["endpoint"])


class Migration(migrations.Migration):
    dependencies = [("experiments", "0002_role_groups")]

    operations = [
        migrations.AddField(
            model_name="variant",
            name="auth_secret",
            field=models.CharField(
                blank=True,
                default="",
                help_text="Name of a secret the operator configured; sent as 'Authorization: Bearer <value>'",
                max_length=64,
                verbose_name="auth secret",
            ),
        ),
        migrations.RunPython(strip_credentials, migrations.RunPython.noop),
    ]
