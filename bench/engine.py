"""`agentfsm bench engine`: what the engine costs per transition, next to a hand-written loop.

Both loops do the same work on the same inputs: N tool-calling trajectories against a zero-latency
scripted backend, the same codec, parser and tools, the same token appends. The hand-written loop is
ToolAgentLoop's control flow written out inline; the difference between the two is what the declarative
machine (action dispatch, guard evaluation through `transitions`, path bookkeeping) costs.

The codec is a table lookup (rendering the chat template with jinja costs far more than a transition and
would bury the number being measured); tokens are real token ids, appended exactly as in a real run.

It lives outside `fsm` because the engine never imports a concrete backend (here `backends.scripted`) or
benchmark code; `agentfsm bench engine` imports it lazily.
"""

from __future__ import annotations

import asyncio
import gc
import statistics
import sys
import time
import tracemalloc
from collections.abc import Callable
from pathlib import Path
from typing import Any

from backends.scripted import ScriptedBackend
from fsm.families import Codec, get_family
from fsm.run.actions import call_tools, encode_prompt, generate
from fsm.run.compile import CompiledAgent, compile_spec
from fsm.run.context import RunContext
from fsm.run.runtime import Runner
from fsm.run.trajectory import Trajectory
from fsm.spec.model import SPECS_DIR, LimitsSpec, ToolSpec

ECHO_SCHEMA = {
    "type": "function",
    "function": {
        "name": "echo",
        "description": "Return the text.",
        "parameters": {"type": "object", "properties": {"text": {"type": "string"}}, "required": ["text"]},
    },
}


async def echo(text: str) -> str:
    return text


class TableCodec(Codec):
    """A qwen2.5 Codec whose renders are precomputed: same interface and token ids, no jinja per call."""

    def __init__(
        self, prompt: list[int], observation: list[int], turns: dict[tuple[int, ...], str], eos: int
    ):
        self.tokenizer, self.eos_id, self.pad_id, self.vocab_size = None, eos, 0, 1 << 16
        self.turn_closer, self.stop_ids, self._strip_ids = [eos, 198], {eos}, {eos}
        self.family, self._verl_exact = get_family("qwen2.5"), True
        self._prompt, self._observation, self._turns = prompt, observation, turns

    def encode_prompt(self, messages, tools):
        return self._prompt

    def encode_observation(self, messages, history=None):
        return self._observation

    def decode(self, ids, *, skip_special_tokens=True):
        return self._turns[tuple(ids)]


def _calculator_replies(tok: Any) -> tuple[list[int], list[int]]:
    """The scripted model's two answers: a calculator call, then the final answer (each ending in EOS)."""
    call = tok.encode(
        '<tool_call>\n{"name": "calculator", "arguments": {"expression": "1 + 2"}}\n</tool_call>',
        add_special_tokens=False,
    ) + [tok.eos_token_id]
    return call, tok.encode("The answer is 3.\n#### 3", add_special_tokens=False) + [tok.eos_token_id]


def _workload(tool_turns: int) -> tuple[TableCodec, ScriptedBackend]:
    eos = 2
    call = [60 + (i % 40) for i in range(24)] + [eos]  # a 25-token model turn holding one tool call
    answer = [70 + (i % 30) for i in range(12)] + [eos]
    codec = TableCodec(
        prompt=[5 + (i % 200) for i in range(64)],
        observation=[90 + (i % 20) for i in range(16)],
        turns={
            tuple(call[:-1]): '<tool_call>{"name": "echo", "arguments": {"text": "hi"}}</tool_call>',
            tuple(answer[:-1]): "The answer is 3.\n#### 3",
        },
        eos=eos,
    )
    backend = ScriptedBackend(
        lambda session, turn, prompt: call if turn < tool_turns else answer, logprob=-0.25
    )
    backend.record_requests = False
    return codec, backend


def bench_agent(tool_turns: int, isolation: str = "none") -> CompiledAgent:
    agent = compile_spec(SPECS_DIR / "tool_agent.yaml")
    limits = LimitsSpec(prompt_length=128, response_length=4096, max_assistant_turns=tool_turns + 2)
    tool = ToolSpec(function="bench.engine:echo", schema=ECHO_SCHEMA, isolation=isolation)
    spec = agent.spec.model_copy(update={"limits": limits, "tools": [tool]})
    return compile_spec(spec)


