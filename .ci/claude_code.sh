#!/usr/bin/env bash
# The real Claude Code CLI (npm's @anthropic-ai/claude-code) for the gateway's Claude Code test
# (tests/gateway/test_claude_code.py), installed with npm into .claude-cli/ (gitignored); reinstalled only when it
# changes (.ci/npm_cli.sh).
set -euo pipefail
cd "$(dirname "$0")/.."
source .ci/npm_cli.sh
npm_cli claude-code @anthropic-ai/claude-code 2.1.197 claude "${AGENTFSM_CLAUDE_CODE:-.claude-cli}"
