"""Every experiment has a team (0007 gave the ones made before teams the default team)."""

import django.db.models.deletion
from django.db import migrations, models


class Migration(migrations.Migration):
    dependencies = [("experiments", "0007_default_team")]

    operations = [
        migrations.AlterField(
            model_name="experiment",
            name="team",
            field=models.ForeignKey(
                on_delete=django.db.models.deletion.PROTECT, related_name="experiments", to="experiments.team"
            ),
        ),
    ]
