"""The Codex CLI (npm's `@openai/codex`, `codex exec`) as a command harness (docs/gateway.md, "Codex").

Codex does not read OPENAI_BASE_URL: it reaches a model through a provider of its config, so each row runs
`codex exec` with a provider `agentfsm` made by `-c` flags (the session's base URL, the Responses API as its wire
API, the key read from OPENAI_API_KEY), a CODEX_HOME of its own (a temporary folder, removed after it: nothing
in ~/.codex is read or written), and the row's last user message as the prompt. Run as a script it does that
for the row in its environment (its arguments: more of Codex's options); `codex_harness` is the action a spec
names. The binary: $AGENTFSM_CODEX, else
the one `.ci/codex.sh` installs into .codex-cli/, else `codex` on PATH.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

LOCAL = Path(__file__).resolve().parents[2] / ".codex-cli" / "node_modules" / ".bin" / "codex"


def codex_binary() -> str | None:
    """Where the Codex CLI is, or None."""
    given = os.environ.get("AGENTFSM_CODEX")
    if given:
        return given
    return str(LOCAL) if LOCAL.exists() else shutil.which("codex")


def codex_argv(
    codex: str, base_url: str, prompt: str, model: str = "agentfsm", more: list[str] | None = None
) -> list[str]:
    """`codex exec` against one gateway session (its OpenAI base URL, `.../sessions/{id}/v1`); `more`: Codex's
    own options, before the prompt."""
    provider = {
        "name": "agentfsm",
        "base_url": base_url,
        "wire_api": "responses",
        "env_key": "OPENAI_API_KEY",
    }
    flags = [f"model_providers.agentfsm.{key}={json.dumps(value)}" for key, value in provider.items()]
    flags += [
        "model_provider=agentfsm",
        "model_providers.agentfsm.stream_max_retries=0",
        "model_providers.agentfsm.request_max_retries=0",
    ]  # a refusal is an answer: never re-sent
    return [
        codex,
        "exec",
        "--skip-git-repo-check",
        "--ephemeral",
        "-m",
        model,
        *(arg for flag in flags for arg in ("-c", flag)),
        *(more or ()),
        prompt,
    ]


def main() -> int:
    codex = codex_binary()
    if codex is None:
        print(
            "codex harness: no Codex CLI (bash .ci/codex.sh installs it into .codex-cli/, or set AGENTFSM_CODEX)",
            file=sys.stderr,
        )
        return 127
    row = json.loads(os.environ["AGENTFSM_ROW"])
    prompt = next(m["content"] for m in reversed(row.get("raw_prompt") or []) if m.get("role") == "user")
    home = tempfile.mkdtemp(prefix="agentfsm-codex-")
    try:
        argv = codex_argv(
            codex,
            os.environ["OPENAI_BASE_URL"],
            prompt,
            os.environ.get("AGENTFSM_MODEL", "agentfsm"),
            sys.argv[1:],
        )
        workdir = os.environ.get("AGENTFSM_WORKDIR") or home  # where it works (a test reads its files there)
        return subprocess.run(
            argv,
            env={**os.environ, "CODEX_HOME": home, "PWD": workdir},
            cwd=workdir,
            stdin=subprocess.DEVNULL,
        ).returncode
    finally:
        shutil.rmtree(home, ignore_errors=True)


# Run as the row's command, the script needs none of the gateway: importing it first cost each row about 3 s.
if __name__ == "__main__":
    sys.exit(main())

from fsm.gateway import harness  # noqa: E402  (the spec's action, when the gateway imports this module)

codex_harness = harness(command=[sys.executable, __file__], timeout_s=300)
