#!/usr/bin/env bash
# The real opencode CLI (npm's opencode-ai) for the gateway's opencode test (tests/gateway/test_opencode.py),
# installed with npm into .opencode-cli/ (gitignored); reinstalled only when it changes (.ci/npm_cli.sh).
set -euo pipefail
cd "$(dirname "$0")/.."
source .ci/npm_cli.sh
npm_cli opencode opencode-ai 1.18.33 opencode "${AGENTFSM_OPENCODE_DIR:-.opencode-cli}"
