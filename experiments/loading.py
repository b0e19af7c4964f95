"""Reading experiment documents from YAML or JSON text, with errors that say where."""

from __future__ import annotations

import json
from pathlib import Path

import yaml

from experiments.document import DocumentError, FieldError


def load_document_text(text: str, source: str = "(input)") -> object:
    stripped = text.lstrip()
    if not stripped:
        raise DocumentError([FieldError("(document)", f"{source} is empty")])
    try:
        if stripped.startswith(("{", "[")):
            return json.loads(text)
        return yaml.safe_load(text)
    except json.JSONDecodeError as exc:
        raise DocumentError(
            [
                FieldError(
                    "(document)", f"{source}: invalid JSON at line {exc.lineno} column {exc.colno}: {exc.msg}"
                )
            ]
        ) from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1} column {mark.column + 1}" if mark else ""
        problem = getattr(exc, "problem", None) or str(exc)
        raise DocumentError([FieldError("(document)", f"{source}: invalid YAML{where}: {problem}")]) from None


def load_document_file(path: str | Path) -> object:
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise DocumentError([FieldError("(document)", f"cannot read {path}: {exc}")]) from None
    return load_document_text(text, str(path))
