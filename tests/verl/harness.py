"""What every parity test shares: verl 0.9.1's loops built the way its AgentLoopWorker builds them, a server
manager that replays scripted model turns, verl-side tools, and helpers to compare two AgentLoopOutputs.

Both loops are built with `hydra.utils.instantiate` of the registered entry (trainer_config, server_manager,
tokenizer, processor, hf_model_type="qwen2", dataset_cls, data_config, tools) from verl's generated default
trainer config, with the same Qwen-style tokenizer and the same tools loaded by verl's `load_all_tools`. The
only double is `ReplayServer`, which follows `LLMServerClient.generate`'s contract (SGLang adapter budget
rules). Nothing here imports verl at module level: without verl every parity test is skipped.
"""

from __future__ import annotations

import copy
import functools
import json
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[2]
ASSETS = REPO / "backends" / "tiny" / "assets"
SPEC = "specs/tool_agent.yaml"
PROMPT_LENGTH = 512
RESPONSE_LENGTH = 256
SAMPLING = {"temperature": 1.0, "top_p": 1.0, "top_k": -1, "repetition_penalty": 1.0, "logprobs": True}
FIELDS = ("prompt_ids", "response_ids", "response_mask", "response_logprobs", "num_turns")
OURS_ONLY = ("tool_scores", "termination_reason")  # extra_fields agentfsm adds (documented in the spec)


def _verl_missing() -> str | None:
    """None when verl 0.9.1's agent loop imports here, else why the parity tests are skipped."""
    hint = "build its env with `bash .ci/verl_env.sh`, then run `.venv-verl/bin/python -m pytest tests/test_verl_parity.py tests/verl`"
    try:
        import verl
        import verl.experimental.agent_loop  # noqa: F401
    except Exception as exc:  # ImportError, or a dependency of verl's import path that is missing/broken
        return f"verl is not importable here ({type(exc).__name__}: {exc}); {hint}"
    if verl.__version__ != "0.9.1":
        return f"the parity tests are pinned to verl 0.9.1, found {verl.__version__}; {hint}"
    return None


VERL_MISSING = _verl_missing()
needs_verl = pytest.mark.skipif(VERL_MISSING is not None, reason=VERL_MISSING or "")


# --- the model: scripted turns ---------------------------------------------------------------------------


def call(expression: str, name: str = "calculator") -> str:
    return (
        "<tool_call>\n"
        + json.dumps({"name": name, "arguments": {"expression": expression}})
        + "\n</tool_call>"
    )


def tool_call(name: str, arguments: Any) -> str:
    return (
        "<tool_call>\n"
        + json.dumps({"name": name, "arguments": arguments}, ensure_ascii=False)
        + "\n</tool_call>"
    )


ANSWER = "The answer is 449.\n#### 449"


def encode_turns(tok, turns: list[str | list[int]]) -> list[list[int]]:
    """Model turns as ids; a text ends with eos (the server stops there, unless a budget cuts it first); a
    list of ids is taken as it is (no eos: the server reports "length")."""
    return [
        t if isinstance(t, list) else tok.encode(t, add_special_tokens=False) + [tok.eos_token_id]
        for t in turns
    ]


