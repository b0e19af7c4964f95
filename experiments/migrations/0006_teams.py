"""Teams own experiments: the Team model, and a team column on experiments (filled by 0007,
required from 0008) and on audit entries (who reads the entries of a deleted draft)."""

import django.core.validators
import django.db.models.deletion
from django.conf import settings
from django.db import migrations, models


class Migration(migrations.Migration):
    dependencies = [
        ("experiments", "0005_variant_cost"),
        migrations.swappable_dependency(settings.AUTH_USER_MODEL),
    ]

    operations = [
        migrations.CreateModel(
            name="Team",
            fields=[
                (
                    "id",
                    models.BigAutoField(
                        auto_created=True, primary_key=True, serialize=False, verbose_name="ID"
                    ),
                ),
                (
                    "name",
                    models.SlugField(
                        help_text="lowercase letters, digits and '-', starting and ending with a letter or digit (max 64); documents name the team that owns the experiment by it",
                        max_length=64,
                        unique=True,
                        validators=[
                            django.core.validators.RegexValidator(
                                "^[a-z0-9](?:[a-z0-9-]{0,62}[a-z0-9])?$",
                                "a team's name is lowercase letters, digits and '-', starting and ending with a letter or digit (max 64)",
                            )
                        ],
                    ),
                ),
                ("description", models.CharField(blank=True, max_length=200)),
                ("created_at", models.DateTimeField(auto_now_add=True)),
                (
                    "members",
                    models.ManyToManyField(
                        blank=True,
                        help_text="product users act on the team's experiments, analysts read them",
                        related_name="abplat_teams",
                        to=settings.AUTH_USER_MODEL,
                    ),
                ),
            ],
            options={
                "ordering": ["name"],
            },
        ),
        migrations.AddField(
            model_name="auditentry",
            name="team",
            field=models.ForeignKey(
                blank=True,
                null=True,
                on_delete=django.db.models.deletion.SET_NULL,
                related_name="+",
                to="experiments.team",
            ),
        ),
        migrations.AddField(
            model_name="experiment",
            name="team",
            field=models.ForeignKey(
                null=True,
                on_delete=django.db.models.deletion.PROTECT,
                related_name="experiments",
                to="experiments.team",
            ),
        ),
    ]
