"""The real Codex CLI (npm's @openai/codex, `codex exec`, installed by .ci/codex.sh) as a command harness on the
embedded tiny model: its Responses API requests (SSE), its tools (functions rendered, its `namespace` and
`web_search` tools left out and noted on the row), one exchange, and a row that ends with a recorded reason.

Codex's own prompt (about 16,000 tiny-tokenizer tokens) is cut to fit the tiny model's 4,096 positions with
Codex's own options: short instructions, no goal, image or skill instructions."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from examples.gateway import codex
from fsm.gateway import harness

ROOT = Path(__file__).resolve().parents[2]
FIT = [
    "-c",
    f"model_instructions_file={json.dumps(str(Path(__file__).with_name('codex_instructions.md')))}",
    "--disable",
    "goals",
    "--disable",
    "view_image",
    "-c",
    "skills.include_instructions=false",
]
small_codex = harness(command=[sys.executable, codex.__file__, *FIT], timeout_s=300)


@pytest.fixture
def codex_cli() -> str:
    found = codex.codex_binary()
    if found is None or (os.path.sep in found and not Path(found).exists()):
        if os.environ.get("CI") == "true":
            pytest.fail(
                "the Codex CLI is missing under CI=true: .ci/run installs it with `bash .ci/codex.sh`"
            )
        pytest.skip("the Codex CLI is not installed: `bash .ci/codex.sh` installs it into .codex-cli/")
    return found


@pytest.mark.slow
def test_the_codex_cli_runs_one_exchange_and_its_row_says_how_it_ended(
    tmp_path: Path, codex_cli: str
) -> None:
    spec = tmp_path / "codex.yaml"
    spec.write_text(
        (ROOT / "examples/gateway/codex.yaml")
        .read_text()
        .replace("extends: base.yaml", f"extends: {ROOT / 'examples/gateway/base.yaml'}")
        .replace("examples.gateway.codex:codex_harness", "tests.gateway.test_codex:small_codex")
    )
    out = tmp_path / "run"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "fsm.cli",
            "gateway",
            str(spec),
            "--num-prompts",
            "1",
            "-q",
            "--max-error-rate",  # the tiny model's one turn is cut by max_new_tokens: a failed row is a warning
            "1",
            "--out",
            str(out),
        ],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT), "AGENTFSM_CODEX": codex_cli},
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    record = json.loads((out / "trajectories.jsonl").read_text().splitlines()[0])
    assert record["termination_reason"] in ("done", "harness_failed"), record
    if record["termination_reason"] == "harness_failed":  # why is recorded, and said in one line
        assert record["harness"]["outcome"] in ("exit", "error", "timeout"), record["harness"]
        assert "agentfsm: warning: all 1 rows failed, all for one cause: harness_failed" in proc.stderr, (
            proc.stderr
        )
    assert record["num_turns"] >= 1 and record["prompt_tokens"] > 1000, (
        record
    )  # Codex's prompt, then the model's turn
    assert [t["role"] for t in record["turns"]][:1] == ["assistant"]
    assert (
        "exec_command" in record["prompt"] and "multi_agent_v1" not in record["prompt"]
    )  # its function tools only
    (note,) = record["gateway_notes"]
    assert "type 'namespace', 'multi_agent_v1'" in note and "type 'web_search'" in note, note
