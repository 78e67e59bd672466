"""`agentfsm bench fleet`: agent traffic replayed through agentfsm's router and the engines' own routers.

Two or more real vLLM servers serve the tiny model; each (shape, router) pair replays the same traffic from a
cold prefix cache and reads the servers' own counters (`vllm:prefix_cache_hits_total` / `_queries_total` on
/metrics). The routers: agentfsm's `Router` (sticky, bounded load, group affinity; and with `by_turn`
priorities), `vllm-router` 0.1.17 (consistent_hash on X-Session-ID, cache_aware, round_robin) and
`sglang-router` 0.3.2 (manual: sticky on x-smg-routing-key with min_load placement of new keys — 0.3.2 has no
consistent-hash policy —, cache_aware), all from the virtualenv `.ci/routers_env.sh` builds.

The route. sglang-router forwards /generate (SGLang's body) and /v1/completions with a text prompt only (a
token-id prompt is refused: "StringOrArray"); vllm-router forwards vLLM's /inference/v1/generate too. So every
router, agentfsm's included, is replayed through vLLM's /v1/completions with a text prompt made of words that
are one token each in the tiny model's vocabulary (`ignore_eos`, `max_tokens` = the recorded new tokens):
the same bytes through every router. A turn's prompt is the session's previous prompt plus new words (the
model's answer and the tool's result stand in as words), so the cache can serve every full KV block (vLLM's CPU
engine: 128 tokens) of the turn before.

Traffic is a list of `Call`s (per request: session, group, turn, prompt tokens, new tokens, tool latency
before the next request): `--trace FILE` replays recorded ones (JSON lines of these fields, or a run directory
whose journal bench/traffic.py reads), else five shapes are generated, their sessions' turn counts drawn anew
each repeat (the same draw for every router of the repeat). Replay is closed-loop: a whole batch starts at once (one synchronous RL step), each session
sends its turns in order, waiting the recorded tool latency between them; the step's makespan is when its
last session ends.

`--sim N` replays against N modeled vLLM servers instead (bench/fleet_sim.py): vLLM's scheduling and prefix
cache with the compute as sleeps, so that the servers compute apart from the client and the routers.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import re
import signal
import socket
import statistics
import subprocess
import sys
import time
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

from backends.base import BackendUnavailable, BaseBackend, GenerateRequest, GenerateResult, retry
from backends.launcher import SGLangLauncher, die_with_parent
from backends.router import Router, by_turn
from backends.server_client import ServerClient
from bench.traffic import Call, calls_of_run

ROOT = Path(__file__).resolve().parent.parent
ROUTERS_VENV = Path(os.environ.get("AGENTFSM_ROUTERS_VENV") or ROOT / ".venv-routers")
VLLM_VENV = Path(os.environ.get("VLLM_VENV") or ROOT / ".venv-vllm")
SHAPES = ("calculator", "long", "groups", "skewed", "crowded")
OURS = ("agentfsm", "agentfsm+priority")  # agentfsm's router, and with `by_turn` priorities


# --- traffic -------------------------------------------------------------------------------------------------


def _session(
    sid: str, group: str | None, first: int, grow: int, turns: int, new: int, tool_s: float
) -> list[Call]:
    return [Call(sid, group, t, first + t * (grow + new), new, tool_s) for t in range(turns)]


def shape(name: str, skewed_keys: Sequence[str] = (), draw: int = 0) -> list[Call]:
    """The generated shapes. `skewed_keys`: session ids of which most hash to one server (`skew_keys`).
    `draw`: which draw of the sessions' turn counts (each repeat of the bench draws anew, the same for every
    router: a router that places deterministically would otherwise meet one split of the work every time)."""
    rng = random.Random(name if draw == 0 else f"{name}:{draw}")
    calls: list[Call] = []
    if name == "calculator":  # short tool sessions: a system prompt with the tool's schema, 2-4 turns
        for i in range(48):
            calls += _session(f"calc{i}", None, 160, 40, rng.randint(2, 4), 24, 0.05)
    elif name == "long":  # long multi-turn sessions: 5-20 KV blocks of 128 tokens by their last turn
        for i in range(16):
            calls += _session(f"long{i}", None, 640, 200, rng.randint(5, 10), 32, 0.1)
    elif name == "groups":  # GRPO: 8 prompts x 8 samples; the samples share a 1,024-token prompt
        for g in range(8):
            for k in range(8):
                calls += _session(f"g{g}s{k}", f"g{g}", 1024, 96, rng.randint(1, 3), 32, 0.05)
    elif name == "crowded":  # more calculator sessions than the servers run at once: turns wait in queues
        for i in range(640):
            calls += _session(f"crowd{i}", None, 160, 40, rng.randint(2, 4), 24, 0.05)
    elif name == "skewed":  # 24 sessions, 18 of whose keys hash to one server under consistent hashing
        for sid in skewed_keys:
            calls += _session(sid, None, 384, 128, rng.randint(3, 5), 32, 0.05)
    else:
        raise ValueError(f"bench fleet: no shape {name!r} ({', '.join(SHAPES)})")
    return calls


def load_trace(path: str | os.PathLike[str]) -> list[Call]:
    """Recorded calls, one JSON object per line with Call's fields; a run directory gives its own
    (bench/traffic.py)."""
    if Path(path).is_dir():
        return calls_of_run(path)
    calls = []
    for n, line in enumerate(Path(path).read_text().splitlines(), 1):
        if line.strip():
            try:
                calls.append(Call(**json.loads(line)))
            except (TypeError, ValueError) as e:
                raise ValueError(f"{path}:{n}: not a call record ({e})") from None
    return calls


class Words:
    """Prompts of exact token counts: words that are one token each (with their leading space) in the model's
    vocabulary, drawn per session (and per group for the shared prompt) from a seeded stream."""

    def __init__(self, model: Path):
        from tokenizers import Tokenizer

        vocab = Tokenizer.from_file(str(model / "tokenizer.json")).get_vocab()
        self.words = sorted(w[1:] for w in vocab if w.startswith("Ġ") and w[1:].isalpha() and w[1:].islower())
        self._streams: dict[str, list[str]] = {}

    def _stream(self, key: str, n: int) -> list[str]:
        s = self._streams.setdefault(key, [])
        if len(s) < n:
            rng = random.Random(f"{key}:{len(s)}")
            s += [rng.choice(self.words) for _ in range(n - len(s))]
        return s

    def text(self, key: str, n: int) -> str:
        """`n` tokens of `key`'s stream, as a prompt."""
        return " " + " ".join(self._stream(key, n)[:n])

    def prompt(self, calls: list[Call], turn: int) -> str:
        """The session's context at `turn`: its group's prompt (its first turn's length), then its own."""
        first, n = calls[0].prompt_tokens, calls[turn].prompt_tokens
        shared = self._stream(calls[0].group, first) if calls[0].group else []
        own = self._stream(calls[0].session, n)
        return " " + " ".join((shared + own[len(shared) :])[:n])


