"""Exchanges with an SGLang-protocol server, scripted once and run against two servers: real SGLang, whose
answers `tests/sglang/record.py` writes to tests/fixtures/sglang/*.json, and the dev server
(backends/devserver.py), whose answers tests/test_devserver_fidelity.py compares with those recordings.

Each scenario is an async function of a `Session` that makes HTTP calls in a fixed order; every call is
recorded as one exchange {name, method, path, request, status, content_type, body}. A scenario is written so
that both servers take the same path through it: it waits for conditions (a request running, the server
paused), never for time. `exact` names what must be equal in the two recordings beyond the shape (the
JSON keys and types, everywhere): statuses always, and the paths listed per exchange.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Awaitable, Callable
from typing import Any

import aiohttp

# The tiny model's chat prompt for "What is 12 + 7?" (backends/tiny/assets' template; eos <|im_end|> is 2).
PROMPT = [
    1,
    502,
    201,
    312,
    351,
    262,
    493,
    411,
    16,
    2,
    201,
    1,
    316,
    201,
    413,
    338,
    223,
    19,
    20,
    390,
    223,
    25,
    33,
    2,
    201,
    1,
    359,
    201,
]
EOS = 2
LONG = 600  # max_new_tokens of a request that must still be running when a scenario pauses or aborts it
GREEDY = {"temperature": 0.0}
WAIT_S = 120.0  # bound on every wait for a condition


class Session:
    """Records the exchanges of one scenario against the server at `url`."""

    def __init__(self, url: str, http: aiohttp.ClientSession):
        self.url, self.http = url, http
        self.exchanges: list[dict[str, Any]] = []
        self.model_path: str | None = None

    async def call(
        self,
        name: str,
        method: str,
        path: str,
        body: Any = None,
        *,
        raw: str | None = None,
        exact: tuple[str, ...] = (),
        keys: tuple[str, ...] = (),
        record: bool = True,
        loose: bool = False,
    ) -> Any:
        """One exchange; `raw` sends that text as the body (malformed JSON); `keys`: compare the shape of
        these top-level keys only (SGLang's /server_info carries every server argument); `loose`: compare the
        `exact` paths only, not the shape. Returns the body."""
        slot = len(self.exchanges)  # recorded in the order the calls are made, whenever their answers come
        if record:
            self.exchanges.append({})
        kwargs: dict[str, Any] = {}
        if raw is not None:
            kwargs = {"data": raw, "headers": {"Content-Type": "application/json"}}
        elif body is not None:
            kwargs = {"json": body}
        async with self.http.request(method, self.url + path, **kwargs) as resp:
            text = await resp.text()
            ctype = resp.headers.get("Content-Type")
        parsed: Any
        if ctype and ctype.startswith("text/event-stream"):  # the events' data, each parsed
            parsed = [_json_or_text(line[6:]) for line in text.split("\n") if line.startswith("data: ")]
        else:
            parsed = _json_or_text(text) if text else None
        if record:
            self.exchanges[slot] = {
                "name": name,
                "method": method,
                "path": path,
                "request": body if raw is None else raw,
                "status": resp.status,
                "content_type": ctype.split(";")[0] if ctype else None,
                "body": parsed,
                "exact": list(exact),
                "keys": list(keys),
                "loose": loose,
            }
        return parsed

    def generate(
        self,
        name: str,
        rid: str,
        max_new: int,
        *,
        logprob: bool = True,
        exact: tuple[str, ...] = (),
        record: bool = True,
        loose: bool = False,
        **params: Any,
    ) -> Awaitable[Any]:
        body = {
            "input_ids": PROMPT,
            "rid": rid,
            "return_logprob": logprob,
            "sampling_params": {**GREEDY, "max_new_tokens": max_new, **params},
        }
        return self.call(name, "POST", "/generate", body, exact=exact, record=record, loose=loose)

    async def loads(self) -> dict[str, Any]:
        body = await self.call("loads", "GET", "/v1/loads", record=False)
        return body["loads"][0]

    async def until(self, what: str, cond: Callable[[dict[str, Any]], bool]) -> None:
        """Poll /v1/loads until `cond(loads[0])` holds."""
        deadline = time.monotonic() + WAIT_S
        while not cond(await self.loads()):
            if time.monotonic() > deadline:
                raise TimeoutError(f"{self.url}: not {what} within {WAIT_S:g} s")
            await asyncio.sleep(0.02)

    async def running(self, n: int = 1) -> None:
        await self.until(f"{n} running", lambda x: x["num_running_reqs"] >= n)

    async def idle(self) -> None:
        await self.until("idle", lambda x: x["num_running_reqs"] == 0 and x["num_waiting_reqs"] == 0)


def _json_or_text(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return text


def spawn(coro: Awaitable[Any]) -> asyncio.Task[Any]:
    return asyncio.ensure_future(coro)


# What is equal on both servers, beyond the shape: the tokens greedy decoding makes and how a request ended.
FINISH = ("meta_info.finish_reason",)
TOKENS = (
    "output_ids",
    "meta_info.prompt_tokens",
    "meta_info.completion_tokens",
    "meta_info.weight_version",
    "meta_info.weight_versions",
    "meta_info.dp_rank",
    "meta_info.cached_tokens",
    "meta_info.cached_tokens_details",
    *FINISH,
)
ERROR = ("body",)


# -- the scenarios ---------------------------------------------------------------------------------------


async def info(s: Session) -> None:
    """Health, readiness and what a server says about itself."""
    await s.call("health", "GET", "/health", exact=ERROR)
    await s.call("ready", "GET", "/ready", exact=ERROR)
    await s.call(
        "model_info",
        "GET",
        "/model_info",
        exact=(
            "body.is_generation",
            "body.weight_version",
            "body.model_type",
            "body.architectures",
            "body.preferred_sampling_params",
            "body.disaggregation_mode",
        ),
    )
    await s.call(
        "server_info",
        "GET",
        "/server_info",
        exact=("body.context_length", "body.max_req_input_len", "body.skip_tokenizer_init", "body.version"),
        keys=(
            "context_length",
            "max_req_input_len",
            "max_total_num_tokens",
            "skip_tokenizer_init",
            "version",
            "model_path",
            "served_model_name",
            "host",
            "port",
            "weight_version",
        ),
    )
    await s.call("loads", "GET", "/v1/loads", exact=("body.loads.0.num_running_reqs",))


async def generate(s: Session) -> None:
    """Greedy /generate: logprobs, a stop id, max_new_tokens 0, the prefix cache, a stream."""
    await s.call("flush_idle", "POST", "/flush_cache", exact=ERROR)
    full = await s.generate("greedy", "gen-a", 12, exact=TOKENS)
    await s.generate("greedy_cached", "gen-b", 12, exact=TOKENS)
    stop_id = full["output_ids"][3]
    await s.generate("stop_id", "gen-c", 12, stop_token_ids=[stop_id], exact=TOKENS)
    await s.generate("eos_stop", "gen-d", 64, stop_token_ids=[EOS], exact=TOKENS)
    await s.generate("zero_new", "gen-e", 0, exact=TOKENS)
    await s.generate("no_logprob", "gen-f", 4, logprob=False, exact=TOKENS)
    body = {
        "input_ids": PROMPT,
        "rid": "gen-s",
        "stream": True,
        "sampling_params": {**GREEDY, "max_new_tokens": 3},
    }
    # (SGLang may send fewer chunks than tokens when the reader lags: the first and the last two are compared)
    await s.call(
        "stream",
        "POST",
        "/generate",
        body,
        exact=("body.0.output_ids", "body.-2.output_ids", "body.-2.meta_info.finish_reason", "body.-1"),
    )


async def errors(s: Session) -> None:
    """What a bad request gets: the status and the server's words."""
    base = {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 4}}
    await s.call("empty_input", "POST", "/generate", {**base, "input_ids": []}, exact=ERROR)
    await s.call(
        "negative_temperature",
        "POST",
        "/generate",
        {**base, "sampling_params": {"temperature": -1.0}},
        exact=ERROR,
    )
    await s.call(
        "stop_without_tokenizer",
        "POST",
        "/generate",
        {**base, "sampling_params": {"stop": ["x"]}},
        exact=ERROR,
    )
    await s.call(
        "unknown_sampling_field", "POST", "/generate", {**base, "sampling_params": {"seed": 1}}, exact=ERROR
    )
    await s.call(
        "wrong_type", "POST", "/generate", {**base, "sampling_params": {"temperature": "hot"}}, exact=ERROR
    )
    await s.call("malformed_json", "POST", "/generate", raw='{"input_ids": [1, 2', exact=("body.object",))
    await s.call("input_too_long", "POST", "/generate", {**base, "input_ids": [5] * 5000}, exact=ERROR)
    await s.call(
        "over_context",
        "POST",
        "/generate",
        {**base, "sampling_params": {"max_new_tokens": 4090}},
        exact=ERROR,
    )
    await s.call(
        "negative_max_new",
        "POST",
        "/generate",
        {**base, "sampling_params": {"max_new_tokens": -1}},
        exact=ERROR,
    )
    await s.call("abort_empty_rid", "POST", "/abort_request", {"rid": ""}, exact=ERROR)
    await s.call("abort_unknown_rid", "POST", "/abort_request", {"rid": "nobody"}, exact=ERROR)


