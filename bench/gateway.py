"""`agentfsm bench gateway`: the gateway's CPU per model call against the native state machine doing the same
conversation.

Both run the calculator conversation on the tiny tokenizer's real chat template (system prompt with the tool
schema, the question, a calculator call, its result, the answer) against the same zero-latency scripted
model, each row in its own trajectory, at 1 and at 1,000 sessions in flight. Native: specs/calculator.yaml
(the engine renders, calls the tool, parses). Gateway: examples/gateway/base.yaml's states with a minimal
harness that speaks Chat Completions over loopback HTTP with one shared aiohttp client, runs the calculator
itself and loops: `gateway` runs that harness in one separate client process (rows sent on a pipe), so its
number is the gateway's own CPU; `gateway_and_client` runs it in the gateway's process, an upper bound.
`gateway_same_core` / `gateway_other_core` are `gateway` with this process and the client pinned to one core
or to two (Linux, two cores or more), since at 1 in flight the cost of waking the gateway depends on it.
`run_workers` runs N gateway processes behind a front (fsm/gateway/front.py). `--workload` is not used. CPU is
the process's (time.process_time), divided by the model calls made; the median of `repeats` rounds, each
running every kind once in turn. From heap.FREEZE_AT in flight the heap is frozen as a RolloutEngine freezes it.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import itertools
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from backends.scripted import ScriptedBackend
from fsm.gateway import HarnessCall, harness
from fsm.run import heap
from fsm.run.compile import CompiledAgent, compile_spec
from fsm.run.runtime import Runner
from specs.calculator import SYSTEM_PROMPT, TOOL_SCHEMA, _format, evaluate

ROOT = Path(__file__).resolve().parent.parent
CALL = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "1 + 2"}}\n</tool_call>'
ANSWER = "The answer is 3.\n#### 3"
_HTTP: dict[Any, Any] = {}  # event loop -> the harnesses' shared aiohttp client
ROW_TIMEOUT_S = 120.0  # one row's HTTP, and one row in the client process: the row fails past it


def _backend(tokenizer: Any) -> ScriptedBackend:
    ids = [tokenizer.encode(t, add_special_tokens=False) + [tokenizer.eos_token_id] for t in (CALL, ANSWER)]
    backend = ScriptedBackend(lambda session, k, prompt: ids[min(k, 1)])
    backend.record_requests = False
    return backend


async def minimal_harness(call: HarnessCall) -> str:
    """The least a harness can do: POST the conversation, run the calculator, POST again."""
    import aiohttp

    loop = asyncio.get_running_loop()
    http = _HTTP.get(loop)
    if http is None:
        http = _HTTP[loop] = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0), timeout=aiohttp.ClientTimeout(total=ROW_TIMEOUT_S)
        )
    headers = {"Authorization": f"Bearer {call.api_key}"}
    messages: list[dict] = [{"role": "system", "content": SYSTEM_PROMPT}, *call.messages]
    for _ in range(4):
        async with http.post(
            f"{call.base_url}/chat/completions",
            headers=headers,
            json={"model": "m", "messages": messages, "tools": [TOOL_SCHEMA]},
        ) as r:
            message = (await r.json())["choices"][0]["message"]
        messages.append(message)
        if not message.get("tool_calls"):
            return message["content"]
        for tc in message["tool_calls"]:
            result = _format(evaluate(**json.loads(tc["function"]["arguments"])))
            messages.append({"role": "tool", "tool_call_id": tc["id"], "content": result})
    return ""


bench_harness = harness(minimal_harness, timeout_s=600)

_CLIENT: dict[Any, asyncio.Task] = {}  # event loop -> the task that started its client process
CLIENT_COMMAND = [sys.executable, "-m", "bench.gateway"]  # reads rows on stdin, writes [id, result] lines
STOP_TIMEOUT_S = 10.0  # the client process ends after its stdin closes, else it is killed
_CLIENT_CPUS: list[set[int] | None] = [None]  # the cores the next client process is pinned to (_placed)


async def _start_client() -> tuple[asyncio.subprocess.Process, dict[str, asyncio.Future[Any]], asyncio.Task]:
    """The client process and a reader that resolves each row's future from its stdout; when the process
    ends, every row still waiting fails with its exit code (never waits for a line that cannot come)."""
    loop = asyncio.get_running_loop()
    proc = await asyncio.create_subprocess_exec(
        *CLIENT_COMMAND,
        stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE,
        cwd=ROOT,
        limit=1 << 20,
    )
    if _CLIENT_CPUS[0] is not None:
        os.sched_setaffinity(proc.pid, _CLIENT_CPUS[0])
    pending: dict[str, asyncio.Future[Any]] = {}

    async def read() -> None:
        reason = "the bench stopped"
        try:
            while line := await proc.stdout.readline():  # type: ignore[union-attr]
                rid, result = json.loads(line)
                future = pending.pop(rid, None)
                if future is not None and not future.done():
                    future.set_result(result)
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(STOP_TIMEOUT_S):
                    await proc.wait()
            reason = f"the client process's output ended (exit code {proc.returncode})"
        finally:
            for future in pending.values():
                if not future.done():
                    future.set_exception(RuntimeError(f"bench gateway: {reason}"))

    return proc, pending, loop.create_task(read())


async def remote_harness(call: HarnessCall) -> str:
    """The same harness run in a separate client process (`python -m bench.gateway`): this process then spends
    only the gateway's CPU (and a line on a pipe per row). One process per event loop: its start is one task
    that every row awaits, so concurrent rows never start one each."""
    loop = asyncio.get_running_loop()
    start = _CLIENT.get(loop)
    if start is None:
        start = _CLIENT[loop] = loop.create_task(_start_client())
    async with asyncio.timeout(ROW_TIMEOUT_S):
        proc, pending, _reader = await asyncio.shield(start)
        future = pending[call.api_key] = loop.create_future()
        proc.stdin.write(json.dumps([call.api_key, call.base_url, call.messages]).encode() + b"\n")  # type: ignore[union-attr]
        result = await future
    if isinstance(result, dict):
        raise RuntimeError(f"bench gateway: the client process's row failed: {result['error']}")
    return result


async def _stop_client() -> None:
    start = _CLIENT.pop(asyncio.get_running_loop(), None)
    if start is None:
        return
    proc, _pending, reader = await start
    proc.stdin.close()  # type: ignore[union-attr]
    try:
        async with asyncio.timeout(STOP_TIMEOUT_S):
            await proc.wait()
    except TimeoutError:
        proc.kill()
        await proc.wait()
    reader.cancel()


async def _client_main() -> None:
    """The client process: rows in on stdin, each run by minimal_harness concurrently, results out on stdout
    (a row that fails sends `{"error": ...}`, so the gateway's side never waits for it)."""
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader(limit=1 << 20)
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
    tasks = set()

    async def one(rid: str, base_url: str, messages: list) -> None:
        try:
            result: Any = await minimal_harness(HarnessCall(base_url, "", rid, "m", {"raw_prompt": messages}))
        except Exception as exc:
            result = {"error": f"{type(exc).__name__}: {exc}"[:500]}
        sys.stdout.write(json.dumps([rid, result]) + "\n")
        sys.stdout.flush()

    while line := await reader.readline():
        task = asyncio.create_task(one(*json.loads(line)))
        tasks.add(task)
        task.add_done_callback(tasks.discard)
    await asyncio.gather(*tasks)
    http = _HTTP.pop(loop, None)
    if http is not None:
        await http.close()


remote_bench_harness = harness(remote_harness, timeout_s=600)


def _unscored(agent: CompiledAgent) -> CompiledAgent:
    """A copy of `agent` without its reward function: the reward is the same on both sides and not what is
    measured (a compiled agent is shared and never changed in place)."""
    unscored = copy.copy(agent)
    unscored.reward = None
    return unscored


def _rows(n: int, system: bool) -> list[dict[str, Any]]:
    prompt = [{"role": "system", "content": SYSTEM_PROMPT}] if system else []
    return [
        {
            "raw_prompt": [*prompt, {"role": "user", "content": "What is 1 + 2?"}],
            "uid": f"r{i}",
            "reward_model": {"ground_truth": "3"},
        }
        for i in range(n)
    ]


def _gateway_spec(tmp: Path, action: str = "bench_harness") -> Path:
    path = tmp / f"gateway_{action}.yaml"
    path.write_text(
        f"name: gateway_bench\nextends: {ROOT / 'examples/gateway/base.yaml'}\nstates:\n  HARNESS:\n"
        f"    action: bench.gateway:{action}\n"
        "    next:\n      - {to: GENERATING, when: harness_calling}\n"
        "      - {to: TERMINATED, when: harness_failed, reason: harness_failed}\n"
        "      - {to: TERMINATED, reason: done}\n"
    )
    return path


async def _measure(runner: Runner, rows: list[dict[str, Any]]) -> tuple[float, int]:
    t0 = time.process_time()
    trajs = await runner.run(rows)
    cpu = time.process_time() - t0
    bad = [t for t in trajs if t.failed or t.assistant_turns != 2]
    assert not bad, f"bench gateway: {bad[0].error or bad[0].extra.get('harness')}"
    return cpu, sum(t.assistant_turns for t in trajs)


KINDS = ("native", "gateway", "gateway_and_client")  # gateway: the client in its own process
# where the client process runs against the gateway's process (`gateway` kinds only): the OS's choice, or both
# pinned to one core, or to two: at 1 in flight each request wakes the sleeping gateway, which costs most when
# the wake comes from another core
PLACEMENTS = {"gateway": None, "gateway_same_core": (0, 0), "gateway_other_core": (0, 1)}


@contextlib.contextmanager
def _placed(kind: str) -> Any:
    """Pin this process and the client process it starts as `kind` says (PLACEMENTS); unpinned after."""
    place = PLACEMENTS.get(kind)
    if place is None:
        yield
        return
    before = os.sched_getaffinity(0)
    os.sched_setaffinity(0, {place[0]})
    _CLIENT_CPUS[0] = {place[1]}
    try:
        yield
    finally:
        _CLIENT_CPUS[0] = None
        os.sched_setaffinity(0, before)


def placements_here() -> tuple[str, ...]:
    """The pinned kinds this machine can run (Linux, two cores or more)."""
    if (
        not hasattr(os, "sched_setaffinity")
        or len(os.sched_getaffinity(0)) < 2
        or not {0, 1} <= os.sched_getaffinity(0)
    ):
        return ()
    return ("gateway_same_core", "gateway_other_core")


def bench_gateway(
    sessions: tuple[int, ...] = (1, 1000),
    repeats: int = 3,
    calls_at_one: int = 200,
    kinds: tuple[str, ...] | None = None,
    repeats_at_many: int = 1,
) -> dict[str, Any]:
    """CPU µs per model call, native and through the gateway, at each number of sessions in flight: `repeats`
    rounds at 1 in flight, each running every kind once in turn (so load that drifts meets all kinds alike; the
    ratio of each round is kept too), `repeats_at_many` above (each row of 1,000 sessions makes 2,000 model
    calls, which bounds the run on a small machine). The pinned kinds run at 1 in flight only."""
    import tempfile

    from fsm.api import load_tokenizer, tiny_model_dir  # here, not above: the client process needs no torch

    kinds = kinds or (*KINDS, *placements_here())
    tokenizer = load_tokenizer(tiny_model_dir())
    out: dict[str, Any] = {"repeats": repeats, "rows": {}}
    with tempfile.TemporaryDirectory() as tmp:
        remote = compile_spec(_gateway_spec(Path(tmp), "remote_bench_harness"))
        agents = {
            "native": compile_spec(ROOT / "specs" / "calculator.yaml"),
            "gateway_and_client": compile_spec(_gateway_spec(Path(tmp))),
            **dict.fromkeys(PLACEMENTS, remote),
        }

        async def one(kind: str, n: int, concurrency: int) -> tuple[float, int]:
            held = heap.hold() if concurrency >= heap.FREEZE_AT else None
            runner = Runner(
                _unscored(agents[kind]),
                _backend(tokenizer),
                tokenizer,
                max_concurrency=concurrency,
                watchdog_s=None,
            )
            try:
                return await _measure(runner, _rows(n, system=kind == "native"))
            finally:
                http = _HTTP.pop(asyncio.get_running_loop(), None)
                if http is not None:
                    await http.close()
                await _stop_client()
                if held is not None:
                    held.release()

        def cpu_per_call(kind: str, n: int, concurrency: int) -> float:
            with _placed(kind):
                cpu, calls = asyncio.run(one(kind, n, concurrency))
            return cpu / calls * 1e6

        for concurrency in sessions:
            n = calls_at_one // 2 if concurrency == 1 else concurrency
            here = [k for k in kinds if concurrency == 1 or k not in PLACEMENTS or PLACEMENTS[k] is None]
            if concurrency == sessions[0]:
                for kind in here:
                    cpu_per_call(
                        kind, min(n, 20), concurrency
                    )  # warm up: template compilation, caches, imports
            runs: dict[str, list[float]] = {kind: [] for kind in here}
            for _ in range(repeats if concurrency == 1 else repeats_at_many):
                for kind in here:
                    runs[kind].append(cpu_per_call(kind, n, concurrency))
            row: dict[str, Any] = {}
            for kind in here:
                row[f"{kind}_cpu_us_per_call"] = round(statistics.median(runs[kind]), 1)
                row[f"{kind}_runs_us"] = [round(r, 1) for r in runs[kind]]
            for kind in here:
                if kind != "native":
                    row[f"{kind}_ratio"] = round(
                        row[f"{kind}_cpu_us_per_call"] / row["native_cpu_us_per_call"], 2
                    )
                    row[f"{kind}_round_ratios"] = [
                        round(g / b, 2) for g, b in zip(runs[kind], runs["native"])
                    ]
            row["model_calls"] = 2 * n
            out["rows"][f"{concurrency}_in_flight"] = row
            print(
                f"bench gateway: {concurrency} in flight: "
                + ", ".join(
                    f"{k} {row[f'{k}_cpu_us_per_call']:.0f} µs"
                    + (f" ({row[f'{k}_ratio']}x)" if k != "native" else "")
                    for k in here
                )
                + " CPU per model call",
                file=sys.stderr,
            )
    return out


# --- several gateway processes behind a front (fsm/gateway/front.py) ----------------------------------------------


async def _worker_main(tag: str, front: str, n: int, max_sessions: int) -> None:
    """One gateway worker: its own engine (the scripted model) and gateway, tagged `tag`, whose `n` rows' harnesses
    call the front. Prints its URL, waits for a line (the front knows it), runs, prints each row's tokens and the
    prompts the backend was given, and its CPU."""
    import tempfile

    from fsm.api import load_tokenizer, tiny_model_dir
    from fsm.gateway import Gateway, GatewayLimits
    from fsm.run.engine import owned

    loop = asyncio.get_running_loop()
    stdin = asyncio.StreamReader()
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(stdin), sys.stdin)
    tokenizer = load_tokenizer(tiny_model_dir())
    with tempfile.TemporaryDirectory() as tmp:
        agent = compile_spec(_gateway_spec(Path(tmp)))
    backend = _backend(tokenizer)
    backend.record_requests = True
    gateway = Gateway(limits=GatewayLimits(max_sessions=max_sessions), tag=tag, front=front)
    await gateway.attach(owned()).start()  # this loop's: the Runner below runs on it
    print(json.dumps({"url": gateway.url}), flush=True)
    async with asyncio.timeout(ROW_TIMEOUT_S):
        await stdin.readline()
    runner = Runner(_unscored(agent), backend, tokenizer, max_concurrency=n, watchdog_s=None)
    t0 = time.process_time()
    trajs = await runner.run(_rows(n, system=False))
    cpu = time.process_time() - t0
    seen: dict[str, list[list[int]]] = {}
    for r in backend.requests:
        seen.setdefault(r.session_id, []).append(list(r.prompt_ids))
    rows = [
        {
            "ok": not t.failed and t.assistant_turns == 2,
            "error": t.error,
            "prompt": t.prompt_ids.tolist(),
            "response": t.response_ids.tolist(),
            "mask": t.response_mask.tolist(),
            "runs": [[r.start, r.end, r.role] for r in t.runs],
            "requests": seen.get(t.session_id, []),
        }
        for t in trajs
    ]
    print(json.dumps({"cpu": cpu, "rows": rows}), flush=True)
    await _close_http()
    await gateway.close()


