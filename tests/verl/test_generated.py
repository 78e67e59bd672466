"""Generated parity: random multi-turn scripts through verl 0.9.1's ToolAgentLoop and through fsm_agent.

Hypothesis writes the model's side of a conversation: 0 to 4 tool rounds then an answer; parallel calls within
and beyond max_parallel_calls; malformed calls (bad JSON, no "name", no "arguments", no closing tag),
unknown tools, arguments of the wrong type or shape, arguments as a JSON string, raising tools; unicode and
emoji in the model's text, the question and the tools' output; tool output long enough to be truncated
left, right or in the middle; per-turn caps and turns the server cuts without eos, also inside a call; and
response budgets that end one token before, at and one past a turn boundary (found by a first run), or
inside a turn. Tools are verl's own (BaseTools from a tool config, with per-trajectory state in
agent_data.extra_fields, or @function_tool functions), the prompt may be left-truncated, and rows may select
tools. EXPLICIT scripts, run every time, reach each of these situations for sure; the test fails if a run
missed one (COVERAGE).

Every script runs three loops on the same ReplayServer script: verl's ToolAgentLoop, fsm_agent with
specs/tool_agent.yaml, and `AgentfsmRules` (tests/verl/rules.py): verl's loop with exactly the documented
differences applied. Then:

  1. fsm_agent == AgentfsmRules on every field (prompt_ids, response_ids, response_mask, response_logprobs,
     num_turns, extra_fields, num_preempted) and on every request's prompt: no undocumented difference.
  2. When no documented difference fired, AgentfsmRules == verl's own loop: the reference is verl.
  3. verl's AgentLoopWorker postprocessing pads both rows (with the same reward_score) into equal rows, and
     fsm.collate of the same outputs gives verl's tensors key for key (rm_scores included, empty rows too).

At least MIN_EXAMPLES (300; AGENTFSM_PARITY_EXAMPLES to change it) scripts per run; about a minute here.
"""

from __future__ import annotations

import asyncio
import collections
import json
import os

from hypothesis import HealthCheck, event, example, given, settings
from hypothesis import strategies as st

from tests.verl.harness import (
    OURS_ONLY,
    SAMPLING,
    Pair,
    ReplayServer,
    assert_identical,
    assert_native_collate_matches,
    assert_same_requests,
    fsm_entry,
    instantiate,
    load_tools,
    needs_verl,
    reused_config,
    row,
    split,
    verl_batch,
    verl_entry,
)

MIN_EXAMPLES = int(os.environ.get("AGENTFSM_PARITY_EXAMPLES", "300"))
PROBE_R = 1536  # the budget of the first run, which finds the turn boundaries

# --- the model's words and the tools' inputs -----------------------------------------------------------------

ALPHABET = list("abcdefghijklmnopqrstuvwxyz ABCXYZ0123456789.,;:!?'-_()[]{}#*+/=\"\\\n\t") + [
    "é",
    "ü",
    "ß",
    "ñ",
    "Ω",
    "д",
    "中",
    "文",
    "日",
    "한",
    "ع",
    "🙂",
    "🎉",
    "👍🏽",
    "🧑‍💻",
    "🇫🇷",
    "\u200b",
    "\u00a0",
]
TEXT = st.lists(st.sampled_from(ALPHABET), max_size=24).map("".join)  # some "characters" are emoji sequences
LONG_TEXT = st.lists(st.sampled_from(ALPHABET), max_size=200).map("".join)
NUMBER = st.integers(-20, 20) | st.floats(-9, 9, allow_nan=False).map(lambda x: round(x, 2))
EXPRESSION = st.one_of(
    st.builds(
        lambda a, op, b: f"{a} {op} {b}", st.integers(0, 99), st.sampled_from("+-*/"), st.integers(0, 9)
    ),
    st.just("1 / 0"),  # ZeroDivisionError
    st.text(alphabet=st.sampled_from(list("xyz ")), min_size=1, max_size=120),  # ValueError quoting it: long
)

REPEATED = st.builds(
    lambda parts, n: "".join(parts) * n,
    st.lists(st.sampled_from(ALPHABET), min_size=3, max_size=12),
    st.integers(4, 16),
)
TOOL_TEXT = st.one_of(TEXT, LONG_TEXT, REPEATED, REPEATED)  # often longer than max_tool_response_length