async def warm(s: Session) -> None:
    """The prompt in the prefix cache (each scenario runs on a fresh dev server, on a used SGLang)."""
    await s.generate("warm", "warm", 1, record=False)


async def aborts(s: Session) -> None:
    """/abort_request of running requests: partial output; prefix matching; a duplicate rid while live."""
    await warm(s)
    await s.idle()
    run = spawn(s.generate("aborted_running", "abt", LONG, ignore_eos=True, exact=FINISH))
    await s.running()
    await s.call(
        "duplicate_rid",
        "POST",
        "/generate",
        {"input_ids": PROMPT, "rid": "abt", "sampling_params": {"max_new_tokens": 2}},
        exact=ERROR,
    )
    await s.call("abort_running", "POST", "/abort_request", {"rid": "abt"}, exact=ERROR)
    await run
    await s.idle()
    # SGLang matches rids by prefix: aborting "pre" aborts "pre_x" too; a prefix that is not live aborts nothing
    a = spawn(s.generate("prefix_owner", "pre", LONG, ignore_eos=True, exact=FINISH))
    # (the dev server's model batches without joining a running batch: "pre_x" may still wait there, and then
    # ends as a waiting-queue abort; that it ends aborted is what is compared)
    b = spawn(
        s.generate(
            "prefix_extended",
            "pre_x",
            LONG,
            ignore_eos=True,
            exact=("meta_info.finish_reason.type",),
            loose=True,
        )
    )
    await s.running(2)
    await s.call("abort_dead_prefix", "POST", "/abort_request", {"rid": "pr"}, exact=ERROR)
    await s.call("abort_prefix", "POST", "/abort_request", {"rid": "pre"}, exact=ERROR)
    await asyncio.gather(a, b)
    await s.idle()
    run = spawn(s.generate("aborted_all", "abt-all", LONG, ignore_eos=True, exact=FINISH))
    await s.running()
    await s.call("abort_all", "POST", "/abort_request", {"rid": "", "abort_all": True}, exact=ERROR)
    await run


