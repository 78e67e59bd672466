#!/usr/bin/env bash
# The real Gemini CLI (npm's @google/gemini-cli) for the gateway's Gemini CLI test
# (tests/gateway/test_gemini_cli.py), installed with npm into .gemini-cli/ (gitignored); reinstalled only when it
# changes (.ci/npm_cli.sh).
set -euo pipefail
cd "$(dirname "$0")/.."
source .ci/npm_cli.sh
npm_cli gemini-cli @google/gemini-cli 0.61.0 gemini "${AGENTFSM_GEMINI_CLI_DIR:-.gemini-cli}"