class ReplayServer:
    """verl's server manager (LLMServerClient.generate) over scripted turns (ids), for one trajectory.

    Budget as verl's SGLang adapter: an explicit max_new_tokens/max_tokens, else min(R, P + R - len(prompt));
    clamped to the context left. Stops after a stop token (eos or stop_token_ids, included) and reports
    "stop", else "length". Logprobs are float32 values, as engines compute them, except on the turns in
    `no_logprobs`; extra_fields carry global_steps the way LLMServerClient fills them. Past the script's end
    it answers `after` (an error when None).
    """

    def __init__(
        self,
        turns: list[list[int]],
        *,
        eos: int,
        prompt_length: int,
        response_length: int,
        after: list[int] | None = None,
        no_logprobs: frozenset[int] = frozenset(),
        logprob_shortfall: frozenset[int] = frozenset(),
    ):
        self.turns, self.eos, self.after = turns, eos, after
        self.P, self.R = prompt_length, response_length
        self.no_logprobs, self.logprob_shortfall = no_logprobs, logprob_shortfall
        self.requests: list[dict[str, Any]] = []

    async def generate(
        self,
        request_id,
        *,
        prompt_ids,
        sampling_params,
        image_data=None,
        video_data=None,
        audio_data=None,
        mm_processor_kwargs=None,
        **kwargs,
    ):
        import numpy as np
        from verl.workers.rollout.replica import TokenOutput

        params = dict(sampling_params)
        k = len(self.requests)
        self.requests.append(
            {"request_id": request_id, "prompt_ids": list(prompt_ids), "params": dict(params)}
        )
        left = self.P + self.R - len(prompt_ids) - 1
        if "max_new_tokens" in params:
            limit = params.pop("max_new_tokens")
        elif "max_tokens" in params:
            limit = params.pop("max_tokens")
        else:
            limit = min(self.R, self.P + self.R - len(prompt_ids))
        limit = max(0, min(limit, left))
        stops = {self.eos, *(params.get("stop_token_ids") or ())}
        if k >= len(self.turns) and self.after is None:
            raise IndexError(f"the script has no turn {k}")
        ids: list[int] = []
        for tok in self.turns[k] if k < len(self.turns) else self.after:
            if len(ids) == limit:
                break
            ids.append(tok)
            if tok in stops:
                break
        logprobs = [float(np.float32(-0.01 * (k * 97 + i + 1))) for i in range(len(ids))]
        if k in self.logprob_shortfall:
            logprobs = logprobs[:-1]
        steps = 3 + k
        return TokenOutput(
            token_ids=ids,
            log_probs=logprobs if params.get("logprobs") and k not in self.no_logprobs else None,
            stop_reason="stop" if ids and ids[-1] in stops else "length",
            extra_fields={"global_steps": steps, "min_global_steps": steps, "max_global_steps": steps},
        )


# --- verl's side: tools, config, loops ----------------------------------------------------------------------

TOOLS_PY = '''
import ast, copy, operator

from verl.tools.base_tool import BaseTool
from verl.tools.schemas import ToolResponse

OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
       ast.Pow: operator.pow}


def evaluate(expression: str):
    def ev(node):
        if isinstance(node, ast.BinOp) and type(node.op) in OPS:
            return OPS[type(node.op)](ev(node.left), ev(node.right))
        if isinstance(node, ast.Constant) and isinstance(node.value, int):
            return node.value
        raise ValueError(f"unsupported expression {expression!r}")
    value = ev(ast.parse(expression, mode="eval").body)
    return int(value) if value == int(value) else value


class Calculator(BaseTool):
    """A verl BaseTool that counts its lifecycle calls."""

    def __init__(self, config, tool_schema):
        super().__init__(config, tool_schema)
        self.calls = {"create": 0, "execute": 0, "calc_reward": 0, "release": 0}

    async def create(self, instance_id=None, **kwargs):
        self.calls["create"] += 1
        return await super().create(instance_id, **kwargs)

    async def execute(self, instance_id, parameters, **kwargs):
        self.calls["execute"] += 1
        return ToolResponse(text=str(evaluate(parameters["expression"]))), 0.5, {}

    async def calc_reward(self, instance_id, **kwargs):
        self.calls["calc_reward"] += 1
        return 1.0

    async def release(self, instance_id, **kwargs):
        self.calls["release"] += 1


class Echo(BaseTool):
    """Answers its text (unicode, long: truncation) or, for {"fail": msg}, raises msg."""

    async def execute(self, instance_id, parameters, **kwargs):
        if "fail" in parameters:
            raise ValueError(parameters["fail"])
        return ToolResponse(text=parameters["text"]), 0.25, {}


class Blank(BaseTool):
    """`create` returns an empty instance id: verl passes it to execute and never releases it."""

    async def create(self, instance_id=None, **kwargs):
        return "", ToolResponse()

    async def execute(self, instance_id, parameters, **kwargs):
        return ToolResponse(text=f"id={instance_id!r} {parameters['text']}"), 0.5, {}

    async def release(self, instance_id, **kwargs):
        raise RuntimeError(f"release({instance_id!r}) of an instance that was never created")


class Tally(BaseTool):
    """Keeps a per-trajectory tally in agent_data.extra_fields (where verl documents tool session state) and
    reports what else it read from agent_data; the request id only as whether it is the loop's own."""

    async def execute(self, instance_id, parameters, **kwargs):
        data = kwargs["agent_data"]
        tally = data.extra_fields["tally"] = data.extra_fields.get("tally", 0) + parameters["add"]
        first = data.extra_fields.setdefault("request_id", data.request_id)
        data.extra_fields["messages_seen"] = copy.deepcopy(data.messages)  # verl's, exactly (the parity compares)
        text = (f"tally={tally} turns={data.assistant_turns}/{data.user_turns} messages={len(data.messages)} "
                f"context={len(data.prompt_ids)} last={len(data.response_ids)} mask={len(data.response_mask)} "
                f"kwargs={sorted(data.tools_kwargs)} same_request={first == data.request_id}")
        return ToolResponse(text=text), None, {}
'''

