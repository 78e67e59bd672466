"""`agentfsm bench engines --server URL [--server URL]`: the calculator spec over each inference engine's server.

Each server (SGLang, vLLM or the dev server, told apart by backends/engines.py) runs the same rows greedily
through `RolloutEngine(servers=[url])` in this process, the servers taking turns (the order rotates every
repeat, so a machine that gets busier does not favour one). Per engine: wall time of the run, and the
client's CPU time (this process: the engine, its HTTP client, the answer checks) per model call; then
whether every trajectory's tokens were equal across runs and engines. The servers must serve the same model (for
vLLM on CPU, the tiny model with 32-dim heads: backends/tiny/head_pad.py, which computes the same function).

Then the client under load: `in_flight` rows (1,000 by default) all in flight against each server, the
client's CPU per model call (what one process pays per call when a fleet answers fast) in an engine's first
batch and in its second (a trainer's every later step), and, with
`processes`, the same rows split over 1, 2, ... processes started together: calls per second in all, and CPU
per call summed over the processes. A server slower than the clients bounds the calls per second, not them:
without --server, each process has a modeled vLLM server of its own (bench/fleet_sim.py, its token route,
compute free), and the servers' own CPU is counted beside the clients'.
"""

from __future__ import annotations

import asyncio
import contextlib
import multiprocessing
import os
import queue
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from typing import Any

from backends.tiny import ASSET_DIR
from bench.fleet_sim import Costs


async def _run(
    url: str, rows: list[dict[str, Any]], tokenizer: Any, batches: int = 1, tracer: Any = None
) -> dict[str, Any]:
    """`rows` through one engine, `batches` times in a row (a trainer's steps): the first batch's numbers, and
    with `batches` > 1 the last one's under "steady" (the engine's connections, caches and frozen heap,
    fsm/run/heap.py, set up by then)."""
    from fsm.api import RolloutEngine

    async with RolloutEngine(
        "calculator", tokenizer, servers=[url], max_concurrency=max(1, len(rows)), tracer=tracer
    ) as engine:
        await engine.start()
        measured = []
        for _ in range(batches):
            before = sum(s["requests"] for s in engine.backend.stats()["servers"])  # type: ignore[attr-defined]
            wall, cpu = time.perf_counter(), time.process_time()
            trajs = await engine.arun(rows, sampling_params={"temperature": 0.0})
            wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
            stats = engine.backend.stats()  # type: ignore[attr-defined]
            calls = sum(s["requests"] for s in stats["servers"]) - before
            measured.append(
                {
                    "wall_s": wall,
                    "client_cpu_s": cpu,
                    "model_calls": calls,
                    "failed": sum(1 for t in trajs if t.failed),
                    "reward_mean": statistics.fmean(t.reward_score or 0.0 for t in trajs) if trajs else 0.0,
                }
            )
            if len(measured) == 1:
                tokens = [(list(t.response_ids), list(t.response_mask)) for t in trajs]
            # a trainer drops a batch's trajectories once it has its tensors: not kept into the next batch
            del trajs
        return {
            "engine": engine.backend.provider,
            **measured[0],
            "tokens": tokens,
            **({"steady": measured[-1]} if batches > 1 else {}),
        }


def _load(url: str, rows: list[dict[str, Any]], go: Any, out: Any) -> None:
    """One process of the load: its rows against `url`, once every process is ready (`out` says so; `go`)."""
    from fsm.api import load_tokenizer

    tokenizer = load_tokenizer(str(ASSET_DIR))
    out.put(None)
    go.wait()
    run = asyncio.run(_run(url, rows, tokenizer))
    out.put({k: run[k] for k in ("wall_s", "client_cpu_s", "model_calls", "failed")})