async def _close_http() -> None:
    http = _HTTP.pop(asyncio.get_running_loop(), None)
    if http is not None:
        await http.close()


async def run_workers(workers: int, sessions: int, max_sessions: int = 10_000) -> dict[str, Any]:
    """`sessions` rows, all in flight, over `workers` gateway processes (each holding at most `max_sessions`)
    behind one front in this process: every row's tokens, the requests routed per worker, and the CPU per model
    call of the front and the workers together (their harnesses' HTTP client included)."""
    from fsm.gateway.front import Front

    async with Front() as front:
        procs = []
        for k in range(workers):
            n = sessions // workers + (k < sessions % workers)
            procs.append(
                await asyncio.create_subprocess_exec(
                    sys.executable,
                    "-m",
                    "bench.gateway",
                    "worker",
                    f"w{k}",
                    front.url,
                    str(n),
                    str(max_sessions),
                    cwd=ROOT,
                    limit=1 << 26,
                    stdin=asyncio.subprocess.PIPE,
                    stdout=asyncio.subprocess.PIPE,
                )
            )
        try:
            async with asyncio.timeout(ROW_TIMEOUT_S * 2):
                for k, proc in enumerate(procs):
                    front.register(f"w{k}", json.loads(await proc.stdout.readline())["url"])  # type: ignore[union-attr]
                t0 = time.process_time()
                for proc in procs:
                    proc.stdin.write(b"go\n")  # type: ignore[union-attr]
                outs = [json.loads(await proc.stdout.readline()) for proc in procs]  # type: ignore[union-attr]
                front_cpu = time.process_time() - t0
                for proc in procs:
                    await proc.wait()
        finally:
            for proc in procs:
                if proc.returncode is None:
                    proc.kill()
                    await proc.wait()
    rows = [row for out in outs for row in out["rows"]]
    calls = 2 * sum(row["ok"] for row in rows)
    workers_cpu = sum(out["cpu"] for out in outs)
    return {
        "rows": rows,
        "routed": dict(front.routed),
        "front_cpu_us_per_call": front_cpu / calls * 1e6,
        "workers_cpu_us_per_call": workers_cpu / calls * 1e6,
        "cpu_us_per_call": (front_cpu + workers_cpu) / calls * 1e6,
    }


