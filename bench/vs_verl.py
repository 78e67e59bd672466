"""`agentfsm bench vs-verl`: CPU per trajectory of verl 0.9.1's ToolAgentLoop next to agentfsm's, on one script.

Run it where verl is installed: `bash .ci/verl_env.sh`, then `.venv-verl/bin/agentfsm bench vs-verl`.

Every variant runs the same 2-turn calculator trajectory (a tool call, its result, the answer) on the same
Qwen-style tokenizer and chat template, with the model's turns replayed at zero latency, so what is measured is
each loop's own work: building the loop, rendering the prompt, parsing the call, running the tool, appending the
tokens. The variants:
- `verl`: verl's ToolAgentLoop, built per sample with `hydra.utils.instantiate` as AgentLoopWorker builds it,
  its calculator a verl BaseTool loaded once by `load_all_tools`;
- `verl_direct`: the same loop constructed directly, which shows what hydra's instantiate costs per sample
  (the same for any entry: it merges the worker's keyword arguments into a copy of the entry's config);
- `fsm_agent_hydra`: agentfsm's adapter (`fsm.adapters.verl.FSMAgentLoop`, specs/tool_agent.yaml) built the
  same way, with the same verl tool;
- `fsm_agent_direct`: the adapter constructed directly;
- `native`: agentfsm's own engine on specs/calculator.yaml's tool over tool_agent.yaml's machine (a coroutine
  calculator at `isolation: none`), through `Runner.run` and the engine's scripted backend.
verl's per-sample postprocessing (padding each output) is the same for both loops and is not counted.
"""

from __future__ import annotations

import asyncio
import gc
import importlib.resources
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from specs.calculator import TOOL_SCHEMA

TOOL_MODULE = """
import ast, operator

from verl.tools.base_tool import BaseTool
from verl.tools.schemas import ToolResponse

OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul}


def evaluate(node):
    if isinstance(node, ast.BinOp) and type(node.op) in OPS:
        return OPS[type(node.op)](evaluate(node.left), evaluate(node.right))
    if isinstance(node, ast.Constant) and isinstance(node.value, int):
        return node.value
    raise ValueError("unsupported expression")


class Calculator(BaseTool):
    async def execute(self, instance_id, parameters, **kwargs):
        value = evaluate(ast.parse(parameters["expression"], mode="eval").body)
        return ToolResponse(text=str(value)), 0.0, {}
"""


CALL = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "37 * 12 + 5"}}\n</tool_call>'
ANSWER = "The answer is 449.\n#### 449"
QUESTION = "What is 37 * 12 + 5?"
SAMPLING = {"temperature": 1.0, "top_p": 1.0, "top_k": -1, "repetition_penalty": 1.0, "logprobs": True}
KINDS = {
    "verl": "verl 0.9.1's ToolAgentLoop, hydra.utils.instantiate per sample (as AgentLoopWorker builds it)",
    "verl_direct": "the same ToolAgentLoop, constructed directly (what hydra's instantiate adds is the difference)",
    "fsm_agent_hydra": "fsm.adapters.verl.FSMAgentLoop on specs/tool_agent.yaml, instantiated the same way",
    "fsm_agent_direct": "the same adapter, constructed directly",
    "native": "agentfsm's engine (Runner.run), the calculator awaited on the run's loop",
}


class ReplayServer:
    """verl's server manager contract (`generate(request_id, prompt_ids=, sampling_params=) -> TokenOutput`):
    each request id gets the call, then the answer."""

    def __init__(self, turns: list[list[int]]):
        self.turns = turns
        self.seen: dict[str, int] = {}

    async def generate(
        self, request_id: str, *, prompt_ids: list[int], sampling_params: dict[str, Any], **_: Any
    ):
        from verl.workers.rollout.replica import TokenOutput

        k = self.seen[request_id] = self.seen.get(request_id, -1) + 1
        ids = self.turns[min(k, len(self.turns) - 1)]
        return TokenOutput(token_ids=ids, log_probs=[-0.25] * len(ids), stop_reason="completed")