FUNCTION_TOOLS_PY = '''
from verl.tools.function_tool import function_tool

from parity_tools import evaluate


@function_tool("calculator")
def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression.

    Args:
        expression: The expression, e.g. "37 * 12 + 5".
    """
    return str(evaluate(expression))
'''

# The generated scripts' function tools (a file of their own: verl's registry is global and by name).
GEN_FUNCTION_TOOLS_PY = '''
from verl.tools.function_tool import function_tool
from verl.tools.schemas import ToolResponse


@function_tool
def echo(text: str) -> str:
    """Answer the text.

    Args:
        text: The text.
    """
    return text


@function_tool
def scale(x: int | float, factor: int | None = None) -> str:
    """Multiply a number.

    Args:
        x: The number.
        factor: The factor, 2 when null.
    """
    return str(x * (2 if factor is None else factor))


@function_tool
def odd(kind: str) -> str:
    """Answer in one of the shapes a function tool may return, odd ones included.

    Args:
        kind: Which shape.
    """
    shapes = {
        "quad": ("a", 1.0, {}, "x"), "empty": (), "nested": (("héllo", 1),), "empty_reward": ("x", ""),
        "text_reward": ("x", "1.5"), "word_reward": ("x", "high"), "none_reward": ("x", None, None),
        "bad_metrics": ("x", 1, 5), "pairs_metrics": ("x", 2, [("k", 1)]), "number": 3.5, "list": [1, "é"],
        "dict_in_tuple": ({"k": "ü"}, 2), "response": ToolResponse(text="tr é"), "none": None, "zero": (0, 0),
    }
    return shapes.get(kind, kind)


@function_tool
async def shout(text: str, fail: str = "") -> dict:
    """Answer the text in capitals, as JSON; raise `fail` when it is not empty.

    Args:
        text: The text.
        fail: An error to raise.
    """
    if fail:
        raise RuntimeError(fail)
    return {"upper": text.upper(), "len": len(text)}
'''

CALCULATOR_SCHEMA = """
      type: function
      function:
        name: calculator
        description: Evaluate an arithmetic expression.
        parameters:
          type: object
          properties:
            expression: {type: string, description: 'The expression, e.g. "37 * 12 + 5".'}
          required: [expression]"""

TOOLS_YAML = f"""
tools:
  - class_name: parity_tools.Calculator
    config: {{type: native}}
    tool_schema: {CALCULATOR_SCHEMA}
"""

