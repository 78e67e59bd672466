"""Token-in-token-out client for an SGLang 0.5.23 server (backends/launcher.py starts SGLang replicas).

The wire contract is SGLang's native HTTP API (`/generate` with `input_ids`, `/abort_request`, `/model_info`,
the memory and weight endpoints); backends/devserver.py serves the same contract for tests. The HTTP plumbing
(bounded bodies, retries, per-attempt deadlines with their abort and grace, pauses that stop the deadlines,
fault counts) is backends/server_client.py's, shared with the vLLM client. What is SGLang's own, each where
it is done: `max_new_tokens` clamped to the room left (`_clamp`); a deadline's abort awaited for its partial
answer (`_grace`); rids kept prefix-free and never reused while the server may hold them (`_wire_rid`,
SGLang aborts by prefix); no deadline running while paused (`pause_generation`: SGLang holds a request that
arrives then where an abort never reaches it). `sglang` itself is never imported.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from bisect import bisect_left, insort
from collections import Counter
from collections.abc import Mapping, Sequence
from typing import Any

from backends.answer import ANSWER_FAULTS, body_limit, parse_generate, snippet
from backends.base import (
    BackendError,
    BackendMalformed,
    BackendRequestError,
    BackendUnavailable,
    GenerateRequest,
    GenerateResult,
)
from backends.contract import INPUT_MARGIN
from backends.server_client import ServerClient, error_message, wire_ids

__all__ = ["SGLangBackend", "parse_generate", "error_message", "FAULT_KINDS"]

log = logging.getLogger("agentfsm.sglang")

_WEIGHTS_TIMEOUT_S = 600.0  # a weight reload may take minutes
# After a deadline's /abort_request a live SGLang answers the request with its partial output once its
# scheduler gets to the abort: seconds on a loaded CPU server, more than 5 s for some with 16 requests running
# (docs/engines.md). An abort not awaited loses the attempt's tokens and fails the server over; a hung server
# costs this much more before the router fails over.
DEFAULT_ABORT_GRACE_S = 30.0
MIN_ABORT_GRACE_S = 5.0  # a loaded CPU SGLang answers an abort in 0.7-1.4 s (docs/engines.md)
# How long a rid whose attempt ended without an answer is kept from reuse: past SGLang's own watchdog.
_HELD_S = 600.0
# SGLang's 400 for an update that loaded the weights but could not flush the cache (requests held or running)
_UPDATED_NOT_FLUSHED = "Weights were updated, but the cache was not flushed"
# Attempts that end this way may leave their rid at the server (a deadline, a cut connection, a duplicate).
_MAY_BE_HELD = ("timeouts", "disconnects", "resets", "duplicate")
# What a /generate can meet, counted in stats()["faults"]; each is one failed attempt or one abort.
FAULT_KINDS = (
    "http_errors",
    "refused",
    "disconnects",
    "resets",
    "timeouts",
    *ANSWER_FAULTS,
    "duplicate",
    "aborts_waiting",
    "aborts_running",
)


class SGLangBackend(ServerClient):
    """One SGLang server. Safe to share across all trajectories of an event loop."""

    provider = "sglang"
    generate_path = "/generate"
    info_what = "/model_info and /server_info"
    context_margin = 1

    fault_kinds = FAULT_KINDS

    def __init__(self, url: str, **options: Any):
        """`options`: ServerClient's; `abort_grace_s` None is DEFAULT_ABORT_GRACE_S here."""
        super().__init__(url, **options)
        self.max_input_len: int | None = None  # server's max_req_input_len when it reports one
        # rids whose attempt ended without an answer (deadline, cut connection, duplicate): the server may
        # still hold them until this monotonic time, so no new request reuses or prefixes one (`_wire_rid`)
        self._held: _Rids = _Rids()
        self._live: _Rids = _Rids()  # ServerClient's, indexed: _wire_rid asks it once per attempt

    # -- what the server says about itself -------------------------------------------------------

    async def _get_info(self, paths: Sequence[str]) -> dict[str, Any]:
        """GET the first path that exists (new name, then the deprecated alias)."""
        for path in paths:
            status, body = await self._call("GET", path, timeout_s=30)
            if status == 200 and isinstance(body, dict):
                return body
        return {}

    async def _read_info(self) -> dict[str, Any]:
        info = await self._get_info(("/model_info", "/get_model_info"))
        server = await self._get_info(("/server_info", "/get_server_info"))
        states = server.get("internal_states") or [{}]
        state = states[0] if isinstance(states, list) and states and isinstance(states[0], dict) else {}
        self.max_input_len = self._count(
            server.get("max_req_input_len") or state.get("max_req_input_len"), "max_req_input_len"
        )
        # Server args hold the context length when it was set at launch (else null); the input limit is
        # always there, `INPUT_MARGIN` below it.
        if self.context_length is None:
            ctx = server.get("context_length") or state.get("context_length") or info.get("context_length")
            ctx = self._count(ctx, "context_length")
            self.context_length = ctx or (self.max_input_len + INPUT_MARGIN if self.max_input_len else None)
        if not self._name_given:
            name = info.get("served_model_name") or info.get("model_path")
            self.model_name = name if isinstance(name, str) and name else self.model_name
        self._info = info
        return info

    def _count(self, value: Any, key: str) -> int | None:
        """A positive integer the server info reports, or None when it reports none; else a one-line fault."""
        if value is None or value == 0:
            return None
        if type(value) is int and value > 0:
            return value
        raise BackendMalformed(
            f"{self.url}: server info has {key} {snippet(value)}, not a positive integer",
            server=self.url,
            status=200,
            kind="bad_fields",
        )

    async def model_info(self) -> dict[str, Any]:
        """`/model_info`, falling back to the deprecated `/get_model_info` of older servers."""
        await self._ensure_info()
        assert self._info is not None
        return self._info

    async def server_info(self) -> dict[str, Any]:
        return await self._get_info(("/server_info", "/get_server_info"))

    # -- generation ------------------------------------------------------------------------------

    def _clamp(self, ids: list[int], params: dict[str, Any]) -> dict[str, Any]:
        """Clamp `max_new_tokens` to the room left so the turn ends by 'length' instead of a 400.

        SGLang refuses `max_new_tokens + len(input_ids) >= context_len` (newer releases: `> max_req_len`,
        which is `context_len - 1`), so the room is `context_len - 1 - len(input_ids)`: one token stricter
        than "≤ context_len − len", and accepted by every release (`context_margin`).
        """
        if self.max_input_len is not None and len(ids) >= self.max_input_len:
            raise BackendRequestError(
                f"{self.url}: prompt of {len(ids)} tokens reaches the server's max input length "
                f"{self.max_input_len} (it takes fewer); lower the trajectory's prompt/response budget",
                server=self.url,
            )
        return super()._clamp(ids, params)

    async def _generate_once(
        self, request: GenerateRequest, asked: GenerateRequest, timeout_s: float
    ) -> GenerateResult:
        rid = asked.rid or ""
        payload = {
            "input_ids": wire_ids(asked.prompt_ids),
            "sampling_params": asked.sampling_params,
            "return_logprob": asked.return_logprob,
            "rid": rid,
        }
        body = await self._exchange(payload, rid, timeout_s, body_limit(asked), shapes=(dict, list))
        result = parse_generate(
            body, server=self.url, return_logprob=asked.return_logprob, rid=rid, request=asked
        )
        if result.finish_reason == "abort":
            self.faults[f"aborts_{result.extra['abort_kind']}"] += 1
        return self._context_cut(result, request)

    def _attempt_failed(self, rid: str, error: BackendError) -> None:
        if error.kind in _MAY_BE_HELD:
            self._held[rid] = asyncio.get_running_loop().time() + _HELD_S

    def _grace(self, timeout_s: float) -> float:
        """A tenth of the deadline, at least MIN_ABORT_GRACE_S, at most DEFAULT_ABORT_GRACE_S: a loaded server's
        partial answer is kept, and a hung server's row still ends within what its flags say (the retry window,
        one request timeout and this grace: docs/engines.md)."""
        if self.abort_grace_s is not None:
            return self.abort_grace_s
        return min(DEFAULT_ABORT_GRACE_S, max(MIN_ABORT_GRACE_S, timeout_s / 10))

    def _abort_route(self, rid: str) -> tuple[str, Any]:
        return "/abort_request", {"rid": rid}

    def _wire_rid(self, rid: str, attempt: int, session_id: str) -> str:
        """Each attempt's rid is picked anew: the last one's may still be held. `rid`, unless it and a rid live here or held by the server would prefix one another (SGLang aborts
        by prefix and refuses a rid it still holds: a resume `{turn}_r1` while `{turn}` lives, a retry after a
        deadline): then `{session}_x<random>`, which extends no such rid and which none extends."""
        if self._held:
            now = asyncio.get_running_loop().time()
            for held in [r for r, until in self._held.items() if until <= now]:
                del self._held[held]
        for _ in range(3):
            if not self._live.prefix_related(rid) and not (self._held and self._held.prefix_related(rid)):
                return rid
            rid = f"{session_id}_x{uuid.uuid4().hex[:12]}"
        return uuid.uuid4().hex  # a session id that is itself a prefix of a live rid: no lineage at all

    def _refusal(self, status: int, headers: Mapping[str, str], body: Any, rid: str) -> BackendError:
        error = super()._refusal(status, headers, body, rid)
        if isinstance(error, BackendRequestError) and "Duplicate request ID" in str(error):
            # an earlier attempt of ours is still live there: retry later, under another rid
            message = str(error).removeprefix(f"{self.url} rejected rid {rid}: ")
            return BackendUnavailable(
                f"HTTP {status} for rid {rid}: {message}", server=self.url, status=status, kind="duplicate"
            )
        return error

    # -- control ---------------------------------------------------------------------------------

    async def health(self, timeout_s: float = 25.0) -> bool:
        """`/health` runs a 1-token generate server-side (≥ 1 s, up to 20 s): True when it answered 200."""
        return await super().health(timeout_s)

    async def ready(self, timeout_s: float = 5.0) -> bool:
        """`/ready`: cheap; False while starting, shutting down or paused."""
        return await self._ok("/ready", timeout_s)

    async def flush_cache(self) -> bool:
        """False when the server refused because requests are running or waiting."""
        status, _ = await self._call("POST", "/flush_cache", timeout_s=60)
        return status == 200

    async def abort_request(self, rid: str = "", abort_all: bool = False) -> None:
        """Abort one live rid (the server also aborts live rids it prefixes), or everything."""
        await self._control("POST", "/abort_request", {"rid": rid, "abort_all": abort_all})

    async def release_memory_occupation(self, tags: list[str] | None = None) -> None:
        await self._control("POST", "/release_memory_occupation", {"tags": tags} if tags else {})

    async def resume_memory_occupation(self, tags: list[str] | None = None) -> None:
        await self._control("POST", "/resume_memory_occupation", {"tags": tags} if tags else {})

    sleep = release_memory_occupation
    wake_up = resume_memory_occupation

    async def update_weights_from_disk(
        self, path: str, weight_version: str | None = None, **options: Any
    ) -> dict[str, Any]:
        """Reload weights in place; `options` are passed through (load_format, abort_all_requests, flush_cache)."""
        payload: dict[str, Any] = {"model_path": path, **options}
        if weight_version is not None:
            payload["weight_version"] = weight_version
        if self._pause.mode == "in_place":
            # Held requests keep their cache, so SGLang cannot flush it: it would load the weights and answer
            # 400 "Weights were updated, but the cache was not flushed". Say so up front instead.
            payload.setdefault("flush_cache", False)
        status, body = await self._call(
            "POST", "/update_weights_from_disk", payload, timeout_s=_WEIGHTS_TIMEOUT_S
        )
        message = error_message(body, str(body)[:500])
        if status == 400 and message.startswith(_UPDATED_NOT_FLUSHED):
            log.warning("%s: %s", self.url, message)  # the new weights serve; only the prefix cache is stale
            return {**body, "success": True, "cache_flushed": False}
        if status >= 400:  # a failed load: 400 {"success": false, "message": ...}
            raise BackendRequestError(
                f"{self.url}/update_weights_from_disk failed: {message}", server=self.url, status=status
            )
        return body

    async def update_weights_from_tensor(
        self, weight_version: str | None = None, **payload: Any
    ) -> dict[str, Any]:
        """`/update_weights_from_tensor`: payload passed through (serialized_named_tensors, load_format...)."""
        return await self._weights("/update_weights_from_tensor", payload, weight_version)

    async def update_weights_from_distributed(
        self, weight_version: str | None = None, **payload: Any
    ) -> dict[str, Any]:
        """`/update_weights_from_distributed`: payload passed through (names, dtypes, shapes, group_name...)."""
        return await self._weights("/update_weights_from_distributed", payload, weight_version)

    async def init_weights_update_group(self, **payload: Any) -> dict[str, Any]:
        """`/init_weights_update_group` (master_address, master_port, rank_offset, world_size, group_name...)."""
        return await self._weights("/init_weights_update_group", payload)

    async def _weights(
        self, path: str, payload: dict[str, Any], version: str | None = None
    ) -> dict[str, Any]:
        """A weights call, its payload passed through, under the weights' long timeout."""
        if version is not None:
            payload["weight_version"] = version
        return await self._control("POST", path, payload, timeout_s=_WEIGHTS_TIMEOUT_S)

    async def destroy_weights_update_group(self, **payload: Any) -> dict[str, Any]:
        return await self._control("POST", "/destroy_weights_update_group", payload)

    async def pause_generation(self, mode: str = "abort") -> dict[str, Any]:
        """`/pause_generation` in SGLang's mode: "abort", "retract" or "in_place". From now until
        `continue_generation` the deadlines of this client's requests stand still (module docstring)."""
        self._pause.set(mode)
        try:
            return await self._control("POST", "/pause_generation", {"mode": mode})
        except BaseException:
            self._pause.set(None)
            raise

    async def continue_generation(self) -> dict[str, Any]:
        body = await self._control("POST", "/continue_generation", {})
        self._pause.set(None)
        return body