ODD_RETURNS = [
    "quad",
    "empty",
    "nested",
    "empty_reward",
    "text_reward",
    "word_reward",
    "none_reward",
    "bad_metrics",
    "pairs_metrics",
    "number",
    "list",
    "dict_in_tuple",
    "response",
    "none",
    "zero",
    "plain",
]
GOOD_ARGS = {  # per tool set: tool -> strategy of well-formed arguments (raising ones included)
    "gen_base": {
        "tally": st.fixed_dictionaries({"add": NUMBER}),
        "echo": st.fixed_dictionaries({"text": TOOL_TEXT}) | st.fixed_dictionaries({"fail": LONG_TEXT}),
        "calculator": st.fixed_dictionaries({"expression": EXPRESSION}),
        "blank": st.fixed_dictionaries({"text": TEXT}),  # an empty instance id from create
    },
    "gen_function": {
        "echo": st.fixed_dictionaries({"text": TOOL_TEXT}),
        "scale": st.fixed_dictionaries({"x": NUMBER}, optional={"factor": st.none() | st.integers(-3, 3)}),
        "shout": st.fixed_dictionaries({"text": TOOL_TEXT}, optional={"fail": LONG_TEXT}),
        "odd": st.fixed_dictionaries({"kind": st.sampled_from(ODD_RETURNS)}),
    },
}


@st.composite
def arguments(draw, good):
    """Well-formed arguments, or ones verl hands the tool anyway: wrong type, unknown key, missing, not an
    object, or a JSON string."""
    args = draw(good)
    kind = draw(
        st.sampled_from(["good"] * 6 + ["wrong_type", "extra", "missing", "not_object", "json_string"])
    )
    event(f"arguments: {kind}")
    if kind == "wrong_type" and args:
        return {**args, next(iter(args)): draw(st.sampled_from([7, [1], None, True, "7"]))}
    if kind == "extra":
        return {**args, draw(st.sampled_from(["zzz", "Text", "é"])): draw(NUMBER | TEXT)}
    if kind == "missing":
        return {}
    if kind == "not_object":
        return draw(st.sampled_from([[1, 2], None, 3, "", True, "plain"]))
    if kind == "json_string":
        return json.dumps(args, ensure_ascii=draw(st.booleans()))
    return args


@st.composite
def call_body(draw, tools):
    """The JSON between <tool_call> and </tool_call>: a call, an unknown tool's, or a malformed one."""
    kind = draw(
        st.sampled_from(["known"] * 8 + ["unknown", "bad_json", "no_name", "no_arguments", "not_object"])
    )
    event(f"call: {kind}")
    name = draw(st.sampled_from(sorted(GOOD_ARGS[tools])))
    args = draw(arguments(GOOD_ARGS[tools][name]))
    if kind == "unknown":
        name = draw(st.sampled_from(["search", "Echo", "calc", ""]))
    body = json.dumps({"name": name, "arguments": args}, ensure_ascii=draw(st.booleans()))
    if kind == "bad_json":
        return body[: draw(st.integers(1, len(body) - 1))]
    if kind == "no_name":
        return json.dumps({"arguments": args, **draw(st.sampled_from([{}, {"name": 7}, {"name": None}]))})
    if kind == "no_arguments":
        return json.dumps({"name": name})
    if kind == "not_object":
        return json.dumps(draw(st.sampled_from([[name, args], name, 42])))
    return body


@st.composite
def model_turn(draw, tools):
    """(text, ends with eos). A tool turn has 1 to 4 calls, maybe an unterminated one last."""
    calls = [f"<tool_call>\n{draw(call_body(tools))}\n</tool_call>" for _ in range(draw(st.integers(1, 4)))]
    if draw(st.sampled_from([False, False, True])):  # a call whose output is long: truncated
        long = json.dumps({"name": "echo", "arguments": {"text": draw(REPEATED)}}, ensure_ascii=False)
        calls.insert(draw(st.integers(0, len(calls))), f"<tool_call>\n{long}\n</tool_call>")
    if draw(st.integers(0, 9)) == 0:
        calls.append(f"<tool_call>\n{draw(call_body(tools))}")  # the closing tag never comes
        event("unterminated call")
    text = "\n".join([draw(TEXT), *calls, draw(TEXT)]).strip("\n ")
    eos = draw(st.integers(0, 5)) > 0  # else the server stops without eos ("length"), maybe inside a call
    return text, eos


