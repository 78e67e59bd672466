#!/usr/bin/env bash
# The real Claude Code CLI (npm's @anthropic-ai/claude-code) for the gateway's Claude Code test
# (tests/gateway/test_claude_code.py), installed with npm into .claude-cli/ (gitignored); reinstalled only when this
# script changes (its hash is the stamp).
set -euo pipefail
cd "$(dirname "$0")/.."
DEST=${AGENTFSM_CLAUDE_CODE:-.claude-cli}
VERSION=2.1.197

WANT=$(sha256sum "$0" | cut -d' ' -f1)
if [ -f "$DEST/.stamp" ] && [ "$(cat "$DEST/.stamp")" = "$WANT" ] && [ -x "$DEST/node_modules/.bin/claude" ]; then
  echo "claude-code: $DEST is up to date"
  exit 0
fi
command -v npm >/dev/null || { echo "claude-code: npm is needed to install it (apt-get install npm)" >&2; exit 1; }
START=$SECONDS
rm -rf "$DEST"
mkdir -p "$DEST"
npm install --silent --no-audit --no-fund --prefix "$DEST" "@anthropic-ai/claude-code@$VERSION"
HOME=$(mktemp -d) "$DEST/node_modules/.bin/claude" --version
echo "$WANT" > "$DEST/.stamp"
echo "claude-code: installed @anthropic-ai/claude-code@$VERSION into $DEST in $((SECONDS - START)) s"
