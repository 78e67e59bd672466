#!/usr/bin/env bash
# AReaL 1.0.4, CPU only, in its own virtualenv: the environment of tests/areal.
#
#   bash .ci/areal_env.sh                                     # builds .venv-areal ($AREAL_VENV to move it)
#   .venv-areal/bin/python -m pytest tests/areal
#
# areal is installed with --no-deps: its declared dependencies (sglang, vllm, megatron, flash-attn, a
# transformers pin, CUDA torch...) are not what the test imports. DEPS is exactly what these import at module
# level: areal.api (RolloutWorkflow, ModelRequest, GenerationHyperparameters, InferenceEngineConfig),
# areal.engine.sglang_remote (RemoteSGLangEngine, its WorkflowExecutor and HTTP client), areal.utils.data
# (concat_padded_tensors) and areal.utils.functional (ppo_actor_loss_fn, gather_logprobs). The SGLang server
# the engine talks to is agentfsm's dev server over the tiny model, so no sglang is installed.
# On a fresh machine this takes about 2 minutes; a second run only checks the imports and returns.
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
VENV="${AREAL_VENV:-$ROOT/.venv-areal}"
PYTHON="${PYTHON:-python3}"
export PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_ROOT_USER_ACTION=ignore
source "$ROOT/.ci/venv_lib.sh"

DEPS=(
  "ray==2.60.0" "hydra-core==1.3.8" "omegaconf==2.3.1" "lark==1.3.1" "uvloop==0.23.0" "torchdata==0.11.0"
  "httpx==0.28.1" "requests==2.34.2" "aiofiles==25.1.0" "pybase64==1.5.1" "orjson==3.13.0" "colorlog==6.12.0"
  "tenacity==9.2.1" "flask==3.1.3" "numba==0.68.1" "einops==0.8.2" "openai==3.57.0" "pillow==13.0.0"
  "pyyaml==6.0.4"
)
IMPORTS="import areal.api.workflow_api, areal.engine.sglang_remote, areal.utils.data, areal.utils.functional, fsm.adapters.areal"

want="$(venv_want "$0" "$ROOT/pyproject.toml" "$ROOT/.ci/venv_lib.sh")"
venv_current areal "$VENV" "$want" env -C "$ROOT" "$VENV/bin/python" -c "$IMPORTS" && exit 0

start=$SECONDS
venv_fresh areal "$VENV" "$PYTHON"
pip=("$VENV/bin/python" -m pip install -q)
"${pip[@]}" torch==2.13.0                 # first: the local CPU wheel, so nothing below pulls CUDA torch
"${pip[@]}" -e "$ROOT" pytest pytest-asyncio
echo "areal env: pip will list areal's declared dependencies that are left out on purpose (see DEPS)"
"${pip[@]}" --no-deps areal==1.0.4
"${pip[@]}" "${DEPS[@]}"
cd "$ROOT"
"$VENV/bin/python" -c "$IMPORTS"
venv_done areal "$VENV" "$want" "$start"
