"""verl 0.7.1 parity: INTERACTING, token for token.

verl 0.7.1 (on the package index) is the last release whose ToolAgentLoop has `AgentState.INTERACTING`, the
loop the seed articles describe. Hypothesis writes conversations: model turns (unicode, cut without eos,
empty, sometimes a tool call), the simulated user's replies, scores and the turn it stops at, turn limits, and
response budgets that end before, at, one past or inside a turn. Each runs through verl 0.7.1's ToolAgentLoop
(a ReplayServer script, an interaction config) and through agentfsm's engine on the same script, with:

  specs/interaction_agent.yaml + `turn_closer: none`
  specs/tool_agent.yaml + the same interaction, `interaction.final_reply: append`, `reply_overflow: cut`
  and `turn_closer: none` (its INTERACTING path, tool rounds included)

and the two must give the same prompt_ids, response_ids, response_mask, response_logprobs, num_turns and
turn_scores. The simulated user's replies carry a digest of the messages it received, so what the
interaction sees is compared too. Three documented differences are allowed, each where verl loses data:

  spent_turn           after a reply that filled the response budget, verl asks the server for one more turn,
                       whose tokens are then cut away, and counts it in num_turns; agentfsm stops without
                       asking (applied to verl's side: `SpentBudgetTurn`).
  empty_response       a response with no token at all is verl's whole prompt (`prompt_ids[-0:]`) with
                       logprobs None, as in verl 0.9.1; agentfsm's is empty, logprobs [].
  empty_turn_logprobs  verl's logprob list starts at the first model turn with tokens: after an empty first
                       turn it is None or shorter than the response (misaligned); agentfsm's is aligned (the
                       comparison takes agentfsm's from the first generated token).

Run it in verl 0.7.1's environment: `VERL_VERSION=0.7.1 bash .ci/verl_env.sh &&
.venv-verl07/bin/python -m pytest tests/verl07`. Elsewhere it is skipped.
"""

from __future__ import annotations

import asyncio
import collections
import json
import os
import sys
import textwrap
from pathlib import Path

import pytest

verl = pytest.importorskip("verl")
if verl.__version__ != "0.7.1":
    pytest.skip(f"needs verl 0.7.1 (.venv-verl07), found {verl.__version__}", allow_module_level=True)

from hypothesis import HealthCheck, event, example, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

import fsm  # noqa: E402
from backends.scripted import ScriptedBackend  # noqa: E402
from tests.conftest import SPECS  # noqa: E402

MIN_EXAMPLES = int(os.environ.get("AGENTFSM_PARITY_EXAMPLES", "200"))
P = 512
SAMPLING = {"temperature": 1.0, "top_p": 1.0, "repetition_penalty": 1.0, "logprobs": True}

INTERACTION_PY = '''
import json, zlib

from verl.interactions.base import BaseInteraction


class Script(BaseInteraction):
    """Replies from interaction_kwargs, each ending with a digest of the messages it was given."""

    def __init__(self, config):
        super().__init__(config)
        self.turn = {}

    async def generate_response(self, instance_id, messages, **kwargs):
        k = self.turn[instance_id] = self.turn.get(instance_id, -1) + 1
        digest = zlib.crc32(json.dumps(messages, sort_keys=True, ensure_ascii=False).encode())
        reply = kwargs["replies"][k % len(kwargs["replies"])] + f" #{digest % 997}"
        score = kwargs["scores"][k % len(kwargs["scores"])]
        return kwargs["stop_after"] is not None and k + 1 >= kwargs["stop_after"], reply, score, {}
'''

ECHO_PY = '''
from verl.tools.schemas import ToolResponse


class Echo:
    """verl's BaseTool lifecycle; built by verl with a schema model, by agentfsm with a dict."""

    def __init__(self, config, tool_schema):
        self.config, self.tool_schema = config, tool_schema
        self.name = tool_schema["function"]["name"] if isinstance(tool_schema, dict) else tool_schema.function.name

    async def create(self, instance_id=None, **kwargs):
        return instance_id or "echo-1", ToolResponse()

    async def execute(self, instance_id, parameters, **kwargs):
        return ToolResponse(text="heard " + parameters["text"]), 0.5, {}

    async def calc_reward(self, instance_id, **kwargs):
        return 0.0

    async def release(self, instance_id, **kwargs):
        return None
'''