def _take(out: Any, procs: list[Any]) -> list[Any]:
    """One message from each process, or a one-line error once one of them died (its traceback is above)."""
    got: list[Any] = []
    while len(got) < len(procs):
        try:
            got.append(out.get(timeout=1))
        except queue.Empty:
            if dead := [p for p in procs if p.exitcode not in (None, 0)]:
                for p in procs:
                    p.kill()
                raise RuntimeError(
                    f"bench engines: client process {dead[0].pid} exited with code {dead[0].exitcode}; "
                    "its error is printed above"
                ) from None
    return got


def load(url: str | Sequence[str], rows: list[dict[str, Any]], processes: int) -> dict[str, Any]:
    """`rows` all in flight against `url`, split over `processes` processes (given several URLs, process i uses
    the i-th, round robin): calls/s and CPU per call, and the share of the machine's cores busy meanwhile (every
    process's, the servers' and other load's: where it nears 1 the cores have run out)."""
    urls = [url] if isinstance(url, str) else list(url)
    ctx = multiprocessing.get_context("spawn")
    go, out = ctx.Event(), ctx.Queue()
    shares = [rows[i::processes] for i in range(processes)]
    procs = [
        ctx.Process(target=_load, args=(urls[i % len(urls)], share, go, out))
        for i, share in enumerate(shares)
    ]
    for p in procs:
        p.start()
    _take(out, procs)  # every process has its tokenizer: they start together
    go.set()
    ticks = _cpu_ticks()
    runs = _take(out, procs)
    busy = _busy_share(ticks, _cpu_ticks())
    for p in procs:
        p.join(60)
    calls = sum(r["model_calls"] for r in runs)
    wall = max(r["wall_s"] for r in runs)
    return {
        "processes": processes,
        "in_flight": len(rows),
        "model_calls": calls,
        "failed": sum(r["failed"] for r in runs),
        "calls_per_s": calls / wall,
        "client_cpu_ms_per_call": sum(r["client_cpu_s"] for r in runs) / max(1, calls) * 1e3,
        # one core is all a client's event loop can use: near 1, the loop is what bounds its calls
        "client_loop_busy_share": statistics.fmean(r["client_cpu_s"] / r["wall_s"] for r in runs),
        "cores_busy_share": busy,
    }


# The modeled servers' flags for `processes`: compute free (a server faster than any client) and the limits
# vLLM's API server takes on an H100 (1,024 sequences, 8,192 batched tokens a step)
FREE_COMPUTE = [
    *(x for f in Costs.__dataclass_fields__ if f.endswith("_s") for x in ("--" + f.replace("_", "-"), "0")),
    *("--max-num-seqs", "1024", "--max-batched-tokens", "8192"),
]


@contextlib.contextmanager
def modeled_servers(n: int) -> Iterator[list[Any]]:
    """`n` modeled vLLM servers (bench/fleet_sim.py) with FREE_COMPUTE, as processes, each on a free port of its
    own (consecutive ports may be taken); yields their launchers (`urls`, `procs`). One that does not start is a
    one-line RuntimeError with its log's last line."""
    from backends.launcher import LaunchError
    from bench.fleet import SimLauncher, free_port

    with tempfile.TemporaryDirectory(prefix="agentfsm-bench-engines-") as tmp:
        fleet = [
            SimLauncher(
                str(ASSET_DIR),
                base_port=free_port(),
                log_dir=tmp,
                startup_timeout_s=120,
                extra_args=FREE_COMPUTE,
            )
            for _ in range(n)
        ]

        async def start() -> None:
            await asyncio.gather(*(server.__aenter__() for server in fleet))

        async def stop() -> None:
            await asyncio.gather(*(server.stop() for server in fleet))

        try:
            asyncio.run(start())
            yield fleet
        except LaunchError as e:
            lines = str(e).strip().splitlines()
            raise RuntimeError(f"bench engines: {lines[0].split(';')[0]}: {lines[-1]}") from None
        finally:
            asyncio.run(stop())


