"""A modeled vLLM server for `bench fleet --sim N`: its scheduler and prefix cache, its compute as sleeps.

On this machine the real fleet (bench/fleet.py) shares 2 cores between the servers' engines, their front ends,
the routers and the client, so which process a core serves decides a step's last seconds and no router's
makespan reproduces. A fleet whose servers compute apart from the clients (GPUs) cannot run here; this model
stands in for it. Each server is its own process that answers vLLM's routes (/v1/completions with a text
prompt; /inference/v1/generate with token ids, the route the engine's client drives, answered with the
calculator's real turns over the tokenizer in --root; /metrics, /health, /v1/models, /reset_prefix_cache) and
runs vLLM v1's scheduling in outline:

- a running set of at most `max_num_seqs`, each engine step a token budget of `max_batched_tokens` spent on
  the running sequences first (one token per decoding sequence, chunks of pending prompts), then on admitting
  waiting requests in order of (priority, arrival) (`--scheduling-policy priority`) or arrival (fcfs);
- an LRU prefix cache of full blocks keyed by the chain of their tokens, a block cached when a step allocates
  it: a new request skips its longest cached run of full blocks (all but the last token at most), counted in `vllm:prefix_cache_queries_total`
  and `vllm:prefix_cache_hits_total` (tokens);
- each step lasts `Costs.step(work)`: a base, plus prices per prompt token computed and per pair of such a
  token and a token it attends, per decoding sequence and per token of context it attends, constants fitted by `calibrate` against a real vLLM server (the defaults:
  vLLM 0.32's CPU engine on one core of this machine, the padded tiny model; docs/benchmarks.md).

A text prompt's tokens are its whitespace-separated words (bench/fleet.py replays words that are one token each).
What it leaves out: preemption when the KV cache is full (the shapes fit), sampling, and the front end's own
CPU. The engine routers cannot tell it from vLLM: they forward the same bytes and read the same routes.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import logging
import statistics
import time
from collections import OrderedDict
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
from aiohttp import web

MAX_MODEL_LEN = 32768

WORK = ("steps", "prefilled", "pairs", "decoding", "context")


@dataclass
class Work:
    """What engine steps did, summed: the terms `Costs.step` prices (`calibrate` fits the prices to them)."""

    steps: int = 0
    prefilled: int = 0  # prompt tokens computed
    pairs: int = 0  # (prompt token, token it attends) pairs of those
    decoding: int = 0  # sequences that decoded a token
    context: int = 0  # the tokens those sequences attended

    def add(self, other: Work) -> None:
        for k in WORK:
            setattr(self, k, getattr(self, k) + getattr(other, k))


@dataclass(frozen=True)
class Costs:
    """Prices of an engine step's work, and the engine's limits."""

    base_s: float = 5.5e-3
    prefill_token_s: float = 4.7e-5
    pair_s: float = 5.1e-8
    decode_seq_s: float = 1.45e-4
    context_token_s: float = 6.8e-7
    # each request's turn in the server's front end (one request at a time) before it reaches the queue
    frontend_s: float = 1.8e-3
    block: int = 128
    max_num_seqs: int = 128
    max_batched_tokens: int = 2048
    cache_blocks: int = 1024

    def prices(self) -> tuple[float, ...]:
        return (self.base_s, self.prefill_token_s, self.pair_s, self.decode_seq_s, self.context_token_s)

    def step(self, work: Work) -> float:
        return sum(p * getattr(work, k) for p, k in zip(self.prices(), WORK))


@dataclass(eq=False)
class Seq:
    tokens: list[Any]  # words of a text prompt, or token ids
    new: int
    priority: int
    arrival: int
    done: asyncio.Future[None]
    keys: list[int]  # the chain of its prompt's full blocks, hashed once
    computed: int = 0  # prompt tokens in the KV cache (cached or prefilled)
    generated: int = 0
    cached: int = 0


@dataclass
class Counters:
    queries: int = 0
    hits: int = 0
    success: int = 0
    work: Work = field(default_factory=Work)


class Engine:
    """One server's scheduler, prefix cache and step loop."""

    def __init__(self, costs: Costs, priority: bool = True):
        self.costs, self.priority = costs, priority
        self.waiting: list[Seq] = []
        self.running: list[Seq] = []
        self.cache: OrderedDict[int, None] = OrderedDict()
        self.counters = Counters()
        self._arrivals = itertools.count()
        self._frontend = asyncio.Lock()
        self._wake = asyncio.Event()
        self._loop: asyncio.Task[None] | None = None

    def _block_keys(self, tokens: list[Any]) -> list[int]:
        keys, h = [], 0
        for i in range(len(tokens) // self.costs.block):
            h = hash((h, *tokens[i * self.costs.block : (i + 1) * self.costs.block]))
            keys.append(h)
        return keys

    def _lookup(self, seq: Seq) -> int:
        """Tokens the cache serves: the longest run of cached full blocks, never the prompt's last token."""
        n = 0
        for key in seq.keys[: (len(seq.tokens) - 1) // self.costs.block]:
            if key not in self.cache:
                break
            self.cache.move_to_end(key)
            n += self.costs.block
        return n

    def _insert(self, keys: list[int]) -> None:
        for key in keys:
            self.cache[key] = None
            self.cache.move_to_end(key)
        while len(self.cache) > self.costs.cache_blocks:
            self.cache.popitem(last=False)

    async def generate(self, tokens: list[Any], new: int, priority: int) -> Seq:
        if self.costs.frontend_s:
            async with self._frontend:
                await asyncio.sleep(self.costs.frontend_s)
        loop = asyncio.get_running_loop()
        seq = Seq(
            tokens,
            max(1, new),
            priority if self.priority else 0,
            next(self._arrivals),
            loop.create_future(),
            self._block_keys(tokens),
        )
        self.waiting.append(seq)
        self._wake.set()
        if self._loop is None:
            self._loop = asyncio.create_task(self._run())
        await seq.done
        return seq

    def _schedule(self) -> tuple[dict[Seq, int], Work]:
        """This step's prompt chunks (tokens per sequence) and its work."""
        budget = self.costs.max_batched_tokens
        chunks: dict[Seq, int] = {}
        work = Work(steps=1)

        def chunk(seq: Seq) -> None:
            nonlocal budget
            chunks[seq] = n = min(len(seq.tokens) - seq.computed, budget)
            work.prefilled += n
            work.pairs += n * (seq.computed + n // 2)
            budget -= n
            # vLLM caches a chunk's full blocks when it allocates them (vllm/v1/core/kv_cache_manager.py
            # allocate_slots): a request scheduled later in the same step already hits them
            self._insert(seq.keys[: (seq.computed + n) // self.costs.block])

        for seq in self.running:
            if budget <= 0:
                break
            if seq.computed < len(seq.tokens):
                chunk(seq)
            else:
                work.decoding += 1
                work.context += len(seq.tokens) + seq.generated
                budget -= 1
        self.waiting.sort(key=lambda s: (s.priority, s.arrival))
        while self.waiting and budget > 0 and len(self.running) < self.costs.max_num_seqs:
            seq = self.waiting.pop(0)
            seq.cached = seq.computed = self._lookup(seq)
            self.counters.queries += len(seq.tokens)
            self.counters.hits += seq.cached
            self.running.append(seq)
            chunk(seq)
        return chunks, work

    async def _run(self) -> None:
        while True:
            if not self.waiting and not self.running:
                self._wake.clear()
                await self._wake.wait()
            chunks, work = self._schedule()
            await asyncio.sleep(self.costs.step(work))
            self.counters.work.add(work)
            for seq in list(self.running):
                if seq in chunks:
                    seq.computed += chunks[seq]
                    if seq.computed < len(seq.tokens):
                        continue
                seq.generated += 1  # a prompt's last chunk samples its first token in the same step
                if seq.generated >= seq.new:
                    self.running.remove(seq)
                    self.counters.success += 1
                    seq.done.set_result(None)

    async def close(self) -> None:
        if self._loop is not None:
            self._loop.cancel()
            await asyncio.gather(self._loop, return_exceptions=True)

    def reset_cache(self) -> None:
        self.cache.clear()


def app(engine: Engine, model: str, root: str) -> web.Application:
    labels = f'{{engine="0",model_name="{model}"}}'
    calculator: list[Any] = []  # the token route's model, made at its first request (root's tokenizer)

    def refuse(message: str) -> web.Response:  # vLLM's shape of a 400
        return web.json_response(
            {"error": {"message": message, "type": "BadRequestError", "code": 400}}, status=400
        )

    def too_long(prompt: int, new: int) -> web.Response | None:  # as vLLM: the whole sequence must fit
        if prompt + new <= MAX_MODEL_LEN:
            return None
        return refuse(f"{prompt} prompt tokens + max_tokens {new} exceed the context of {MAX_MODEL_LEN}")

    def usage(seq: Seq) -> dict[str, Any]:
        n = len(seq.tokens)
        return {
            "prompt_tokens": n,
            "completion_tokens": seq.new,
            "total_tokens": n + seq.new,
            "prompt_tokens_details": {"cached_tokens": seq.cached},
        }

    async def completions(request: web.Request) -> web.Response:
        try:
            body = await request.json()
            tokens = body["prompt"].split()
            new, priority = int(body.get("max_tokens") or 16), int(body.get("priority") or 0)
        except (ValueError, TypeError, KeyError, AttributeError) as e:
            return refuse(f"not a completion request with a text prompt ({type(e).__name__}: {e})")
        if refused := too_long(len(tokens), new):
            return refused
        seq = await engine.generate(tokens, new, priority)
        choice = {"index": 0, "text": " a" * seq.new, "token_ids": [0] * seq.new, "finish_reason": "length"}
        return web.json_response(
            {
                "id": f"cmpl-{seq.arrival}",
                "object": "text_completion",
                "created": int(time.time()),
                "model": model,
                "choices": [{**choice, "logprobs": None}],
                "usage": usage(seq),
            }
        )

    async def generate(request: web.Request) -> web.Response:
        """vLLM's token route (backends/vllm.py speaks it): the calculator model's turn, scheduled as its
        tokens; the sampling parameters it reads are max_tokens, stop_token_ids and logprobs."""
        from backends.base import GenerateRequest
        from backends.scripted import calculator_backend

        try:
            body = await request.json()
            ids, params = body["token_ids"], body.get("sampling_params") or {}
            if not isinstance(ids, list) or not all(type(t) is int for t in ids):
                raise TypeError("token_ids is not a list of integers")
            new, priority = int(params.get("max_tokens") or 16), int(body.get("priority") or 0)
            stops = list(params.get("stop_token_ids") or ())
        except (ValueError, TypeError, KeyError, AttributeError) as e:
            return refuse(f"not a generate request with token_ids ({type(e).__name__}: {e})")
        if refused := too_long(len(ids), new):
            return refused
        if not calculator:
            try:
                calculator.append(calculator_backend(root))
            except (OSError, ValueError, KeyError) as e:
                return refuse(
                    f"the token route speaks with the tokenizer in --root {root!r}, which failed: {e}"
                )
        asked = {"max_new_tokens": new, "stop_token_ids": stops}
        said = await calculator[0].generate(GenerateRequest("", ids, asked, return_logprob=False))
        seq = await engine.generate(ids, len(said.token_ids), priority)
        logprobs = [{"token_id": t, "logprob": -0.5} for t in said.token_ids]
        choice = {"index": 0, "token_ids": said.token_ids, "finish_reason": said.finish_reason}
        return web.json_response(
            {
                "request_id": body.get("request_id"),
                "choices": [{**choice, "logprobs": {"content": logprobs} if "logprobs" in params else None}],
                "usage": usage(seq),
            }
        )

    async def metrics(_: web.Request) -> web.Response:
        c = engine.counters
        lines = [
            f"vllm:prefix_cache_queries_total{labels} {float(c.queries)}",
            f"vllm:prefix_cache_hits_total{labels} {float(c.hits)}",
            f'vllm:request_success_total{{engine="0",finished_reason="length",model_name="{model}"}} '
            f"{float(c.success)}",
            f"vllm:num_requests_running{labels} {float(len(engine.running))}",
            f"vllm:num_requests_waiting{labels} {float(len(engine.waiting))}",
        ]
        return web.Response(text="\n".join(lines) + "\n")

    async def models(_: web.Request) -> web.Response:
        return web.json_response(
            {
                "object": "list",
                "data": [
                    {
                        "id": model,
                        "object": "model",
                        "root": root,
                        "owned_by": "vllm",  # how the engine tells a vLLM server (backends/engines.py)
                        "max_model_len": MAX_MODEL_LEN,
                    }
                ],
            }
        )

    async def reset(_: web.Request) -> web.Response:
        engine.reset_cache()
        return web.Response()

    async def health(_: web.Request) -> web.Response:
        return web.Response()

    a = web.Application()
    a.add_routes(
        [
            web.post("/v1/completions", completions),
            web.post("/inference/v1/generate", generate),
            web.get("/metrics", metrics),
            web.get("/v1/models", models),
            web.post("/reset_prefix_cache", reset),
            web.get("/health", health),
        ]
    )
    return a


# --- fitting the costs to a real server -----------------------------------------------------------------------


@dataclass
class Probe:
    """One timed load: `n` requests at once, of `prompt` tokens each (the first `shared` of them the same in
    every request), `new` tokens each."""

    n: int
    prompt: int
    new: int
    shared: int = 0

    def texts(self, words: Any, key: str) -> list[str]:
        own = [words.text(f"{key}:{i}", self.prompt - self.shared) for i in range(self.n)]
        return [(words.text(key, self.shared) if self.shared else "") + x for x in own]


PROBES = [
    Probe(1, 8, 1),
    Probe(32, 8, 1),  # the front end: 32 requests' turns in it, one engine step
    Probe(1, 2048, 1),
    Probe(8, 1024, 1),
    Probe(1, 8, 129),
    Probe(64, 8, 129),
    Probe(16, 2048, 65),  # decoding over long contexts
    Probe(4, 2048, 129),
    Probe(16, 512, 65),
    Probe(16, 1024, 33, shared=896),  # a group: the shared blocks served from the cache
    Probe(48, 200, 24),  # a calculator step's first turns
]


async def features(probe: Probe, words: Any) -> list[float]:
    """The model's own work for `probe` (`WORK`'s sums, then its requests and a 1 for the round trip), from
    running its scheduler with steps that take no time."""
    engine = Engine(Costs(*(0.0,) * 6))
    await asyncio.gather(*(engine.generate(t.split(), probe.new, 0) for t in probe.texts(words, "f")))
    await engine.close()
    return [*(float(getattr(engine.counters.work, k)) for k in WORK), probe.n, 1.0]


def nonnegative_fit(rows: list[list[float]], seconds: list[float]) -> list[float]:
    """Least squares of the relative errors, every coefficient >= 0: solve, drop the columns that came out
    negative, again."""
    import numpy as np

    b = np.array(seconds, dtype=float)
    a = np.array(rows, dtype=float) / b[:, None]  # relative errors: the short probes count as the long
    b = np.ones_like(b)
    keep = list(range(a.shape[1]))
    while True:
        x, *_ = np.linalg.lstsq(a[:, keep] / a[:, keep].max(0), b, rcond=None)
        x = x / a[:, keep].max(0)
        if (x >= 0).all():
            out = [0.0] * a.shape[1]
            for k, v in zip(keep, x):
                out[k] = float(v)
            return out
        keep = [k for k, v in zip(keep, x) if v > 0]


async def calibrate(url: str, words: Any, repeats: int = 3) -> tuple[Costs, dict[str, Any]]:
    """Fit `Costs` to a real vLLM server: time `PROBES` from cold caches (medians of `repeats`), count what
    the model's scheduler does for each, and solve for the costs (nonnegative least squares; a constant for
    the client's round trip). Returns the costs and, per probe, the real and the fitted seconds."""
    from bench.fleet import completion_body

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as http:
        async with http.get(url + "/v1/models") as r:
            model = (await r.json())["data"][0]["id"]
        keys = itertools.count()

        async def load(p: Probe) -> float:
            async with http.post(url + "/reset_prefix_cache") as r:
                r.raise_for_status()
            texts = p.texts(words, f"cal{next(keys)}")
            t = time.perf_counter()

            async def one(text: str) -> None:
                async with http.post(url + "/v1/completions", json=completion_body(model, text, p.new)) as r:
                    r.raise_for_status()
                    await r.read()

            await asyncio.gather(*(one(x) for x in texts))
            return time.perf_counter() - t

        await load(Probe(4, 64, 8))  # warm the server's code paths
        seconds: list[list[float]] = [[] for _ in PROBES]
        for _ in range(repeats):
            for p, s in zip(PROBES, seconds):
                s.append(await load(p))
    real = [statistics.median(s) for s in seconds]
    rows = [await features(p, words) for p in PROBES]
    fit = nonnegative_fit(rows, real)
    base, prefill, pair, decode, context, frontend, round_trip = fit
    costs = Costs(base, prefill, pair, decode, context, frontend)
    report = {
        f"{p.n}x{p.prompt}{'/' + str(p.shared) if p.shared else ''}+{p.new}": [
            round(r, 4),
            round(sum(k * v for k, v in zip(row, fit)), 4),
        ]
        for p, r, row in zip(PROBES, real, rows)
    }
    return costs, {"round_trip_s": round_trip, "probes (real s, fitted s)": report}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m bench.fleet_sim", description=__doc__.splitlines()[0])
    ap.add_argument("--port", type=int, help="serve on this port")
    ap.add_argument("--calibrate", metavar="URL", help="print the costs fitted to this real vLLM server")
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--root", default="", help="what /v1/models names as the model's directory")
    ap.add_argument("--scheduling-policy", choices=["fcfs", "priority"], default="priority")
    for f in Costs.__dataclass_fields__.values():
        ap.add_argument("--" + f.name.replace("_", "-"), type=type(f.default), default=f.default)
    a = ap.parse_args(argv)
    if a.calibrate:
        from bench.fleet import Words

        async def fit() -> tuple[Costs, dict[str, Any]]:
            async with aiohttp.ClientSession() as http, http.get(a.calibrate + "/v1/models") as r:
                root = (await r.json())["data"][0]["root"]
            return await calibrate(a.calibrate, Words(Path(root)))

        costs, report = asyncio.run(fit())
        print(json.dumps({"costs": asdict(costs), **report}, indent=1))
        return
    if a.port is None:
        ap.error("give --port (serve) or --calibrate URL")
    costs = Costs(**{k: getattr(a, k) for k in asdict(Costs())})
    engine = Engine(costs, priority=a.scheduling_policy == "priority")
    # sglang-router opens each worker connection with an HTTP/2 preface first; aiohttp answers it 400, as
    # uvicorn does, and would log a traceback for each
    logging.getLogger("aiohttp.server").setLevel(logging.CRITICAL)
    web.run_app(app(engine, a.model, a.root), host="127.0.0.1", port=a.port, print=None)


if __name__ == "__main__":
    main()
