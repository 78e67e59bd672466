#!/usr/bin/env bash
# verl 0.9.1, CPU only, in its own virtualenv: the environment of the parity test.
#
#   bash .ci/verl_env.sh                                     # builds .venv-verl ($VERL_VENV to move it)
#   .venv-verl/bin/python -m pytest tests/test_verl_parity.py tests/verl
#
# verl is installed with --no-deps: its declared dependencies (wandb, tensorboard, peft, accelerate,
# torchdata, a torch pin that is not the local CPU wheel...) are not what its agent loop imports. DEPS is
# exactly what `verl.experimental.agent_loop` (with ToolAgentLoop, the tool registry, RLHFDataset and
# hydra's instantiate) imports at module level, pinned where verl 0.9.1 pins a range. No vllm, sglang,
# flash-attn or CUDA package is installed. On a fresh machine this takes about 3 minutes; a second run
# with the same script and pyproject.toml only checks the import and returns.
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
VENV="${VERL_VENV:-$ROOT/.venv-verl}"
PYTHON="${PYTHON:-python3}"
export PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_ROOT_USER_ACTION=ignore

DEPS=(
  "transformers==5.10.4"     # verl 0.9.1 wants >=5.5.3,<5.11,!=5.6.0 (agent_loop, tools.function_tool)
  "tensordict==0.10.0"       # verl 0.9.1 wants >=0.8.0,<=0.10.0,!=0.9.0 (verl, protocol, agent_loop)
  "numpy==2.4.6"             # verl 0.9.1 wants >=2.0.0
  "ray==2.60.0"              # verl 0.9.1 wants >=2.41.0 (agent_loop, protocol, single_controller)
  "hydra-core==1.3.8"        # hydra.utils.instantiate and omegaconf
  "datasets==5.2.0"          # utils.dataset.rl_dataset; brings pandas (utils.dataset.rm_dataset)
  "pillow==13.0.0"           # PIL in agent_loop and tool_agent_loop
  "codetiming==1.4.0"        # utils.profiler.performance
  "cachetools==8.0.1"        # workers.rollout.router
  "fastapi==0.165.0"         # workers.rollout.utils
  "uvicorn==0.54.0"          # workers.rollout.utils
  "orjson==3.13.0"           # utils.tracking
  "pydantic==2.14.3"         # AgentLoopOutput, tools.schemas
  "regex==2026.11.15"        # agent_loop.tool_parser
  "pyyaml==6.0.3"            # workers.rollout.utils
  "packaging==25.0"          # verl, protocol, utils.device
)

stamp="$VENV/.agentfsm-verl-env"
want="$(cat "$0" "$ROOT/pyproject.toml" | sha256sum | cut -d' ' -f1)"
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ] \
  && "$VENV/bin/python" -c "import verl.experimental.agent_loop, fsm.verl_adapter, hypothesis" 2>/dev/null; then
  echo "verl env: $VENV is up to date"
  exit 0
fi

start=$SECONDS
if [ -e "$VENV" ]; then
  [ -f "$VENV/pyvenv.cfg" ] || { echo "verl env: $VENV exists and is not a virtualenv; not touching it" >&2; exit 1; }
  rm -rf "$VENV"
fi
"$PYTHON" -m venv "$VENV"
pip=("$VENV/bin/python" -m pip install -q)
"${pip[@]}" torch==2.13.0                 # first: the local CPU wheel, so nothing below pulls CUDA torch
"${pip[@]}" --no-deps verl==0.9.1
echo "verl env: pip will list verl's declared dependencies that are left out on purpose (see DEPS)"
"${pip[@]}" "${DEPS[@]}"
"${pip[@]}" -e "$ROOT" pytest pytest-asyncio "hypothesis>=6.100"   # hypothesis: tests/verl/test_generated.py
cd "$ROOT"
"$VENV/bin/python" -c "import verl, verl.experimental.agent_loop, fsm.verl_adapter; assert verl.__version__ == '0.9.1'"
echo "$want" > "$stamp"
echo "verl env: built $VENV in $((SECONDS - start)) s"