def bench_processes(
    processes: Sequence[int], rows: list[dict[str, Any]], repeats: int
) -> list[dict[str, Any]]:
    """`rows` split over each count of `processes` client processes, a modeled server each (the counts
    alternated over `repeats` rounds): calls/s and CPU per call of the clients and of the servers, medians and
    ranges."""
    runs: dict[int, list[dict[str, Any]]] = {p: [] for p in processes}
    with modeled_servers(max(processes)) as fleet:
        urls, procs = [server.urls[0] for server in fleet], [server.procs[0] for server in fleet]
        for r in range(repeats):
            for p in _turns(list(processes), r):
                before = _cpu_s(procs)
                scaled = load(urls, rows, p)
                scaled["server_cpu_ms_per_call"] = (_cpu_s(procs) - before) / scaled["model_calls"] * 1e3
                runs[p].append(scaled)
    keys = ("calls_per_s", "client_cpu_ms_per_call", "server_cpu_ms_per_call", "client_loop_busy_share")
    out = []
    for p, rs in runs.items():
        row = {"processes": p, "failed": max(x["failed"] for x in rs), "model_calls": rs[0]["model_calls"]}
        row.update({k: _range([x[k] for x in rs]) for k in keys})
        row["cores_busy_share"] = _range([x["cores_busy_share"] or 0.0 for x in rs])
        out.append(row)
        print(
            f"        calculator: {len(rows):,} in flight over {p} process(es), a modeled vLLM server each: "
            f"{_show(row['calls_per_s'], 0)} calls/s, client CPU {_show(row['client_cpu_ms_per_call'])} ms per "
            f"call, servers' {_show(row['server_cpu_ms_per_call'])} ms; each client's loop "
            f"{row['client_loop_busy_share']['median']:.0%} busy, the machine's cores "
            f"{row['cores_busy_share']['median']:.0%}",
            file=sys.stderr,
        )
    return out


def _cpu_s(procs: Sequence[Any]) -> float:
    """CPU seconds (user + system) the processes used so far (/proc/PID/stat)."""
    total = 0
    for proc in procs:
        with open(f"/proc/{proc.pid}/stat", encoding="ascii") as f:
            total += sum(int(x) for x in f.read().rsplit(")", 1)[1].split()[11:13])
    return total / os.sysconf("SC_CLK_TCK")


def _cpu_ticks() -> tuple[int, int]:
    """(busy, total) CPU ticks of the whole machine since boot (/proc/stat); (0, 0) where there is none."""
    try:
        with open("/proc/stat", encoding="ascii") as f:
            ticks = [int(x) for x in f.readline().split()[1:]]
    except (OSError, ValueError):
        return 0, 0
    idle = ticks[3] + (ticks[4] if len(ticks) > 4 else 0)  # idle + iowait
    return sum(ticks) - idle, sum(ticks)


def _busy_share(before: tuple[int, int], after: tuple[int, int]) -> float | None:
    total = after[1] - before[1]
    return round((after[0] - before[0]) / total, 3) if total > 0 else None


