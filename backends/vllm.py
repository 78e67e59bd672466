"""Token-in-token-out client for a vLLM 0.32 server (backends/launcher.py starts one; `vllm serve` with
`--enable-scale-out` and VLLM_SERVER_DEV_MODE=1 serves everything used here).

The same Backend contract as backends/sglang.py over vLLM's own routes:
- `/inference/v1/generate` (`token_ids`, `sampling_params` in vLLM's names, `request_id`) answers
  `choices[0]` with `token_ids`, `logprobs.content[{token_id, logprob}]`, `finish_reason` ("stop", "length",
  "abort"), `weight_versions` spans, and `usage` (`prompt_tokens`, `prompt_tokens_details.cached_tokens`).
  Each answer is put in SGLang's shape and checked by the one validation step (backends/answer.py): ids in
  the vocabulary, finite logprobs <= 0, no more than asked, nothing past a stop id, version spans that cover
  the output;
- the engine speaks SGLang's sampling names; they are renamed here (`max_new_tokens` -> `max_tokens`,
  `sampling_seed` -> `seed`, `min_new_tokens` -> `min_tokens`) and an unknown one is refused before sending.
  `max_new_tokens` 0 is answered here (vLLM refuses it; nothing is generated either way), and it is clamped
  to the room left in `max_model_len` (vLLM answers 400 instead of truncating);
- vLLM prefixes the request id it runs with `generate-tokens-`; an abort (`/inference/v1/abort_requests`)
  names that full id and matches it exactly (SGLang matches by prefix), and an aborted request answers with
  the tokens it made, which the engine resumes. Each attempt has its own wire id, so aborting a hung
  attempt never reaches its retry;
- pauses: `/pause?mode=abort|wait|keep`, `/resume`, `/is_paused`. The engine's SGLang mode names map to the
  nearest vLLM mode: "abort" -> abort (requests end with their partial output), "in_place" -> keep (requests
  are frozen with their KV cache and go on after resume), "retract" -> wait (vLLM cannot requeue a running
  request: the pause lets the running ones finish first, so none is held across a weight update). While this
  client has the server paused, the deadlines of its requests stand still (backends/pause_clock.py);
- weights from a checkpoint directory: `/collective_rpc` `reload_weights(weights_path=...)` then
  `/update_weight_version`, under a `keep` pause this client takes when it holds none, so no token is made by
  new weights under the old version's label; `/start_weight_update`, `/update_weights` and
  `/finish_weight_update` pass a configured weight-transfer engine's payloads through (NCCL/IPC: GPU hosts);
- `/health` (200 once the engine runs), `/is_paused` for readiness, `/v1/models` for the served name, model
  path and `max_model_len`, `/weight_info` for the version, `/reset_prefix_cache` for the cache.
`vllm` itself is never imported.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import uuid
from dataclasses import replace
from typing import Any

from backends.answer import ANSWER_FAULTS, DEFAULT_MAX_NEW_TOKENS, body_limit, parse_generate, snippet
from backends.base import (
    BackendError,
    BackendMalformed,
    BackendRequestError,
    BackendTimeout,
    BackendUnavailable,
    GenerateRequest,
    GenerateResult,
)
from backends.pause_clock import PauseClock
from backends.retry import RetryPolicy, parse_retry_after
from backends.server_client import ServerClient, decode, error_message

__all__ = ["VLLMBackend", "FAULT_KINDS", "PAUSE_MODES", "sglang_shape", "vllm_params"]

log = logging.getLogger(__name__)

_WEIGHTS_TIMEOUT_S = 600.0  # a weight reload may take minutes
REQUEST_PREFIX = "generate-tokens-"  # what vLLM puts before a /inference/v1/generate request id
# The engine's (SGLang's) pause modes -> vLLM's; vLLM's own names are taken as they are.
PAUSE_MODES = {"abort": "abort", "in_place": "keep", "retract": "wait", "keep": "keep", "wait": "wait"}
_RENAMED = {"max_new_tokens": "max_tokens", "min_new_tokens": "min_tokens", "sampling_seed": "seed"}
_SAME = ("temperature", "top_p", "top_k", "min_p", "frequency_penalty", "presence_penalty", "repetition_penalty",
         "stop_token_ids", "ignore_eos", "n", "logit_bias")  # fmt: skip
FAULT_KINDS = ("http_errors", "refused", "disconnects", "resets", "timeouts", *ANSWER_FAULTS, "aborts")


def vllm_params(params: dict[str, Any], return_logprob: bool) -> dict[str, Any]:
    """SGLang-named sampling parameters -> vLLM's SamplingParams fields; an unknown one is a request error."""
    out: dict[str, Any] = {}
    for key, value in params.items():
        if key in _RENAMED:
            out[_RENAMED[key]] = value
        elif key in _SAME:
            out[key] = value
        else:
            known = ", ".join(sorted((*_RENAMED, *_SAME)))
            raise BackendRequestError(f"sampling parameter {key!r} has no vLLM equivalent here (known: {known})")
    if out.get("top_k") is not None and out["top_k"] < 0:
        out["top_k"] = 0  # SGLang's "off" is -1; vLLM 0.32 takes 0 (and -1) for off
    if return_logprob:
        out["logprobs"] = 0  # the sampled token's logprob, no alternatives
    out["detokenize"] = False  # ids in, ids out: no text is made or sent
    return out