class Setup:
    """What AgentLoopWorker holds per worker: the trainer config, tokenizer, tools, loop entries."""

    def __init__(self, prompt_length: int = 1024, response_length: int = 1024):
        from omegaconf import OmegaConf
        from transformers import AutoTokenizer
        from verl.experimental.agent_loop.agent_loop import _agent_loop_registry
        from verl.tools.tool_registry import load_all_tools

        from backends.tiny import ASSET_DIR

        self.tokenizer = AutoTokenizer.from_pretrained(ASSET_DIR)
        eos = self.tokenizer.eos_token_id
        self.turns = [self.tokenizer.encode(t, add_special_tokens=False) + [eos] for t in (CALL, ANSWER)]
        config = OmegaConf.load(
            importlib.resources.files("verl.trainer.config") / "_generated_ppo_trainer.yaml"
        )
        rollout = config.actor_rollout_ref.rollout
        rollout.name, rollout.prompt_length, rollout.response_length = (
            "sglang",
            prompt_length,
            response_length,
        )
        rollout.multi_turn.enable = True
        self.config = config
        tools = Path(tempfile.mkdtemp(prefix="bench_vs_verl_"))
        (tools / "bench_vs_verl_tools.py").write_text(TOOL_MODULE)
        entry = {
            "class_name": "bench_vs_verl_tools.Calculator",
            "config": {"type": "native"},
            "tool_schema": TOOL_SCHEMA,
        }  # the schema the native variant's calculator has
        (tools / "tools.yaml").write_text(json.dumps({"tools": [entry]}))  # JSON is YAML
        sys.path.insert(0, str(tools))
        self.tools = load_all_tools(tool_config_path=str(tools / "tools.yaml"), function_tool_path=None)
        self.verl_entry = _agent_loop_registry["tool_agent"]
        self.fsm_entry = OmegaConf.create(
            {
                "name": "fsm_agent",
                "_target_": "fsm.adapters.verl.FSMAgentLoop",
                "spec": "specs/tool_agent.yaml",
            }
        )

    def row(self, i: int) -> dict[str, Any]:
        """A dataset row as the worker passes it to run(); each row's question its own, as in a dataset."""
        return {
            "raw_prompt": [{"role": "user", "content": f"{QUESTION} (question {i})"}],
            "tools_kwargs": {},
            "index": i,
            "extra_info": {"index": i},
            "uid": f"u{i}",
            "data_source": "calculator",
            "priority": 0,
        }

    def loop_kwargs(self, server: ReplayServer) -> dict[str, Any]:
        from verl.experimental.agent_loop.agent_loop import DictConfigWrap, ToolListWrap
        from verl.utils.dataset.rl_dataset import RLHFDataset

        return dict(
            trainer_config=DictConfigWrap(config=self.config),
            server_manager=server,
            tokenizer=self.tokenizer,
            processor=None,
            hf_model_type="qwen2",
            dataset_cls=RLHFDataset,
            data_config=DictConfigWrap(self.config.data),
            tools=ToolListWrap(self.tools),
        )


async def _through_loops(setup: Setup, kind: str, rows: range) -> tuple[float, list[list[int]]]:
    import hydra
    from verl.experimental.agent_loop.tool_agent_loop import ToolAgentLoop

    from fsm.adapters.verl import FSMAgentLoop

    server = ReplayServer(setup.turns)

    async def one(i: int) -> Any:
        kwargs = setup.loop_kwargs(server)
        if kind == "fsm_agent_direct":
            loop = FSMAgentLoop(spec="specs/tool_agent.yaml", **kwargs)
        elif kind == "verl_direct":
            loop = ToolAgentLoop(**kwargs)
        else:
            entry = setup.verl_entry if kind == "verl" else setup.fsm_entry
            loop = hydra.utils.instantiate(config=entry, **kwargs)
        return await loop.run(dict(SAMPLING), **setup.row(i))

    t0 = time.process_time()
    outs = await asyncio.gather(*(one(i) for i in rows))
    return time.process_time() - t0, [out.response_ids for out in outs]