# --- the servers and the routers -----------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def metrics(http: aiohttp.ClientSession, url: str) -> dict[str, float]:
    """vLLM's own counters: prefix-cache queries and hits (tokens), finished requests."""
    async with http.get(url + "/metrics") as r:
        text = await r.text()
    out: dict[str, float] = defaultdict(float)
    for name in ("prefix_cache_queries_total", "prefix_cache_hits_total", "request_success_total"):
        for m in re.finditer(rf"^vllm:{name}{{[^}}]*}} ([0-9.e+]+)$", text, re.M):
            out[name] += float(m.group(1))
    return out


@dataclass
class EngineRouter:
    """One engine router process in front of the servers."""

    name: str
    argv: list[str]
    model: str = ""  # the served model's name: a ready router answers a 1-token completion for it
    url: str = ""
    proc: subprocess.Popen[bytes] | None = None
    log: Path | None = None

    async def __aenter__(self) -> EngineRouter:
        port = free_port()
        self.url = f"http://127.0.0.1:{port}"
        argv = [a.replace("{port}", str(port)).replace("{metrics}", str(free_port())) for a in self.argv]
        self.log = Path(os.environ.get("TMPDIR", "/tmp")) / f"agentfsm-fleet-{self.name}-{port}.log"
        self.proc = subprocess.Popen(
            argv,
            stdout=self.log.open("wb"),
            stderr=subprocess.STDOUT,
            start_new_session=True,
            preexec_fn=die_with_parent(),  # a bench killed mid-run leaves no router behind
        )
        # Ready when it forwards: sglang-router answers /health before it has registered its workers (on a
        # loaded machine its first requests then fail with 5xx).
        probe = completion_body(self.model, " a", 1)
        async with aiohttp.ClientSession() as http:
            for _ in range(600):  # 60 s
                if self.proc.poll() is not None:
                    raise RuntimeError(f"bench fleet: router {self.name} exited; see {self.log}")
                try:
                    async with http.post(self.url + "/v1/completions", json=probe) as r:
                        if r.status == 200:
                            return self
                except aiohttp.ClientError:
                    pass
                await asyncio.sleep(0.1)
        raise RuntimeError(f"bench fleet: router {self.name} not forwarding after 60 s; see {self.log}")

    async def __aexit__(self, *exc: object) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()


