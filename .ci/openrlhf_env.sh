#!/usr/bin/env bash
# OpenRLHF 0.11.2, CPU only, in its own virtualenv: the environment of tests/openrlhf.
#
#   bash .ci/openrlhf_env.sh                                  # builds .venv-openrlhf ($OPENRLHF_VENV to move it)
#   .venv-openrlhf/bin/python -m pytest tests/openrlhf
#
# openrlhf and vllm are installed with --no-deps: their declared dependencies (flash-attn, CUDA torch, a
# transformers pin, xgrammar...) are not what the test imports. DEPS is exactly what these modules import
# at module level: openrlhf.utils.agent (AgentExecutorBase), openrlhf.trainer.ray.vllm_engine (the loader of
# --train.agent_func_path), openrlhf.trainer.ppo_utils.samples_generator (response -> Experience),
# openrlhf/models/loss.py and utils.py (PolicyLoss, log_probs_from_logits: deepspeed), and the vllm modules
# they reach (SamplingParams, RequestOutput). No CUDA package is installed; vllm's engine never starts.
# On a fresh machine this takes about 2 minutes; a second run only checks the imports and returns.
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
VENV="${OPENRLHF_VENV:-$ROOT/.venv-openrlhf}"
PYTHON="${PYTHON:-python3}"
export PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_ROOT_USER_ACTION=ignore
source "$ROOT/.ci/venv_lib.sh"

DEPS=(
  "ray==2.60.0"               # openrlhf.trainer.ray (openrlhf pins 2.55.0; its API used here is the same)
  "sympy==1.14.0" "pylatexenc==2.10"   # openrlhf.utils.math_utils (openrlhf.utils' __init__)
  "tqdm" "packaging"          # samples_generator, vllm_engine
  "hjson" "einops" "py-cpuinfo" "psutil" "msgpack" "ninja"   # deepspeed (openrlhf.models.utils)
  "msgspec" "cbor2" "pyzmq" "openai" "openai-harmony" "cloudpickle" "pillow" "pybase64" "cachetools"
  "uvloop" "prometheus-client"   # vllm: sampling_params, outputs, inputs, utils
)
IMPORTS="import openrlhf.utils.agent, openrlhf.trainer.ray.vllm_engine, openrlhf.trainer.ppo_utils.samples_generator, vllm.outputs, deepspeed, fsm.adapters.openrlhf"

want="$(venv_want "$0" "$ROOT/pyproject.toml" "$ROOT/.ci/venv_lib.sh")"
venv_current openrlhf "$VENV" "$want" env -C "$ROOT" "$VENV/bin/python" -c "$IMPORTS" && exit 0

start=$SECONDS
venv_fresh openrlhf "$VENV" "$PYTHON"
pip=("$VENV/bin/python" -m pip install -q)
"${pip[@]}" torch==2.13.0                 # first: the local CPU wheel, so nothing below pulls CUDA torch
"${pip[@]}" -e "$ROOT" pytest pytest-asyncio
echo "openrlhf env: pip will list openrlhf's and vllm's declared dependencies that are left out on purpose (see DEPS)"
"${pip[@]}" --no-deps openrlhf==0.11.2 vllm==0.29.0 deepspeed==0.19.6
"${pip[@]}" "${DEPS[@]}"
cd "$ROOT"
"$VENV/bin/python" -c "$IMPORTS"
venv_done openrlhf "$VENV" "$want" "$start"
