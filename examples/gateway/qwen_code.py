"""qwen-code (npm's `@qwen-code/qwen-code`, `qwen PROMPT`) as a command harness (docs/gateway.md, "qwen-code").

qwen-code speaks OpenAI Chat Completions and reads OPENAI_BASE_URL and OPENAI_API_KEY, which the harness's
environment already holds (the session's); OPENAI_MODEL names the model and `--auth-type openai` picks that
provider. Everything else is qwen-code's own default (its tools, streaming, its `agent` sub-agents, which call on the
same URL with no header telling them apart: the gateway links them by their content). Only what a non-interactive
run needs is set: a HOME of its own (a temporary folder, removed after it) whose settings turn usage statistics and
telemetry off, since nothing outside loopback is reached, and `--approval-mode yolo` (a run with nobody to ask).
It works in $AGENTFSM_WORKDIR when set, else in a temporary folder. The prompt is the row's last user message. The
binary: $AGENTFSM_QWEN_CODE, else the one `.ci/qwen_code.sh` installs into .qwen-code-cli/, else `qwen` on PATH.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

LOCAL = Path(__file__).resolve().parents[2] / ".qwen-code-cli" / "node_modules" / ".bin" / "qwen"
SETTINGS = {"privacy": {"usageStatisticsEnabled": False}, "telemetry": {"enabled": False}}


def qwen_binary() -> str | None:
    """Where qwen-code is, or None."""
    given = os.environ.get("AGENTFSM_QWEN_CODE")
    if given:
        return given
    return str(LOCAL) if LOCAL.exists() else shutil.which("qwen")


def main() -> int:
    qwen = qwen_binary()
    if qwen is None:
        print(
            "qwen-code harness: no qwen-code CLI (bash .ci/qwen_code.sh installs it into .qwen-code-cli/, or set "
            "AGENTFSM_QWEN_CODE)",
            file=sys.stderr,
        )
        return 127
    row = json.loads(os.environ["AGENTFSM_ROW"])
    prompt = next(m["content"] for m in reversed(row.get("raw_prompt") or []) if m.get("role") == "user")
    home = tempfile.mkdtemp(prefix="agentfsm-qwen-")
    os.makedirs(f"{home}/.qwen")
    with open(f"{home}/.qwen/settings.json", "w") as f:
        json.dump(SETTINGS, f)
    workdir = os.environ.get("AGENTFSM_WORKDIR") or home
    env = {**os.environ, "HOME": home, "PWD": workdir, "OPENAI_MODEL": os.environ["AGENTFSM_MODEL"]}
    try:
        argv = [qwen, "--auth-type", "openai", "--approval-mode", "yolo", *sys.argv[1:], prompt]
        return subprocess.run(argv, env=env, cwd=workdir, stdin=subprocess.DEVNULL).returncode
    finally:
        shutil.rmtree(home, ignore_errors=True)


# Run as the row's command, the script needs none of the gateway: importing it first cost each row about 3 s.
if __name__ == "__main__":
    sys.exit(main())

from fsm.gateway import harness  # noqa: E402  (the spec's action, when the gateway imports this module)

qwen_code_harness = harness(command=[sys.executable, __file__], timeout_s=300)