def engine_routers(servers: Sequence[str]) -> dict[str, list[str]]:
    """The engine routers' command lines ({port}, {metrics}: free ports filled at start)."""
    bin_ = ROUTERS_VENV / "bin"
    vllm = [
        str(bin_ / "vllm-router"),
        "--worker-urls",
        *servers,
        "--port",
        "{port}",
        "--prometheus-port",
        "{metrics}",
    ]
    vllm += ["--log-level", "warning", "--health-check-interval-secs", "5"]
    sgl = [str(bin_ / "python"), "-m", "sglang_router.launch_router", "--worker-urls", *servers]
    sgl += [
        "--host",
        "127.0.0.1",
        "--port",
        "{port}",
        "--prometheus-port",
        "{metrics}",
        "--log-level",
        "warn",
    ]
    return {
        "vllm-router consistent_hash": [*vllm, "--policy", "consistent_hash"],
        "vllm-router cache_aware": [*vllm, "--policy", "cache_aware"],
        "vllm-router round_robin": [*vllm, "--policy", "round_robin"],
        "sglang-router manual": [*sgl, "--policy", "manual", "--assignment-mode", "min_load"],
        "sglang-router cache_aware": [*sgl, "--policy", "cache_aware"],
    }


class Completions(BaseBackend):
    """A vLLM server's /v1/completions with a text prompt: the route every router is replayed through. A
    failure is retried on the same server under the engine's own client's default policy
    (backends/server_client.py) before the router sees it, so a dropped connection does not fail a server over
    here when it would not in a run."""

    provider = "vllm"

    def __init__(self, url: str, http: aiohttp.ClientSession, model: str):
        self.url, self.http, self.model_name = url, http, model
        self.policy = ServerClient(url).retry_policy

    async def generate(self, request: GenerateRequest) -> GenerateResult:
        return await retry(self.policy, lambda _: self._attempt(request))

    async def _attempt(self, request: GenerateRequest) -> GenerateResult:
        body = completion_body(
            self.model_name, request.sampling_params["text"], request.sampling_params["max_new_tokens"]
        )
        if request.priority is not None:
            body["priority"] = request.priority
        try:
            async with self.http.post(self.url + "/v1/completions", json=body) as r:
                if r.status != 200:
                    raise BackendUnavailable(
                        f"{self.url}: /v1/completions answered {r.status}", server=self.url, status=r.status
                    )
                answer = await r.json()
        except aiohttp.ClientError as e:
            raise BackendUnavailable(f"{self.url}: /v1/completions: {e}", server=self.url) from None
        usage = answer["usage"]
        cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
        return GenerateResult(
            answer["choices"][0]["token_ids"], None, "length", usage["prompt_tokens"], cached
        )


def completion_body(model: str, text: str, new: int) -> dict[str, Any]:
    return {
        "model": model,
        "prompt": text,
        "max_tokens": new,
        "ignore_eos": True,
        "temperature": 0.0,
        "return_token_ids": True,
    }


# --- replay --------------------------------------------------------------------------------------------------


@dataclass
class Outcome:
    latencies: list[float] = field(default_factory=list)
    new_tokens: int = 0
    makespan_s: float = 0.0
    errors: int = 0