def bench_engines(
    servers: Sequence[str],
    n: int = 8,
    repeats: int = 3,
    in_flight: int = 1000,
    processes: Sequence[int] = (),
) -> dict[str, Any]:
    """Per server: median wall time of the run and client CPU per model call over `repeats` alternated runs
    of `n` calculator prompts at T=0; `tokens_equal` says whether every run (of every server) gave the same
    token ids. Then
    (`in_flight` > 0) the client's CPU per call with `in_flight` rows in flight in this process, median of
    `repeats` alternated runs, and for each count in `processes` the load split over that many processes."""
    from fsm.api import load_tokenizer
    from specs.calculator import make_prompts

    rows = make_prompts(n, seed=0)
    tokenizer = load_tokenizer(str(ASSET_DIR))
    runs: dict[str, list[dict[str, Any]]] = {url: [] for url in servers}
    for r in range(repeats):
        for url in _turns(servers, r):
            runs[url].append(asyncio.run(_run(url, rows, tokenizer)))
    first = runs[servers[0]][0]["tokens"]
    out: dict[str, Any] = {"prompts": n, "repeats": repeats, "in_flight": in_flight, "servers": {}}
    out["tokens_equal"] = all(run["tokens"] == first for rs in runs.values() for run in rs)
    for url, rs in runs.items():
        calls = rs[0]["model_calls"]
        out["servers"][url] = {
            "engine": rs[0]["engine"],
            "model_calls": calls,
            "failed": max(x["failed"] for x in rs),
            "wall_s": statistics.median(x["wall_s"] for x in rs),
            "client_cpu_ms_per_call": _spread(rs),
            "wall_ms_per_call": statistics.median(x["wall_s"] / max(1, x["model_calls"]) for x in rs) * 1e3,
        }
        s = out["servers"][url]
        print(
            f"{s['engine']:>6} {url}: {s['wall_s']:.2f} s for {calls} model calls ({s['wall_ms_per_call']:.1f} ms "
            f"each), client CPU {_show(s['client_cpu_ms_per_call'])} ms per call",
            file=sys.stderr,
        )
    print(f"tokens equal across engines at T=0: {out['tokens_equal']}", file=sys.stderr)
    if in_flight > 0:
        many = make_prompts(in_flight, seed=1)
        loaded: dict[str, list[dict[str, Any]]] = {url: [] for url in servers}
        for r in range(repeats):
            for url in _turns(servers, r):
                loaded[url].append(asyncio.run(_run(url, many, tokenizer, batches=2)))
        for url, rs in loaded.items():
            s = out["servers"][url]
            steady = [x["steady"] for x in rs]
            s["in_flight_client_cpu_ms_per_call"] = _spread(rs)
            s["in_flight_steady_client_cpu_ms_per_call"] = _spread(steady)
            s["in_flight_calls_per_s"] = statistics.median(x["model_calls"] / x["wall_s"] for x in rs)
            s["in_flight_failed"] = max(x["failed"] for x in rs + steady)
            print(
                f"{s['engine']:>6} {url}: {in_flight:,} in flight: client CPU "
                f"{_show(s['in_flight_client_cpu_ms_per_call'])} ms per call in an engine's first batch, "
                f"{_show(s['in_flight_steady_client_cpu_ms_per_call'])} ms in its second, "
                f"{s['in_flight_calls_per_s']:.0f} calls/s",
                file=sys.stderr,
            )
            for p in processes:
                scaled = load(url, many, p)
                s.setdefault("processes", []).append(scaled)
                print(
                    f"{s['engine']:>6} {url}: {in_flight:,} in flight over {p} process(es): "
                    f"{scaled['calls_per_s']:.0f} calls/s, client CPU {scaled['client_cpu_ms_per_call']:.2f} ms "
                    "per call",
                    file=sys.stderr,
                )
    return out


def _turns(servers: Sequence[Any], r: int) -> list[Any]:
    """The servers (or cases) in repeat `r`'s order (rotated each repeat)."""
    return list(servers[r % len(servers) :]) + list(servers[: r % len(servers)])


# The turn shapes an instant server answers (`agentfsm bench engines` without --server): its dev-server mode and
# what one row costs in model calls.
SHAPES = {
    "calculator": (
        "--scripted-calculator",
        "the calculator's real turns: a calculator call, its result, then the answer (2 model calls a row)",
    ),
    "echo": (
        "--scripted",
        "the echo model: one 9-token turn and no tool call (1 model call a row; the cheapest shape)",
    ),
}