async def pauses(s: Session) -> None:
    """/pause_generation in each mode with a running request, /ready while paused, /continue_generation; a
    request that arrives while paused; an abort of it, which is lost."""
    await warm(s)
    await s.idle()
    for mode in ("abort", "retract", "in_place"):
        run = spawn(
            s.generate(
                f"paused_{mode}", f"pz-{mode}", 40 if mode != "abort" else LONG, ignore_eos=True, exact=FINISH
            )
        )
        await s.running()
        await s.call(f"pause_{mode}", "POST", "/pause_generation", {"mode": mode}, exact=ERROR)
        await s.call(f"ready_paused_{mode}", "GET", "/ready", exact=ERROR)
        if mode == "abort":
            await run
        await s.call(f"continue_{mode}", "POST", "/continue_generation", {}, exact=ERROR)
        await run
        await s.idle()
    # A request sent while paused waits in the front end: /abort_request does not reach it (twice), and it
    # runs to completion after continue.
    await s.call("pause_for_late", "POST", "/pause_generation", {"mode": "abort"}, exact=ERROR)
    late = spawn(s.generate("late_after_continue", "late", 6, exact=TOKENS))
    await s.call("abort_late", "POST", "/abort_request", {"rid": "late"}, exact=ERROR)
    await s.call("abort_late_again", "POST", "/abort_request", {"rid": "late"}, exact=ERROR)
    await s.call("ready_while_late", "GET", "/ready", exact=ERROR)
    assert not late.done(), "a request sent while paused answered before continue"
    await s.call("continue_late", "POST", "/continue_generation", {}, exact=ERROR)
    await late
    # A retracted request waits in the queue while paused: an abort of it is a waiting-queue abort.
    await s.idle()
    run = spawn(s.generate("aborted_waiting", "wq", LONG, ignore_eos=True, exact=FINISH))
    await s.running()
    await s.call("pause_retract_for_wq", "POST", "/pause_generation", {"mode": "retract"}, exact=ERROR)
    await s.call("abort_waiting", "POST", "/abort_request", {"rid": "wq"}, exact=ERROR)
    await s.call("continue_wq", "POST", "/continue_generation", {}, exact=ERROR)
    await run


