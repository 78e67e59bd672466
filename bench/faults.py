"""`agentfsm bench faults`: what each server fault (and a misbehaving tool) costs, and proof that none loses
or corrupts a row.

Each case runs the same batch through two HashLM dev servers (deterministic, so the fault-free run is the
reference for every row), each behind backends/faults.py's proxy injecting one fault kind at a rate, with the
SGLang client and the router as a run would use them. Per case: faults injected; what absorbed them (retries on
the same server, failovers, resumes of aborted turns); error rows; rows lost (missing from the output) and
rows wrong (not an error row, yet different from the fault-free run), which must both be 0; wall time against
the fault-free run in the same process. "rows cut" are rows that end `context_length` with what they had before
an empty "length" turn (hostile.CUT_KINDS: a server cannot be told from a full context), shorter than the
fault-free row and saying so: not wrong. The request deadline is 2 s: a hang costs about that per request, and
a deadline met by a live server (a slow, loaded machine) shows as a deadline abort and a resume. The hostile
answers (backends/hostile.py: ids outside the vocabulary, non-finite or positive logprobs, tokens past a stop,
more than asked, version forms, oversize bodies, logprob entries for other tokens, empty "length" turns) are cases of their own, and "outage_2s" answers every
/generate 503 for the first 2 s on both servers (a fleet restart, ridden out by the router's retry window).
"liar:<kind>" cases put one server that answers every /generate with a hostile answer (the JSON edge cases: a
400-digit logprob, logprob entries too short with a phantom, a 50,000-deep body; and out-of-vocabulary ids)
beside a healthy one: "faults counted" (the clients' counts, aborts aside) must equal "injected", and no row
may be lost or become an error.
Two tool cases run a spec whose model calls a tool that raises, or one that sleeps past its timeout: both must
become observations, not failed rows.
"""

from __future__ import annotations

import asyncio
import json
import sys
import tempfile
import time
from contextlib import AsyncExitStack
from pathlib import Path
from typing import Any

from backends.base import BaseBackend, GenerateRequest, GenerateResult
from backends.devserver import DevServer
from backends.faults import FAULT_KINDS, FaultProxy
from backends.router import Router
from backends.scripted import HashLM
from backends.sglang import SGLangBackend
from backends.tiny import ASSET_DIR

# Answers a server may send that the JSON decoder or the check itself trips on (issue 27): run again with one
# server sending them on every /generate beside a healthy one, where each must fail over and lose no row.
LIAR_KINDS = ("huge_logprob", "short_triples_phantom", "deep_json", "out_of_vocab", "mismatched_logprob_ids")
SPECS = Path(__file__).resolve().parents[1] / "specs"
ROWS_SPEC = """name: bench_faults
extends: {specs}/single_turn.yaml
limits: {{prompt_length: 64, response_length: 48, max_resumes: 20, request_timeout_s: 2.0}}
"""
TOOLS_SPEC = """name: bench_tools
extends: {specs}/tool_agent.yaml
limits: {{prompt_length: 1024, response_length: 256, max_assistant_turns: 2}}
tools:
  - function: bench.faults:broken_tool
  - function: bench.faults:slow_tool
    timeout_s: 0.05
"""


async def broken_tool(text: str) -> str:
    """A tool that always raises.

    Args:
        text: Ignored.
    """
    raise RuntimeError("the sandbox crashed")


async def slow_tool(text: str) -> str:
    """A tool that sleeps far past its timeout.

    Args:
        text: Ignored.
    """
    await asyncio.sleep(30)
    return "too late"


class _ToolCaller(BaseBackend):
    """Calls `tool` on its first turn and answers on the next: a function of the prompt, like HashLM."""

    def __init__(self, tok: Any, tool: str):
        call = json.dumps({"name": tool, "arguments": {"text": "x"}})
        self.call = tok.encode(f"<tool_call>\n{call}\n</tool_call>", add_special_tokens=False) + [
            tok.eos_token_id
        ]
        self.answer = tok.encode("#### 42", add_special_tokens=False) + [tok.eos_token_id]
        self.marker = tok.convert_tokens_to_ids("<tool_response>")
        self.model_name = f"calls-{tool}"

    async def generate(self, request: GenerateRequest) -> GenerateResult:
        ids = self.answer if self.marker in request.prompt_ids else self.call
        ids = ids[: request.sampling_params.get("max_new_tokens") or len(ids)]
        return GenerateResult(
            ids,
            [-0.1] * len(ids) if request.return_logprob else None,
            "stop",
            prompt_tokens=len(request.prompt_ids),
            cached_tokens=0,
        )


async def _case(
    agent: Any,
    tok: Any,
    rows: list[dict],
    make_model: Any,
    rates: dict[str, float],
    outage_s: float = 0.0,
    healthy_second: bool = False,
) -> dict[str, Any]:
    from fsm.api import RolloutEngine
    from fsm.output.batch import fault_summary

    async with AsyncExitStack() as stack:
        devs = [await stack.enter_async_context(DevServer(make_model())) for _ in range(2)]
        proxies = [
            await stack.enter_async_context(
                FaultProxy(d.url, rates={} if healthy_second and i else rates, seed=i)
            )
            for i, d in enumerate(devs)
        ]
        for proxy in proxies:  # the whole fleet answers 503 from the start for this long: a restart
            proxy.outage(outage_s)
        clients = [SGLangBackend(p.url, backoff_s=0.01) for p in proxies]
        backend = Router(clients, health_interval_s=0.2, cooldown_s=0.2)
        engine = await stack.enter_async_context(RolloutEngine(agent, tok, backend=backend))
        sampling = engine.sampling({"temperature": 0.0})
        t0 = time.perf_counter()
        trajs = await engine.arun(rows, sampling=sampling)
        wall = time.perf_counter() - t0
        stats = backend.stats()
    faults = fault_summary(trajs, stats)
    return {
        "injected": sum(sum(p.injected.values()) for p in proxies),
        "retried": faults["retries"],
        "failed_over": faults["failovers"],
        "deadline_aborts": faults["aborts_sent"],
        "resumed": faults["resumes"],
        "error_rows": faults["error_rows"],
        "faults_counted": sum(n for kind, n in faults["faults"].items() if not kind.startswith("aborts_")),
        "tool_errors": sum(t.metrics.tool_errors for t in trajs),
        "wall_s": wall,
        "_trajs": trajs,
    }