async def reference_loop(ctx: RunContext, traj: Trajectory) -> None:
    """ToolAgentLoop's control flow, hand-written over the same actions: the engine's baseline."""
    limits = ctx.agent.limits
    await encode_prompt(ctx, traj)
    while True:
        await generate(ctx, traj)
        if len(traj.response_mask) >= limits.response_length:
            traj.termination_reason = "response_length"
            break
        if limits.max_assistant_turns and traj.assistant_turns >= limits.max_assistant_turns:
            traj.termination_reason = "max_assistant_turns"
            break
        if not traj.pending_calls:
            traj.termination_reason = "done"
            break
        await call_tools(ctx, traj)
        if traj.observation_overflow:
            traj.termination_reason = "response_length"
            break
    await ctx.backend.release(traj.session_id)


async def _run(kind: str, n: int, concurrency: int, tool_turns: int) -> tuple[float, int, list[Trajectory]]:
    agent = bench_agent(tool_turns, "thread" if kind == "engine_lane" else "none")
    codec, backend = _workload(tool_turns)
    runner = Runner(agent, backend, codec, max_concurrency=concurrency)
    rows = [{"raw_prompt": [{"role": "user", "content": "hi"}]} for _ in range(n)]
    if kind != "reference":
        t0 = time.process_time()
        trajs = await runner.run(rows)
        elapsed = time.process_time() - t0
        return elapsed, sum(len(t.transitions_fired) for t in trajs), trajs
    ctx = runner.make_context(None, False)
    trajs = runner.trajectories(rows)
    gate = asyncio.Semaphore(concurrency)

    async def one(traj: Trajectory) -> None:
        async with gate:
            await reference_loop(ctx, traj)

    t0 = time.process_time()
    async with asyncio.TaskGroup() as tg:
        for traj in trajs:
            tg.create_task(one(traj))
    elapsed = time.process_time() - t0
    # The same trajectories take 2 + 2*tool_turns transitions in the spec; count them the same way.
    return elapsed, n * (2 + 2 * tool_turns), trajs


def _peak_bytes_per_trajectory(kind: str, n: int, concurrency: int, tool_turns: int) -> float:
    gc.collect()
    tracemalloc.start()
    asyncio.run(_run(kind, n, concurrency, tool_turns))
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    return peak / n


def bench_step(tool_turns: int = 4, steps: int = 20_000) -> dict[str, float]:
    """µs for one machine step (guards + recording the edge), lean path vs transitions' stock Event.trigger."""
    agent = bench_agent(tool_turns)
    traj = Trajectory(0, 0, "s", "u", {}, agent.initial)
    out = {}

    def advance(t: Trajectory) -> None:
        t.enter(agent.advance(t))

    for name, step in (("advance", advance), ("stock_trigger", agent.trigger)):
        runs = []
        for _ in range(5):
            t0 = time.process_time()
            for i in range(steps):
                traj.state = "GENERATING"  # the busiest state: 6 edges, 5 guards before the default
                step(traj)
                if i % 1024 == 0:
                    del traj.transitions_fired[:], traj.path[:], traj.path_times[:]
            runs.append((time.process_time() - t0) / steps * 1e6)
        out[f"{name}_us"] = round(statistics.median(runs), 3)
    return out


KINDS = {
    "engine": "the spec's machine; the echo tool awaited on the run's loop (isolation: none)",
    "engine_lane": "the same, the echo tool on its own loop thread (isolation: thread, the default)",
    "reference": "the hand-written loop over the same actions (isolation: none)",
}