# The generated scripts' BaseTools, declared out of alphabetical order (verl keeps the list's order).
GEN_TOOLS_YAML = (
    """
tools:
  - class_name: parity_tools.Tally
    config: {type: native}
    tool_schema:
      type: function
      function:
        name: tally
        description: Add to this conversation's tally.
        parameters:
          type: object
          properties:
            add: {type: [integer, number], description: How much to add.}
          required: [add]
  - class_name: parity_tools.Echo
    config: {type: native}
    tool_schema:
      type: function
      function:
        name: echo
        description: Answer the text.
        parameters:
          type: object
          properties:
            text: {type: string, description: The text.}
          required: [text]
  - class_name: parity_tools.Blank
    config: {type: native}
    tool_schema:
      type: function
      function:
        name: blank
        description: Answer with the instance id it was given.
        parameters:
          type: object
          properties:
            text: {type: string, description: The text.}
          required: [text]
"""
    + f"""  - class_name: parity_tools.Calculator
    config: {{type: native}}
    tool_schema: {CALCULATOR_SCHEMA}
"""
)


@functools.cache
def tool_dir() -> Path:
    """The tool modules and configs, written once per process and importable (as verl imports class_name)."""
    path = Path(tempfile.mkdtemp(prefix="verl_tools_"))
    for name, text in {
        "parity_tools.py": TOOLS_PY,
        "parity_function_tools.py": FUNCTION_TOOLS_PY,
        "gen_function_tools.py": GEN_FUNCTION_TOOLS_PY,
        "tools.yaml": TOOLS_YAML,
        "gen_tools.yaml": GEN_TOOLS_YAML,
    }.items():
        (path / name).write_text(text)
    sys.path.insert(0, str(path))
    return path


def load_tools(kind: str) -> list:
    """verl's worker does this once per worker: load_all_tools(tool_config_path, function_tool_path).
    kind: "base" / "function" (the calculator), "gen_base" / "gen_function" (the generated scripts' tools)."""
    from verl.tools.tool_registry import load_all_tools

    d = tool_dir()
    config = {"base": "tools.yaml", "gen_base": "gen_tools.yaml"}.get(kind)
    functions = {"function": "parity_function_tools.py", "gen_function": "gen_function_tools.py"}.get(kind)
    return load_all_tools(
        tool_config_path=str(d / config) if config else None,
        function_tool_path=str(d / functions) if functions else None,
    )


@functools.cache
def _default_config():
    """verl's generated default trainer config, parsed once (parsing it takes seconds; a copy, milliseconds)."""
    import importlib.resources

    from omegaconf import OmegaConf

    return OmegaConf.load(importlib.resources.files("verl.trainer.config") / "_generated_ppo_trainer.yaml")


def trainer_config(
    response_length: int, multi_turn: dict[str, Any] | None = None, *, prompt_length: int = PROMPT_LENGTH
):
    """verl's generated default trainer config with this case's rollout settings."""
    config = copy.deepcopy(_default_config())
    rollout = config.actor_rollout_ref.rollout
    rollout.name = "sglang"
    rollout.prompt_length = prompt_length
    rollout.response_length = response_length
    rollout.multi_turn.enable = True
    for key, value in (multi_turn or {}).items():
        rollout.multi_turn[key] = value
    return config


@functools.cache
def _shared_config():
    return copy.deepcopy(_default_config())


def reused_config(
    response_length: int, multi_turn: dict[str, Any] | None = None, *, prompt_length: int = PROMPT_LENGTH
):
    """trainer_config's settings on one config object, set in place: for loops run one after another (a
    loop reads its rollout config while it runs), without copying verl's large config for each."""
    config = _shared_config()
    rollout = config.actor_rollout_ref.rollout
    rollout.prompt_length = prompt_length
    rollout.response_length = response_length
    rollout.name = "sglang"
    rollout.multi_turn.enable = True
    defaults = _default_config().actor_rollout_ref.rollout.multi_turn
    for key in defaults:
        rollout.multi_turn[key] = (multi_turn or {}).get(key, defaults[key])
    return config


