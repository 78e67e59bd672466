"""opencode (npm's `opencode-ai`, `opencode run`) as a command harness (docs/gateway.md, "opencode").

opencode reads its providers from its config; `OPENCODE_CONFIG_CONTENT` gives it one, `agentfsm`, an
OpenAI-compatible provider (the `@ai-sdk/openai-compatible` package opencode bundles) at the session's
OPENAI_BASE_URL with its key, and makes its one model the default. Everything else is opencode's own default (its
agents, tools, streaming, its title agent, its `task` sub-agents, which it calls on the same URL with their own
`X-Session-Id`); only what a non-interactive run needs is set: a HOME of its own (a temporary folder, removed after
it), and no model list, update or share traffic, since nothing outside loopback is reached. It works in
$AGENTFSM_WORKDIR when set, else in a temporary folder. The prompt is the row's last user message. The binary:
$AGENTFSM_OPENCODE, else the one `.ci/opencode.sh` installs into .opencode-cli/, else `opencode` on PATH.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

LOCAL = Path(__file__).resolve().parents[2] / ".opencode-cli" / "node_modules" / ".bin" / "opencode"


def opencode_binary() -> str | None:
    """Where opencode is, or None."""
    given = os.environ.get("AGENTFSM_OPENCODE")
    if given:
        return given
    return str(LOCAL) if LOCAL.exists() else shutil.which("opencode")


def config(base_url: str, api_key: str, model: str = "agentfsm") -> dict:
    """opencode's config: one OpenAI-compatible provider, the session's, and its model the default."""
    return {
        "$schema": "https://opencode.ai/config.json",
        "provider": {
            "agentfsm": {
                "npm": "@ai-sdk/openai-compatible",
                "name": "agentfsm",
                "options": {"baseURL": base_url, "apiKey": api_key},
                "models": {model: {"name": model}},
            }
        },
        "model": f"agentfsm/{model}",
        "autoupdate": False,
        "share": "disabled",
    }


def main() -> int:
    opencode = opencode_binary()
    if opencode is None:
        print(
            "opencode harness: no opencode CLI (bash .ci/opencode.sh installs it into .opencode-cli/, or set "
            "AGENTFSM_OPENCODE)",
            file=sys.stderr,
        )
        return 127
    row = json.loads(os.environ["AGENTFSM_ROW"])
    prompt = next(m["content"] for m in reversed(row.get("raw_prompt") or []) if m.get("role") == "user")
    home = tempfile.mkdtemp(prefix="agentfsm-opencode-")
    workdir = os.environ.get("AGENTFSM_WORKDIR") or home
    env = {
        **os.environ,
        "HOME": home,
        "XDG_CONFIG_HOME": f"{home}/.config",
        "XDG_DATA_HOME": f"{home}/.local/share",
        "XDG_CACHE_HOME": f"{home}/.cache",
        "XDG_STATE_HOME": f"{home}/.local/state",
        "OPENCODE_CONFIG_CONTENT": json.dumps(
            config(os.environ["OPENAI_BASE_URL"], os.environ["OPENAI_API_KEY"], os.environ["AGENTFSM_MODEL"])
        ),
        "OPENCODE_DISABLE_MODELS_FETCH": "1",
        "OPENCODE_DISABLE_AUTOUPDATE": "1",
        "OPENCODE_DISABLE_SHARE": "1",
        "OPENCODE_DISABLE_LSP_DOWNLOAD": "1",
    }
    try:
        argv = [opencode, "run", "--dir", workdir, *sys.argv[1:], prompt]  # (it reads $PWD, not its cwd)
        return subprocess.run(
            argv, env={**env, "PWD": workdir}, cwd=workdir, stdin=subprocess.DEVNULL
        ).returncode
    finally:
        shutil.rmtree(home, ignore_errors=True)


# Run as the row's command, the script needs none of the gateway: importing it first cost each row about 3 s.
if __name__ == "__main__":
    sys.exit(main())

from fsm.gateway import harness  # noqa: E402  (the spec's action, when the gateway imports this module)

opencode_harness = harness(command=[sys.executable, __file__], timeout_s=300)
