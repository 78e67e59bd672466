"""Parity with verl 0.9.1's own ToolAgentLoop, through fsm.verl_adapter running specs/tool_agent.yaml.

Both loops are built the way verl's AgentLoopWorker builds them (`hydra.utils.instantiate` of the registered
entry with trainer_config, server_manager, tokenizer, processor, hf_model_type="qwen2", dataset_cls,
data_config, tools), from verl's generated default trainer config, with the same Qwen-style tokenizer and the
same tools loaded by verl's `load_all_tools`. The only double is `ReplayServer`, a server manager that follows
`LLMServerClient.generate`'s contract (SGLang adapter budget rules) and replays scripted model turns.

For each script the fields verl trains on must be identical: prompt_ids, response_ids, response_mask,
response_logprobs and num_turns (and the server-provided extra_fields, tool_rewards and turn_scores). Where
verl has a bug agentfsm deliberately does not copy, the test asserts the exact difference instead:

  - malformed_json: verl's hermes parser logs and drops a call whose JSON does not parse, and the loop ends
    as if the model had answered. agentfsm answers it with an error observation and the model goes on.
  - missing_arguments: verl drops a call without an "arguments" key (KeyError in its parser); agentfsm runs
    the argument check and answers "missing required argument(s) 'expression'".
  - parallel_calls: verl silently drops calls beyond max_parallel_calls; agentfsm answers each with an error
    observation (`limits.extra_calls: error`, the default; `drop` restores verl's behaviour, also tested).
  - cut_turn_then_tool: after a turn that stopped without eos (a per-turn cap), verl appends the tool turn
    right after the cut text; agentfsm first appends the template's `<|im_end|>\\n` (mask 0) so the tokens
    match a re-render of the conversation.
  - calc_reward: verl never calls BaseTool.calc_reward; agentfsm calls it after each successful execute and
    reports the values as extra_fields["tool_scores"].
  - requests: agentfsm sends an explicit per-turn max_new_tokens (the budget left) and eos in
    stop_token_ids; verl leaves both to the server. The prompts sent each turn are identical.
  - logprobs: agentfsm keeps them as float32 (4 bytes a token). Engines compute float32 logprobs, so the
    values are unchanged (the fake server returns float32 values too), and verl's batch is float32 anyway.

Run it with verl installed: `bash .ci/verl_env.sh && .venv-verl/bin/python -m pytest tests/test_verl_parity.py`.
Without verl every test but the import check is skipped.
"""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[1]
ASSETS = REPO / "backends" / "tiny" / "assets"
SPEC = "specs/tool_agent.yaml"
PROMPT_LENGTH = 512
RESPONSE_LENGTH = 256


def _verl_missing() -> str | None:
    """None when verl 0.9.1's agent loop imports here, else why the parity tests are skipped."""
    hint = "build its env with `bash .ci/verl_env.sh`, then run `.venv-verl/bin/python -m pytest tests/test_verl_parity.py`"
    try:
        import verl
        import verl.experimental.agent_loop  # noqa: F401
    except Exception as exc:  # ImportError, or a dependency of verl's import path that is missing/broken
        return f"verl is not importable here ({type(exc).__name__}: {exc}); {hint}"
    if verl.__version__ != "0.9.1":
        return f"the parity test is pinned to verl 0.9.1, found {verl.__version__}; {hint}"
    return None


VERL_MISSING = _verl_missing()
needs_verl = pytest.mark.skipif(VERL_MISSING is not None, reason=VERL_MISSING or "")


def test_importing_fsm_never_imports_verl():
    code = "import sys, fsm; bad = sorted(m for m in sys.modules if m == 'verl' or m.startswith(('verl.', 'fsm.verl'))); assert not bad, bad"
    subprocess.run([sys.executable, "-c", code], check=True, cwd=REPO)


# --- the model: scripted turns ---------------------------------------------------------------------------


def call(expression: str, name: str = "calculator") -> str:
    return (
        "<tool_call>\n"
        + json.dumps({"name": name, "arguments": {"expression": expression}})
        + "\n</tool_call>"
    )


