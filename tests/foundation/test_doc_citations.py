"""Citations of a document's section, such as ``bench/RESULTS.md, "Gateway overhead"`` in a comment,
name a section that exists: the cited file is there and has a heading that starts with the cited
text (a citation often gives only the heading's beginning). A renamed heading breaks every citation
of its old name; this finds them all, in every tracked text file. And the headings of the results
and the docs say what a section measures, not which issue in a tracker (that readers do not have)
asked for it."""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SKIPPED = (".venv/", "var/", "test-artifacts/")
THIS = Path(__file__).resolve().relative_to(ROOT).as_posix()  # its examples cite files that do not exist

# A continuation line of a comment or docstring: its leading comment marker is not part of the text.
_CONT = r"[ \t]*(?:\n[ \t]*(?:\#+|//|\*)?[ \t]*)?"
# A quoted heading, over at most two lines (a citation wrapped in a comment or a paragraph).
_QUOTED = r'"([^"\n]+(?:\n[^"\n]+)?)"'
_PATH = r"(?<![\w./-])([\w./-]+\.md)`?"  # the cited file, perhaps in backticks
_BEFORE = r"(?:,|[ \t]+\(|[ \t]|,?\n)" + _CONT + r"\(?"  # `, "X"`, ` "X"`, ` ("X"`, over a line break
_SECOND = r"(?:\s+and" + _CONT + _QUOTED + r")?"  # `"X" and "Y"`: a second section of the same file
CITATION = re.compile(_PATH + _BEFORE + _QUOTED + _SECOND)
HEADING = re.compile(r"^#{1,6}[ \t]+(.+?)[ \t]*#*[ \t]*$")
ISSUE = re.compile(r"\bissues?\s*#?\s*\d", re.IGNORECASE)


@dataclass(frozen=True)
class Citation:
    source: str  # the citing file, relative to the repository
    line: int
    path: str  # the cited file as written
    heading: str  # the cited heading text, whitespace and comment markers folded

    def __str__(self) -> str:
        return f'{self.source}:{self.line}: {self.path}, "{self.heading}"'


def folded(text: str) -> str:
    """The quoted text as one line: a line break and the next line's comment marker become a space."""
    text = re.sub(r"\n[ \t]*(?:#+|//|\*)?[ \t]*", " ", text)
    return re.sub(r"\s+", " ", text).strip()


def citations(source: str, text: str) -> list[Citation]:
    found = []
    for match in CITATION.finditer(text):
        line = text.count("\n", 0, match.start()) + 1
        for quoted in (match.group(2), match.group(3)):
            if quoted is not None:
                found.append(Citation(source, line, match.group(1), folded(quoted)))
    return found


def headings(text: str) -> list[str]:
    """Markdown ATX headings, outside fenced code (where `#` starts a shell comment)."""
    found, fenced = [], False
    for line in text.splitlines():
        if line.lstrip().startswith(("```", "~~~")):
            fenced = not fenced
        elif not fenced and (match := HEADING.match(line)):
            found.append(re.sub(r"\s+", " ", match.group(1)))
    return found


def resolve(root: Path, citation: Citation) -> Path | None:
    """The cited file: from the repository's root, or else beside the citing file."""
    for base in (root, (root / citation.source).parent):
        if (base / citation.path).is_file():
            return base / citation.path
    return None


def broken(root: Path, found: list[Citation]) -> list[str]:
    problems = []
    for citation in found:
        path = resolve(root, citation)
        if path is None:
            problems.append(f"{citation}: no such file")
        elif not any(h.startswith(citation.heading) for h in headings(path.read_text(encoding="utf-8"))):
            problems.append(f"{citation}: no heading starts with this text")
    return problems


# What .gitignore leaves out, and git's own directory: the project's files are the rest, read
# in-process (no git subprocess: make test-fast starts none).
IGNORED_DIRS = frozenset(
    {".git", ".venv", "var", "bench/out", "test-artifacts", "__pycache__", ".pytest_cache", ".ruff_cache"}
)