ECHO_SCHEMA = {
    "type": "function",
    "function": {
        "name": "echo",
        "description": "Answer the text.",
        "parameters": {
            "type": "object",
            "properties": {"text": {"type": "string", "description": "The text."}},
            "required": ["text"],
        },
    },
}


@pytest.fixture(scope="module")
def parts(tmp_path_factory) -> Path:
    """The interaction and tool modules, verl's config files for them, and agentfsm's two specs."""
    d = tmp_path_factory.mktemp("verl07")
    (d / "v07_interaction.py").write_text(INTERACTION_PY)
    (d / "v07_tools.py").write_text(ECHO_PY)
    (d / "interaction.yaml").write_text(
        "interaction:\n  - name: script\n    class_name: v07_interaction.Script\n    config: {}\n"
    )
    (d / "tools.yaml").write_text(
        json.dumps(
            {
                "tools": [
                    {"class_name": "v07_tools.Echo", "config": {"type": "native"}, "tool_schema": ECHO_SCHEMA}
                ]
            }
        )
    )
    common = """
        interaction:
          class: v07_interaction:Script
          final_reply: append
          reply_overflow: cut
        turn_closer: none
    """
    (d / "talk.yaml").write_text(
        f"name: talk\nextends: {SPECS}/interaction_agent.yaml\n" + textwrap.dedent(common)
    )
    tools = f"""
        tools:
          - class: v07_tools:Echo
            schema: {json.dumps(ECHO_SCHEMA)}
    """
    (d / "tools_talk.yaml").write_text(
        f"name: tools_talk\nextends: {SPECS}/tool_agent.yaml\n"
        + textwrap.dedent(common)
        + textwrap.dedent(tools)
    )
    sys.path.insert(0, str(d))
    return d


class ReplayServer:
    """verl 0.7.1's SGLang server (async_sglang_server.generate) over scripted turns: max_new_tokens is
    min(R, P + R - len(prompt)) unless given, clamped to the context left; stops after eos."""

    def __init__(self, turns: list[list[int]], eos: int, R: int):
        self.turns, self.eos, self.R, self.requests = turns, eos, R, 0

    async def generate(self, request_id, *, prompt_ids, sampling_params, image_data=None, video_data=None):
        from verl.workers.rollout.replica import TokenOutput

        k, self.requests = self.requests, self.requests + 1
        limit = max(0, min(self.R, P + self.R - len(prompt_ids), P + self.R - len(prompt_ids)))
        ids: list[int] = []
        for tok in self.turns[k] if k < len(self.turns) else [self.eos]:
            if len(ids) == limit:
                break
            ids.append(tok)
            if tok == self.eos:
                break
        return TokenOutput(token_ids=ids, log_probs=[logprob(k, i) for i in range(len(ids))])


def logprob(turn: int, i: int) -> float:
    import numpy as np

    return float(np.float32(-0.01 * (turn * 97 + i + 1)))


def verl_loop(parts: Path, tok, server: ReplayServer, scn: dict):
    """verl 0.7.1's ToolAgentLoop, built as its AgentLoopWorker builds it, with SpentBudgetTurn applied."""
    import importlib.resources

    from omegaconf import OmegaConf
    from verl.experimental.agent_loop.agent_loop import DictConfigWrap
    from verl.experimental.agent_loop.tool_agent_loop import AgentState, ToolAgentLoop
    from verl.utils.dataset.rl_dataset import RLHFDataset

    class SpentBudgetTurn(ToolAgentLoop):
        fired = False

        async def _handle_generating_state(self, agent_data, sampling_params, ignore_termination=False):
            if len(agent_data.response_mask) >= self.response_length:
                SpentBudgetTurn.fired = True
                return AgentState.TERMINATED
            return await super()._handle_generating_state(agent_data, sampling_params, ignore_termination)

    config = OmegaConf.load(importlib.resources.files("verl.trainer.config") / "_generated_ppo_trainer.yaml")
    rollout = config.actor_rollout_ref.rollout
    rollout.prompt_length, rollout.response_length = P, scn["R"]
    mt = rollout.multi_turn
    mt.enable, mt.interaction_config_path = True, str(parts / "interaction.yaml")
    mt.max_user_turns, mt.max_assistant_turns = scn["max_user_turns"], scn["max_assistant_turns"]
    mt.max_tool_response_length = min(scn["R"], 256)  # middle truncation: verl 0.7.1's is agentfsm's
    mt.tool_config_path = str(parts / "tools.yaml") if scn["spec"] == "tools_talk" else None
    SpentBudgetTurn.fired = False
    return SpentBudgetTurn(
        trainer_config=DictConfigWrap(config=config),
        server_manager=server,
        tokenizer=tok,
        processor=None,
        dataset_cls=RLHFDataset,
        data_config=DictConfigWrap(config.data),
    )