def _check(case: dict[str, Any], rows: int, clean: list[Any] | None) -> dict[str, Any]:
    """rows lost (missing) and rows wrong (not an error row, yet unlike the fault-free run's)."""
    trajs = case.pop("_trajs")
    case["rows_lost"] = rows - len(trajs)
    case["rows_wrong"] = case["rows_cut"] = 0
    if clean is not None:
        for t, c in zip(trajs, clean):
            n = len(t.response_ids) if t.termination_reason == "context_length" else None  # says it was cut
            same = (t.response_ids[:n].tolist(), t.response_logprobs[:n].tolist()) == (
                c.response_ids[:n].tolist(),
                c.response_logprobs[:n].tolist(),
            )
            case["rows_cut"] += n is not None and same
            case["rows_wrong"] += not t.failed and not same
    return case


async def _bench(rows: int, rate: float) -> dict[str, dict[str, Any]]:
    from transformers import AutoTokenizer

    from fsm.data.rows import RowError  # noqa: F401  (the engine's modules load before timing starts)
    from fsm.run.compile import compile_spec

    tok = AutoTokenizer.from_pretrained(str(ASSET_DIR))
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "rows.yaml").write_text(ROWS_SPEC.format(specs=SPECS))
        (Path(tmp) / "tools.yaml").write_text(TOOLS_SPEC.format(specs=SPECS))
        agent, tools_agent = compile_spec(Path(tmp) / "rows.yaml"), compile_spec(Path(tmp) / "tools.yaml")
    data = [{"raw_prompt": [{"role": "user", "content": f"What is {i} * {i + 7}?"}]} for i in range(rows)]

    def model() -> HashLM:
        return HashLM(vocab=len(tok), eos=tok.eos_token_id, stop_every=30, per_token_s=0.002)

    out: dict[str, dict[str, Any]] = {}
    await _case(agent, tok, data, model, {})  # warm-up: the first run pays for imports and template caches
    clean = await _case(agent, tok, data, model, {})
    reference = clean["_trajs"]
    out["none"] = _check(clean, rows, None)
    plans = {kind: {kind: rate} for kind in FAULT_KINDS}
    plans["mixed"] = {kind: rate / len(FAULT_KINDS) * 2 for kind in FAULT_KINDS}
    for name, plan in plans.items():
        out[name] = _check(await _case(agent, tok, data, model, plan), rows, reference)
    out["outage_2s"] = _check(await _case(agent, tok, data, model, {}, outage_s=2.0), rows, reference)
    for kind in LIAR_KINDS:  # one server answers every /generate this way, the other is healthy
        plan = {kind: 1.0}
        out[f"liar:{kind}"] = _check(
            await _case(agent, tok, data, model, plan, healthy_second=True), rows, reference
        )
    for tool in ("broken_tool", "slow_tool"):
        case = await _case(tools_agent, tok, data, lambda t=tool: _ToolCaller(tok, t), {})
        case["injected"] = case["tool_errors"]
        out[tool] = _check(case, rows, None)
    base = out["none"]["wall_s"]
    for case in out.values():
        case["vs_clean"] = case["wall_s"] / base if base else float("nan")
    return out


def bench_faults(rows: int = 128, rate: float = 0.1) -> dict[str, dict[str, Any]]:
    """Run every case (fault kinds at `rate` per /generate, "mixed", two bad tools); print a table, return
    the numbers. Call outside an event loop."""
    out = asyncio.run(_bench(rows, rate))
    head = (
        "case",
        "injected",
        "faults counted",
        "retried",
        "failed over",
        "timeout abort",
        "resumed",
        "error rows",
        "rows cut",
        "rows lost",
        "rows wrong",
        "wall s",
        "vs clean",
    )
    keys = (
        "injected",
        "faults_counted",
        "retried",
        "failed_over",
        "deadline_aborts",
        "resumed",
        "error_rows",
        "rows_cut",
        "rows_lost",
        "rows_wrong",
    )
    lines = [f"{head[0]:<28}" + "".join(f"{h:>15}" for h in head[1:])]
    for name, case in out.items():
        cells = [f"{case[k]:>15}" for k in keys] + [f"{case['wall_s']:>15.2f}", f"{case['vs_clean']:>14.2f}x"]
        lines.append(f"{name:<28}" + "".join(cells))
    print(
        f"faults: {rows} rows over 2 HashLM dev servers behind fault proxies, each kind at {rate:.0%} of /generate",
        file=sys.stderr,
    )
    print("\n".join(lines), file=sys.stderr)
    from bench.parser_faults import bench_parser_faults

    out.update(bench_parser_faults())  # the model's own text: bench/parser_faults.py
    return out