@st.composite
def scenario(draw):
    tools = draw(st.sampled_from(sorted(GOOD_ARGS)))
    rounds = draw(st.sampled_from([1, 2, 3, 4, 2, 3, 0]))
    event(f"tool rounds: {rounds}")
    turns = [draw(model_turn(tools)) for _ in range(rounds)]
    turns.append((draw(TEXT) + "\n#### 42", True))
    if draw(st.sampled_from([False] * 11 + [True])):  # the model's first turn has no token at all
        turns = [("", False), *turns]
    limits = {
        "max_parallel_calls": draw(st.integers(1, 3)),
        "max_tool_response_length": draw(st.integers(4, 60) | st.integers(1, 3)),
        "tool_response_truncate_side": draw(st.sampled_from(["left", "right", "middle"])),
        "max_assistant_turns": draw(st.sampled_from([None, None, 3, 2, 4, 1])),
        "max_user_turns": draw(st.sampled_from([None, None, 2, 1, 1])),
    }
    names = sorted(GOOD_ARGS[tools])
    selection = draw(
        st.none() | st.just([]) | st.lists(st.sampled_from([*names, "nope"]), min_size=1, max_size=4)
    )
    fields = {"extra_info": {"index": 0, **({"tool_selection": selection} if selection is not None else {})}}
    if draw(st.booleans()):
        fields["tools_kwargs"] = {"tally": {"create_kwargs": {"seed": 1}}}
    question = draw(TEXT) + " " + draw(LONG_TEXT) * draw(st.sampled_from([1, 1, 1, 12]))  # sometimes over P
    return {
        "tools": tools,
        "turns": turns,
        "limits": {k: v for k, v in limits.items() if v is not None},
        "extra_calls": draw(st.sampled_from(["error", "error", "drop"])),
        "cap": draw(
            st.sampled_from([None] * 6 + [1, 5, 12, 25, 40, 60])
        ),  # sampling max_tokens: a per-turn cap
        "prompt_length": draw(st.sampled_from([512, 512, 300])),
        "row": row(question, **fields),
        "reward": draw(st.floats(-2, 2, width=32)),
        "budget": draw(BUDGET),
    }


# How the response budget R ends, resolved against a first run's turn boundaries (see budget_for):
BUDGET = st.one_of(
    st.tuples(st.just("boundary"), st.integers(0, 20), st.sampled_from([-1, 0, 1])),  # before / at / past one
    st.tuples(st.just("inside"), st.integers(0, 20), st.integers(1, 10_000)),  # inside a model turn
    st.tuples(st.just("roomy"), st.just(0), st.integers(1, 40)),  # everything fits
    st.tuples(st.just("free"), st.just(0), st.integers(8, 700)),
)


# --- running the three loops ----------------------------------------------------------------------------------

_TOOLS: dict[str, list] = {}


def tools_for(kind: str) -> list:
    """verl's tools for a tool set, loaded once (as a worker does) and shared by all three loops."""
    if kind not in _TOOLS:
        _TOOLS[kind] = load_tools(kind)
    return _TOOLS[kind]


async def run_loop(which: str, scn: dict, R: int, tok):
    """One loop over the scenario's script: "verl", "rules" (verl + documented changes) or "fsm"."""
    from omegaconf import OmegaConf

    ids = [
        tok.encode(t, add_special_tokens=False) + ([tok.eos_token_id] if eos else [])
        for t, eos in scn["turns"]
    ]
    P = scn["prompt_length"]
    server = ReplayServer(
        ids,
        eos=tok.eos_token_id,
        prompt_length=P,
        response_length=R,
        after=tok.encode("bye", add_special_tokens=False) + [tok.eos_token_id],
    )
    config = reused_config(R, dict(scn["limits"]), prompt_length=P)
    if which == "verl":
        entry = verl_entry()
    elif which == "rules":
        entry = OmegaConf.create(
            {"_target_": "tests.verl.rules.AgentfsmRules", "extra_calls": scn["extra_calls"]}
        )
    else:
        entry = fsm_entry(None, {**scn["limits"], "extra_calls": scn["extra_calls"]})
    loop = instantiate(entry, config, server, tok, tools_for(scn["tools"]))
    sampling = dict(SAMPLING, **({"max_tokens": scn["cap"]} if scn["cap"] else {}))
    out = await loop.run(sampling, **json.loads(json.dumps(scn["row"])))  # each loop its own copy of the row
    return out, server, getattr(loop, "fired", set())