async def cache_and_weights(s: Session) -> None:
    """/flush_cache while busy; /update_weights_from_disk to the early checkpoint and back, and a bad path."""
    await warm(s)
    await s.idle()
    run = spawn(s.generate("busy", "busy", LONG, ignore_eos=True))
    await s.running()
    await s.call("flush_busy", "POST", "/flush_cache", exact=ERROR)
    await s.call("abort_busy", "POST", "/abort_request", {"rid": "busy"})
    await run
    await s.idle()
    assert s.model_path is not None
    early = s.model_path.rstrip("/") + "/early"
    await s.call(
        "update_early",
        "POST",
        "/update_weights_from_disk",
        {"model_path": early, "weight_version": "2"},
        exact=("body.success", "body.num_paused_requests"),
    )
    await s.generate("greedy_early", "w-early", 12, exact=TOKENS)
    await s.call("model_info_early", "GET", "/model_info", exact=("body.weight_version",))
    await s.call(
        "update_missing",
        "POST",
        "/update_weights_from_disk",
        {"model_path": early + "/missing", "weight_version": "3"},
        exact=("body.success", "body.num_paused_requests"),
    )
    await s.call(
        "update_back",
        "POST",
        "/update_weights_from_disk",
        {"model_path": s.model_path, "weight_version": "4"},
        exact=("body.success",),
    )
    await s.generate("greedy_back", "w-back", 12, exact=TOKENS)
    # Held in place across an update: the weights change, the cache cannot be flushed (a 400 that is not a
    # failed load), and the held request reports which weights made which tokens.
    await s.idle()
    run = spawn(
        s.generate("held_across_update", "held", 300, ignore_eos=True, exact=("meta_info.weight_version",))
    )
    await s.running()
    await s.call("pause_in_place", "POST", "/pause_generation", {"mode": "in_place"}, exact=ERROR)
    await s.call(
        "update_held",
        "POST",
        "/update_weights_from_disk",
        {"model_path": s.model_path, "weight_version": "5"},
        exact=("body.success", "body.num_paused_requests"),
    )
    await s.call(
        "update_held_no_flush",
        "POST",
        "/update_weights_from_disk",
        {"model_path": s.model_path, "weight_version": "6", "flush_cache": False},
        exact=ERROR,
    )
    await s.call("continue_held", "POST", "/continue_generation", {}, exact=ERROR)
    await run


