#!/usr/bin/env bash
# SkyRL (skyrl-train 0.3.1), CPU only, in its own virtualenv: the environment of tests/skyrl.
#
#   bash .ci/skyrl_env.sh                                     # builds .venv-skyrl ($SKYRL_VENV to move it)
#   .venv-skyrl/bin/python -m pytest tests/skyrl
#
# skyrl-train declares Python 3.12 and pins (flash-attn, vllm through its extras, ray 2.51.1, datasets 4...)
# that are not what the test imports; this machine's torch 2.13.0 CPU wheel is for Python 3.11. So it is
# installed with --no-deps --ignore-requires-python into a 3.11 virtualenv (the modules used import and run on
# 3.11), and DEPS is exactly what these import at module level: skyrl_train.generators (GeneratorInterface,
# prepare_generator_input; skyrl_gym), inference_engines (InferenceEngineClient), dataset.preprocess,
# utils.ppo_utils and utils.torch_utils (the policy loss, log-probs), utils.trainer_utils
# (validate_generator_output) and trainer (postprocess_generator_output).
# On a fresh machine this takes about 2 minutes; a second run only checks the imports and returns.
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
VENV="${SKYRL_VENV:-$ROOT/.venv-skyrl}"
PYTHON="${PYTHON:-python3}"
export PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_ROOT_USER_ACTION=ignore
source "$ROOT/.ci/venv_lib.sh"

DEPS=(
  "ray==2.51.1"               # skyrl-train's pin (ray.util.placement_group.PlacementGroupSchedulingStrategy)
  "omegaconf==2.3.0" "hydra-core==1.3.2" "loguru" "jaxtyping" "torchdata" "datasets" "pandas" "requests"
  "fastapi" "uvicorn"         # inference_engines' http endpoint module, imported by the client
)
IMPORTS="import skyrl_train.generators, skyrl_train.inference_engines.inference_engine_client, skyrl_train.dataset.preprocess, skyrl_train.utils.ppo_utils, skyrl_train.utils.trainer_utils, skyrl_train.trainer, fsm.adapters.skyrl"

want="$(venv_want "$0" "$ROOT/pyproject.toml" "$ROOT/.ci/venv_lib.sh")"
venv_current skyrl "$VENV" "$want" env -C "$ROOT" "$VENV/bin/python" -c "$IMPORTS" && exit 0

start=$SECONDS
venv_fresh skyrl "$VENV" "$PYTHON"
pip=("$VENV/bin/python" -m pip install -q)
"${pip[@]}" torch==2.13.0                 # first: the local CPU wheel, so nothing below pulls CUDA torch
"${pip[@]}" -e "$ROOT" pytest pytest-asyncio
echo "skyrl env: pip will list skyrl's declared dependencies that are left out on purpose (see DEPS)"
"${pip[@]}" --no-deps --ignore-requires-python skyrl-train==0.3.1 skyrl-gym==0.4.0
"${pip[@]}" "${DEPS[@]}"
cd "$ROOT"
"$VENV/bin/python" -c "$IMPORTS"
venv_done skyrl "$VENV" "$want" "$start"