def instantiate(entry, config, server, tokenizer, tools):
    """Exactly AgentLoopWorker._run_agent_loop's instantiate call."""
    import hydra
    from verl.experimental.agent_loop.agent_loop import DictConfigWrap, ToolListWrap
    from verl.utils.dataset.rl_dataset import RLHFDataset

    return hydra.utils.instantiate(
        config=entry,
        trainer_config=DictConfigWrap(config=config),
        server_manager=server,
        tokenizer=tokenizer,
        processor=None,
        hf_model_type="qwen2",
        dataset_cls=RLHFDataset,
        data_config=DictConfigWrap(config.data),
        tools=ToolListWrap(tools),
    )


def entry_file(
    tmp_path: Path, limits: dict[str, Any], tool_policy: dict[str, Any] | None = None, spec: str = SPEC
) -> Path:
    """The documented agent_loop_config.yaml, with this case's overrides."""
    lines = ["- name: fsm_agent", "  _target_: fsm.adapters.verl.FSMAgentLoop", f"  spec: {spec}"]
    if limits:
        lines.append("  limits: " + json.dumps(limits))
    if tool_policy:
        lines.append("  tool_policy: " + json.dumps(tool_policy))
    path = tmp_path / "agent_loop_config.yaml"
    path.write_text("\n".join(lines) + "\n")
    return path


def fsm_entry(
    tmp_path: Path | None = None,
    limits: dict[str, Any] | None = None,
    tool_policy: dict[str, Any] | None = None,
    spec: str = SPEC,
):
    """The entry loaded as AgentLoopWorker loads agent_loop_config_path (from a file when `tmp_path` is given)."""
    from omegaconf import OmegaConf

    if tmp_path is None:
        entry = {"name": "fsm_agent", "_target_": "fsm.adapters.verl.FSMAgentLoop", "spec": spec}
        return OmegaConf.create(
            {
                **entry,
                **({"limits": limits} if limits else {}),
                **({"tool_policy": tool_policy} if tool_policy else {}),
            }
        )
    (entry,) = [
        cfg
        for cfg in OmegaConf.load(entry_file(tmp_path, limits or {}, tool_policy, spec))
        if cfg.name == "fsm_agent"
    ]
    return entry


def verl_entry():
    from verl.experimental.agent_loop.agent_loop import _agent_loop_registry

    return _agent_loop_registry["tool_agent"]


def row(question: str = "What is 37 * 12 + 5?", **fields: Any) -> dict[str, Any]:
    """A dataset row as the worker passes it to run(): every non-tensor column but agent_name."""
    return {
        "raw_prompt": [{"role": "user", "content": question}],
        "tools_kwargs": {},
        "extra_info": {"index": 0},
        "index": 0,
        "uid": "u0",
        "data_source": "calculator",
        "reward_model": {"ground_truth": "449"},
        "priority": 0,
        **fields,
    }


# --- running and comparing -----------------------------------------------------------------------------------


@dataclass
class Case:
    """One script. `multi_turn` configures verl's ToolAgentLoop, `limits` the same thing in the fsm_agent entry."""

    name: str
    turns: list  # model turns as text (each ends with eos unless the server cuts it) or as ids
    multi_turn: dict[str, Any] = field(default_factory=dict)
    limits: dict[str, Any] = field(default_factory=dict)
    tool_policy: dict[str, Any] = field(default_factory=dict)  # the entry's tool_policy overrides
    sampling: dict[str, Any] = field(default_factory=dict)  # added to both loops' sampling_params
    response_length: Any = None  # None: RESPONSE_LENGTH; else a function of the tokenizer (budget cuts)
    prompt_length: int = PROMPT_LENGTH
    reason: str = "done"  # agentfsm's termination_reason
    tools: str = "base"  # see load_tools
    row: dict[str, Any] = field(default_factory=dict)  # fields over row()'s
    server: dict[str, Any] = field(default_factory=dict)  # ReplayServer options (no_logprobs...)


