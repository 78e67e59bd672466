# Sourced by the coding CLIs' install scripts (.ci/claude_code.sh, codex.sh, gemini_cli.sh, opencode.sh,
# qwen_code.sh): `npm_cli NAME PACKAGE VERSION BIN DEST` installs npm's PACKAGE@VERSION into DEST (gitignored), its
# BIN under DEST/node_modules/.bin, reinstalled only when the calling script or this one changes (their hash is
# the stamp).
npm_cli() {
  local name=$1 package=$2 version=$3 bin=$4 dest=$5
  local want start=$SECONDS
  want=$(cat "$0" "${BASH_SOURCE[0]}" | sha256sum | cut -d' ' -f1)
  if [ -f "$dest/.stamp" ] && [ "$(cat "$dest/.stamp")" = "$want" ] && [ -x "$dest/node_modules/.bin/$bin" ]; then
    echo "$name: $dest is up to date"
    return 0
  fi
  command -v npm >/dev/null || { echo "$name: npm is needed to install it (apt-get install npm)" >&2; return 1; }
  rm -rf "$dest"
  mkdir -p "$dest"
  npm install --silent --no-audit --no-fund --prefix "$dest" "$package@$version"
  HOME=$(mktemp -d) "$dest/node_modules/.bin/$bin" --version
  echo "$want" > "$dest/.stamp"
  echo "$name: installed $package@$version into $dest in $((SECONDS - start)) s"
}