ANSWER = "The answer is 449.\n#### 449"


@dataclass
class Case:
    """One script. `multi_turn` configures verl's ToolAgentLoop, `limits` the same thing in the fsm_agent entry."""

    name: str
    turns: list[str]  # model turns as text; each ends with eos unless the server cuts it
    multi_turn: dict[str, Any] = field(default_factory=dict)
    limits: dict[str, Any] = field(default_factory=dict)
    sampling: dict[str, Any] = field(default_factory=dict)  # added to both loops' sampling_params
    response_length: Any = None  # None: RESPONSE_LENGTH; else a function of the tokenizer (budget cuts)
    reason: str = "done"  # agentfsm's termination_reason
    tools: str = "base"  # "base": a verl BaseTool from tool_config_path; "function": a @function_tool


def _obs_overflow_budget(tok) -> int:
    """A response budget that holds the first call but not the tool turn that answers it."""
    return len(tok.encode(call("37 * 12 + 5"), add_special_tokens=False)) + 1 + 6


def _cut_mid_call_budget(tok) -> int:
    """A budget that holds call 1 and its tool turn (~20 tokens) but ends inside the second call."""
    return len(tok.encode(call("37 * 12"), add_special_tokens=False)) + 1 + 40


LONG_CALL = call("1 + 2 + 3 + 4 + 5 + 6 + 7 + 8 + 9 + 10 + 11 + 12 + 13 + 14 + 15 + 16 + 17")

IDENTICAL = [
    Case("tool_then_answer", [call("37 * 12 + 5"), ANSWER]),
    Case("function_tool", [call("37 * 12 + 5"), ANSWER], tools="function"),
    Case("two_tool_rounds", [call("37 * 12"), call("444 + 5"), ANSWER]),
    Case("unknown_tool", [call("37 * 12 + 5", name="calc"), call("37 * 12 + 5"), ANSWER]),
    Case("tool_raises", [call("1 / 0"), ANSWER]),
    Case(
        "budget_cut_before_tool_turn",
        [call("37 * 12 + 5"), ANSWER],
        response_length=_obs_overflow_budget,
        reason="response_length",
    ),
    Case(
        "budget_cut_mid_call",
        [call("37 * 12"), LONG_CALL, ANSWER],
        response_length=_cut_mid_call_budget,
        reason="response_length",
    ),
    Case(
        "max_assistant_turns",
        [call("1 + 1"), call("2 + 2"), call("3 + 3"), ANSWER],
        multi_turn={"max_assistant_turns": 2},
        limits={"max_assistant_turns": 2},
        reason="max_assistant_turns",
    ),
    Case(
        "max_user_turns",
        [call("1 + 1"), call("2 + 2"), call("3 + 3"), ANSWER],
        multi_turn={"max_user_turns": 1},
        limits={"max_user_turns": 1},
        reason="max_user_turns",
    ),
    Case(
        "parallel_calls_dropped",
        [call("37 * 12") + "\n" + call("444 + 5"), ANSWER],
        limits={"extra_calls": "drop"},
    ),
    Case(
        "truncated_tool_output",
        [call("7 ** 400"), ANSWER],
        multi_turn={"max_tool_response_length": 40, "tool_response_truncate_side": "left"},
        limits={"max_tool_response_length": 40, "tool_response_truncate_side": "left"},
    ),
]


# --- verl's side: tools, config, the server manager double -----------------------------------------------