@dataclass
class Pair:
    verl: Any  # AgentLoopOutput of verl's ToolAgentLoop
    fsm: Any  # AgentLoopOutput of fsm_agent
    verl_server: ReplayServer
    fsm_server: ReplayServer
    verl_tools: list
    fsm_tools: list
    R: int  # verl's rollout.response_length for this case


async def run_both(case: Case, tok, tmp_path: Path | None = None) -> Pair:
    """The same script through verl's ToolAgentLoop and through fsm_agent running specs/tool_agent.yaml."""
    R = (
        case.response_length(tok)
        if callable(case.response_length)
        else case.response_length or RESPONSE_LENGTH
    )
    turns = encode_turns(tok, case.turns)
    config = trainer_config(R, case.multi_turn, prompt_length=case.prompt_length)
    servers, outputs, tools = [], [], []
    for entry in (verl_entry(), fsm_entry(tmp_path, case.limits, case.tool_policy)):
        server = ReplayServer(
            turns, eos=tok.eos_token_id, prompt_length=case.prompt_length, response_length=R, **case.server
        )
        side_tools = load_tools(case.tools)
        loop = instantiate(entry, config, server, tok, side_tools)
        outputs.append(await loop.run(dict(SAMPLING, **case.sampling), **row(**case.row)))
        servers.append(server)
        tools.append(side_tools)
    return Pair(outputs[0], outputs[1], servers[0], servers[1], tools[0], tools[1], R)


def assert_identical(pair: Pair) -> None:
    """Every field verl trains on, and every extra field verl sets, is the same."""
    for name in FIELDS:
        assert getattr(pair.fsm, name) == getattr(pair.verl, name), name
    assert set(pair.fsm.extra_fields) - set(pair.verl.extra_fields) == set(OURS_ONLY)
    for key, value in pair.verl.extra_fields.items():  # server extras, tool state, turn_scores, tool_rewards
        if key == "request_id":  # the tally tool's record of agent_data.request_id: each loop's own
            assert value == pair.verl_server.requests[0]["request_id"]
            assert pair.fsm.extra_fields[key] == pair.fsm_server.requests[0]["request_id"]
            continue
        assert pair.fsm.extra_fields[key] == value, key
    assert pair.fsm.reward_score == pair.verl.reward_score
    assert pair.fsm.metrics.num_preempted == pair.verl.metrics.num_preempted


def assert_same_requests(pair: Pair, eos: int) -> None:
    """Each turn the model saw the same context; only the sampling params differ (documented in the spec)."""
    assert [r["prompt_ids"] for r in pair.fsm_server.requests] == [
        r["prompt_ids"] for r in pair.verl_server.requests
    ]
    for verl_req, fsm_req in zip(pair.verl_server.requests, pair.fsm_server.requests):
        assert "max_new_tokens" not in verl_req["params"] and "stop_token_ids" not in verl_req["params"]
        assert fsm_req["params"]["stop_token_ids"] == [eos]
        budget = pair.R - (len(fsm_req["prompt_ids"]) - len(pair.fsm.prompt_ids))
        cap = verl_req["params"].get("max_tokens")
        assert fsm_req["params"]["max_new_tokens"] == (budget if cap is None else min(budget, cap))
        common = {k: v for k, v in fsm_req["params"].items() if k not in ("max_new_tokens", "stop_token_ids")}
        assert common == {k: v for k, v in verl_req["params"].items() if k != "max_tokens"}
    assert len({r["request_id"] for r in pair.fsm_server.requests}) == 1  # one sticky id per trajectory


def split(output) -> list[tuple[int, list[int]]]:
    """response_ids as runs of equal mask: [(mask, ids), ...]."""
    runs: list[tuple[int, list[int]]] = []
    for tok_id, m in zip(output.response_ids, output.response_mask):
        if runs and runs[-1][0] == m:
            runs[-1][1].append(tok_id)
        else:
            runs.append((m, [tok_id]))
    return runs


