"""The README and the docs/ pages cannot rot: their Python blocks, and the shell commands that need no GPU,
server, network or Docker, run here as written, the README first and then each page in name order, in one
scratch directory that holds copies of specs/, docs/ and examples/ (so `runs/latest` and the diagrams land there, not in
the checkout; a page may use what the README's blocks made, such as runs/latest).

Conventions, as HTML comments (invisible on GitHub) right before a fenced block:
    <!-- skip-test: REASON -->                 the block is not run
    <!-- skip-test-line: PREFIX | REASON -->    the block's lines that start with PREFIX are not run
```bash blocks run under `bash -e`, with `agentfsm` meaning this checkout's `python -m fsm.cli.commands`; ```python
blocks run as scripts; a ```console block is a transcript: each `$ ` line runs and the output must be the
lines that follow (`…` stands for any text). Other blocks (yaml, json, plain output) are data. The blocks
that did not run, and why, are listed by `test_readme_inventory` (pytest -rA shows it) and as skips.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from tests.conftest import ASSETS, REPO, extra

README = REPO / "README.md"
PAGES = [README, *sorted((REPO / "docs").glob("*.md"))]
RUNNABLE = ("bash", "python", "console")
EXTRAS = {
    "trl": "trl",
    "datasets": "trl",
    "accelerate": "trl",
    "ray": "ray",
    "pyarrow": "parquet",
    "openai": "gateway",
    "anthropic": "gateway",
    "agents": "gateway",
    "langgraph": "gateway",
    "google.genai": "gateway",
}  # pyproject
TIMEOUT_S = 600


@dataclass
class Block:
    path: Path
    line: int  # of the opening fence, 1-based
    lang: str
    text: str
    skip: str | None = None  # why the whole block does not run
    skip_lines: list[tuple[str, str]] = field(default_factory=list)  # (prefix, why)

    @property
    def id(self) -> str:
        where = self.path.relative_to(REPO) if self.path.is_relative_to(REPO) else self.path.name
        return f"{where}:{self.line} {self.lang or 'text'}"


def parse(path: Path = README) -> list[Block]:
    blocks: list[Block] = []
    skip: str | None = None
    skip_lines: list[tuple[str, str]] = []
    lines = path.read_text(encoding="utf-8").splitlines()
    i = 0
    while i < len(lines):
        line = lines[i]
        if m := re.fullmatch(r"\s*<!--\s*skip-test:\s*(.+?)\s*-->\s*", line):
            skip = m.group(1)
        elif m := re.fullmatch(r"\s*<!--\s*skip-test-line:\s*(.+?)\s*\|\s*(.+?)\s*-->\s*", line):
            skip_lines.append((m.group(1), m.group(2)))
        elif m := re.fullmatch(r"```(\S*)\s*", line):
            start, body = i + 1, []
            i += 1
            while i < len(lines) and lines[i].strip() != "```":
                body.append(lines[i])
                i += 1
            blocks.append(Block(path, start, m.group(1), "\n".join(body) + "\n", skip, skip_lines))
            skip, skip_lines = None, []
        elif line.strip():
            skip, skip_lines = None, []  # a marker belongs to the block right after it
        i += 1
    return blocks


BLOCKS = [block for page in PAGES for block in parse(page)]


def logical_lines(text: str) -> list[str]:
    """Shell lines with backslash continuations joined."""
    out, pending = [], ""
    for line in text.splitlines():
        if line.endswith("\\"):
            pending += line[:-1] + " "
        else:
            out.append(pending + line)
            pending = ""
    return out + ([pending] if pending else [])


@pytest.fixture(scope="module")
def workdir(tmp_path_factory) -> Path:
    work = tmp_path_factory.mktemp("readme")
    for name in ("specs", "docs", "examples"):
        shutil.copytree(REPO / name, work / name, ignore=shutil.ignore_patterns("__pycache__"))
    return work


def env() -> dict[str, str]:
    out = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}  # no tracing unless a block asks
    out["PYTHONPATH"] = str(REPO)  # this checkout's fsm, backends, viz
    return out


def bash(script: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    prelude = f'agentfsm() {{ "{sys.executable}" -m fsm.cli.commands "$@"; }}\npython() {{ "{sys.executable}" "$@"; }}\n'
    return subprocess.run(
        ["bash", "-e", "-o", "pipefail", "-c", prelude + script],
        cwd=cwd,
        env=env(),
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
    )


def matches(expected: str, actual: str) -> bool:
    return re.fullmatch(".*".join(re.escape(part) for part in expected.split("…")), actual) is not None


def run_block(block: Block, cwd: Path) -> None:
    if block.lang == "python":
        script = cwd / f"{block.path.stem.lower()}_{block.line}.py"
        script.write_text(block.text)
        proc = subprocess.run(
            [sys.executable, script.name],
            cwd=cwd,
            env=env(),
            capture_output=True,
            text=True,
            timeout=TIMEOUT_S,
        )
        assert proc.returncode == 0, f"{block.id}\n{proc.stdout}\n{proc.stderr}"
        return
    if block.lang == "bash":
        lines = [
            line
            for line in logical_lines(block.text)
            if not any(line.lstrip().startswith(prefix) for prefix, _ in block.skip_lines)
        ]
        if "agentfsm render" in block.text and shutil.which("dot") is None:
            pytest.skip(f"{block.id}: Graphviz's dot is not installed")
        proc = bash("\n".join(lines) + "\n", cwd)
        assert proc.returncode == 0, f"{block.id}\n{proc.stdout}\n{proc.stderr}"
        return
    # console: "$ command" then its output
    commands: list[tuple[str, list[str]]] = []
    for line in block.text.splitlines():
        if line.startswith("$ "):
            commands.append((line[2:], []))
        else:
            commands[-1][1].append(line)
    for command, expected in commands:
        proc = bash(command + "\n", cwd)
        actual = (proc.stdout + proc.stderr).splitlines()
        assert len(actual) == len(expected), f"{block.id}: $ {command}\n{proc.stdout}{proc.stderr}"
        for want, got in zip(expected, actual):
            assert matches(want, got), f"{block.id}: $ {command}\nwant: {want}\ngot:  {got}"


@pytest.mark.slow
@pytest.mark.skipif(not (ASSETS / "model.safetensors").exists(), reason="the tiny model is not trained")
@pytest.mark.parametrize("block", [b for b in BLOCKS if b.lang in RUNNABLE], ids=lambda b: b.id)
def test_readme_block(block: Block, workdir: Path):
    if block.skip:
        pytest.skip(f"{block.id}: {block.skip}")
    if block.lang == "python":  # a block that imports an optional extra's package needs that extra
        # `import a.b`, `from a.b import c` and `from a import b` (google-genai is `from google import genai`)
        found = re.findall(r"^\s*(?:from ([\w.]+) import (\w+)|import ([\w.]+))", block.text, re.M)
        for path, name, imported in found:
            for module in (
                (path.split(".")[0], path, f"{path}.{name}") if path else (imported.split(".")[0], imported)
            ):
                if module in EXTRAS:
                    extra(module, EXTRAS[module])
    if "examples/gateway" in block.text:  # the shipped harnesses use the openai SDK
        extra("openai", "gateway")
    run_block(block, workdir)


def test_readme_inventory(capsys):
    """Every block the README and docs/ show is run, data, or skipped with a reason; print the list."""
    report = []
    for b in BLOCKS:
        if b.lang not in RUNNABLE:
            report.append(f"{b.id}: data, not run")
        elif b.skip:
            report.append(f"{b.id}: skipped: {b.skip}")
        else:
            report.append(
                f"{b.id}: run" + "".join(f"; lines starting {p!r} skipped: {why}" for p, why in b.skip_lines)
            )
    with capsys.disabled():
        print("\n" + "\n".join(report))
    runnable = [b for b in BLOCKS if b.lang in RUNNABLE and not b.skip]
    assert {b.lang for b in runnable} == set(RUNNABLE), report  # python, shell and a transcript all run
    assert any("agentfsm run specs/calculator.yaml" in b.text for b in runnable)  # the main job


def test_the_parser_reads_the_markers(tmp_path):
    md = tmp_path / "x.md"
    md.write_text(
        "<!-- skip-test: needs a GPU -->\n```bash\nnvidia-smi\n```\n\ntext\n"
        "<!-- skip-test-line: pip | network -->\n```bash\npip install x\necho hi \\\n  there\n```\n"
        "<!-- skip-test: stale -->\nA paragraph in between.\n```python\nprint(1)\n```\n"
    )
    gpu, shell, py = parse(md)
    assert (gpu.line, gpu.skip, shell.skip, shell.skip_lines) == (
        2,
        "needs a GPU",
        None,
        [("pip", "network")],
    )
    assert logical_lines(shell.text) == ["pip install x", "echo hi    there"]
    assert py.skip is None  # a marker belongs only to the block right after it
    assert matches("a … z", "a b c z") and not matches("a … z", "a b c")


def test_the_diagram_the_readme_shows_is_of_the_spec_as_it_is():
    """docs/tool_agent.svg is rendered from specs/tool_agent.yaml, whose hash it shows in its title: re-render it
    (`agentfsm render specs/tool_agent.yaml -o docs/tool_agent.svg`) when the spec changes."""
    from fsm.run.compile import compile_spec

    assert (
        f"({compile_spec(REPO / 'specs' / 'tool_agent.yaml').hash})"
        in (REPO / "docs" / "tool_agent.svg").read_text()
    )


def test_every_docs_page_is_linked_from_the_readme():
    readme = README.read_text(encoding="utf-8")
    assert [p.name for p in PAGES[1:] if f"(docs/{p.name})" not in readme] == []
