"""make demo: everything on the embedded defaults, then the admin.

1. Migrate the database and the sample store.
2. Load the demo experiment (demo/ttft-optimizations.yaml) and a demo login.
3. Serve the admin and dashboards on 127.0.0.1 until Ctrl-C.
"""

from pathlib import Path

from django.conf import settings
from django.contrib.auth import get_user_model
from django.core.management import call_command
from django.core.management.base import BaseCommand

DEMO_DOCUMENT = Path(settings.BASE_DIR) / "demo" / "ttft-optimizations.yaml"


class Command(BaseCommand):
    help = "Run the demo on the embedded defaults and serve the admin."

    def add_arguments(self, parser):
        parser.add_argument("--port", type=int, default=8000)
        parser.add_argument("--no-serve", action="store_true", help="stop after the demo job")

    def handle(self, *args, port: int, no_serve: bool, **options):
        call_command("migrate", verbosity=0)
        call_command("apply_experiment", str(DEMO_DOCUMENT))
        user_model = get_user_model()
        if not user_model.objects.filter(username="demo").exists():
            user_model.objects.create_superuser("demo", "demo@localhost", "demo")
        if no_serve:
            return
        self.stdout.write(
            f"\nAdmin: http://127.0.0.1:{port}/admin/  (login demo / demo)\n"
            f"API docs: http://127.0.0.1:{port}/api/docs/\n"
        )
        call_command("runserver", f"127.0.0.1:{port}", use_reloader=False)
