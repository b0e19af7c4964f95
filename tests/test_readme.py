"""README.md's walkthroughs run as written, in a temporary copy of the project, after what
`make demo` leaves behind.

Every ```sh and ```python block of every section between "After `make demo`" and "Where next"
runs, in order, section after section, in one copy: a new block, or a new section there, runs
too. A sh block runs line by line as a shell would (a `\\` continues a line, a here-document
is one command), each command with bash in the copy's directory and a newcomer's environment
(no ABPLAT_* variable: the settings are the `.env` that `make demo` writes); a command ending in
`&` starts in the background and counts as started once every port it names, on its command
line or in an http://127.0.0.1:PORT it prints, accepts connections; `kill %N` stops the Nth
background command of its section, as bash's job numbers do. A python block runs with
`.venv/bin/python`. Every command must succeed, and each section's end state is checked
(`CHECKS`).

What differs from a newcomer's run, and why:
- The README's first block (`make demo`, `make test`) does not run. `make test` is the suite this
  test is part of; `make demo` is replaced by what it leaves behind, made as cheaply as possible:
  `make dev-env` (the `.env` step of `make demo`) and `manage.py demo --no-serve` on 100 requests
  (`--limit 100`) without the capacity search (`--capacity-steps 0`). The walkthroughs need the
  demo's experiment running with a finished replay, its trace slice and its user, not its
  verdicts or its capacity table.
- The fixed ports the README names for the web server and the product team's simulators (8000,
  8110, 8111) are replaced by free ones throughout the text, so the test can run beside a
  developer's `make demo`; the demo's simulators run wherever its experiment's endpoints say
  (`manage.py simulator --experiment`).
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest

from tests.workers.background import wait_for

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
FIRST_SECTION, LAST_SECTION = "After `make demo`", "Where next"
REPLACED_PORTS = (8000, 8110, 8111)
SLICE = "var/demo/azure_llm_2023_code-prompts384-answers32.csv"
COMMAND_TIMEOUT_S = 180
READY_TIMEOUT_S = 60
VERDICT = r"meets|misses|not enough data|cannot be judged"  # the report's verdicts (docs/report-json.md)

pytestmark = [pytest.mark.process, pytest.mark.slow]


# ---- the README, parsed ----


@dataclass
class Block:
    language: str  # "sh" or "python"
    text: str


@dataclass
class Section:
    title: str
    blocks: list[Block]


def sections(text: str) -> list[Section]:
    """The walkthrough sections (between FIRST_SECTION and LAST_SECTION) with their fenced blocks;
    a block in another language there is an error naming it (the test could not run it)."""
    found, inside = [], False
    for chunk in re.split(r"^## ", text, flags=re.M)[1:]:
        title = chunk.split("\n", 1)[0].strip()
        if title.startswith(FIRST_SECTION):
            inside = True
            continue
        if title.startswith(LAST_SECTION):
            break
        if not inside:
            continue
        blocks = []
        for language, body in re.findall(r"^```(\w*)\n(.*?)^```", chunk, flags=re.M | re.S):
            if language not in ("sh", "python"):
                raise AssertionError(
                    f'README section "{title}": a ```{language} block cannot be run: use sh or python'
                )
            blocks.append(Block(language, body))
        found.append(Section(title, blocks))
    return found


def commands(script: str) -> list[str]:
    """The commands of a sh block: comment lines dropped, `\\` continuations joined, a
    here-document kept whole with the command that opens it."""
    lines, out = script.split("\n"), []
    i = 0
    while i < len(lines):
        line = lines[i]
        i += 1
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        while line.endswith("\\") and i < len(lines):
            line = line[:-1] + lines[i]
            i += 1
        heredoc = re.search(r"<<-?\s*'?\"?(\w+)'?\"?", line)
        if heredoc:
            end = heredoc.group(1)
            body = []
            while i < len(lines) and lines[i].strip() != end:
                body.append(lines[i])
                i += 1
            line = "\n".join([line, *body, end])
            i += 1
        out.append(line)
    return out


# ---- running them ----


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def listening(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.5):
            return True
    except OSError:
        return False


@dataclass
class Job:
    command: str
    process: subprocess.Popen
    log: Path

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def stop(self) -> None:
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGINT)  # Ctrl-C, as a newcomer stops it
            try:
                self.process.wait(20)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait(10)


@dataclass
class Run:
    """One section's run: the output of each command, its background jobs."""

    copy: Path
    env: dict[str, str]
    ports: dict[int, int]
    outputs: list[tuple[str, str]] = field(default_factory=list)
    printed: list[str] = field(default_factory=list)  # each python block's output
    seconds: list[tuple[str, float]] = field(default_factory=list)  # each command's wall time
    jobs: list[Job | None] = field(default_factory=list)

    def out(self, pattern: str) -> str:
        """The output of the one command matching ``pattern``."""
        found = [o for c, o in self.outputs if re.search(pattern, c)]
        assert len(found) == 1, f"{len(found)} commands match {pattern!r}: {[c for c, _ in self.outputs]}"
        return found[0]

    def shell(self, command: str) -> None:
        if m := re.fullmatch(r"kill((?:\s+%\d+)+)", command.strip()):
            for n in re.findall(r"%(\d+)", m.group(1)):
                job = self.jobs[int(n) - 1]
                assert job is not None, f"{command}: job %{n} was stopped already"
                job.stop()
                self.jobs[int(n) - 1] = None
            self.outputs.append((command, ""))
            return
        if command.rstrip().endswith("&") and not command.rstrip().endswith("&&"):
            self.background(command.rstrip()[:-1].rstrip())
            return
        started = time.monotonic()
        done = subprocess.run(
            ["bash", "-o", "pipefail", "-c", command],
            cwd=self.copy,
            env=self.env,
            capture_output=True,
            text=True,
            timeout=COMMAND_TIMEOUT_S,
        )
        output = done.stdout + done.stderr
        self.outputs.append((command, output))
        self.seconds.append((command, time.monotonic() - started))
        assert done.returncode == 0, f"README command failed (exit {done.returncode}):\n$ {command}\n{output}"

    def python(self, code: str) -> None:
        done = subprocess.run(
            [".venv/bin/python", "-"],
            input=code,
            cwd=self.copy,
            env=self.env,
            capture_output=True,
            text=True,
            timeout=COMMAND_TIMEOUT_S,
        )
        output = done.stdout + done.stderr
        self.outputs.append((code, output))
        self.printed.append(output)
        assert done.returncode == 0, f"README python block failed (exit {done.returncode}):\n{code}\n{output}"

    def background(self, command: str) -> None:
        log = self.copy / "var" / f"job-{len(self.outputs)}.log"
        log.parent.mkdir(parents=True, exist_ok=True)
        with log.open("w") as fh:
            process = subprocess.Popen(
                ["bash", "-c", command],
                cwd=self.copy,
                env=self.env,
                stdout=fh,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        job = Job(command, process, log)
        self.jobs.append(job)
        self.outputs.append((command, ""))
        named = {int(p) for p in re.findall(r"(?:--port\s+|127\.0\.0\.1:)(\d+)", command)}

        def ready() -> bool:
            assert process.poll() is None, (
                f"README background command ended (exit {process.returncode}):\n$ {command}\n{job.output()}"
            )
            ports = named | {int(p) for p in re.findall(r"http://127\.0\.0\.1:(\d+)", job.output())}
            return bool(ports) and all(listening(p) for p in ports)

        wait_for(
            ready,
            timeout=READY_TIMEOUT_S,
            poll=0.2,
            message=lambda: f"README background command not serving:\n$ {command}\n{job.output()}",
        )

    def stop_all(self) -> None:
        for job in self.jobs:
            if job is not None:
                job.stop()
        self.jobs.clear()


def newcomer_env(copy: Path) -> dict[str, str]:
    """A shell's environment without any of abplat's settings or the suite's: only what the copy
    (its .env) says."""
    return {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("ABPLAT_", "DJANGO_", "PYTEST_", "TEST_", "OTEL_"))
    }


