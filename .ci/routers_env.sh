#!/usr/bin/env bash
# The engines' own routers, vllm-router 0.1.17 and sglang-router 0.3.2 (both Rust, cp38-abi3 wheels from the
# package index), in a virtualenv of their own: what `agentfsm bench fleet` and tests/vllm/test_fleet.py
# measure agentfsm's router against.
#
#   bash .ci/routers_env.sh                # builds .venv-routers ($AGENTFSM_ROUTERS_VENV to move it)
#   .venv-routers/bin/vllm-router --worker-urls URL URL --policy consistent_hash|cache_aware|round_robin
#   .venv-routers/bin/python -m sglang_router.launch_router --worker-urls URL URL --policy manual|cache_aware
#
# Both wheels carry a binary; neither pins anything the other does, so one virtualenv holds both (a few MB,
# seconds to build). .ci/routers-lock.txt pins every package the resolver picked once; a second run with the
# same script and lock file only checks the commands and returns.
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
VENV="${AGENTFSM_ROUTERS_VENV:-$ROOT/.venv-routers}"
PYTHON="${PYTHON:-python3}"
LOCK="$ROOT/.ci/routers-lock.txt"
export PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_ROOT_USER_ACTION=ignore
source "$ROOT/.ci/venv_lib.sh"
CHECK="import importlib.metadata as m, sglang_router, vllm_router; \
assert m.version('vllm-router') == '0.1.17' and m.version('sglang-router') == '0.3.2'"

want="$(venv_want "$0" "$ROOT/.ci/venv_lib.sh" "$LOCK" 2>/dev/null || true)"
venv_current routers "$VENV" "$want" "$VENV/bin/python" -c "$CHECK" && exit 0

start=$SECONDS
venv_fresh routers "$VENV" "$PYTHON"
pip=("$VENV/bin/python" -m pip install -q)
if [ -f "$LOCK" ]; then
  "${pip[@]}" --no-deps -r "$LOCK"
  "$VENV/bin/python" -m pip check
else
  "${pip[@]}" "vllm-router==0.1.17" "sglang-router==0.3.2"
  "$VENV/bin/python" -m pip freeze --all --exclude pip > "$LOCK"
  echo "routers env: wrote $LOCK; commit it"
fi
"$VENV/bin/python" -c "$CHECK"
"$VENV/bin/vllm-router" --help >/dev/null
venv_done routers "$VENV" "$(venv_want "$0" "$ROOT/.ci/venv_lib.sh" "$LOCK")" "$start"
