"""python manage.py add_trace PATH [--name NAME] [--format azure|jsonl] [--json]

--json: {"name", "created" (false: the same content was stored already), "rows", "span_s",
"rate", "format", "size", "sha256"}; a refused file exits 1 with the error document
(experiments.cli).
"""

from experiments.cli import CliError, JsonCommand, add_json_argument
from traces.storage import TraceError, store_file


class Command(JsonCommand):
    help = "Store a local trace or log in the trace directory (as an upload would), and list it."

    def add_arguments(self, parser):
        parser.add_argument("path", help="a local Azure CSV trace or abplat JSONL log")
        parser.add_argument("--name", help="how replays name it (default: the file's name)")
        parser.add_argument(
            "--format", choices=["azure", "jsonl"], help="default: recognized from the first line"
        )
        add_json_argument(parser)

    def handle(self, *args, path: str, name: str | None, format: str | None, **options):
        try:
            trace, created = store_file(path, name=name, fmt=format)
        except TraceError as exc:
            option = {"name": "--name", "format": "--format"}.get(exc.field, "path")
            raise CliError(str(exc), field=option) from None
        except OSError as exc:
            raise CliError(str(exc), field="path") from None
        if self.json:
            self.emit(
                {
                    "name": trace.name,
                    "created": created,
                    "rows": trace.rows,
                    "span_s": trace.span_s,
                    "rate": trace.rate,
                    "format": trace.format,
                    "size": trace.size,
                    "sha256": trace.sha256,
                }
            )
            return
        rate = "-" if trace.rate is None else f"{trace.rate:.3g}/s"
        said = "stored" if created else "already stored (same content)"
        self.stdout.write(
            f"{trace.name}: {said}; {trace.rows} requests over {trace.span_s:.1f} s ({rate}), {trace.format}, "
            f"sha256 {trace.sha256}"
        )