def project_files(root: Path):
    for folder, dirs, files in os.walk(root):
        rel = Path(folder).relative_to(root)
        dirs[:] = sorted(
            d for d in dirs if d not in IGNORED_DIRS and (rel / d).as_posix() not in IGNORED_DIRS
        )
        for f in sorted(files):
            if f != ".env" and not f.endswith(".pyc"):
                yield (rel / f).as_posix()


def tracked_texts(root: Path):
    for name in project_files(root):
        if name.startswith(SKIPPED) or name == THIS:
            continue
        try:
            yield name, (root / name).read_text(encoding="utf-8")
        except UnicodeDecodeError:
            continue  # binary: screenshots and the like


def test_the_forms_of_a_citation_are_found_across_line_breaks_and_comment_markers():
    text = (
        'as measured (bench/RESULTS.md, "Gateway overhead") and\n'
        'see docs/deploy.md "TLS in front" or\n'
        '(`docs/report-json.md`, "ITL"); (`bench/RESULTS.md` ("Anytime-valid\n'
        'guardrails") a\n'
        "    # per request (bench/RESULTS.md,\n"
        '    # "Replay CPU per token against vLLM\'s client").\n'
        'Figures: bench/RESULTS.md, "The demo" and "SLA capacity of\n'
        'the demo profiles". HISTORY.md, "Traffic split" |\n'
        'open("README.md", "r"); x = "a.md"; y = "b"\n'
    )
    assert [(c.line, c.path, c.heading) for c in citations("x.py", text)] == [
        (1, "bench/RESULTS.md", "Gateway overhead"),
        (2, "docs/deploy.md", "TLS in front"),
        (3, "docs/report-json.md", "ITL"),
        (3, "bench/RESULTS.md", "Anytime-valid guardrails"),
        (5, "bench/RESULTS.md", "Replay CPU per token against vLLM's client"),
        (7, "bench/RESULTS.md", "The demo"),
        (7, "bench/RESULTS.md", "SLA capacity of the demo profiles"),
        (8, "HISTORY.md", "Traffic split"),
    ]


def test_a_citation_needs_the_file_and_a_heading_that_starts_with_its_text(tmp_path):
    (tmp_path / "bench").mkdir()
    (tmp_path / "bench" / "RESULTS.md").write_text(
        "# Results\n\n## Gateway overhead\n\n```\n# Old name\n```\n### At abc: quiet\n"
    )
    (tmp_path / "bench" / "HISTORY.md").write_text("## Traffic split (earlier)\n")
    cited = citations(
        "src/a.py",
        (
            '# bench/RESULTS.md, "Gateway overhead" and "At abc"\n'
            '# bench/RESULTS.md, "Gateway overhead (before)"\n'
            '# bench/RESULTS.md, "Old name"\n'
            '# docs/gone.md, "Anything"\n'
        ),
    ) + citations("bench/RESULTS.md", 'HISTORY.md, "Traffic split"')
    assert broken(tmp_path, cited) == [
        'src/a.py:2: bench/RESULTS.md, "Gateway overhead (before)": no heading starts with this text',
        'src/a.py:3: bench/RESULTS.md, "Old name": no heading starts with this text',
        'src/a.py:4: docs/gone.md, "Anything": no such file',
    ]


def test_every_cited_section_exists():
    found = [c for name, text in tracked_texts(ROOT) for c in citations(name, text)]
    # The code and the docs cite the results and each other dozens of times: finding few means
    # the pattern stopped matching them, not that they are gone.
    assert len(found) >= 30, found
    assert {c.path for c in found} >= {"bench/RESULTS.md", "docs/security.md", "docs/report-json.md"}
    problems = broken(ROOT, found)
    assert not problems, "cited sections that do not exist:\n" + "\n".join(problems)


def test_no_heading_of_the_results_or_the_docs_names_an_issue():
    named = [
        f"{path.relative_to(ROOT)}: {heading}"
        for path in [ROOT / "bench" / "RESULTS.md", *sorted((ROOT / "docs").glob("*.md"))]
        for heading in headings(path.read_text(encoding="utf-8"))
        if ISSUE.search(heading)
    ]
    assert not named, "headings that name an issue, not what they measure:\n" + "\n".join(named)