def fsm_agent(parts: Path, scn: dict) -> fsm.CompiledAgent:
    limits = {
        "prompt_length": P,
        "response_length": scn["R"],
        "max_user_turns": scn["max_user_turns"],
        "max_assistant_turns": scn["max_assistant_turns"],
        "max_tool_response_length": min(scn["R"], 256),
    }
    path = parts / f"{scn['spec']}_run.yaml"
    path.write_text(f"name: run\nextends: {scn['spec']}.yaml\nlimits: {json.dumps(limits)}\n")
    return fsm.compile_spec(path)


def row(scn: dict) -> dict:
    kwargs = {
        "name": "script",
        "replies": scn["replies"],
        "scores": scn["scores"],
        "stop_after": scn["stop_after"],
    }
    return {
        "raw_prompt": [{"role": "user", "content": scn["question"]}],
        "tools_kwargs": {},
        "extra_info": {"index": 0, "interaction_kwargs": kwargs},
    }


def run_both(parts: Path, tok, scn: dict):
    turns = [
        tok.encode(text, add_special_tokens=False) + ([tok.eos_token_id] if eos else [])
        for text, eos in scn["turns"]
    ]
    server = ReplayServer(turns, tok.eos_token_id, scn["R"])

    async def verl_side():  # verl's loop keeps the event loop it was built in
        loop = verl_loop(parts, tok, server, scn)
        return await loop.run(dict(SAMPLING), **json.loads(json.dumps(row(scn)))), type(loop).fired

    theirs, spent = asyncio.run(verl_side())
    fired = {"spent_turn"} if spent else set()
    backend = ScriptedBackend(
        lambda session, k, prompt: turns[k] if k < len(turns) else [tok.eos_token_id], logprob=logprob
    )  # past the script: eos, as ReplayServer answers
    (ours,) = asyncio.run(fsm.Runner(fsm_agent(parts, scn), backend, tok).run([row(scn)]))
    assert not ours.failed, ours.error
    return theirs, ours.to_output(), fired


def assert_same(theirs, ours: dict, fired: set[str]) -> None:
    assert ours["prompt_ids"] == theirs.prompt_ids, "prompt_ids"
    assert ours["extra_fields"]["turn_scores"] == theirs.extra_fields["turn_scores"], "turn_scores"
    assert ours["num_turns"] == theirs.num_turns, "num_turns"
    response_ids = theirs.response_ids
    if not theirs.response_mask and response_ids:
        fired.add("empty_response")  # verl: prompt_ids[-0:], the whole prompt
        response_ids = []
    assert ours["response_ids"] == response_ids, "response_ids"
    assert ours["response_mask"] == theirs.response_mask, "response_mask"
    logprobs = ours["response_logprobs"]
    if not theirs.response_mask:  # no token at all: verl None, agentfsm [] (as against verl 0.9.1)
        fired.add("empty_response")
        assert logprobs == [] and theirs.response_logprobs is None, "response_logprobs"
        return
    first = next((i for i, m in enumerate(ours["response_mask"]) if m), None)  # the first generated token
    if first != 0 and theirs.response_mask:  # an observation came before it (after an empty model turn)
        fired.add("empty_turn_logprobs")  # verl's list starts at the first model turn with tokens
        if first is None:
            assert theirs.response_logprobs is None, "response_logprobs"
            return
        logprobs = logprobs[first:]  # verl's cut at R keeps entries of tokens past it: compare what both hold
        assert theirs.response_logprobs[: len(logprobs)] == logprobs, "response_logprobs"
        return
    assert logprobs == theirs.response_logprobs, "response_logprobs"


# --- the conversations ----------------------------------------------------------------------------------------