def bench_engine(
    n: int = 2000,
    concurrency: int | None = None,
    tool_turns: int = 4,
    repeats: int = 3,
    memory_n: int | None = None,
) -> dict[str, Any]:
    """Median over `repeats` of interleaved runs of each of KINDS (CPU seconds of this process, so other load
    on the machine does not count), peak memory per trajectory, and one machine step in isolation. The
    defaults take well under a minute; `n` and `concurrency` 10,000 show the cost at scale."""
    concurrency = concurrency or n
    times: dict[str, list[float]] = {kind: [] for kind in KINDS}
    transitions = 0
    for _ in range(repeats):
        for kind in KINDS:
            gc.collect()
            elapsed, transitions, trajs = asyncio.run(_run(kind, n, concurrency, tool_turns))
            expected = (
                64 + tool_turns * (25 + 1 + 16) + 13
            )  # prompt, tool rounds (turn, closer, observation), answer
            bad = [
                t
                for t in trajs
                if t.termination_reason != "done" or len(t.prompt_ids) + len(t.response_ids) != expected
            ]
            assert not bad, f"{kind}: {bad[0].termination_reason} {bad[0].error}"
            times[kind].append(elapsed)
            del trajs
    out: dict[str, Any] = {
        "trajectories": n,
        "concurrency": concurrency,
        "tool_turns": tool_turns,
        "transitions_per_trajectory": transitions // n,
        "repeats": repeats,
        "kinds": KINDS,
    }
    for kind, ts in times.items():
        med = statistics.median(ts)
        out[kind] = {
            "median_cpu_s": round(med, 4),
            "us_per_transition": round(med / transitions * 1e6, 2),
            "trajectories_per_cpu_s": round(n / med, 1),
        }
        if kind != "engine_lane":
            m = memory_n or n
            out[kind]["peak_bytes_per_trajectory"] = round(
                _peak_bytes_per_trajectory(kind, m, min(m, concurrency), tool_turns)
            )
    out["engine_overhead_us_per_transition"] = round(
        out["engine"]["us_per_transition"] - out["reference"]["us_per_transition"], 2
    )
    out["ratio_engine_to_reference"] = round(
        out["engine"]["median_cpu_s"] / out["reference"]["median_cpu_s"], 3
    )
    out["machine_step"] = bench_step(tool_turns)
    print(
        f"bench engine: {n} trajectories, {concurrency} in flight, {tool_turns} tool turns, median of {repeats}: "
        + ", ".join(f"{k} {out[k]['us_per_transition']:.1f} µs" for k in KINDS)
        + " CPU per transition",
        file=sys.stderr,
    )
    return out


def calculator_workload(n: int, concurrency: int) -> Callable[[Any], tuple[Runner, list]]:
    """make_run(tracer) -> (runner, rows): specs/calculator.yaml on the tiny tokenizer against a replayed model
    (one tool call, then the answer), `n` rows, `concurrency` in flight."""
    from transformers import AutoTokenizer

    from backends.base import BaseBackend, GenerateResult
    from specs.calculator import make_prompts

    repo = Path(__file__).resolve().parent.parent
    tok = AutoTokenizer.from_pretrained(str(repo / "backends/tiny/assets"))
    agent = compile_spec(repo / "specs/calculator.yaml")
    call, answer = _calculator_replies(tok)

    class Replay(BaseBackend):
        provider, model_name = "scripted", "replay"

        async def generate(self, request: Any) -> GenerateResult:
            ids = call if request.rid.endswith("_t00") else answer
            return GenerateResult(
                list(ids), [-0.5] * len(ids), "stop", len(request.prompt_ids), 0, server="replay"
            )

    rows = make_prompts(n)

    def make_calculator_run(tracer: Any) -> tuple[Runner, list]:
        return Runner(agent, Replay(), tok, max_concurrency=concurrency, tracer=tracer), rows

    return make_calculator_run


def bench_calculator(n: int = 2000, concurrency: int | None = None, repeats: int = 3) -> dict[str, Any]:
    """CPU per trajectory on the calculator workload (specs/calculator.yaml: the tiny tokenizer's chat
    template per prompt, one tool turn, the answer; a replayed model), `n` trajectories with `concurrency`
    in flight: run at 1,000 and 50,000 to see what grows with the number in flight. Median of `repeats`;
    then tracemalloc's peak per trajectory with min(n, 1,000) in flight (the rows excluded)."""
    concurrency = concurrency or n
    make_run = calculator_workload(n, concurrency)
    runner, rows = make_run(None)
    asyncio.run(runner.run(rows[:200]))  # warm up (template compilation, caches)
    runs, collections = [], []
    for _ in range(repeats):
        runner, rows = make_run(None)
        gc.collect()
        before = [s["collections"] for s in gc.get_stats()]
        t0 = time.process_time()
        trajs = asyncio.run(runner.run(rows))
        runs.append(time.process_time() - t0)
        collections.append([s["collections"] - b for s, b in zip(gc.get_stats(), before)])
        bad = [t for t in trajs if t.failed]
        assert not bad, f"calculator: {bad[0].error}"
        del trajs
    us = statistics.median(runs) / n * 1e6
    m = min(n, 1000)  # tracemalloc triples the run's time: memory at a thousand in flight
    runner, rows = make_run(None)
    rows = rows[:m]
    gc.collect()
    tracemalloc.start()
    asyncio.run(runner.run(rows))
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    print(
        f"bench engine: calculator workload, {n} trajectories, {concurrency} in flight, median of {repeats}: "
        f"{us:.0f} µs CPU per trajectory; {peak / m / 1024:.1f} KB per in-flight trajectory ({m} in flight)",
        file=sys.stderr,
    )
    return {
        "workload": "calculator",
        "trajectories": n,
        "concurrency": concurrency,
        "repeats": repeats,
        "cpu_us_per_trajectory": round(us, 1),
        "runs_cpu_s": [round(r, 3) for r in runs],
        "gc_collections_per_run": collections,
        "peak_bytes_per_trajectory": round(peak / m),
        "memory_trajectories": m,
    }