def _native_runner(setup: Setup) -> Any:
    from backends.scripted import ScriptedBackend
    from fsm.families import codec_for
    from fsm.run.compile import compile_spec
    from fsm.run.runtime import Runner
    from fsm.spec.model import SPECS_DIR, ToolSpec

    agent = compile_spec(SPECS_DIR / "tool_agent.yaml")
    calculator = compile_spec(SPECS_DIR / "calculator.yaml").spec.tools[0]
    tool = ToolSpec.model_validate({**calculator.model_dump(exclude_unset=True), "isolation": "none"})
    spec = agent.spec.model_copy(update={"tools": [tool]})
    turns = setup.turns
    backend = ScriptedBackend(lambda session, turn, prompt: turns[min(turn, len(turns) - 1)], logprob=-0.25)
    backend.record_requests = False
    return Runner(compile_spec(spec), backend, codec_for(setup.tokenizer, "qwen2.5"))


async def _native(setup: Setup, runner: Any, indices: range) -> tuple[float, list[list[int]]]:
    rows = [setup.row(i) for i in indices]
    t0 = time.process_time()
    trajs = await runner.run(rows, sampling_params=SAMPLING)
    elapsed = time.process_time() - t0
    bad = [t for t in trajs if t.termination_reason != "done"]
    assert not bad, f"native: {bad[0].termination_reason} {bad[0].error}"
    return elapsed, [t.response_ids.tolist() for t in trajs]


def bench_vs_verl(n: int = 128, repeats: int = 5) -> dict[str, Any]:
    """Median over `repeats` interleaved rounds of each of KINDS: CPU µs per trajectory (this process's CPU
    time, so other load does not count), `n` trajectories in flight at once as in one worker's batch."""
    try:
        import verl

        from fsm import verl_adapter  # noqa: F401  (registers fsm_agent)
    except ImportError as exc:
        raise SystemExit(
            f"bench vs-verl needs verl 0.9.1 ({exc}); build its env with `bash .ci/verl_env.sh` "
            "and run `.venv-verl/bin/agentfsm bench vs-verl`"
        ) from None
    setup = Setup()
    runner = _native_runner(setup)
    gc.freeze()  # verl, torch and the tokenizer, loaded by now, out of the collector's way (for both loops alike)
    times: dict[str, list[float]] = {kind: [] for kind in KINDS}
    responses: dict[str, list[list[int]]] = {}
    step = 0
    for round_ in range(
        repeats + 1
    ):  # the first round warms every cache (spec compile, tokenizer) and is dropped
        for kind in KINDS:
            gc.collect()
            rows = range(
                n * step, n * (step + 1)
            )  # questions no variant has seen (nothing cached across rounds)
            step += 1
            run = _native(setup, runner, rows) if kind == "native" else _through_loops(setup, kind, rows)
            elapsed, responses[kind] = asyncio.run(run)
            if round_:
                times[kind].append(elapsed / n * 1e6)
    for kind, resp in responses.items():  # the same tokens, or the comparison means nothing
        assert resp == responses["verl"], f"{kind}'s responses differ from verl's"
    med = {kind: statistics.median(ts) for kind, ts in times.items()}
    out: dict[str, Any] = {
        "verl_version": verl.__version__,
        "trajectories": n,
        "repeats": repeats,
        "kinds": KINDS,
        "response_tokens": len(responses["verl"][0]),
    }
    for kind in KINDS:
        out[kind] = {
            "cpu_us_per_trajectory": round(med[kind], 1),
            "vs_verl": round(med[kind] / med["verl"], 3),
        }
    print(
        f"{n} calculator trajectories (2 model turns, 1 tool call) in flight, CPU µs per trajectory, median of "
        f"{repeats} interleaved rounds:",
        file=sys.stderr,
    )
    for kind in KINDS:
        print(f"  {kind:17} {med[kind]:9.1f}  {med[kind] / med['verl']:.3f}x verl", file=sys.stderr)
    return out
