#!/usr/bin/env bash
# The real Gemini CLI (npm's @google/gemini-cli) for the gateway's Gemini CLI test
# (tests/gateway/test_gemini_cli.py), installed with npm into .gemini-cli/ (gitignored); reinstalled only when this
# script changes (its hash is the stamp).
set -euo pipefail
cd "$(dirname "$0")/.."
DEST=${AGENTFSM_GEMINI_CLI_DIR:-.gemini-cli}
VERSION=0.61.0

WANT=$(sha256sum "$0" | cut -d' ' -f1)
if [ -f "$DEST/.stamp" ] && [ "$(cat "$DEST/.stamp")" = "$WANT" ] && [ -x "$DEST/node_modules/.bin/gemini" ]; then
  echo "gemini-cli: $DEST is up to date"
  exit 0
fi
command -v npm >/dev/null || { echo "gemini-cli: npm is needed to install it (apt-get install npm)" >&2; exit 1; }
START=$SECONDS
rm -rf "$DEST"
mkdir -p "$DEST"
npm install --silent --no-audit --no-fund --prefix "$DEST" "@google/gemini-cli@$VERSION"
HOME=$(mktemp -d) "$DEST/node_modules/.bin/gemini" --version
echo "$WANT" > "$DEST/.stamp"
echo "gemini-cli: installed @google/gemini-cli@$VERSION into $DEST in $((SECONDS - START)) s"
