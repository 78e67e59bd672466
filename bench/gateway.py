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
running every kind once in turn.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from backends.scripted import ScriptedBackend
from fsm.api import load_tokenizer, tiny_model_dir
from fsm.gateway import HarnessCall, harness
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


def _main(argv: list[str]) -> None:
    if argv[:1] == ["worker"]:
        asyncio.run(_worker_main(argv[1], argv[2], int(argv[3]), int(argv[4])))
    else:
        asyncio.run(_client_main())


if __name__ == "__main__":
    from bench import gateway  # the spec's harness is bench.gateway's (imported by name): run with its state

    gateway._main(sys.argv[1:])
