from django.core.management.base import BaseCommand, CommandError

from traces.storage import TraceError, store_file


class Command(BaseCommand):
    help = "Store a local trace or log in the trace directory (as an upload would), and list it."

    def add_arguments(self, parser):
        parser.add_argument("path", help="a local Azure CSV trace or abplat JSONL log")
        parser.add_argument("--name", help="how replays name it (default: the file's name)")
        parser.add_argument(
            "--format", choices=["azure", "jsonl"], help="default: recognized from the first line"
        )

    def handle(self, *args, path: str, name: str | None, format: str | None, **options):
        try:
            trace, created = store_file(path, name=name, fmt=format)
        except (TraceError, OSError) as exc:
            raise CommandError(str(exc)) from None
        rate = "-" if trace.rate is None else f"{trace.rate:.3g}/s"
        said = "stored" if created else "already stored (same content)"
        self.stdout.write(
            f"{trace.name}: {said}; {trace.rows} requests over {trace.span_s:.1f} s ({rate}), {trace.format}, "
            f"sha256 {trace.sha256}"
        )