def sglang_shape(body: Any, *, server: str, rid: str) -> dict[str, Any]:
    """A /inference/v1/generate answer in SGLang's /generate shape, for backends.answer.parse_generate: the
    structure is checked here (one choice, a known finish reason), the values there."""

    def bad(what: str) -> BackendMalformed:
        return BackendMalformed(f"{server}: /inference/v1/generate (rid {rid}) answered 200 with {what}; a server "
                                "fault", server=server, status=200, kind="malformed")  # fmt: skip

    choices = body.get("choices") if isinstance(body, dict) else None
    if not isinstance(choices, list) or len(choices) != 1 or not isinstance(choices[0], dict):
        raise bad(f"a body without exactly one choice: {snippet(body)}")
    choice = choices[0]
    finish = choice.get("finish_reason")
    if finish not in ("stop", "length", "abort"):
        raise bad(f"finish_reason {snippet(finish)}, not stop, length or abort")
    meta: dict[str, Any] = {"id": body.get("request_id"), "finish_reason": {"type": finish}}
    if finish == "stop" and choice.get("stop_reason") is not None:
        meta["finish_reason"]["matched"] = choice["stop_reason"]
    usage = body.get("usage")
    if isinstance(usage, dict):
        meta["prompt_tokens"] = usage.get("prompt_tokens")
        details = usage.get("prompt_tokens_details")
        meta["cached_tokens"] = details.get("cached_tokens") if isinstance(details, dict) else None
    logprobs = choice.get("logprobs")
    if isinstance(logprobs, dict):
        content = logprobs.get("content")
        if not isinstance(content, list) or not all(isinstance(c, dict) for c in content):
            raise bad(f"logprobs.content that is not a list of entries: {snippet(content)}")
        meta["output_token_logprobs"] = [[c.get("logprob"), c.get("token_id"), None] for c in content]
    elif logprobs is not None:
        raise bad(f"logprobs {snippet(logprobs)}, not an object")
    spans = choice.get("weight_versions")
    if spans:
        meta["weight_versions"] = spans
        last = spans[-1]
        meta["weight_version"] = last.get("version") if isinstance(last, dict) else last
    return {"output_ids": choice.get("token_ids"), "meta_info": meta}