def bench_instant(
    shapes: Sequence[str] = ("calculator", "echo"),
    in_flight: int = 1000,
    repeats: int = 3,
    processes: Sequence[int] = (),
) -> dict[str, Any]:
    """The client's CPU per model call against a server that answers at once (a dev server in its own process,
    whose CPU is not counted: what a fast GPU fleet looks like to one client), `in_flight` calculator rows all in
    flight, an engine's first batch and its second (the steady state). Per shape of SHAPES: tracing off, and for
    the calculator also on (every trajectory traced, OTLP/HTTP to a collector that discards, in its own
    process). The cases run alternated, `repeats` times; medians and ranges. With `processes`, the calculator's
    rows split over that many processes too, each with an instant server of its own (`load`)."""
    from backends.scripted import scripted_servers
    from bench.tracing import _RECEIVER
    from fsm.api import load_tokenizer
    from fsm.telemetry import Telemetry
    from specs.calculator import make_prompts

    unknown = [s for s in shapes if s not in SHAPES]
    if unknown:
        raise ValueError(f"bench engines: no shape {unknown[0]!r} (known: {', '.join(SHAPES)})")
    tokenizer = load_tokenizer(str(ASSET_DIR))
    rows = make_prompts(in_flight, seed=1)
    cases = [
        (shape, traced) for shape in shapes for traced in (False, True) if shape == "calculator" or not traced
    ]
    runs: dict[tuple[str, bool], list[dict[str, Any]]] = {case: [] for case in cases}
    collector = subprocess.Popen([sys.executable, "-c", _RECEIVER], stdout=subprocess.PIPE, text=True)
    try:
        otlp = f"http://127.0.0.1:{int(collector.stdout.readline())}"  # type: ignore[union-attr]
        with contextlib.ExitStack() as stack:
            started = scripted_servers(len(shapes), mode=[SHAPES[s][0] for s in shapes])
            urls = dict(zip(shapes, stack.enter_context(started)))
            for r in range(repeats):
                for case in _turns(cases, r):
                    shape, traced = case
                    tracer = Telemetry(otlp=otlp) if traced else None
                    runs[case].append(
                        asyncio.run(_run(urls[shape], rows, tokenizer, batches=2, tracer=tracer))
                    )
            out: dict[str, Any] = {"in_flight": in_flight, "repeats": repeats, "shapes": {}}
            for (shape, traced), rs in runs.items():
                steady = [x["steady"] for x in rs]
                name = f"{shape}, traced" if traced else shape
                out["shapes"][name] = {
                    "about": SHAPES[shape][1],
                    "traced": traced,
                    "model_calls_per_batch": rs[0]["model_calls"],
                    "failed": max(x["failed"] for x in rs + steady),
                    "reward_mean": min(x["reward_mean"] for x in rs + steady),
                    "first_batch_client_cpu_ms_per_call": _spread(rs),
                    "steady_client_cpu_ms_per_call": _spread(steady),
                    "steady_calls_per_s": statistics.median(x["model_calls"] / x["wall_s"] for x in steady),
                }
                s = out["shapes"][name]
                print(
                    f"{name:>18}: {in_flight:,} in flight, an instant server: client CPU per model call "
                    f"{_show(s['steady_client_cpu_ms_per_call'])} ms steady, "
                    f"{_show(s['first_batch_client_cpu_ms_per_call'])} ms in an engine's first batch; "
                    f"{s['steady_calls_per_s']:.0f} calls/s; reward {s['reward_mean']:.2f}",
                    file=sys.stderr,
                )
    finally:
        collector.terminate()
        collector.wait(10)
    if processes:  # a server per client process, so no one server process bounds the clients
        out["processes"] = bench_processes(processes, rows, repeats)
    return out


def _spread(runs: list[dict[str, Any]]) -> dict[str, float]:
    """Median and range of the runs' client CPU per model call, in ms."""
    return _range([x["client_cpu_s"] / max(1, x["model_calls"]) * 1e3 for x in runs])


def _range(values: list[float]) -> dict[str, float]:
    each = sorted(values)
    return {"median": round(statistics.median(each), 3), "min": round(each[0], 3), "max": round(each[-1], 3)}


def _show(spread: dict[str, float], digits: int = 2) -> str:
    return f"{spread['median']:.{digits}f} ({spread['min']:.{digits}f}-{spread['max']:.{digits}f})"
