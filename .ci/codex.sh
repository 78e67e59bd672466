#!/usr/bin/env bash
# The real Codex CLI (npm's @openai/codex) for the gateway's Codex test (tests/gateway/test_codex.py), installed
# with npm into .codex-cli/ (gitignored); reinstalled only when it changes (.ci/npm_cli.sh).
set -euo pipefail
cd "$(dirname "$0")/.."
source .ci/npm_cli.sh
npm_cli codex @openai/codex 0.171.0 codex "${AGENTFSM_CODEX:-.codex-cli}"