@pytest.fixture(scope="session")
def after_demo(tmp_path_factory) -> tuple[Path, dict]:
    """A copy of the project (its files as they are in this tree; .venv linked) after what
    `make demo` leaves behind (module docstring): .env, var/ with the demo's experiment running
    and one replay done. (the copy, `manage.py demo --json`'s document)."""
    copy = tmp_path_factory.mktemp("readme") / "abplat"
    copy.mkdir()
    tracked = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=ROOT,
        capture_output=True,
        check=True,
    ).stdout
    for name in tracked.decode().split("\0"):
        source = ROOT / name
        if name and source.is_file():  # a tracked file deleted in this tree is left out
            target = copy / name
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(source.read_bytes())
    for name in ("manage.py",):
        (copy / name).chmod(0o755)
    (copy / ".venv").symlink_to(ROOT / ".venv")
    env = newcomer_env(copy)
    made = subprocess.run(
        ["make", "--no-print-directory", "dev-env"],
        cwd=copy,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert made.returncode == 0 and (copy / ".env").exists(), made.stdout + made.stderr
    demo = subprocess.run(
        [
            ".venv/bin/python",
            "manage.py",
            "demo",
            "--no-serve",
            "--json",
            "--limit",
            "100",
            "--capacity-steps",
            "0",
            "--no-progress",
        ],
        cwd=copy,
        env={**env, "ABPLAT_LOG_LEVEL": "WARNING"},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert demo.returncode == 0, demo.stdout[-3000:] + demo.stderr[-3000:]
    doc = json.loads(demo.stdout)
    assert doc["experiment"] == "ttft-optimizations" and doc["replay"]["run"]["status"] == "done"
    assert (copy / SLICE).exists()
    return copy, doc


def with_ports(text: str, ports: dict[int, int]) -> str:
    for old, new in ports.items():
        text = re.sub(rf"\b{old}\b", str(new), text)
    return text


def logged_in(base: str) -> httpx.Client:
    """An httpx client logged in as the demo user through the admin's login form."""
    client = httpx.Client(base_url=base, timeout=30)
    client.get("/admin/login/")
    done = client.post(
        "/admin/login/?next=/admin/",
        data={"username": "demo", "password": "demo", "csrfmiddlewaretoken": client.cookies["csrftoken"]},
    )
    assert done.status_code == 302, done.text[:500]
    return client


# ---- what each section promises ----


def text_of(html: str) -> str:
    return re.sub(r"\s+", " ", re.sub(r"<[^>]+>", " ", html))


def check_product(run: Run) -> None:
    assert "created my-first-experiment" in run.out(r"apply_experiment my-experiment")
    assert "draft -> running" in run.out(r"experiment start my-first")
    replay = run.out(r"manage.py replay my-first")
    assert re.search(r"run \d+ done: (\d+)/\1 samples", replay), replay  # every sample recorded
    table = run.out(r"sla_report my-first")
    rows = {line.split()[0]: line for line in table.splitlines() if re.match(r"(fp16|awq) +\d+ ", line)}
    assert set(rows) == {"fp16", "awq"}, table
    for line in rows.values():
        assert re.search(r"\d+ +0 +\d\.\d{4} \[", line), line  # n, no errors, attainment [interval]
        assert re.search(VERDICT, line), line


def check_sre(run: Run) -> None:
    assert re.search(r"written at revision \d+", run.out(r"set_weights"))
    assigned = [
        line.split("\t") for line in run.out(r"manage.py assign").splitlines() if line.startswith("user-")
    ]
    assert [user for user, _ in assigned] == ["user-1", "user-2", "user-3"]
    assert {variant[:7] for _, variant in assigned} <= {"fp16", "awq", "awq-fa2"}
    rollout = run.out(r"rollout awq-fa2-rollout --once")
    assert "decision: start" in rollout and "5%" in rollout, rollout
    capacity = run.out(r"manage.py capacity")
    assert "SLA capacity of ttft-optimizations" in capacity, capacity
    assert re.search(r"^awq-fa2 +(\d+|-) ", capacity, flags=re.M), capacity


def check_analyst_dashboard(run: Run) -> None:
    """While the README's server runs: the dashboard draws the report of the demo's replay."""
    client = logged_in(f"http://127.0.0.1:{run.ports[8000]}")
    page = client.get("/dashboards/ttft-optimizations/")
    assert page.status_code == 200, page.text[:500]
    text = text_of(page.text)
    for key in ("fp16 (control)", "awq", "awq-fa2", "attainment"):
        assert key in text, text[:2000]
    assert re.search(VERDICT, text), text[:2000]


def check_analyst(run: Run) -> None:
    table = run.out(r"sla_report ttft-optimizations$")
    assert re.search(r"^variant +n +errors +attainment", table, flags=re.M), table
    [printed] = run.printed  # the python block reading report.json
    for key in ("fp16", "awq", "awq-fa2"):
        assert re.search(rf"^{key} \d+ samples, attainment", printed, flags=re.M), printed
    # the mirror replay's answers: each variant against fp16's, fp16 not against itself
    shares = re.findall(
        r"^(\S+) \d+ samples.*\n  (\d+\.\d)% of its answers identical to fp16's$", printed, re.M
    )
    assert [key for key, _ in shares] == ["awq", "awq-fa2"], printed
    assert all(80.0 <= float(share) < 100.0 for _, share in shares), printed


def check_live_dashboard(run: Run) -> None:
    """While the gateway runs: the live run is listed with the 200 requests' samples."""
    client = logged_in(f"http://127.0.0.1:{run.ports[8000]}")
    seen = {}

    def recorded_all() -> bool:  # the gateway writes its samples in batches, off the request path
        seen["report"] = client.get("/api/experiments/ttft-optimizations/report?mode=live").json()
        return sum(v["n"] for v in seen["report"]["variants"]) == 200

    wait_for(recorded_all, timeout=30, poll=0.3, message=lambda: json.dumps(seen.get("report"))[:2000])
    [live] = seen["report"]["runs"]["read"]
    assert live["mode"] == "live"
    page = text_of(client.get("/dashboards/ttft-optimizations/?mode=live").text)
    assert re.search(rf"live \(real users, through the gateway\): {live['run_id']}\b", page), page[:2000]


def check_live(run: Run) -> None:
    [printed] = run.printed
    assert printed.strip().endswith("200 answers"), printed


# Each walkthrough section's end state, by the start of its title; `during` runs before the
# section's first `kill`, while what it started in the background still serves.
CHECKS = {
    "Product teams": {"after": check_product},
    "SREs": {"after": check_sre},
    "Analysts": {"during": check_analyst_dashboard, "after": check_analyst},
    "Live traffic": {"during": check_live_dashboard, "after": check_live},
}


def test_the_readme_starts_with_the_two_commands():
    first = re.search(r"^```sh\n(.*?)^```", README.read_text(), flags=re.M | re.S).group(1)
    assert [line.split("#")[0].strip() for line in first.strip().splitlines()] == ["make demo", "make test"]


def test_every_walkthrough_section_is_checked():
    titles = [s.title for s in sections(README.read_text())]
    assert [next((k for k in CHECKS if t.startswith(k)), t) for t in titles] == list(CHECKS), titles
    assert all(s.blocks for s in sections(README.read_text()))


def test_every_file_the_readme_cites_exists():
    # `docs/x.md`, [text](docs/screenshots/y.png), `demo/z.yaml`, `bench/RESULTS.md`: a newcomer
    # who follows a pointer finds the file (a moved doc changes its pointers with it)
    text = README.read_text()
    cited = set(re.findall(r"(?:`|\()((?:docs|demo|bench|data|tests|scripts)/[\w./-]+\.\w+)(?:`|\))", text))
    assert {"docs/statistics.md", "docs/screenshots/dashboard-mirror.png", "tests/test_readme.py"} <= cited
    root = README.parent
    assert [c for c in sorted(cited) if not (root / c).is_file()] == []


def test_the_walkthroughs_run_as_written(after_demo):
    copy, _ = after_demo
    ports = {p: free_port() for p in REPLACED_PORTS}
    for section in sections(README.read_text()):
        hooks = next((h for k, h in CHECKS.items() if section.title.startswith(k)), {})
        run = Run(copy, newcomer_env(copy), ports)
        try:
            for block in section.blocks:
                text = with_ports(block.text, ports)
                if block.language == "python":
                    run.python(text)
                    continue
                for command in commands(text):
                    if command.startswith("kill") and "during" in hooks:
                        hooks.pop("during")(run)
                    run.shell(command)
            assert not [j for j in run.jobs if j is not None], (
                f'README section "{section.title}" leaves {[j.command for j in run.jobs if j]} running: end it with kill %N'
            )
            if "after" in hooks:
                hooks["after"](run)
        finally:
            run.stop_all()
            # what each command took, in the captured output: where the test's time goes
            print(
                f"{section.title}:",
                *(f"  {t:6.1f} s  {c.splitlines()[0][:100]}" for c, t in run.seconds),
                sep="\n",
            )