class VLLMBackend(ServerClient):
    """One vLLM server. Safe to share across all trajectories of an event loop."""

    provider = "vllm"

    def __init__(
        self,
        url: str,
        *,
        request_timeout_s: float | None = None,  # per attempt; overrides the spec's limits.request_timeout_s
        max_retries: int = 3,  # retries after the first attempt, for retryable failures only
        backoff_s: float = 0.05,  # first retry delay; doubles each retry, ±20 % jitter
        backoff_max_s: float = 5.0,
        retry: RetryPolicy | None = None,  # the whole policy; replaces max_retries/backoff_s/backoff_max_s
        abort_grace_s: float | None = None,  # after a deadline's abort, how long the partial answer is awaited
        keepalive_s: float = 4.0,  # must stay below uvicorn's 5 s keep-alive
        context_length: int | None = None,  # skip discovery when given
        model_name: str | None = None,
        api_key: str | None = None,
    ):
        policy = retry or RetryPolicy(attempts=1 + max_retries, backoff_s=backoff_s, backoff_max_s=backoff_max_s)
        super().__init__(url, request_timeout_s=request_timeout_s, retry_policy=policy, keepalive_s=keepalive_s,
                         api_key=api_key, faults=FAULT_KINDS)  # fmt: skip
        self.abort_grace_s = abort_grace_s
        self.context_length = context_length
        self.model_name = model_name or "unknown"
        self._name_given = model_name is not None
        self._info: dict[str, Any] | None = None
        self._info_task: asyncio.Future[dict[str, Any]] | None = None  # one read shared by every waiter
        self._pause = PauseClock()  # the pause this client set: generate deadlines run only outside it

    async def close(self) -> None:
        if self._info_task is not None and not self._info_task.done():
            self._info_task.cancel()
            await asyncio.wait({self._info_task})
        await super().close()

    # -- what the server says about itself ----------------------------------------------------------------

    async def _ensure_info(self, timeout_s: float = 30.0) -> None:
        """Read /v1/models once (served name, model path, max_model_len), shared by every caller; each waits at
        most `timeout_s`. A failed read is tried again by the next caller."""
        if self._info is not None:
            return
        task = self._info_task
        if task is None or (task.done() and (task.cancelled() or task.exception() is not None)):
            task = self._info_task = asyncio.ensure_future(self._read_info())
        try:
            async with asyncio.timeout(timeout_s):
                await asyncio.shield(task)
        except TimeoutError:
            raise BackendTimeout(f"{self.url}: /v1/models gave no answer within {timeout_s:g} s", server=self.url,
                                 kind="timeouts") from None  # fmt: skip

    async def _read_info(self) -> dict[str, Any]:
        status, body = await self._call("GET", "/v1/models")
        cards = body.get("data") if isinstance(body, dict) else None
        if status != 200 or not isinstance(cards, list) or not cards or not isinstance(cards[0], dict):
            raise BackendMalformed(f"{self.url}: /v1/models answered {status} {snippet(body)}, not a model list",
                                   server=self.url, status=status, kind="bad_fields")  # fmt: skip
        card = cards[0]
        length = card.get("max_model_len")
        if length is not None and (type(length) is not int or length <= 0):
            raise BackendMalformed(f"{self.url}: /v1/models has max_model_len {snippet(length)}, not a positive "
                                   "integer", server=self.url, status=200, kind="bad_fields")  # fmt: skip
        if self.context_length is None:
            self.context_length = length
        if not self._name_given and isinstance(card.get("id"), str):
            self.model_name = card["id"]
        path = card.get("root") if isinstance(card.get("root"), str) else None
        # SGLang's /model_info keys, which the engine reads (tokenizer path, weight version)
        self._info = {"model_path": path, "tokenizer_path": path, "served_model_name": card.get("id"),
                      "context_length": length, "engine": "vllm"}  # fmt: skip
        return self._info

    async def model_info(self) -> dict[str, Any]:
        """/v1/models' card in SGLang's /model_info keys, with the weight version vLLM reports now."""
        await self._ensure_info()
        assert self._info is not None
        return {**self._info, "weight_version": await self.weight_version_now()}

    async def weight_version_now(self) -> str | None:
        """`/weight_info`'s version (None when the server has no such route: VLLM_SERVER_DEV_MODE unset)."""
        status, body = await self._call("GET", "/weight_info", timeout_s=30)
        return body.get("weight_version") if status == 200 and isinstance(body, dict) else None

    async def server_info(self) -> dict[str, Any]:
        """`/server_info?config_format=json`: vLLM's whole config, its VLLM_* environment and the system's."""
        return await self._control("GET", "/server_info", params={"config_format": "json"})

    async def tokenizer_info(self) -> dict[str, Any]:
        """`/tokenizer_info` (served only with --enable-tokenizer-info-endpoint)."""
        return await self._control("GET", "/tokenizer_info")

    # -- generation ---------------------------------------------------------------------------------------

    def _clamp(self, ids: list[int], params: dict[str, Any]) -> dict[str, Any]:
        """Clamp `max_new_tokens` to the room left in max_model_len, so the turn ends by 'length' instead of a
        400; vLLM takes prompt + max_tokens == max_model_len."""
        if self.context_length is None:
            return params
        room = self.context_length - len(ids)
        if room <= 0:
            raise BackendRequestError(f"{self.url}: prompt of {len(ids)} tokens leaves no room in the context length "
                                      f"{self.context_length}: nothing can be generated; lower the trajectory's "
                                      "budget", server=self.url)  # fmt: skip
        wanted = params.get("max_new_tokens", DEFAULT_MAX_NEW_TOKENS)
        clamped = room if wanted is None else min(int(wanted), room)
        return params if clamped == wanted else {**params, "max_new_tokens": clamped}

    async def generate(self, request: GenerateRequest) -> GenerateResult:
        ids = list(request.prompt_ids)
        rid = request.rid or f"{request.session_id}_g{uuid.uuid4().hex}"
        timeout_s = self.deadline(request)

        async def attempt(n: int) -> GenerateResult:
            wire = rid if n == 1 else f"{rid}_a{n}"  # exact-match aborts: a retry never shares a hung attempt's id
            if n > 1:
                self.counts["retries"] += 1
            self._live[wire] = request.session_id
            try:
                await self._ensure_info(timeout_s)
                params = self._clamp(ids, dict(request.sampling_params))
                asked = replace(request, sampling_params=params, rid=wire)  # what the answer is held to
                if params.get("max_new_tokens") == 0:  # vLLM refuses max_tokens 0; nothing would be made
                    return GenerateResult([], [] if request.return_logprob else None, "length",
                                          prompt_tokens=len(ids), server=self.url)  # fmt: skip
                payload = {"token_ids": ids, "request_id": wire,
                           "sampling_params": vllm_params(params, request.return_logprob)}  # fmt: skip
                return await self._generate_once(payload, wire, timeout_s, asked)
            except BackendError as e:
                if e.kind in self.faults:
                    self.faults[e.kind] += 1
                raise
            finally:
                self._live.pop(wire, None)

        def retryable(e: BaseException) -> bool:  # a hung server stays hung: the router fails over instead
            return self.retry_policy.retryable(e) and not isinstance(e, BackendTimeout)

        return await self._retrying(f"POST /inference/v1/generate (rid {rid})", attempt, self.retry_policy, retryable)

    async def _generate_once(self, payload: dict[str, Any], rid: str, timeout_s: float,
                             asked: GenerateRequest) -> GenerateResult:  # fmt: skip
        """One generate attempt under its deadline; every answer that is not a response raises."""
        self.counts["requests"] += 1
        # owned: ends in `finally`
        exchange = asyncio.ensure_future(self._send("POST", "/inference/v1/generate", payload, body_limit(asked)))
        try:
            if not await self._pause.wait(exchange, timeout_s):
                # Past the deadline: abort it at the server, which then answers this very request with what it
                # made so far (finish_reason abort); else closing the connection ends it (vLLM aborts a request
                # whose client went away).
                await self._abort_quietly(rid)
                grace = self.abort_grace_s if self.abort_grace_s is not None else min(5.0, timeout_s / 10)
                if not await self._pause.wait(exchange, grace):
                    raise BackendTimeout(f"{self.url}: /inference/v1/generate rid {rid} had no answer within "
                                         f"{timeout_s:g} s (request_timeout_s); aborted at the server",
                                         server=self.url, kind="timeouts")  # fmt: skip
            status, headers, data = exchange.result()
        finally:
            if not exchange.done():
                exchange.cancel()
                await asyncio.wait({exchange})
        body = decode(data)
        if status == 200:
            if not isinstance(body, dict):
                kind = headers.get("Content-Type", "no content type").split(";")[0]
                raise BackendMalformed(f"{self.url}: /inference/v1/generate (rid {rid}) answered 200 with a {kind} "
                                       f"body that is not a JSON object: {snippet(body or '')}; a server fault",
                                       server=self.url, status=200, kind="malformed")  # fmt: skip
            shaped = sglang_shape(body, server=self.url, rid=rid)
            result = parse_generate(shaped, server=self.url, return_logprob=asked.return_logprob, rid=rid,
                                    request=asked)  # fmt: skip
            if result.finish_reason == "abort":
                self.faults["aborts"] += 1
            return result
        message = " ".join(error_message(body, str(body)[:200]).split())  # vLLM's validation errors span lines
        if self.retry_policy.retryable_status(status) or status >= 500:
            raise BackendUnavailable(f"HTTP {status} for rid {rid}: {message}", server=self.url, status=status,
                                     kind="http_errors", retry_after=parse_retry_after(headers.get("Retry-After")))  # fmt: skip
        raise BackendRequestError(f"{self.url} rejected rid {rid}: {message}", server=self.url, status=status)

    async def _abort_quietly(self, rid: str) -> None:
        """Best effort abort of a rid past its deadline (the server may be the thing that hangs)."""
        self.counts["aborts_sent"] += 1
        with contextlib.suppress(BackendError):
            await self._call("POST", "/inference/v1/abort_requests", {"request_ids": [REQUEST_PREFIX + rid]},
                             timeout_s=5, retries=0)  # fmt: skip

    # -- control ------------------------------------------------------------------------------------------

    async def _control(self, method: str, path: str, payload: Any = None, timeout_s: float = 60,
                       params: Any = None) -> Any:  # fmt: skip
        status, body = await self._call(method, path, payload, timeout_s=timeout_s, params=params)
        if status >= 400:
            message = " ".join(error_message(body, str(body)[:500]).split())
            raise BackendRequestError(f"{self.url}{path} failed: HTTP {status}: {message}", server=self.url,
                                      status=status)  # fmt: skip
        return body

    async def health(self, timeout_s: float = 25.0) -> bool:
        """`/health`: 200 while the engine runs (paused or not), 503 once it died."""
        return await self._ok("/health", timeout_s)

    async def ready(self, timeout_s: float = 5.0) -> bool:
        """Healthy and not paused (vLLM has no /ready: `/is_paused`, which needs VLLM_SERVER_DEV_MODE)."""
        try:
            status, body = await self._call("GET", "/is_paused", timeout_s=timeout_s, retries=0)
        except BackendUnavailable:
            return False
        if status == 404:  # no dev routes: readiness is health
            return await self.health(timeout_s)
        return status == 200 and isinstance(body, dict) and body.get("is_paused") is False

    async def wait_ready(self, timeout: float = 600.0, interval_s: float = 0.5) -> None:
        """Poll `/health` until 200."""
        deadline = asyncio.get_running_loop().time() + timeout
        while not await self.health(timeout_s=min(25.0, timeout)):
            if asyncio.get_running_loop().time() + interval_s > deadline:
                raise BackendUnavailable(f"{self.url} not healthy after {timeout:.0f} s", server=self.url)
            await asyncio.sleep(interval_s)

    async def is_paused(self) -> bool:
        body = await self._control("GET", "/is_paused", timeout_s=30)
        return bool(body.get("is_paused"))

    async def flush_cache(self) -> bool:
        """`/reset_prefix_cache`: False when vLLM could not (blocks still held by running requests)."""
        body = await self._control("POST", "/reset_prefix_cache", timeout_s=60)
        return bool(isinstance(body, dict) and body.get("success"))

    async def abort_request(self, rid: str = "", abort_all: bool = False) -> None:
        """Abort one live rid (matched exactly), or everything."""
        ids = [] if abort_all else [REQUEST_PREFIX + rid]
        path = "/abort_requests" if abort_all else "/inference/v1/abort_requests"  # the RL route aborts all
        await self._control("POST", path, {"request_ids": ids})

    async def abort(self, session_id: str) -> None:
        """Abort whatever this client has in flight for a trajectory."""
        for rid, sid in list(self._live.items()):
            if sid == session_id:
                await self.abort_request(rid)

    async def pause_generation(self, mode: str = "abort") -> dict[str, Any]:
        """`/pause` in the vLLM mode nearest to `mode` (module docstring). From now until `continue_generation`
        the deadlines of this client's requests stand still."""
        native = PAUSE_MODES.get(mode)
        if native is None:
            raise ValueError(f"unknown pause mode {mode!r}; expected one of {', '.join(PAUSE_MODES)}")
        self._pause.set(mode)
        try:  # "wait" answers once the running requests finished: bounded like a weight update
            return await self._control("POST", "/pause", params={"mode": native}, timeout_s=_WEIGHTS_TIMEOUT_S)
        except BaseException:
            self._pause.set(None)
            raise

    async def continue_generation(self) -> dict[str, Any]:
        body = await self._control("POST", "/resume")
        self._pause.set(None)
        return body

    async def sleep(self, tags: list[str] | None = None) -> Any:
        """`/sleep?level=1` (weights offloaded, KV cache dropped; vLLM sleeps by level, not by tags). Needs a
        server started with --enable-sleep-mode on a platform that has it (not vLLM's CPU engine: not tested
        here)."""
        return await self._control("POST", "/sleep", params={"level": "1"}, timeout_s=_WEIGHTS_TIMEOUT_S)

    async def wake_up(self, tags: list[str] | None = None) -> Any:
        """`/wake_up?tags=...` ("weights", "kv_cache"; none: everything)."""
        params = [("tags", t) for t in tags] if tags else None
        return await self._control("POST", "/wake_up", params=params, timeout_s=_WEIGHTS_TIMEOUT_S)

    async def update_weight_version(self, version: str) -> dict[str, Any]:
        return await self._control("POST", "/update_weight_version", {"new_version": str(version)})

    async def update_weights_from_disk(self, path: str, weight_version: str | None = None,
                                       **options: Any) -> dict[str, Any]:  # fmt: skip
        """Reload the weights in place from a checkpoint directory, then label them `weight_version`, under a
        `keep` pause unless this client already holds one (module docstring). `options` are refused: vLLM's
        reload takes none."""
        if options:
            raise BackendRequestError(f"{self.url}: vLLM's weight reload takes no options {sorted(options)}",
                                      server=self.url)  # fmt: skip
        own = self._pause.mode is None
        if own:
            await self.pause_generation("keep")
        try:
            body = await self._control("POST", "/collective_rpc", {"method": "reload_weights",
                                       "kwargs": {"weights_path": str(path)}}, timeout_s=_WEIGHTS_TIMEOUT_S)  # fmt: skip
            if weight_version is not None:
                await self.update_weight_version(str(weight_version))
        finally:
            if own:
                await self.continue_generation()
        return {"success": True, "weight_version": weight_version, "results": (body or {}).get("results")}

    async def start_weight_update(self) -> dict[str, Any]:
        """`/start_weight_update`: opens a session of the configured weight-transfer engine."""
        return await self._control("POST", "/start_weight_update", timeout_s=_WEIGHTS_TIMEOUT_S)

    async def update_weights(self, update_info: dict[str, Any] | list[dict[str, Any]]) -> dict[str, Any]:
        """`/update_weights`: one chunk of the weight-transfer engine's payload, passed through."""
        return await self._control("POST", "/update_weights", {"update_info": update_info},
                                   timeout_s=_WEIGHTS_TIMEOUT_S)  # fmt: skip

    async def finish_weight_update(self, weight_version: str | None = None) -> dict[str, Any]:
        payload = {} if weight_version is None else {"weight_version": str(weight_version)}
        return await self._control("POST", "/finish_weight_update", payload, timeout_s=_WEIGHTS_TIMEOUT_S)