class _Rids(dict[str, Any]):
    """Request ids as a dict that also keeps them sorted and counts their lengths, so whether a rid and one of
    them prefix one another is a bisection and a lookup per length in use, not a scan of every rid in flight."""

    def __init__(self) -> None:
        super().__init__()
        self._sorted: list[str] = []
        self._lengths: Counter[int] = Counter()

    def __setitem__(self, rid: str, value: Any) -> None:
        if rid not in self:
            insort(self._sorted, rid)
            self._lengths[len(rid)] += 1
        super().__setitem__(rid, value)

    def __delitem__(self, rid: str) -> None:
        super().__delitem__(rid)
        self._forget(rid)

    def _forget(self, rid: str) -> None:
        del self._sorted[bisect_left(self._sorted, rid)]
        self._lengths[len(rid)] -= 1
        if not self._lengths[len(rid)]:
            del self._lengths[len(rid)]

    def pop(self, rid: str, *default: Any) -> Any:
        if rid in self:
            value = super().pop(rid)
            self._forget(rid)
            return value
        if default:
            return default[0]
        raise KeyError(rid)

    def prefix_related(self, rid: str) -> bool:
        """A rid here that starts with `rid` (or is it), or that `rid` starts with."""
        at = bisect_left(self._sorted, rid)
        if at < len(self._sorted) and self._sorted[at].startswith(rid):
            return True
        n = len(rid)
        for k in self._lengths:  # a loop, not any(): this runs once per model call
            if k < n and rid[:k] in self:
                return True
        return False