def budget_for(budget: tuple[str, int, int], probe) -> int:
    """R for a scenario: one before / at / one past the end of the first run's k-th run of tokens (a model
    turn or an observation), inside its k-th model turn, room for all of it, or a number."""
    mode, k, n = budget
    runs, at = [], 0
    for mask, ids in split(probe):
        runs.append((at, at + len(ids), mask))
        at += len(ids)
    turns = [(start, end) for start, end, mask in runs if mask and end - start > 1]
    if mode == "boundary" and runs:
        return max(1, runs[k % len(runs)][1] + n)
    if mode == "inside" and turns:
        start, end = turns[k % len(turns)]
        return start + 1 + n % (end - start - 1)
    if mode == "free":
        return n
    return len(probe.response_ids) + (n if mode == "roomy" else 1)


def R_mode(R: int, probe) -> str:
    """Where the budget ended relative to the first run's turn boundaries."""
    ends = [sum(len(ids) for _, ids in split(probe)[: i + 1]) for i in range(len(split(probe)))]
    for offset, name in ((-1, "one before a boundary"), (0, "at a boundary"), (1, "one past a boundary")):
        if R - offset in ends:
            return name
    return "elsewhere"


def observations_of(out, tok) -> list[str]:
    return [tok.decode(ids) for mask, ids in split(out) if not mask]


def cut_inside_a_call(out, tok) -> bool:
    """A model turn stopped without eos ("length") with a <tool_call> still open."""
    for mask, ids in split(out):
        text = tok.decode(ids)
        if mask and ids[-1] != tok.eos_token_id and text.rfind("<tool_call>") > text.rfind("</tool_call>"):
            return True
    return False


# --- scripts every run has, whatever hypothesis draws: each reaches one situation for sure ---------------------


def scripted(
    tools: str,
    turns: list[tuple[str, bool]],
    *,
    budget=("roomy", 0, 5),
    limits=None,
    question=None,
    prompt_length: int = 512,
) -> dict:
    return {
        "tools": tools,
        "turns": [*turns, ("The answer is 449 🙂\n#### 449", True)],
        "limits": {
            "max_parallel_calls": 1,
            "max_tool_response_length": 256,
            "tool_response_truncate_side": "middle",
            **(limits or {}),
        },
        "extra_calls": "error",
        "cap": None,
        "prompt_length": prompt_length,
        "row": row(question or "What is 37 * 12 + 5? Ünïcödé 🧑‍💻"),
        "reward": 1.0,
        "budget": budget,
    }


def tc(name: str, arguments) -> str:
    return (
        f"<tool_call>\n{json.dumps({'name': name, 'arguments': arguments}, ensure_ascii=False)}\n</tool_call>"
    )


TALLY = (tc("tally", {"add": 1}), True)
EXPLICIT = [
    *(
        scripted(
            "gen_base",
            [(tc("echo", {"text": "héllo wörld 🙂 " * 8}), True)],
            limits={"max_tool_response_length": 24, "tool_response_truncate_side": side},
        )
        for side in ("left", "right", "middle")
    ),  # tool output truncated, each side
    scripted(
        "gen_function",
        [
            (
                tc("shout", {"text": "🎉 party " * 6})
                + "\n"
                + tc("echo", {"text": "x"})
                + "\n"
                + tc("nope", {}),
                True,
            )
        ],
        limits={"max_parallel_calls": 2},
    ),  # an extra call
    scripted(
        "gen_base", [('<tool_call>\n{"name": "echo", "arguments": {"text": \n</tool_call>', True)]
    ),  # malformed
    *(
        {
            **scripted(
                "gen_base",
                [
                    (
                        "\n".join(
                            [
                                tc("tally", {"add": 1}),
                                '<tool_call>\n{"name": "tally"}\n</tool_call>',
                                *(tc("tally", {"add": k}) for k in range(2, n)),
                            ]
                        ),
                        True,
                    )
                ],
                limits={"max_parallel_calls": 3},
            ),
            "extra_calls": mode,
        }
        for n, mode in ((4, "drop"), (5, "error"))
    ),  # a malformed call among parallel ones takes no slot
    scripted("gen_base", [(tc("tally", {"add": 2.5}), False)]),  # a turn cut without eos, then a tool round
    scripted("gen_base", [("", False)]),  # the model says nothing at all
    scripted("gen_base", [TALLY, TALLY, TALLY], limits={"max_user_turns": 1}),
    scripted("gen_base", [TALLY, TALLY, TALLY], limits={"max_assistant_turns": 2}),
    *(
        scripted("gen_base", [(tc("echo", {"text": "abc"}), True)], budget=("boundary", k, offset))
        for k in (0, 1)
        for offset in (-1, 0, 1)
    ),  # one before, at and one past a model turn / tool turn's end
    scripted(
        "gen_base",
        [("Let me: " + tc("calculator", {"expression": "37 * 12 + 5"}), True)],
        budget=("inside", 0, 7),
    ),  # the budget ends inside the call
    scripted("gen_base", [TALLY], question="Why? " + "Because 🙂. " * 200, prompt_length=300),  # over P
]

