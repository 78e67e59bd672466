#!/usr/bin/env bash
# The real Codex CLI (npm's @openai/codex) for the gateway's Codex test (tests/gateway/test_codex.py), installed
# with npm into .codex-cli/ (gitignored); reinstalled only when this script changes (its hash is the stamp).
set -euo pipefail
cd "$(dirname "$0")/.."
DEST=${AGENTFSM_CODEX:-.codex-cli}
VERSION=0.171.0

WANT=$(sha256sum "$0" | cut -d' ' -f1)
if [ -f "$DEST/.stamp" ] && [ "$(cat "$DEST/.stamp")" = "$WANT" ] && [ -x "$DEST/node_modules/.bin/codex" ]; then
  echo "codex: $DEST is up to date"
  exit 0
fi
command -v npm >/dev/null || { echo "codex: npm is needed to install it (apt-get install npm)" >&2; exit 1; }
START=$SECONDS
rm -rf "$DEST"
mkdir -p "$DEST"
npm install --silent --no-audit --no-fund --prefix "$DEST" "@openai/codex@$VERSION"
"$DEST/node_modules/.bin/codex" --version
echo "$WANT" > "$DEST/.stamp"
echo "codex: installed @openai/codex@$VERSION into $DEST in $((SECONDS - START)) s"