ALPHABET = list("abcxyz ABC0123456789.,;:!?'-_()#*+/=\"\\\n") + ["é", "ß", "Ω", "中", "🙂", "👍🏽", "\u200b"]
TEXT = st.lists(st.sampled_from(ALPHABET), max_size=20).map("".join)


@st.composite
def model_turn(draw, tools: bool):
    text = draw(TEXT)
    if tools and draw(st.integers(0, 3)) == 0:
        call = json.dumps(
            {"name": "echo", "arguments": {"text": draw(TEXT)}}, ensure_ascii=draw(st.booleans())
        )
        text = f"{text}\n<tool_call>\n{call}\n</tool_call>"
        event("tool call")
    eos = draw(st.integers(0, 5)) > 0
    return (text, eos) if text or not eos else ("", draw(st.booleans()))


@st.composite
def scenario(draw):
    spec = draw(st.sampled_from(["talk", "tools_talk"]))
    return {
        "spec": spec,
        "question": draw(TEXT) or "hi",
        "turns": draw(st.lists(model_turn(spec == "tools_talk"), min_size=1, max_size=6)),
        "replies": draw(st.lists(TEXT, min_size=1, max_size=4)),
        "scores": draw(st.lists(st.none() | st.floats(-1, 1, width=32), min_size=1, max_size=3)),
        "stop_after": draw(st.none() | st.integers(1, 5)),
        "max_user_turns": draw(st.sampled_from([None, None, 1, 2, 3])),
        "max_assistant_turns": draw(st.sampled_from([None, None, 1, 2, 4])),
        "R": draw(st.sampled_from([4, 8, 16, 24, 40, 64, 100, 160, 400])),
    }


def explicit(**kw) -> dict:
    base = {
        "spec": "talk",
        "question": "Guess my number 🙂",
        "turns": [("5", True), ("9", True), ("7", True)],
        "replies": ["Higher.", "Lower."],
        "scores": [0.0],
        "stop_after": 3,
        "max_user_turns": None,
        "max_assistant_turns": None,
        "R": 400,
    }
    return {**base, **kw}


EXPLICIT = [
    explicit(),  # should_terminate: the final reply appended and counted
    explicit(stop_after=None, max_user_turns=2),  # the limit after the model's next turn
    explicit(stop_after=None, max_assistant_turns=2),
    explicit(stop_after=None, R=30),  # a reply cut at the budget
    explicit(turns=[("5 and", False), ("", False), ("7", True)]),  # cut and empty turns before a reply
    explicit(
        spec="tools_talk",
        turns=[
            ('<tool_call>\n{"name": "echo", "arguments": {"text": "é"}}\n</tool_call>', True),
            ("5", True),
            ("7", True),
        ],
    ),  # a tool round, then the user
]
SEEN: list[set[str]] = []


def with_examples(test):
    for scn in reversed(EXPLICIT):
        test = example(scn=scn)(test)
    return test


@with_examples
@settings(
    max_examples=MIN_EXAMPLES,
    deadline=None,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(scn=scenario())
def check_conversation(parts, tok, scn):
    theirs, ours, fired = run_both(parts, tok, scn)
    assert_same(theirs, ours, fired)
    seen = {f"spec: {scn['spec']}", f"ended: {ours['extra_fields']['termination_reason']}"}
    seen |= {f"documented difference: {name}" for name in fired}
    seen |= (
        {"reply cut at the budget"}
        if len(ours["response_mask"]) == scn["R"] and not ours["response_mask"][-1]
        else set()
    )
    for name in seen:
        event(name)
    SEEN.append(seen)


def test_interacting_matches_verl_0_7_1(parts, tok):
    SEEN.clear()
    check_conversation(parts, tok)
    assert len(SEEN) >= MIN_EXAMPLES
    counts = collections.Counter(name for seen in SEEN for name in seen)
    print("\n".join(f"{n:5d}  {name}" for name, n in sorted(counts.items())))
    for name in (
        "spec: talk",
        "spec: tools_talk",
        "ended: interaction_done",
        "ended: max_user_turns",
        "ended: max_assistant_turns",
        "ended: response_length",
        "reply cut at the budget",
        "documented difference: spent_turn",
        "documented difference: empty_turn_logprobs",
    ):
        assert counts[name], f"no conversation had {name!r}"