EXAMPLES: list[set[str]] = []


def with_examples(test):
    for scn in reversed(EXPLICIT):
        test = example(scn=scn)(test)
    return test


@with_examples
@settings(
    max_examples=MIN_EXAMPLES,
    deadline=None,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.large_base_example],
)
@given(scn=scenario())
def check_generated_script(tok, scn):
    probe, _, _ = asyncio.run(run_loop("fsm", scn, PROBE_R, tok))
    R = budget_for(scn["budget"], probe)

    async def three():
        return [await run_loop(which, scn, R, tok) for which in ("verl", "rules", "fsm")]

    (verl, verl_server, _), (rules, rules_server, fired), (ours, fsm_server, _) = asyncio.run(three())
    seen = {f"documented difference: {name}" for name in fired or ["none"]}
    seen |= {f"termination: {ours.extra_fields['termination_reason']}", f"budget: {R_mode(R, probe)}"}
    seen |= {"prompt truncated"} if len(ours.prompt_ids) == scn["prompt_length"] else set()
    seen |= (
        {"tool output truncated"} if any("(truncated)" in o for o in observations_of(ours, tok)) else set()
    )
    seen |= {"turn cut inside a call"} if cut_inside_a_call(ours, tok) else set()
    for name in seen:
        event(name)

    # 1. fsm_agent is verl with the documented changes, exactly
    pair = Pair(rules, ours, rules_server, fsm_server, [], [], R)
    assert_identical(pair)
    assert_same_requests(pair, tok.eos_token_id)

    # 2. with no documented change fired, that reference is verl's own loop
    if not fired:
        assert_identical(Pair(verl, ours, verl_server, fsm_server, [], [], R))
        assert [r["params"] for r in rules_server.requests] == [r["params"] for r in verl_server.requests]

    # 3. verl's worker pads both rows alike; fsm.collate pads them as verl does
    P = scn["prompt_length"]
    rows = [scn["row"], scn["row"]]
    outputs = [out.model_copy(update={"reward_score": scn["reward"]}) for out in (rules, ours)]
    batch = asyncio.run(verl_batch(outputs, rows, prompt_length=P, response_length=R))
    for key, value in batch.batch.items():
        assert (value[0] == value[1]).all(), key
    for key, value in batch.non_tensor_batch.items():
        if key not in (*OURS_ONLY, "request_id"):
            assert value[0] == value[1], key
    assert_native_collate_matches(
        batch, outputs, prompt_length=P, response_length=R, pad_token_id=tok.pad_token_id
    )
    EXAMPLES.append(seen)


@needs_verl
def test_generated_scripts_match_verl(tok):
    EXAMPLES.clear()
    check_generated_script(tok)
    assert len(EXAMPLES) >= MIN_EXAMPLES
    counts = collections.Counter(name for seen in EXAMPLES for name in seen)
    print("\n".join(f"{n:5d}  {name}" for name, n in sorted(counts.items())))
    for name in COVERAGE:  # the scripts reach every situation they are meant to (EXPLICIT makes sure)
        assert counts[name], f"no script had {name!r}"


COVERAGE = [
    *(
        f"documented difference: {d}"
        for d in (
            "none",
            "malformed",
            "extra_calls",
            "closer",
            "empty_response",
            "empty_logprobs",
            "malformed among parallel calls",
        )
    ),
    *(f"termination: {t}" for t in ("done", "response_length", "max_assistant_turns", "max_user_turns")),
    *(f"budget: {b}" for b in ("one before a boundary", "at a boundary", "one past a boundary")),
    "prompt truncated",
    "tool output truncated",
    "turn cut inside a call",
]
