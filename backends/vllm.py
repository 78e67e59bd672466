"""Token-in-token-out client for a vLLM 0.32 server (backends/launcher.py starts one; `vllm serve` with
`--enable-scale-out` and VLLM_SERVER_DEV_MODE=1 serves everything used here).

The same Backend contract as backends/sglang.py over vLLM's own routes (the table in docs/engines.md): each
answer is put in SGLang's shape and checked by the one validation step (backends/answer.py); SGLang's sampling
names are renamed (an unknown one refused before sending); `max_new_tokens` 0 is answered here and the rest
clamped to the room left in `max_model_len` (vLLM answers 400 instead of truncating). Aborts name vLLM's full
`generate-tokens-` id (matched exactly), one per attempt, so aborting a hung attempt never reaches its retry.
Pause modes map to the nearest vLLM mode, and while this client has the server paused its requests' deadlines
stand still (backends/pause_clock.py). An update from disk runs the worker extension's exact reload
(backends/vllm_reload.py) under a `keep` pause, so no token is made by new weights under the old label; a CPU
server without the extension is refused an update (its tied head would mix checkpoints), never served a mix.
`vllm` itself is never imported.
"""

from __future__ import annotations

import logging
from typing import Any

from backends.answer import ANSWER_FAULTS, body_limit, parse_generate, snippet
from backends.base import (
    BackendMalformed,
    BackendRequestError,
    BackendUnavailable,
    GenerateRequest,
    GenerateResult,
)
from backends.server_client import ServerClient, wire_ids

__all__ = ["VLLMBackend", "FAULT_KINDS", "PAUSE_MODES", "sglang_shape", "vllm_params"]

log = logging.getLogger("agentfsm.vllm")