# --- CPU per call as the context grows (issue 48 §6) ---------------------------------------------------------------

# A coding harness's shape: a long system prompt, ten tools, the task, then one tool call and its result per call
HARNESS_TOOLS = [
    {
        "type": "function",
        "function": {
            "name": name,
            "description": f"{name.replace('_', ' ').capitalize()} in the workspace. " * 4,
            "parameters": {
                "type": "object",
                "properties": {"path": {"type": "string", "description": "A path in the workspace."}},
                "required": ["path"],
            },
        },
    }
    for name in (
        "read_file write_file edit_file list_dir glob grep run_shell web_fetch todo_write spawn_agent".split()
    )
]
PARAGRAPH = (
    "You are a coding agent. Read the files you need before you change them, keep each change small, run the "
    "tests that cover what you touched, and say what you did in one short paragraph at the end.\n"
)
RESULT = "".join(f"{k:4d}| line {k} of the file, as the tool read it back\n" for k in range(1, 25))


def _system(row: int, paragraphs: int) -> str:
    """A system prompt of `paragraphs` numbered rules, its text the row's own (no tokenizer cache holds it)."""
    return "".join(f"Rule {row}.{k}: {PARAGRAPH}" for k in range(paragraphs))


def _api_body(api: str, system: str, task: str, said: list[tuple[str, str, dict]]) -> tuple[str, dict]:
    """The request of `api` for the conversation so far (`said`: the model's calls, each (id, name, arguments),
    each answered with RESULT): its path under the session and its body, as each SDK sends them."""
    tools = [t["function"] for t in HARNESS_TOOLS]
    if api == "chat":
        messages: list[dict[str, Any]] = [
            {"role": "system", "content": system},
            {"role": "user", "content": task},
        ]
        for cid, name, args in said:
            fn = {"name": name, "arguments": json.dumps(args)}
            messages.append(
                {
                    "role": "assistant",
                    "content": "",
                    "tool_calls": [{"id": cid, "type": "function", "function": fn}],
                }
            )
            messages.append({"role": "tool", "tool_call_id": cid, "content": RESULT})
        return "/v1/chat/completions", {"model": "m", "messages": messages, "tools": HARNESS_TOOLS}
    if api == "responses":
        items: list[dict[str, Any]] = [{"role": "user", "content": task}]
        for cid, name, args in said:
            items.append(
                {"type": "function_call", "call_id": cid, "name": name, "arguments": json.dumps(args)}
            )
            items.append({"type": "function_call_output", "call_id": cid, "output": RESULT})
        body = {
            "model": "m",
            "instructions": system,
            "input": items,
            "tools": [{"type": "function", **t} for t in tools],
        }
        return "/v1/responses", body
    if api == "anthropic":
        turns: list[dict[str, Any]] = [{"role": "user", "content": task}]
        for cid, name, args in said:
            turns.append(
                {
                    "role": "assistant",
                    "content": [{"type": "tool_use", "id": cid, "name": name, "input": args}],
                }
            )
            turns.append(
                {"role": "user", "content": [{"type": "tool_result", "tool_use_id": cid, "content": RESULT}]}
            )
        schemas = [
            {"name": t["name"], "description": t["description"], "input_schema": t["parameters"]}
            for t in tools
        ]
        return "/v1/messages", {
            "model": "m",
            "max_tokens": 256,
            "system": system,
            "messages": turns,
            "tools": schemas,
        }
    contents: list[dict[str, Any]] = [{"role": "user", "parts": [{"text": task}]}]
    for cid, name, args in said:
        contents.append(
            {"role": "model", "parts": [{"functionCall": {"id": cid, "name": name, "args": args}}]}
        )
        reply = {"id": cid, "name": name, "response": {"output": RESULT}}
        contents.append({"role": "user", "parts": [{"functionResponse": reply}]})
    body = {
        "systemInstruction": {"parts": [{"text": system}]},
        "contents": contents,
        "tools": [{"functionDeclarations": tools}],
    }
    return "/v1beta/models/m:generateContent", body