def generated(output) -> list[list[int]]:
    return [ids for m, ids in split(output) if m == 1]


def observations(tok, output) -> list[str]:
    return [tok.decode(ids, skip_special_tokens=False) for m, ids in split(output) if m == 0]


# --- verl's worker postprocessing ---------------------------------------------------------------------------


@functools.cache
def model_dir() -> Path:
    """A model path for AgentLoopWorker: the tiny tokenizer and a qwen2 config (it loads both from there)."""
    model = tool_dir() / "model"
    model.mkdir()
    for f in ASSETS.iterdir():
        if f.is_file():  # the files of the shipped model (not its other checkpoints, in subfolders)
            (model / f.name).write_bytes(f.read_bytes())
    (model / "config.json").write_text(
        json.dumps(
            {
                "model_type": "qwen2",
                "architectures": ["Qwen2ForCausalLM"],
                "vocab_size": 576,
                "hidden_size": 128,
                "intermediate_size": 256,
                "num_hidden_layers": 4,
                "num_attention_heads": 8,
                "num_key_value_heads": 8,
                "tie_word_embeddings": True,
            }
        )
    )
    return model


@functools.cache
def worker():
    """One verl AgentLoopWorker (no server, no reward workers) for its postprocessing methods."""
    from verl.experimental.agent_loop.agent_loop import AgentLoopWorker

    config = trainer_config(RESPONSE_LENGTH)
    config.actor_rollout_ref.model.path = str(model_dir())
    return AgentLoopWorker(config, llm_client=None)


async def verl_batch(outputs: list, rows: list[dict[str, Any]], *, prompt_length: int, response_length: int):
    """AgentLoopWorker._agent_loop_postprocess per output, then _postprocess: verl's padded DataProto."""
    import dataclasses

    w = worker()
    w.rollout_config = dataclasses.replace(
        w.rollout_config, prompt_length=prompt_length, response_length=response_length
    )
    padded = [
        await w._agent_loop_postprocess(out.model_copy(deep=True), False, **r)
        for out, r in zip(outputs, rows)
    ]
    return w._postprocess(padded, input_non_tensor_batch=None, validate=False)


def as_trajectory(out):
    """An AgentLoopOutput as an agentfsm Trajectory (same ids, masks, logprobs, score), for fsm.collate."""
    from fsm.run.trajectory import Trajectory

    traj = Trajectory(0, 0, "s", "u", {"raw_prompt": []}, "PENDING")
    traj.prompt_ids.extend(out.prompt_ids)
    at = 0
    for mask, ids in split(out):
        if mask:
            lps = out.response_logprobs[at : at + len(ids)] if out.response_logprobs is not None else None
            traj.append_generated(ids, lps)
        else:
            traj.append_context(ids, "tool")
        at += len(ids)
    traj.reward_score = out.reward_score
    return traj


BATCH_KEYS = (
    "prompts",
    "responses",
    "response_mask",
    "input_ids",
    "attention_mask",
    "position_ids",
    "rollout_log_probs",
    "rm_scores",
)


def assert_native_collate_matches(
    batch, outputs: list, *, prompt_length: int, response_length: int, pad_token_id: int
) -> None:
    """fsm.collate of the same outputs gives verl's padded tensors, key for key."""
    import fsm

    logprobs = outputs[0].response_logprobs is not None
    ours = fsm.collate(
        [as_trajectory(o) for o in outputs],
        prompt_length=prompt_length,
        response_length=response_length,
        pad_token_id=pad_token_id,
        logprobs=logprobs,
    ).batch
    for key in BATCH_KEYS:
        assert (key in ours.keys()) == (key in batch.batch.keys()), key
        if key in ours.keys():
            assert ours[key].dtype == batch.batch[key].dtype, key
            assert ours[key].shape == batch.batch[key].shape, key
            assert (ours[key] == batch.batch[key]).all(), key