_WEIGHTS_TIMEOUT_S = 600.0  # a weight reload may take minutes
EXTENSION = "backends.vllm_reload.ExactReload"  # the worker extension exact updates need
REQUEST_PREFIX = "generate-tokens-"  # what vLLM puts before a /inference/v1/generate request id
# The engine's (SGLang's) pause modes -> vLLM's; vLLM's own names are taken as they are.
PAUSE_MODES = {"abort": "abort", "in_place": "keep", "retract": "wait", "keep": "keep", "wait": "wait"}
_RENAMED = {"max_new_tokens": "max_tokens", "min_new_tokens": "min_tokens", "sampling_seed": "seed"}
_SAME = frozenset(
    "temperature top_p top_k min_p frequency_penalty presence_penalty repetition_penalty stop_token_ids "
    "ignore_eos n logit_bias".split()
)
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
            raise BackendRequestError(
                f"sampling parameter {key!r} has no vLLM equivalent here (known: {known})"
            )
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
        return BackendMalformed(
            f"{server}: /inference/v1/generate (rid {rid}) answered 200 with {what}; a server fault",
            server=server,
            status=200,
            kind="malformed",
        )

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
    generate_path = "/inference/v1/generate"
    info_what = "/v1/models"
    context_margin = 0  # vLLM takes prompt + max_tokens == max_model_len

    fault_kinds = FAULT_KINDS
    _extension: bool | None = None  # the server runs backends/vllm_reload.py (asked at the first update)
    _device = ""  # vLLM's device_config.device

    # -- what the server says about itself ----------------------------------------------------------------

    async def _read_info(self) -> dict[str, Any]:
        status, body = await self._call("GET", "/v1/models")
        cards = body.get("data") if isinstance(body, dict) else None
        if status != 200 or not isinstance(cards, list) or not cards or not isinstance(cards[0], dict):
            raise BackendMalformed(
                f"{self.url}: /v1/models answered {status} {snippet(body)}, not a model list",
                server=self.url,
                status=status,
                kind="bad_fields",
            )
        card = cards[0]
        length = card.get("max_model_len")
        if length is not None and (type(length) is not int or length <= 0):
            raise BackendMalformed(
                f"{self.url}: /v1/models has max_model_len {snippet(length)}, not a positive integer",
                server=self.url,
                status=200,
                kind="bad_fields",
            )
        if self.context_length is None:
            self.context_length = length
        if not self._name_given and isinstance(card.get("id"), str):
            self.model_name = card["id"]
        path = card.get("root") if isinstance(card.get("root"), str) else None
        # SGLang's /model_info keys, which the engine reads (tokenizer path, weight version)
        self._info = {
            "model_path": path,
            "tokenizer_path": path,
            "served_model_name": card.get("id"),
            "context_length": length,
            "engine": "vllm",
        }
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

    # -- generation ---------------------------------------------------------------------------------------

    def _wire_rid(self, rid: str, attempt: int, session_id: str) -> str:
        return rid if attempt == 1 else f"{rid}_a{attempt}"  # aborts match ids exactly: a retry gets its own

    async def _generate_once(
        self, request: GenerateRequest, asked: GenerateRequest, timeout_s: float
    ) -> GenerateResult:
        rid, params = asked.rid or "", asked.sampling_params
        if params.get("max_new_tokens") == 0:  # vLLM refuses max_tokens 0; nothing would be made
            return GenerateResult(
                [],
                [] if asked.return_logprob else None,
                "length",
                prompt_tokens=len(asked.prompt_ids),
                server=self.url,
            )
        payload: dict[str, object] = {
            "token_ids": wire_ids(asked.prompt_ids),
            "request_id": rid,
            "sampling_params": vllm_params(params, asked.return_logprob),
        }
        if asked.priority is not None:  # honoured by a server started with --scheduling-policy priority
            payload["priority"] = asked.priority
        body = await self._exchange(payload, rid, timeout_s, body_limit(asked))
        shaped = sglang_shape(body, server=self.url, rid=rid)
        result = parse_generate(
            shaped, server=self.url, return_logprob=asked.return_logprob, rid=rid, request=asked
        )
        if result.finish_reason == "abort":
            self.faults["aborts"] += 1
        return self._context_cut(result, request)

    def _grace(self, timeout_s: float) -> float:
        return self.abort_grace_s if self.abort_grace_s is not None else min(5.0, timeout_s / 10)

    def _abort_route(self, rid: str) -> tuple[str, Any]:
        return "/inference/v1/abort_requests", {"request_ids": [REQUEST_PREFIX + rid]}

    # -- control ------------------------------------------------------------------------------------------

    async def health(self, timeout_s: float = 25.0) -> bool:
        """`/health`: 200 while the engine runs (paused or not), 503 once it died."""
        return await super().health(timeout_s)

    async def ready(self, timeout_s: float = 5.0) -> bool:
        """Healthy and not paused (vLLM has no /ready: `/is_paused`, which needs VLLM_SERVER_DEV_MODE)."""
        try:
            status, body = await self._call("GET", "/is_paused", timeout_s=timeout_s, retries=0)
        except BackendUnavailable:
            return False
        if status == 404:  # no dev routes: readiness is health
            return await self.health(timeout_s)
        return status == 200 and isinstance(body, dict) and body.get("is_paused") is False

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

    async def pause_generation(self, mode: str = "abort") -> dict[str, Any]:
        """`/pause` in the vLLM mode nearest to `mode` (module docstring). From now until `continue_generation`
        the deadlines of this client's requests stand still."""
        native = PAUSE_MODES.get(mode)
        if native is None:
            raise ValueError(f"unknown pause mode {mode!r}; expected one of {', '.join(PAUSE_MODES)}")
        self._pause.set(mode)
        try:  # "wait" answers once the running requests finished: bounded like a weight update
            return await self._control(
                "POST", "/pause", params={"mode": native}, timeout_s=_WEIGHTS_TIMEOUT_S
            )
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

    async def update_weights_from_disk(
        self, path: str, weight_version: str | None = None, **options: Any
    ) -> dict[str, Any]:
        """Reload the weights in place from a checkpoint directory so that the server serves exactly it, then
        label them `weight_version`, under a `keep` pause unless this client already holds one (module
        docstring). Refused, before anything moves, where the reload could not be exact (a CPU server without
        the worker extension). `options` are refused: vLLM's reload takes none."""
        if options:
            raise BackendRequestError(
                f"{self.url}: vLLM's weight reload takes no options {sorted(options)}", server=self.url
            )
        exact = await self._exact_updates(f"an update from {path}")
        own = self._pause.mode is None
        if own:
            await self.pause_generation("keep")
        try:
            method = "agentfsm_reload_weights" if exact else "reload_weights"
            body = await self._control(
                "POST",
                "/collective_rpc",
                {"method": method, "kwargs": {"weights_path": str(path)}},
                timeout_s=_WEIGHTS_TIMEOUT_S,
            )
            if exact:
                self._check_heads(body, f"the update from {path}")
            if weight_version is not None:
                await self.update_weight_version(str(weight_version))
        finally:
            if own:
                await self.continue_generation()
        return {"success": True, "weight_version": weight_version, "results": (body or {}).get("results")}

    async def _exact_updates(self, what: str) -> bool:
        """Whether the server has the worker extension (read once from `/server_info`). Without it a CPU server
        is refused `what`: its reload would serve new layers with the old tied output head."""
        if self._extension is None:
            info = await self.server_info()
            config = info.get("vllm_config") if isinstance(info, dict) else None
            config = config if isinstance(config, dict) else {}
            parallel, device = config.get("parallel_config") or {}, config.get("device_config") or {}
            self._extension = parallel.get("worker_extension_cls") == EXTENSION
            self._device = str(device.get("device") or "") if isinstance(device, dict) else ""
        if not self._extension and self._device == "cpu":
            raise BackendRequestError(
                f"{self.url}: refused {what}: vLLM's CPU engine keeps the output head's packed copy through "
                "reload_weights, so a model with tie_word_embeddings would serve the new layers with the old head; "
                f"start the server with --worker-extension-cls {EXTENSION} and the directory "
                "backends.launcher.place_extension(DIR) writes on its PYTHONPATH, as --launch-vllm does",
                server=self.url,
            )
        return self._extension

    def _check_heads(self, body: Any, what: str) -> None:
        """The extension's answer, one per worker: any head still computing with other weights than it holds
        fails the update, naming the server and the layer."""
        results = body.get("results") if isinstance(body, dict) else None
        if not isinstance(results, list) or not results or not all(isinstance(r, dict) for r in results):
            raise BackendMalformed(
                f"{self.url}: /collective_rpc answered {snippet(body)} for {what}, not the "
                "worker extension's report",
                server=self.url,
                status=200,
                kind="malformed",
            )
        stale = [item for r in results for item in (r.get("stale") or [])]
        if stale:
            names = ", ".join(f"{name} (off by {error:.3g} relative)" for name, error in stale)
            raise BackendRequestError(
                f"{self.url}: after {what} the server computes with other weights than "
                f"it holds: {names}; it does not serve the checkpoint",
                server=self.url,
            )

    async def start_weight_update(self) -> dict[str, Any]:
        """`/start_weight_update`: opens a session of the configured weight-transfer engine."""
        return await self._control("POST", "/start_weight_update", timeout_s=_WEIGHTS_TIMEOUT_S)

    async def update_weights(self, update_info: dict[str, Any] | list[dict[str, Any]]) -> dict[str, Any]:
        """`/update_weights`: one chunk of the weight-transfer engine's payload, passed through."""
        return await self._control(
            "POST", "/update_weights", {"update_info": update_info}, timeout_s=_WEIGHTS_TIMEOUT_S
        )

    async def finish_weight_update(self, weight_version: str | None = None) -> dict[str, Any]:
        """`/finish_weight_update`, then (with the worker extension) the heads refreshed and checked as after a
        reload from disk."""
        exact = await self._exact_updates("a weight transfer")
        payload = {} if weight_version is None else {"weight_version": str(weight_version)}
        body = await self._control("POST", "/finish_weight_update", payload, timeout_s=_WEIGHTS_TIMEOUT_S)
        if exact:
            heads = await self._control(
                "POST", "/collective_rpc", {"method": "agentfsm_refresh_heads"}, timeout_s=_WEIGHTS_TIMEOUT_S
            )
            self._check_heads(heads, "the weight transfer")
        return body