def _api_call(api: str, answer: dict) -> tuple[str, str, dict]:
    """The model's one call in `api`'s answer: (id, name, arguments)."""
    if api == "chat":
        tc = answer["choices"][0]["message"]["tool_calls"][0]
        return tc["id"], tc["function"]["name"], json.loads(tc["function"]["arguments"])
    if api == "responses":
        fc = next(i for i in answer["output"] if i["type"] == "function_call")
        return fc["call_id"], fc["name"], json.loads(fc["arguments"])
    if api == "anthropic":
        tu = next(b for b in answer["content"] if b["type"] == "tool_use")
        return tu["id"], tu["name"], tu["input"]
    fc = next(p["functionCall"] for p in answer["candidates"][0]["content"]["parts"] if "functionCall" in p)
    return fc["id"], fc["name"], fc["args"]


APIS_MEASURED = ("chat", "responses", "anthropic", "gemini")
_SERVED: list[float] = []  # CPU seconds of each request the gateway served (bench_context's wrapper)


async def context_harness(call: HarnessCall) -> list[float]:
    """The row's API and size (`extra_info`): `calls` model calls, each the whole conversation again as the SDK
    sends it; the gateway's CPU for each (process time from its handler's start to its answer: the HTTP client,
    in this process too, is idle then at one call in flight)."""
    import aiohttp

    info = call.row["extra_info"]
    api, calls = info["api"], info["calls"]
    system, task = call.row["raw_prompt"][0]["content"], call.row["raw_prompt"][1]["content"]
    said: list[tuple[str, str, dict]] = []
    headers = {"Authorization": f"Bearer {call.api_key}"}
    async with aiohttp.ClientSession() as http:
        for _ in range(calls):
            path, body = _api_body(api, system, task, said)
            async with http.post(call.anthropic_base_url + path, json=body, headers=headers) as r:
                answer = await r.json()
                assert r.status == 200, answer
            said.append(_api_call(api, answer))
    return _SERVED[-calls:]