TOOLS_PY = '''
import ast, operator

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

TOOLS_YAML = """
tools:
  - class_name: parity_tools.Calculator
    config: {type: native}
    tool_schema:
      type: function
      function:
        name: calculator
        description: Evaluate an arithmetic expression.
        parameters:
          type: object
          properties:
            expression: {type: string, description: 'The expression, e.g. "37 * 12 + 5".'}
          required: [expression]
"""


class ReplayServer:
    """verl's server manager (LLMServerClient.generate) over scripted turns, for one trajectory.

    Budget as verl's SGLang adapter: an explicit max_new_tokens/max_tokens, else min(R, P + R - len(prompt));
    clamped to the context left. Stops after eos or a stop_token_ids match (the stop token included).
    Logprobs are float32 values, as engines compute them; extra_fields carry global_steps the way
    LLMServerClient fills them.
    """

    def __init__(self, turns: list[list[int]], *, eos: int, prompt_length: int, response_length: int):
        self.turns, self.eos = turns, eos
        self.P, self.R = prompt_length, response_length
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
        ids: list[int] = []
        for tok in self.turns[k]:
            if len(ids) == limit:
                break
            ids.append(tok)
            if tok in stops:
                break
        logprobs = [float(np.float32(-0.01 * (k * 97 + i + 1))) for i in range(len(ids))]
        steps = 3 + k
        return TokenOutput(
            token_ids=ids,
            log_probs=logprobs if params.get("logprobs") else None,
            stop_reason="stop" if ids and ids[-1] in stops else "length",
            extra_fields={"global_steps": steps, "min_global_steps": steps, "max_global_steps": steps},
        )


if VERL_MISSING is None:

    @pytest.fixture(scope="module")
    def tok():
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(ASSETS)

    @pytest.fixture(scope="module")
    def tool_dir(tmp_path_factory):
        path = tmp_path_factory.mktemp("verl_tools")
        (path / "parity_tools.py").write_text(TOOLS_PY)
        (path / "parity_function_tools.py").write_text(FUNCTION_TOOLS_PY)
        (path / "tools.yaml").write_text(TOOLS_YAML)
        sys.path.insert(0, str(path))
        yield path
        sys.path.remove(str(path))


def load_tools(tool_dir: Path, kind: str) -> list:
    """verl's worker does this once per worker: load_all_tools(tool_config_path, function_tool_path)."""
    from verl.tools.tool_registry import load_all_tools

    if kind == "function":
        return load_all_tools(
            tool_config_path=None, function_tool_path=str(tool_dir / "parity_function_tools.py")
        )
    return load_all_tools(tool_config_path=str(tool_dir / "tools.yaml"), function_tool_path=None)


def trainer_config(response_length: int, multi_turn: dict[str, Any]):
    """verl's generated default trainer config with this case's rollout settings."""
    import importlib.resources

    from omegaconf import OmegaConf

    config = OmegaConf.load(importlib.resources.files("verl.trainer.config") / "_generated_ppo_trainer.yaml")
    rollout = config.actor_rollout_ref.rollout
    rollout.name = "sglang"
    rollout.prompt_length = PROMPT_LENGTH
    rollout.response_length = response_length
    rollout.multi_turn.enable = True
    for key, value in multi_turn.items():
        rollout.multi_turn[key] = value
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


def entry_file(tmp_path: Path, limits: dict[str, Any]) -> Path:
    """The documented agent_loop_config.yaml, with this case's limit overrides."""
    lines = ["- name: fsm_agent", "  _target_: fsm.verl_adapter.FSMAgentLoop", f"  spec: {SPEC}"]
    if limits:
        lines.append("  limits: " + json.dumps(limits))
    path = tmp_path / "agent_loop_config.yaml"
    path.write_text("\n".join(lines) + "\n")
    return path


def fsm_entry(tmp_path: Path, limits: dict[str, Any]):
    """The entry loaded as AgentLoopWorker loads agent_loop_config_path."""
    from omegaconf import OmegaConf

    (entry,) = [cfg for cfg in OmegaConf.load(entry_file(tmp_path, limits)) if cfg.name == "fsm_agent"]
    return entry


def row() -> dict[str, Any]:
    """A dataset row as the worker passes it to run(): every non-tensor column but agent_name."""
    return {
        "raw_prompt": [{"role": "user", "content": "What is 37 * 12 + 5?"}],
        "tools_kwargs": {},
        "extra_info": {"index": 0},
        "index": 0,
        "uid": "u0",
        "data_source": "calculator",
        "reward_model": {"ground_truth": "449"},
        "priority": 0,
    }


SAMPLING = {"temperature": 1.0, "top_p": 1.0, "top_k": -1, "repetition_penalty": 1.0, "logprobs": True}


@dataclass
class Pair:
    verl: Any  # AgentLoopOutput of verl's ToolAgentLoop
    fsm: Any  # AgentLoopOutput of fsm_agent
    verl_server: ReplayServer
    fsm_server: ReplayServer
    verl_tools: list
    fsm_tools: list
    R: int  # verl's rollout.response_length for this case


async def run_both(case: Case, tok, tool_dir: Path, tmp_path: Path) -> Pair:
    """The same script through verl's ToolAgentLoop and through fsm_agent running specs/tool_agent.yaml."""
    from verl.experimental.agent_loop.agent_loop import _agent_loop_registry

    R = (
        case.response_length(tok)
        if callable(case.response_length)
        else case.response_length or RESPONSE_LENGTH
    )
    turns = [tok.encode(text, add_special_tokens=False) + [tok.eos_token_id] for text in case.turns]
    config = trainer_config(R, case.multi_turn)
    servers, outputs, tools = [], [], []
    for entry in (_agent_loop_registry["tool_agent"], fsm_entry(tmp_path, case.limits)):
        server = ReplayServer(turns, eos=tok.eos_token_id, prompt_length=PROMPT_LENGTH, response_length=R)
        side_tools = load_tools(tool_dir, case.tools)
        loop = instantiate(entry, config, server, tok, side_tools)
        outputs.append(await loop.run(dict(SAMPLING, **case.sampling), **row()))
        servers.append(server)
        tools.append(side_tools)
    return Pair(outputs[0], outputs[1], servers[0], servers[1], tools[0], tools[1], R)


FIELDS = ("prompt_ids", "response_ids", "response_mask", "response_logprobs", "num_turns")


def assert_same_requests(pair: Pair, eos: int) -> None:
    """Each turn the model saw the same context; only the sampling params differ (documented above)."""
    assert [r["prompt_ids"] for r in pair.fsm_server.requests] == [
        r["prompt_ids"] for r in pair.verl_server.requests
    ]
    for verl_req, fsm_req in zip(pair.verl_server.requests, pair.fsm_server.requests):
        assert "max_new_tokens" not in verl_req["params"] and "stop_token_ids" not in verl_req["params"]
        assert fsm_req["params"]["stop_token_ids"] == [eos]
        assert fsm_req["params"]["max_new_tokens"] == pair.R - (
            len(fsm_req["prompt_ids"]) - len(pair.fsm.prompt_ids)
        )
        common = {k: v for k, v in fsm_req["params"].items() if k not in ("max_new_tokens", "stop_token_ids")}
        assert common == verl_req["params"]
    assert len({r["request_id"] for r in pair.fsm_server.requests}) == 1  # one sticky id per trajectory


@needs_verl
@pytest.mark.parametrize("case", IDENTICAL, ids=[c.name for c in IDENTICAL])
async def test_identical_to_verl_tool_agent_loop(case: Case, tok, tool_dir, tmp_path):
    pair = await run_both(case, tok, tool_dir, tmp_path)
    for name in FIELDS:
        assert getattr(pair.fsm, name) == getattr(pair.verl, name), name
    assert pair.verl.response_logprobs is not None and len(pair.verl.response_logprobs) == len(
        pair.verl.response_ids
    )
    for key, value in pair.verl.extra_fields.items():  # server extras, turn_scores, tool_rewards
        assert pair.fsm.extra_fields[key] == value, key
    assert pair.fsm.reward_score is None and pair.verl.reward_score is None  # the spec has no reward
    assert pair.fsm.metrics.num_preempted == pair.verl.metrics.num_preempted
    assert pair.fsm.extra_fields["termination_reason"] == case.reason  # verl records none
    assert_same_requests(pair, tok.eos_token_id)
    assert len(pair.fsm.response_ids) <= pair.R
    if case.reason == "response_length":
        R, ids = pair.R, pair.verl.response_ids
        if case.name == "budget_cut_mid_call":  # the cut lands inside the second call: it never runs
            assert len(ids) == R and pair.verl.response_mask[-1] == 1 and len(pair.verl_server.requests) == 2
        else:  # the tool turn did not fit, so neither loop appended it
            assert pair.verl.response_mask[-1] == 1 and pair.verl.num_turns == 2
    if case.tools == "base":
        verl_calls, fsm_calls = pair.verl_tools[0].calls, pair.fsm_tools[0].calls
        for step in ("create", "execute", "release"):  # verl's per-call lifecycle, on both sides
            assert fsm_calls[step] == verl_calls[step], step
        # Documented difference: verl never calls calc_reward; agentfsm calls it after each successful execute.
        assert verl_calls["calc_reward"] == 0
        executed_ok = len(pair.fsm.extra_fields["tool_scores"])
        assert (
            fsm_calls["calc_reward"] == executed_ok
            and pair.fsm.extra_fields["tool_scores"] == [1.0] * executed_ok
        )


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


@needs_verl
@pytest.mark.parametrize(
    "bad",
    [
        '{"name": "calculator", "arguments": {"expression": "37 *}',
        '{"name": "calculator", "expression": "37 * 12 + 5"}',
    ],
    ids=["malformed_json", "missing_arguments"],
)
async def test_malformed_call_is_answered_not_dropped(bad: str, tok, tool_dir, tmp_path):
    """verl drops the call and ends the trajectory as if the model had answered; agentfsm tells the model."""
    case = Case("malformed", ["<tool_call>\n" + bad + "\n</tool_call>", ANSWER])
    pair = await run_both(case, tok, tool_dir, tmp_path)
    first = tok.encode(case.turns[0], add_special_tokens=False) + [tok.eos_token_id]
    # verl: one turn, ended; no tool ran, no observation.
    assert (
        pair.verl.response_ids == first and pair.verl.num_turns == 2 and len(pair.verl_server.requests) == 1
    )
    # agentfsm: the same first turn, then an error observation (mask 0), then the model's next turn.
    assert pair.fsm.prompt_ids == pair.verl.prompt_ids
    assert pair.fsm.response_ids[: len(first)] == pair.verl.response_ids
    assert pair.fsm.response_logprobs[: len(first)] == pair.verl.response_logprobs
    assert generated(pair.fsm) == [first, tok.encode(ANSWER, add_special_tokens=False) + [tok.eos_token_id]]
    (obs,) = observations(tok, pair.fsm)
    expected = "Invalid JSON in tool call" if "37 *}" in bad else "missing required argument(s) 'expression'"
    assert obs.startswith("\n<|im_start|>user\n<tool_response>\nError") and expected in obs
    assert pair.fsm.num_turns == 4 and pair.fsm.extra_fields["termination_reason"] == "done"
    assert pair.fsm_tools[0].calls["execute"] == 0  # a malformed call never reaches the tool


@needs_verl
async def test_extra_parallel_calls_are_answered_not_dropped(tok, tool_dir, tmp_path):
    """max_parallel_calls=1 and two calls in a turn: verl runs the first and silently drops the second."""
    case = Case("parallel_calls", [call("37 * 12") + "\n" + call("444 + 5"), ANSWER])
    pair = await run_both(case, tok, tool_dir, tmp_path)
    assert pair.fsm.prompt_ids == pair.verl.prompt_ids and pair.fsm.num_turns == pair.verl.num_turns == 4
    # The model's tokens agree; only the observation differs.
    assert generated(pair.fsm) == generated(pair.verl)
    (verl_obs,) = observations(tok, pair.verl)
    (fsm_obs,) = observations(tok, pair.fsm)
    assert "<tool_response>\n444\n</tool_response>" in verl_obs and "449" not in verl_obs
    first_result = verl_obs.split("<|im_end|>\n<|im_start|>assistant")[0]
    assert fsm_obs.startswith(first_result)  # the first call's result, as in verl, then the second's answer:
    assert (
        "Error: too many tool calls in one turn; at most 1 run per turn, so the call to 'calculator' "
        "was not executed." in fsm_obs
    )
    assert pair.verl_tools[0].calls["execute"] == pair.fsm_tools[0].calls["execute"] == 1


@needs_verl
async def test_turn_cut_before_a_tool_round_gets_its_closer(tok, tool_dir, tmp_path):
    """A turn that stops without eos (here at a per-turn max_tokens, after a complete call), then a tool round:
    verl appends the tool turn straight after the cut text; agentfsm first appends `<|im_end|>\\n` (mask 0),
    the tokens a re-render of the conversation has there."""
    first = call("37 * 12 + 5")
    cap = len(tok.encode(first, add_special_tokens=False)) + 3
    case = Case(
        "cut_turn_then_tool",
        [first + " and then some more words that get cut", ANSWER],
        sampling={"max_tokens": cap},
    )
    pair = await run_both(case, tok, tool_dir, tmp_path)
    closer = [tok.eos_token_id] + tok.encode("\n", add_special_tokens=False)
    n = cap  # the cut first turn, identical on both sides
    assert (
        pair.fsm.response_ids[:n] == pair.verl.response_ids[:n]
        and pair.verl.response_ids[n - 1] != tok.eos_token_id
    )
    assert pair.fsm.response_ids[n : n + 2] == closer and pair.fsm.response_mask[n : n + 2] == [0, 0]
    assert pair.fsm.response_logprobs[n : n + 2] == [0.0, 0.0]
    # Everything after the inserted closer is verl's trajectory shifted by two tokens.
    for name in ("response_ids", "response_mask", "response_logprobs"):
        ours, theirs = getattr(pair.fsm, name), getattr(pair.verl, name)
        assert ours[:n] + ours[n + 2 :] == theirs, name
    assert pair.fsm.num_turns == pair.verl.num_turns == 4
    # The model saw the closer too: agentfsm's second request is verl's plus the two template tokens.
    verl_second, fsm_second = (
        pair.verl_server.requests[1]["prompt_ids"],
        pair.fsm_server.requests[1]["prompt_ids"],
    )
    k = len(pair.verl.prompt_ids) + n
    assert fsm_second[:k] + fsm_second[k + 2 :] == verl_second and fsm_second[k : k + 2] == closer


class RoutingServer:
    """One server manager for a whole worker batch: each trajectory (request_id) replays the script of the
    question in its prompt."""

    def __init__(self, tok, scripts: dict[str, list[str]], *, response_length: int):
        self.tok, self.R = tok, response_length
        self.scripts = {
            q: [tok.encode(t, add_special_tokens=False) + [tok.eos_token_id] for t in turns]
            for q, turns in scripts.items()
        }
        self.sessions: dict[str, ReplayServer] = {}

    async def generate(self, request_id, *, prompt_ids, sampling_params, **kwargs):
        if request_id not in self.sessions:
            text = self.tok.decode(prompt_ids)
            (question,) = [q for q in self.scripts if q in text]
            self.sessions[request_id] = ReplayServer(
                self.scripts[question],
                eos=self.tok.eos_token_id,
                prompt_length=PROMPT_LENGTH,
                response_length=self.R,
            )
        return await self.sessions[request_id].generate(
            request_id, prompt_ids=prompt_ids, sampling_params=sampling_params, **kwargs
        )


@needs_verl
async def test_verl_worker_batch_has_identical_rows(tok, tool_dir, tmp_path):
    """verl's own AgentLoopWorker (agent_loop_config_path, tool_config_path, per-sample hydra instantiate,
    padding) over a batch that mixes agent_name tool_agent and fsm_agent rows: each fsm_agent row of the
    padded batch equals its tool_agent twin."""
    import numpy as np
    from verl.experimental.agent_loop.agent_loop import AgentLoopWorker
    from verl.protocol import DataProto

    model = tmp_path / "model"  # the worker loads tokenizer and hf_config from the model path
    model.mkdir()
    for f in ASSETS.iterdir():
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
    config = trainer_config(RESPONSE_LENGTH, {"tool_config_path": str(tool_dir / "tools.yaml")})
    config.actor_rollout_ref.model.path = str(model)
    config.actor_rollout_ref.rollout.agent.agent_loop_config_path = str(entry_file(tmp_path, {}))
    scripts = {
        f"What is {q}?": turns
        for q, turns in [
            ("37 * 12 + 5", [call("37 * 12 + 5"), ANSWER]),
            ("444 + 5", [call("37 * 12"), call("444 + 5"), ANSWER]),
            ("7 - 7", [call("7 - 7", name="calc"), call("1 / 0"), ANSWER]),
            ("1 + 1", [ANSWER]),
        ]
    }
    server = RoutingServer(tok, scripts, response_length=RESPONSE_LENGTH)
    worker = AgentLoopWorker(config, llm_client=server)
    questions = list(scripts) * 2
    agents = ["tool_agent"] * len(scripts) + ["fsm_agent"] * len(scripts)

    def column(values):
        out = np.empty(len(values), dtype=object)
        out[:] = values
        return out

    batch = DataProto(
        non_tensor_batch={
            "raw_prompt": column([[{"role": "user", "content": q}] for q in questions]),
            "agent_name": column(agents),
            "tools_kwargs": column([{} for _ in questions]),
            "extra_info": column([{"index": i % len(scripts)} for i in range(len(questions))]),
            "index": np.arange(len(questions)) % len(scripts),
            "uid": column([f"u{i % len(scripts)}" for i in range(len(questions))]),
        },
        meta_info={"global_steps": 1},
    )
    out = await worker.generate_sequences(batch)
    n = len(scripts)
    for key, value in out.batch.items():
        assert (value[:n] == value[n:]).all(), key
    assert value.shape[0] == 2 * n
    assert (
        out.batch["responses"].shape[1] == RESPONSE_LENGTH and out.batch["prompts"].shape[1] == PROMPT_LENGTH
    )
    assert set(out.batch.keys()) >= {
        "prompts",
        "responses",
        "response_mask",
        "input_ids",
        "attention_mask",
        "position_ids",
        "rollout_log_probs",
    }
    turns = out.non_tensor_batch["__num_turns__"]
    assert list(turns[:n]) == list(turns[n:]) == [4, 6, 6, 2]
    assert list(out.non_tensor_batch["termination_reason"]) == [None] * n + ["done"] * n
    assert list(out.non_tensor_batch["tool_rewards"][n:]) == list(out.non_tensor_batch["tool_rewards"][:n])


@needs_verl
def test_config_entry_errors_and_caching(tok, tool_dir, tmp_path):
    """The spec is compiled once per process; batch shapes belong to verl's rollout config."""
    from fsm import verl_adapter

    config = trainer_config(RESPONSE_LENGTH, {})
    server = ReplayServer(
        [], eos=tok.eos_token_id, prompt_length=PROMPT_LENGTH, response_length=RESPONSE_LENGTH
    )
    tools = load_tools(tool_dir, "base")
    a = instantiate(fsm_entry(tmp_path, {}), config, server, tok, tools)
    b = instantiate(fsm_entry(tmp_path, {}), config, server, tok, tools)
    assert a.agent is b.agent  # compiled once per (spec, overrides, P, R), tools bound once per worker list
    assert a.agent.limits.response_length == RESPONSE_LENGTH and a.agent.limits.prompt_length == PROMPT_LENGTH
    assert list(a.agent.tools.by_name) == ["calculator"] and a.codec is b.codec
    from hydra.errors import InstantiationException

    with pytest.raises(InstantiationException, match=r"set actor_rollout_ref\.rollout\.response_length"):
        instantiate(fsm_entry(tmp_path, {"response_length": 64}), config, server, tok, [])
    with pytest.raises(FileNotFoundError, match="nope.yaml"):
        verl_adapter.resolve_spec_path("nope.yaml")