async def replay(calls: list[Call], send: Callable[[list[Call], int, str], Any], words: Words) -> Outcome:
    """Closed loop: every session starts at once; each sends its turns in order, sleeping its tool latency."""
    by_session: dict[str, list[Call]] = defaultdict(list)
    for c in sorted(calls, key=lambda c: (c.session, c.turn)):
        by_session[c.session].append(c)
    out = Outcome()
    t0 = time.perf_counter()

    async def run(turns: list[Call]) -> None:
        for k, call in enumerate(turns):
            t = time.perf_counter()
            try:
                await send(turns, k, words.prompt(turns, k))
            except Exception:
                out.errors += 1
                return
            out.latencies.append(time.perf_counter() - t)
            out.new_tokens += call.new_tokens
            if k + 1 < len(turns):
                await asyncio.sleep(call.tool_s)

    await asyncio.gather(*(run(t) for t in by_session.values()))
    out.makespan_s = time.perf_counter() - t0
    return out


def percentile(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


async def measure(
    http: aiohttp.ClientSession, servers: Sequence[str], calls: list[Call], send: Any, words: Words
) -> dict[str, Any]:
    """One replay from a cold cache, with the servers' counters read around it."""
    for url in servers:  # cold: every router starts from empty caches
        async with http.post(url + "/reset_prefix_cache") as r:
            r.raise_for_status()
    before = [await metrics(http, u) for u in servers]
    out = await replay(calls, send, words)
    after = [await metrics(http, u) for u in servers]
    delta = [{k: a[k] - b[k] for k in a} for a, b in zip(after, before)]
    queries = sum(d["prefix_cache_queries_total"] for d in delta)
    hits = sum(d["prefix_cache_hits_total"] for d in delta)
    done = [d["request_success_total"] for d in delta]
    return {
        "hit_rate": hits / queries if queries else 0.0,
        "tokens_per_s": out.new_tokens / out.makespan_s,
        "p50_ms": 1e3 * percentile(out.latencies, 0.5),
        "p99_ms": 1e3 * percentile(out.latencies, 0.99),
        "makespan_s": out.makespan_s,
        "max_server_share": max(done) / sum(done) if sum(done) else 0.0,
        "errors": out.errors,
    }


async def skew_keys(
    http: aiohttp.ClientSession, servers: Sequence[str], model: str, n: int = 24
) -> list[str]:
    """Session ids of which 3/4 hash to the first server under vllm-router's consistent hash, found by asking
    it (one 1-token request per candidate; its log names the worker each key maps to)."""
    argv = engine_routers(servers)["vllm-router consistent_hash"]
    argv[argv.index("warning")] = "info"  # its INFO lines name the worker of each key
    hot: list[str] = []
    cold: list[str] = []
    async with EngineRouter("calibrate", argv, model) as router:
        for i in range(8 * n):
            if len(hot) >= n * 3 // 4 and len(cold) >= n - n * 3 // 4:
                break
            sid = f"skew{i}"
            async with http.post(
                router.url + "/v1/completions",
                json=completion_body(model, " a", 1),
                headers={"X-Session-ID": sid},
            ) as r:
                r.raise_for_status()
            assert router.log is not None
            found = re.findall(
                rf"key='header:x-session-id:{sid}' -> worker='([^']+)'", router.log.read_text()
            )
            if found:
                (hot if found[-1] == servers[0] else cold).append(sid)
    return hot[: n * 3 // 4] + cold[: n - n * 3 // 4]


async def run_fleet(
    servers: Sequence[str],
    model_dir: Path,
    trace: str | None = None,
    shapes: Sequence[str] = (),
    repeats: int = 3,
    only: Sequence[str] = (),  # router names to run (default: all)
) -> dict[str, Any]:
    words = Words(model_dir)
    timeout = aiohttp.ClientTimeout(total=600)
    results: dict[str, dict[str, Any]] = {}
    # keep-alive under uvicorn's 5 s: a pooled connection the server closed would fail a request (a failover)
    connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=4.0)
    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as http:
        async with http.get(servers[0] + "/v1/models") as r:
            model = (await r.json())["data"][0]["id"]
        if trace:
            traces = [{Path(trace).stem: load_trace(trace)}] * repeats
        else:
            names = list(shapes) or list(SHAPES)
            keys = await skew_keys(http, servers, model) if "skewed" in names else []
            traces = [{name: shape(name, keys, rep) for name in names} for rep in range(repeats)]

        def agentfsm(priority: bool) -> Callable[[], Any]:
            def make() -> Any:
                policy = by_turn if priority else None
                clients = [Completions(u, http, model) for u in servers]
                return Router(clients, group_affinity=True, health_interval_s=0, priority=policy)

            return make

        async def engine(name: str, argv: list[str], calls: list[Call]) -> dict[str, Any]:
            async with EngineRouter(name.replace(" ", "-"), argv, model) as router:

                async def send(turns: list[Call], k: int, text: str) -> None:
                    headers = {"X-Session-ID": turns[0].session, "x-smg-routing-key": turns[0].session}
                    body = completion_body(model, text, turns[k].new_tokens)
                    async with http.post(router.url + "/v1/completions", json=body, headers=headers) as r:
                        r.raise_for_status()
                        await r.read()

                return await measure(http, servers, calls, send, words)

        async def ours(make: Callable[[], Router], calls: list[Call]) -> dict[str, Any]:
            router = make()

            async def send(turns: list[Call], k: int, text: str) -> None:
                c = turns[k]
                params = {"text": text, "max_new_tokens": c.new_tokens}
                await router.generate(GenerateRequest(c.session, [], params, group_id=c.group, turn=k))
                if k + 1 == len(turns):
                    await router.release(c.session)

            row = await measure(http, servers, calls, send, words)
            row.update({k: router.counts[k] for k in ("bounded", "moved", "failovers")})
            return row

        runs: dict[str, list[dict[str, Any]]] = defaultdict(list)
        ours_ = {"agentfsm": agentfsm(False), "agentfsm+priority": agentfsm(True)}
        theirs = engine_routers(servers)
        # the order turns each repeat: no router always runs first on a cold machine
        for rep in range(repeats):
            names = [n for n in [*ours_, *theirs] if not only or n in only]
            names = names[rep % len(names) :] + names[: rep % len(names)]
            for shape_name, calls in traces[rep].items():
                for name in names:
                    row = await (
                        ours(ours_[name], calls) if name in ours_ else engine(name, theirs[name], calls)
                    )
                    runs[f"{shape_name} | {name}"].append(row)
                    print_row(shape_name, name, row)
        print(f"medians of {repeats} repeats:", file=sys.stderr)
        for key, rows in runs.items():  # the median of each number over the repeats
            results[key] = {k: statistics.median(r[k] for r in rows) for k in rows[0]}
            print_row(*key.split(" | "), results[key])
    return {
        "servers": list(servers),
        "repeats": repeats,
        "results": results,
        "traffic": {k: len(v) for k, v in traces[0].items()},
    }


def print_row(shape_name: str, router: str, r: dict[str, Any]) -> None:
    print(
        f"| {shape_name} | {router} | {r['hit_rate']:.3f} | {r['tokens_per_s']:.0f} | {r['p50_ms']:.0f} | "
        f"{r['p99_ms']:.0f} | {r['makespan_s']:.2f} | {r['max_server_share']:.2f} | {r['errors']} | "
        f"{r.get('moved', '-')} |",
        file=sys.stderr,
        flush=True,
    )


def refusal(trace: str | None = None, shapes: Sequence[str] = (), routers: Sequence[str] = ()) -> str | None:
    """Why `bench fleet` with these flags cannot start here, in one line that says what to do (None: it can);
    checked before any server starts (`agentfsm bench fleet` prints it as its error)."""
    known = [*OURS, *engine_routers([])]
    unknown = [r for r in routers if r not in known]
    if unknown:
        return f"bench fleet: no router {unknown[0]!r}; the routers: {', '.join(known)}"
    skewed = not trace and (not shapes or "skewed" in shapes)  # its keys are found by asking vllm-router
    needs_theirs = skewed or not routers or any(r not in OURS for r in routers)
    if needs_theirs and not (ROUTERS_VENV / "bin" / "vllm-router").exists():
        ours = " ".join(f"--router {r}" for r in OURS)
        return (
            f"bench fleet: no routers virtualenv at {ROUTERS_VENV}; build it with `bash .ci/routers_env.sh` "
            f"(or measure agentfsm's routers alone: --shape calculator {ours})"
        )
    return None


def bench_fleet(
    servers: Sequence[str] = (),
    trace: str | None = None,
    n_servers: int = 2,
    repeats: int = 3,
    shapes: Sequence[str] = (),
    routers: Sequence[str] = (),
    sim: int = 0,
) -> dict[str, Any]:
    """Replay every shape (or `trace`, or `shapes`) through every router (or `routers`, by name) against
    `servers` (vLLM serving the padded tiny model, started with `--scheduling-policy priority` and
    VLLM_SERVER_DEV_MODE=1, the model directory on this machine), or against `n_servers` launched here from
    $VLLM_VENV, or against `sim` modeled servers (bench/fleet_sim.py). Prints the table's rows as they come."""
    problem = refusal(trace, shapes, routers)
    if problem is not None:
        raise ValueError(problem)
    print(
        "| shape | router | hit rate | tok/s | p50 ms | p99 ms | makespan s | max share | errors | moved |",
        file=sys.stderr,
    )
    print("|---|---|---|---|---|---|---|---|---|---|", file=sys.stderr)
    which = {"shapes": shapes, "only": routers, "repeats": repeats}
    if servers:
        return asyncio.run(_given(list(servers), trace, which))
    if sim:
        return asyncio.run(_simulated(sim, trace, which))
    return asyncio.run(_launched(n_servers, trace, which))


async def _given(servers: list[str], trace: str | None, which: dict[str, Any]) -> dict[str, Any]:
    async with aiohttp.ClientSession() as http, http.get(servers[0] + "/v1/models") as r:
        model_dir = Path((await r.json())["data"][0]["root"])  # the served directory: its tokenizer.json
    return await run_fleet(servers, model_dir, trace, **which)


async def _launched(n: int, trace: str | None, which: dict[str, Any]) -> dict[str, Any]:
    import tempfile

    from backends.launcher import VLLMLauncher
    from backends.tiny.head_pad import convert_tiny

    with tempfile.TemporaryDirectory(prefix="agentfsm-fleet-") as tmp:
        model = convert_tiny(Path(tmp) / "model")  # vLLM's CPU attention needs 32-dim heads (tests/vllm)
        launcher = VLLMLauncher(
            str(model),
            dp=n,
            base_port=free_port(),
            device="cpu",
            python=str(VLLM_VENV / "bin" / "python"),
            log_dir=Path(tmp) / "logs",
            extra_args=["--scheduling-policy", "priority"],
        )
        async with launcher:
            result = await run_fleet(launcher.urls, model, trace, **which)
    result["launched"] = n
    return result


class SimLauncher(SGLangLauncher):
    """`dp` modeled servers (bench/fleet_sim.py), launched as backends/launcher.py launches real ones: ports
    from `base_port`, one log each, healthy on /health, stopped with a grace. `model_path` is the directory
    their /v1/models names."""

    def __init__(self, model_path: str, **options: Any):
        path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)
        env = {"PYTHONPATH": path}  # `bench` is importable from its parent directory, checkout or bundle
        super().__init__(model_path, mem_fraction=None, module="bench.fleet_sim", env=env, **options)

    def command(self, i: int) -> list[str]:
        port = ["--port", str(self.base_port + i)]
        return [self.python, "-m", self.module, *port, "--root", self.model_path, *self.extra_args]


async def _simulated(n: int, trace: str | None, which: dict[str, Any]) -> dict[str, Any]:
    import tempfile

    from backends.tiny import ASSET_DIR

    with tempfile.TemporaryDirectory(prefix="agentfsm-fleet-sim-") as tmp:
        launcher = SimLauncher(str(ASSET_DIR), dp=n, base_port=free_port(), log_dir=tmp, startup_timeout_s=60)
        async with launcher:
            result = await run_fleet(launcher.urls, ASSET_DIR, trace, **which)
    result["simulated"] = n
    return result
