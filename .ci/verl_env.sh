#!/usr/bin/env bash
# verl, CPU only, in its own virtualenv: the environment of the parity tests.
#
#   bash .ci/verl_env.sh                                     # verl 0.9.1 in .venv-verl ($VERL_VENV to move it)
#   .venv-verl/bin/python -m pytest tests/test_verl_parity.py tests/verl
#   VERL_VERSION=0.7.1 bash .ci/verl_env.sh                  # verl 0.7.1 (INTERACTING) in .venv-verl07
#   .venv-verl07/bin/python -m pytest tests/verl07
#
# verl is installed with --no-deps: its declared dependencies (wandb, tensorboard, peft, accelerate,
# torchdata, a torch pin that is not the local CPU wheel...) are not what its agent loop imports. DEPS is
# exactly what `verl.experimental.agent_loop` (with ToolAgentLoop, the tool registry, RLHFDataset and
# hydra's instantiate) imports at module level, pinned where verl 0.9.1 pins a range. No vllm, sglang,
# flash-attn or CUDA package is installed. On a fresh machine this takes about 3 minutes; a second run
# with the same script and pyproject.toml only checks the import and returns.
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
VERSION="${VERL_VERSION:-0.9.1}"
PYTHON="${PYTHON:-python3}"
export PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_ROOT_USER_ACTION=ignore
source "$ROOT/.ci/venv_lib.sh"

DEPS_0_9_1=(
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
DEPS_0_7_1=(                 # what verl 0.7.1's agent loop imports, at the releases of its time
  "transformers==4.57.3"     # 0.7.1 predates transformers 5 (apply_chat_template returns ids)
  "tensordict==0.10.0" "numpy==1.26.4" "pyarrow==21.0.0"   # verl 0.7.1 wants numpy<2 (and so does this pyarrow)
  "ray==2.60.0" "hydra-core==1.3.8" "datasets==4.4.1" "pillow==12.0.0" "codetiming==1.4.0"
  "cachetools==6.2.2" "fastapi==0.121.3" "uvicorn==0.38.0" "pydantic==2.12.4" "pyyaml==6.0.3" "packaging==25.0"
)
case "$VERSION" in
  0.9.1) VENV="${VERL_VENV:-$ROOT/.venv-verl}"; DEPS=("${DEPS_0_9_1[@]}")
         CHECK="verl.experimental.agent_loop, fsm.adapters.verl" ;;
  0.7.1) VENV="${VERL_VENV:-$ROOT/.venv-verl07}"; DEPS=("${DEPS_0_7_1[@]}")   # the native engine is compared
         CHECK="verl.experimental.agent_loop.tool_agent_loop, fsm" ;;
  *) echo "verl env: no dependency list for verl $VERSION (0.9.1, 0.7.1)" >&2; exit 2 ;;
esac

want="$(venv_want "$0" "$ROOT/pyproject.toml" "$ROOT/.ci/venv_lib.sh")"
venv_current verl "$VENV" "$want" "$VENV/bin/python" -c "import $CHECK, hypothesis" && exit 0

start=$SECONDS
venv_fresh verl "$VENV" "$PYTHON"
pip=("$VENV/bin/python" -m pip install -q)
"${pip[@]}" torch==2.13.0                 # first: the local CPU wheel, so nothing below pulls CUDA torch
"${pip[@]}" --no-deps "verl==$VERSION"
echo "verl env: pip will list verl's declared dependencies that are left out on purpose (see DEPS)"
"${pip[@]}" "${DEPS[@]}"
"${pip[@]}" -e "$ROOT" pytest pytest-asyncio "hypothesis>=6.100"   # hypothesis: tests/verl/test_generated.py
cd "$ROOT"
"$VENV/bin/python" -c "import verl, $CHECK; assert verl.__version__ == '$VERSION'"
venv_done verl "$VENV" "$want" "$start"