context_bench_harness = harness(context_harness, timeout_s=600)


def bench_context(
    sizes: tuple[int, ...] = (1_000, 30_000),
    calls: int = 6,
    repeats: int = 3,
    apis: tuple[str, ...] = APIS_MEASURED,
) -> dict[str, Any]:
    """The gateway's CPU per model call, per API, at each first-prompt size (Qwen2.5 tokens, its real template):
    the first call of a session whose system prompt is new (`first_new_us`: all of it rendered and tokenized),
    of one whose system prompt an earlier session sent (`first_seen_us`: as a harness's every session after its
    first), and the later calls (`later_us`: each only its new messages); the median over `repeats` rounds,
    after one that warms up. The model is scripted (zero latency): each turn calls one tool."""
    import tempfile

    from fsm.api import load_tokenizer
    from fsm.gateway import Gateway

    tokenizer = load_tokenizer(str(ROOT / ".tokenizers" / "qwen2_5"))  # .ci/tokenizers.sh fetches it
    text = '<tool_call>\n{"name": "read_file", "arguments": {"path": "src/app.py"}}\n</tool_call><|im_end|>'
    turn = tokenizer.encode(text, add_special_tokens=False)
    backend = ScriptedBackend(lambda session, k, prompt: turn)
    backend.record_requests = False
    per_rule = len(tokenizer.encode(_system(-99_999, 10), add_special_tokens=False)) / 10
    product = itertools.product(range(repeats + 1), sizes, apis, (True, False))
    rows = [
        {
            "raw_prompt": [
                {
                    "role": "system",
                    "content": _system(k if new else -size, max(1, int((size - 900) / per_rule))),
                },
                {"role": "user", "content": "Fix the failing test in tests/test_app.py."},
            ],
            "extra_info": {"api": api, "calls": calls, "size": size, "new": new},
        }
        for k, (_, size, api, new) in enumerate(product)
    ]
    serve = Gateway._serve

    async def timed(self: Gateway, request: Any) -> Any:
        t0 = time.process_time()
        try:
            return await serve(self, request)
        finally:
            _SERVED.append(time.process_time() - t0)

    with tempfile.TemporaryDirectory() as tmp:
        spec = Path(tmp) / "context.yaml"
        spec.write_text(
            f"name: gateway_context\nextends: {ROOT / 'examples/gateway/base.yaml'}\n"
            "limits: {prompt_length: 60000, response_length: 30000, max_new_tokens: 256, max_assistant_turns: 64}\n"
            "states:\n  HARNESS:\n    action: bench.gateway:context_bench_harness\n"
            "    next:\n      - {to: GENERATING, when: harness_calling}\n"
            "      - {to: TERMINATED, when: harness_failed, reason: harness_failed}\n"
            "      - {to: TERMINATED, reason: done}\n"
        )
        agent = _unscored(compile_spec(spec))
        Gateway._serve = timed  # type: ignore[method-assign]
        try:
            runner = Runner(agent, backend, tokenizer, max_concurrency=1, watchdog_s=None)
            trajs = asyncio.run(runner.run(rows))
        finally:
            Gateway._serve = serve  # type: ignore[method-assign]
    cells: dict[str, dict[str, Any]] = {}
    for traj, row in list(zip(trajs, rows))[2 * len(sizes) * len(apis) :]:  # past the warm-up round
        result = traj.extra["harness"].get("result")
        if not isinstance(result, list) or len(traj.extra.get("tree") or "1") != 1:  # one row: no history
            raise RuntimeError(f"bench gateway --workload contexts: {traj.error or traj.extra['harness']}")
        info = row["extra_info"]
        cell = cells.setdefault(f"{info['api']}_{info['size']}", {"first_new_us": [], "first_seen_us": []})
        cell["prompt_tokens"] = len(traj.prompt_ids)
        cell["first_new_us" if info["new"] else "first_seen_us"].append(result[0] * 1e6)
        cell.setdefault("later_us", []).extend(r * 1e6 for r in result[1:])
    for cell in cells.values():
        for key in ("first_new_us", "first_seen_us", "later_us"):
            cell[key] = round(statistics.median(cell[key]))
    out: dict[str, Any] = {"calls": calls, "repeats": repeats, "rows": cells}
    for api in apis:
        small, large = cells[f"{api}_{min(sizes)}"], cells[f"{api}_{max(sizes)}"]
        ratios = {k: round(large[k] / small[k], 2) for k in ("first_new_us", "first_seen_us", "later_us")}
        out[f"{api}_ratio"] = ratios
        print(
            f"bench gateway contexts: {api} at {small['prompt_tokens']} / {large['prompt_tokens']} tokens: first "
            f"call {small['first_new_us']} / {large['first_new_us']} µs ({ratios['first_new_us']}x), its system "
            f"prompt seen before {small['first_seen_us']} / {large['first_seen_us']} µs "
            f"({ratios['first_seen_us']}x), later calls {small['later_us']} / {large['later_us']} µs "
            f"({ratios['later_us']}x)",
            file=sys.stderr,
        )
    return out


def _main(argv: list[str]) -> None:
    if argv[:1] == ["worker"]:
        asyncio.run(_worker_main(argv[1], argv[2], int(argv[3]), int(argv[4])))
    else:
        asyncio.run(_client_main())


if __name__ == "__main__":
    from bench import gateway  # the spec's harness is bench.gateway's (imported by name): run with its state

    gateway._main(sys.argv[1:])
