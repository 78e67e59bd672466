#!/usr/bin/env bash
# The real qwen-code CLI (npm's @qwen-code/qwen-code) for the gateway's qwen-code test
# (tests/gateway/test_qwen_code.py), installed with npm into .qwen-code-cli/ (gitignored); reinstalled only when this
# script changes (its hash is the stamp).
set -euo pipefail
cd "$(dirname "$0")/.."
DEST=${AGENTFSM_QWEN_CODE_DIR:-.qwen-code-cli}
VERSION=0.24.4

WANT=$(sha256sum "$0" | cut -d' ' -f1)
if [ -f "$DEST/.stamp" ] && [ "$(cat "$DEST/.stamp")" = "$WANT" ] && [ -x "$DEST/node_modules/.bin/qwen" ]; then
  echo "qwen-code: $DEST is up to date"
  exit 0
fi
command -v npm >/dev/null || { echo "qwen-code: npm is needed to install it (apt-get install npm)" >&2; exit 1; }
START=$SECONDS
rm -rf "$DEST"
mkdir -p "$DEST"
npm install --silent --no-audit --no-fund --prefix "$DEST" "@qwen-code/qwen-code@$VERSION"
HOME=$(mktemp -d) "$DEST/node_modules/.bin/qwen" --version
echo "$WANT" > "$DEST/.stamp"
echo "qwen-code: installed @qwen-code/qwen-code@$VERSION into $DEST in $((SECONDS - START)) s"