def bench_contexts(n: int = 500, tool_turns: int = 4, repeats: int = 3) -> dict[str, Any]:
    """CPU per model turn of the `template` context policy against `append`, on the same conversation:
    specs/calculator.yaml on the tiny tokenizer's (real, jinja) chat template, `tool_turns` calculator calls then
    the answer, a replayed model. `template` renders the whole conversation before each model turn; the
    tiny template is append-only, so both policies give the same single-segment rows (checked), and the
    difference is the render. The two run alternated, `repeats` times each; the medians and their ratio."""
    from transformers import AutoTokenizer

    from backends.base import BaseBackend, GenerateResult
    from specs.calculator import make_prompts

    repo = Path(__file__).resolve().parent.parent
    tok = AutoTokenizer.from_pretrained(str(repo / "backends/tiny/assets"))
    base = compile_spec(repo / "specs/calculator.yaml")
    limits = base.spec.limits.model_copy(
        update={"max_assistant_turns": tool_turns + 2, "response_length": 2048}
    )
    agents = {
        policy: compile_spec(
            base.spec.model_copy(
                update={"limits": limits, "context": base.spec.context.model_copy(update={"policy": policy})}
            )
        )
        for policy in ("append", "template")
    }
    call, answer = _calculator_replies(tok)

    class Replay(BaseBackend):
        provider, model_name = "scripted", "replay"

        async def generate(self, request: Any) -> GenerateResult:
            ids = call if int(request.rid.rsplit("_t", 1)[1][:2]) < tool_turns else answer
            return GenerateResult(
                list(ids), [-0.5] * len(ids), "stop", len(request.prompt_ids), 0, server="replay"
            )

    rows = make_prompts(n)
    runs: dict[str, list[float]] = {policy: [] for policy in agents}
    outputs: dict[str, list[list[int]]] = {}
    for agent in agents.values():  # warm up (template compilation, caches)
        asyncio.run(Runner(agent, Replay(), tok, max_concurrency=n).run(rows[:50]))
    for _ in range(repeats):
        for policy, agent in agents.items():
            runner = Runner(agent, Replay(), tok, max_concurrency=n)
            gc.collect()
            t0 = time.process_time()
            trajs = asyncio.run(runner.run(rows))
            runs[policy].append(time.process_time() - t0)
            bad = [t for t in trajs if t.failed or t.assistant_turns != tool_turns + 1 or t.num_segments != 1]
            assert not bad, (
                f"{policy}: {bad[0].termination_reason} {bad[0].error} ({bad[0].num_segments} segments)"
            )
            outputs[policy] = [t.prompt_ids.tolist() + t.response_ids.tolist() for t in trajs[:20]]
            del trajs
    assert outputs["append"] == outputs["template"], (
        "append and template rows differ on an append-only template"
    )
    turns = n * (tool_turns + 1)
    out: dict[str, Any] = {
        "workload": "contexts",
        "trajectories": n,
        "model_turns_per_trajectory": tool_turns + 1,
        "repeats": repeats,
    }
    for policy, ts in runs.items():
        out[policy] = {
            "median_cpu_s": round(statistics.median(ts), 4),
            "runs_cpu_s": [round(t, 3) for t in ts],
            "us_per_model_turn": round(statistics.median(ts) / turns * 1e6, 1),
        }
    out["ratio_template_to_append"] = round(
        out["template"]["median_cpu_s"] / out["append"]["median_cpu_s"], 3
    )
    print(
        f"bench engine: contexts, {n} trajectories of {tool_turns + 1} model turns, median of {repeats}: append "
        f"{out['append']['us_per_model_turn']:.0f} µs, template {out['template']['us_per_model_turn']:.0f} µs CPU per "
        f"model turn (x{out['ratio_template_to_append']})",
        file=sys.stderr,
    )
    return out
