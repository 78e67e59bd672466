"""Claude Code (npm's `@anthropic-ai/claude-code`, `claude -p`) as a command harness (docs/gateway.md, "Claude Code").

Claude Code reads ANTHROPIC_BASE_URL and ANTHROPIC_API_KEY, which the harness's environment already holds (the
session's), so each row runs `claude -p PROMPT` with Claude Code's own defaults (its model name, streaming,
thinking, context management, its 25 tools) and only what a non-interactive run needs: a HOME of its own (a
temporary folder, removed after it: nothing in ~/.claude is read or written), edits accepted without asking
(`--permission-mode acceptEdits`), and its non-essential traffic (updates, telemetry) off, since nothing outside
loopback is reached. It works in $AGENTFSM_WORKDIR when set (a test reads the files it writes there), else in a
temporary folder. The prompt is the row's last user message. Run as a script it does that for the row in its
environment (its arguments: more of Claude Code's options); `claude_code_harness` is the action a spec names.
The binary: $AGENTFSM_CLAUDE_CODE, else the one `.ci/claude_code.sh` installs into .claude-cli/, else `claude` on
PATH.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

LOCAL = Path(__file__).resolve().parents[2] / ".claude-cli" / "node_modules" / ".bin" / "claude"


def claude_binary() -> str | None:
    """Where Claude Code is, or None."""
    given = os.environ.get("AGENTFSM_CLAUDE_CODE")
    if given:
        return given
    return str(LOCAL) if LOCAL.exists() else shutil.which("claude")


def make_prompts(n: int, seed: int = 0) -> list[dict]:
    """One coding task per row: write a file, then finish."""
    return [
        {"raw_prompt": [{"role": "user", "content": f"Write hello{k}.txt containing hi"}], "uid": f"cc-{k}"}
        for k in range(n)
    ]


def compute_score(
    solution_str: str, ground_truth: Any = None, trajectory: Any = None, **kwargs: Any
) -> float:
    """1.0 when Claude Code finished its task (it exited 0 after the model's last turn), else 0.0."""
    outcome = (trajectory.extra.get("harness") or {}) if trajectory is not None else {}
    return 1.0 if outcome.get("outcome") == "exit" and outcome.get("exit_code") == 0 else 0.0


def main() -> int:
    claude = claude_binary()
    if claude is None:
        print(
            "claude code harness: no Claude Code CLI (bash .ci/claude_code.sh installs it into .claude-cli/, or set "
            "AGENTFSM_CLAUDE_CODE)",
            file=sys.stderr,
        )
        return 127
    row = json.loads(os.environ["AGENTFSM_ROW"])
    prompt = next(m["content"] for m in reversed(row.get("raw_prompt") or []) if m.get("role") == "user")
    home = tempfile.mkdtemp(prefix="agentfsm-claude-")
    workdir = os.environ.get("AGENTFSM_WORKDIR") or home
    env = {
        **os.environ,
        "HOME": home,
        "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
        "DISABLE_AUTOUPDATER": "1",
    }
    try:
        argv = [claude, "-p", "--permission-mode", "acceptEdits", *sys.argv[1:], prompt]
        return subprocess.run(argv, env=env, cwd=workdir, stdin=subprocess.DEVNULL).returncode
    finally:
        shutil.rmtree(home, ignore_errors=True)


# Run as the row's command, the script needs none of the gateway: importing it first cost each row about 3 s.
if __name__ == "__main__":
    sys.exit(main())

from fsm.gateway import harness  # noqa: E402  (the spec's action, when the gateway imports this module)

claude_code_harness = harness(command=[sys.executable, __file__], timeout_s=300)
