#!/usr/bin/env bash
# The real qwen-code CLI (npm's @qwen-code/qwen-code) for the gateway's qwen-code test
# (tests/gateway/test_qwen_code.py), installed with npm into .qwen-code-cli/ (gitignored); reinstalled only when it
# changes (.ci/npm_cli.sh).
set -euo pipefail
cd "$(dirname "$0")/.."
source .ci/npm_cli.sh
npm_cli qwen-code @qwen-code/qwen-code 0.24.4 qwen "${AGENTFSM_QWEN_CODE_DIR:-.qwen-code-cli}"