SCENARIOS: dict[str, Callable[[Session], Awaitable[None]]] = {
    "info": info,
    "generate": generate,
    "errors": errors,
    "aborts": aborts,
    "pauses": pauses,
    "cache_and_weights": cache_and_weights,
}


async def run_scenario(name: str, url: str, model_path: str) -> list[dict[str, Any]]:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=WAIT_S)) as http:
        s = Session(url, http)
        s.model_path = model_path
        await SCENARIOS[name](s)
        return s.exchanges


# -- comparing two recordings ---------------------------------------------------------------------------


def shape(value: Any) -> Any:
    """The JSON structure without the values: key sets, list-ness (by the first element) and types."""
    if isinstance(value, dict):
        return {k: shape(v) for k, v in sorted(value.items())}
    if isinstance(value, list):
        return [shape(value[0])] if value else []
    if isinstance(value, bool):
        return "bool"
    if isinstance(value, (int, float)):
        return "number"
    if value is None:
        return "null"
    return "str"


def shape_differences(real: Any, dev: Any, path: str = "body") -> list[str]:
    """Where two shapes differ, one line per place: a missing or extra key, or another type."""
    if isinstance(real, dict) and isinstance(dev, dict):
        out = [f"{path}.{k} missing (SGLang: {json.dumps(real[k])})" for k in real if k not in dev]
        out += [f"{path}.{k} is extra" for k in dev if k not in real]
        for k in real:
            if k in dev:
                out += shape_differences(real[k], dev[k], f"{path}.{k}")
        return out
    if isinstance(real, list) and isinstance(dev, list) and real and dev:
        return shape_differences(real[0], dev[0], f"{path}[0]")
    if real != dev and not (isinstance(real, list) and isinstance(dev, list)):  # an empty list fits any list
        return [f"{path} is {json.dumps(dev)}, SGLang {json.dumps(real)}"]
    return []


def at(value: Any, path: str) -> Any:
    for part in path.split("."):
        if isinstance(value, list) and part.lstrip("-").isdigit() and -len(value) <= int(part) < len(value):
            value = value[int(part)]
        elif isinstance(value, dict) and part in value:
            value = value[part]
        else:
            return "<absent>"
    return value


def _rooted(body: Any) -> dict[str, Any]:
    """Paths name the body's own keys ("meta_info.id") or the whole body ("body")."""
    return {"body": body, **body} if isinstance(body, dict) else {"body": body}


def differences(real: list[dict[str, Any]], dev: list[dict[str, Any]]) -> list[str]:
    """Each way the dev server's exchanges differ from the recorded real ones, one line each."""
    out: list[str] = []
    if [e["name"] for e in real] != [e["name"] for e in dev]:
        return [f"exchanges differ: {[e['name'] for e in real]} vs {[e['name'] for e in dev]}"]
    for r, d in zip(real, dev):
        where = f"{r['name']} ({r['method']} {r['path']})"
        for key in ("status", "content_type"):
            if r[key] != d[key]:
                out.append(f"{where}: {key} {d[key]!r}, SGLang {r[key]!r}")
        real_body, dev_body = r["body"], d["body"]
        if r.get("keys") and isinstance(real_body, dict) and isinstance(dev_body, dict):
            real_body = {k: real_body.get(k, "<absent>") for k in r["keys"]}
            dev_body = {k: dev_body.get(k, "<absent>") for k in r["keys"]}
        if not r.get("loose"):
            out += [f"{where}: {line}" for line in shape_differences(shape(real_body), shape(dev_body))]
        for path in r["exact"]:
            want, got = at(_rooted(r["body"]), path), at(_rooted(d["body"]), path)
            if want != got:
                out.append(f"{where}: {path} = {json.dumps(got)}, SGLang {json.dumps(want)}")
    return out
