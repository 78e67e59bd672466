#!/usr/bin/env bash
# The real opencode CLI (npm's opencode-ai) for the gateway's opencode test (tests/gateway/test_opencode.py),
# installed with npm into .opencode-cli/ (gitignored); reinstalled only when this script changes (its hash is the
# stamp).
set -euo pipefail
cd "$(dirname "$0")/.."
DEST=${AGENTFSM_OPENCODE_DIR:-.opencode-cli}
VERSION=1.18.33

WANT=$(sha256sum "$0" | cut -d' ' -f1)
if [ -f "$DEST/.stamp" ] && [ "$(cat "$DEST/.stamp")" = "$WANT" ] && [ -x "$DEST/node_modules/.bin/opencode" ]; then
  echo "opencode: $DEST is up to date"
  exit 0
fi
command -v npm >/dev/null || { echo "opencode: npm is needed to install it (apt-get install npm)" >&2; exit 1; }
START=$SECONDS
rm -rf "$DEST"
mkdir -p "$DEST"
npm install --silent --no-audit --no-fund --prefix "$DEST" "opencode-ai@$VERSION"
HOME=$(mktemp -d) "$DEST/node_modules/.bin/opencode" --version
echo "$WANT" > "$DEST/.stamp"
echo "opencode: installed opencode-ai@$VERSION into $DEST in $((SECONDS - START)) s"
