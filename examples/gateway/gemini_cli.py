"""Gemini CLI (npm's `@google/gemini-cli`, `gemini -p PROMPT`) as a command harness (docs/gateway.md, "Gemini CLI").

Gemini CLI speaks Gemini's API (`streamGenerateContent`, which the gateway serves) and reads GEMINI_API_KEY and
GOOGLE_GEMINI_BASE_URL: the session's key and its URL (the gateway serves `v1beta/models/...` under it). Everything
else is Gemini CLI's own default (its model name, tools, streaming, thinking config); only what a non-interactive
run needs is set: a HOME of its own (a temporary folder, removed after it) whose settings pick the API-key
login and turn usage statistics, telemetry and updates off, since nothing outside loopback is reached, the
working folder trusted, and `--approval-mode yolo` (a run with nobody to ask). It works in $AGENTFSM_WORKDIR when
set, else in a temporary folder. The prompt is the row's last user message. The binary: $AGENTFSM_GEMINI_CLI, else
the one `.ci/gemini_cli.sh` installs into .gemini-cli/, else `gemini` on PATH.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

LOCAL = Path(__file__).resolve().parents[2] / ".gemini-cli" / "node_modules" / ".bin" / "gemini"
SETTINGS = {
    "security": {"auth": {"selectedType": "gemini-api-key"}, "folderTrust": {"enabled": False}},
    "privacy": {"usageStatisticsEnabled": False},
    "telemetry": {"enabled": False},
    "general": {"disableAutoUpdate": True, "disableUpdateNag": True},
}


def gemini_binary() -> str | None:
    """Where Gemini CLI is, or None."""
    given = os.environ.get("AGENTFSM_GEMINI_CLI")
    if given:
        return given
    return str(LOCAL) if LOCAL.exists() else shutil.which("gemini")


def main() -> int:
    gemini = gemini_binary()
    if gemini is None:
        print(
            "gemini cli harness: no Gemini CLI (bash .ci/gemini_cli.sh installs it into .gemini-cli/, or set "
            "AGENTFSM_GEMINI_CLI)",
            file=sys.stderr,
        )
        return 127
    row = json.loads(os.environ["AGENTFSM_ROW"])
    prompt = next(m["content"] for m in reversed(row.get("raw_prompt") or []) if m.get("role") == "user")
    home = tempfile.mkdtemp(prefix="agentfsm-gemini-")
    os.makedirs(f"{home}/.gemini")
    with open(f"{home}/.gemini/settings.json", "w") as f:
        json.dump(SETTINGS, f)
    workdir = os.environ.get("AGENTFSM_WORKDIR") or home
    env = {
        **os.environ,
        "HOME": home,
        "PWD": workdir,
        "GEMINI_API_KEY": os.environ["ANTHROPIC_API_KEY"],  # the session's key
        "GOOGLE_GEMINI_BASE_URL": os.environ["ANTHROPIC_BASE_URL"],  # the session's root: v1beta/... under it
        "GEMINI_CLI_TRUST_WORKSPACE": "true",
    }
    try:
        argv = [gemini, "--approval-mode", "yolo", *sys.argv[1:], "-p", prompt]
        return subprocess.run(argv, env=env, cwd=workdir, stdin=subprocess.DEVNULL).returncode
    finally:
        shutil.rmtree(home, ignore_errors=True)


# Run as the row's command, the script needs none of the gateway: importing it first cost each row about 3 s.
if __name__ == "__main__":
    sys.exit(main())

from fsm.gateway import harness  # noqa: E402  (the spec's action, when the gateway imports this module)

gemini_cli_harness = harness(command=[sys.executable, __file__], timeout_s=300)
