# Shared by .ci/*_env.sh: a framework in a virtualenv of its own, rebuilt only when what built it changed.
# A script computes WANT (venv_want of its inputs), returns early when venv_current says the virtualenv is up
# to date, else starts from venv_fresh, installs, checks its imports and ends with venv_done.

venv_want() {  # FILE...: the hash the stamp holds
  cat "$@" | sha256sum | cut -d' ' -f1
}

venv_current() {  # NAME VENV WANT CHECK...: true (and says so) when the stamp matches and CHECK succeeds
  local name=$1 venv=$2 want=$3
  shift 3
  [ -f "$venv/.agentfsm-$name-env" ] && [ "$(cat "$venv/.agentfsm-$name-env")" = "$want" ] \
    && "$@" >/dev/null 2>&1 || return 1
  echo "$name env: $venv is up to date"
}

venv_fresh() {  # NAME VENV PYTHON: a new, empty virtualenv; an old one is replaced, anything else refused
  local name=$1 venv=$2 python=$3
  if [ -e "$venv" ]; then
    [ -f "$venv/pyvenv.cfg" ] || { echo "$name env: $venv exists and is not a virtualenv; not touching it" >&2; exit 1; }
    rm -rf "$venv"
  fi
  "$python" -m venv "$venv"
}

venv_share() {  # VENV [PYTHON]: hardlink its files that are byte-identical to the main interpreter's packages
  # Seven virtualenvs each hold the torch wheel the main interpreter has (~750 MiB each), and more alike; a CI
  # machine's free disk varies, and a full disk fails the suite's tmp_path fixtures in bulk. Same name, mode and
  # owner, 256 KiB and up (util-linux hardlink compares the bytes); skipped where hardlink or one filesystem is not.
  local venv=$1 python=${2:-python3} main saved
  command -v hardlink >/dev/null || return 0
  main="$("$python" -c 'import sysconfig; print(sysconfig.get_path("purelib"))')"
  # -m: the copy with the most links stays, so every virtualenv links to one inode, not to the one shared last
  saved="$(hardlink -m -f -t -s 256k "$main" "$venv" 2>&1 | awk '/^Saved:/ {print $2, $3}' || true)"
  echo "$(basename "$venv"): ${saved:-nothing} shared with $main"
}

venv_done() {  # NAME VENV WANT START: stamp it, share its files with the main interpreter's, say how long it took
  echo "$3" > "$2/.agentfsm-$1-env"
  venv_share "$2"
  echo "$1 env: built $2 in $((SECONDS - $4)) s"
}
