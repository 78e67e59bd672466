"""Rows that are not training data (issue 48 §5): a harness whose every model call was refused, and that exits 0
anyway, is an error row naming the refusal, never a 0-token `done` row. Run through a real `agentfsm gateway`
with a real command harness (this file, run as a script: it posts what the gateway refuses, then exits 0)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path

from fsm.gateway import harness

ROOT = Path(__file__).resolve().parents[2]
refused_harness = harness(command=[sys.executable, __file__], timeout_s=120)


def spec(tmp_path: Path) -> Path:
    path = tmp_path / "refused.yaml"
    path.write_text(
        (ROOT / "examples/gateway/claude_code.yaml")
        .read_text()
        .replace("extends: base.yaml", f"extends: {ROOT / 'examples/gateway/base.yaml'}")
        .replace(
            "examples.gateway.claude_code:claude_code_harness",
            "tests.gateway.test_refused_rows:refused_harness",
        )
    )
    return path


def test_a_harness_whose_every_call_was_refused_is_an_error_row_though_it_exits_0(tmp_path: Path) -> None:
    out = tmp_path / "run"
    proc = subprocess.run(
        [sys.executable, "-m", "fsm.cli", "gateway", str(spec(tmp_path)), "--num-prompts", "1", "-q"]
        + ["--max-error-rate", "1", "--out", str(out)],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    record = json.loads((out / "trajectories.jsonl").read_text().splitlines()[0])
    assert record["harness"]["outcome"] == "exit" and record["harness"]["exit_code"] == 0, record["harness"]
    assert record["termination_reason"] == (
        "error: gateway: every model call of the harness was refused (2; the first: 400 invalid_request: "
        "messages: must be a non-empty list)"
    ), record
    summary = json.loads((out / "summary.json").read_text())
    assert summary["failed"] == 1 and "done" not in summary["termination_reasons"], summary


def main() -> int:
    """The harness: two requests the gateway refuses (no messages), then exit 0 as a harness that shrugs."""
    url = os.environ["ANTHROPIC_BASE_URL"] + "/v1/messages"
    body = json.dumps({"model": "m", "max_tokens": 16, "messages": []}).encode()
    for _ in range(2):
        request = urllib.request.Request(
            url, body, {"x-api-key": os.environ["ANTHROPIC_API_KEY"], "content-type": "application/json"}
        )
        try:
            urllib.request.urlopen(request, timeout=60)
        except urllib.error.HTTPError as e:
            print(e.code, e.read().decode()[:200], file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
