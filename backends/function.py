"""A Backend over any async token-in/token-out generate function: a trainer's own engine client, an
OpenAI-style completions endpoint or an in-process model plugs in without subclassing.

    async def generate(prompt_ids: list[int], sampling_params: dict) -> dict: ...
    backend = FunctionBackend(generate, start=open_client, close=close_client)
    engine = RolloutEngine(spec, tokenizer, backend=backend)   # the engine starts and closes it

A function that also takes a `request` keyword gets the whole `GenerateRequest` (session_id, rid, group_id:
keys for sticky routing). `sampling_params` uses SGLang's names (max_new_tokens, temperature, top_p, top_k, stop_token_ids,
sampling_seed...). The function answers with one of:
- `{"token_ids": [...], "logprobs": [...] | None, "finish_reason": "stop" | "length" | "abort",
  "weight_version": ..., "versions": [...]}`: only `token_ids` is required; a missing finish_reason is "stop"
  when the last id is a stop id and "length" otherwise; `versions` gives each token's weight version (an engine
  that updates weights mid-request has several);
- an SGLang `/generate` body (`output_ids`, `meta_info`), e.g. what `sglang.Engine.async_generate` returns;
- a `GenerateResult`.
Whatever it answers crosses the trust boundary the SGLang client's answers cross (backends/answer.py): ids in
the vocabulary, finite logprobs <= 0, no more tokens than asked, nothing after a stop id. A violation, an
exception or a missed deadline is a server fault, counted by kind; a retryable one (malformed answers,
timeouts, and `BackendUnavailable` the function raises itself) is tried again (`retry_policy`), and past the
budget, as any other, it ends its row with an error naming this backend. A BaseException the function raises
(KeyboardInterrupt, SystemExit, a CancelledError of its own) ends its row the same way, never retried: left to
propagate it would leave the event loop and kill the engine's thread, hanging every caller.

`start` and `close` (sync or async, each optional) run on the engine's event loop, once each: open an
aiohttp session in `start` and close it in `close`, and the session never outlives the engine (no
"Unclosed client session" at exit) nor meets a second event loop.
"""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

from backends.answer import parse_generate
from backends.base import (
    BackendError,
    BackendMalformed,
    BackendTimeout,
    BaseBackend,
    GenerateRequest,
    GenerateResult,
    RetryPolicy,
    retry,
)

# generate(prompt_ids, sampling_params), or with a `request` keyword (the GenerateRequest) where it takes one
GenerateFn = Callable[..., Awaitable[Any]]
Hook = Callable[[], Any]
FINISH_REASONS = ("stop", "length", "abort")


class FunctionBackend(BaseBackend):
    """`generate(prompt_ids, sampling_params)` as a Backend; `start`/`close` are owned by whoever owns this."""

    def __init__(
        self,
        generate: GenerateFn,
        *,
        model_name: str = "function",
        provider: str = "custom",
        context_length: int | None = None,
        start: Hook | None = None,
        close: Hook | None = None,
        retry_policy: RetryPolicy | None = None,
    ):
        if not callable(generate):
            raise TypeError(
                f"generate must be an async function (prompt_ids, sampling_params), got {generate!r}"
            )
        self.fn = generate
        try:
            self._wants_request = "request" in inspect.signature(generate).parameters
        except (TypeError, ValueError):
            self._wants_request = False
        self.model_name = model_name
        self.provider = provider
        self.context_length = context_length
        self._start_hook, self._close_hook = start, close
        self._state = "new"  # new -> started -> closed
        self.retry_policy = retry_policy or RetryPolicy(attempts=3, backoff_s=0.1)  # retryable faults only
        self.requests = 0
        self.retries = 0
        self.faults: dict[str, int] = {}

    async def start(self) -> None:
        if self._state == "new":
            self._state = "started"
            await _call(self._start_hook)

    async def close(self) -> None:
        if self._state == "started":
            self._state = "closed"
            await _call(self._close_hook)
        self._state = "closed"

    def stats(self) -> dict[str, Any]:
        return {"requests": self.requests, "retries": self.retries, "faults": dict(self.faults)}

    async def generate(self, request: GenerateRequest) -> GenerateResult:
        def count(attempt: int, exc: BaseException, wait: float) -> None:
            self.retries += 1

        return await retry(self.retry_policy, lambda attempt: self._attempt(request), on_retry=count)

    async def _attempt(self, request: GenerateRequest) -> GenerateResult:
        self.requests += 1
        params = dict(request.sampling_params)
        try:
            async with asyncio.timeout(request.timeout_s):
                extra = {"request": request} if self._wants_request else {}
                answer = await self.fn(list(request.prompt_ids), params, **extra)
        except TimeoutError:
            self._count("timeouts")
            raise BackendTimeout(
                f"{self.model_name}: generate function gave no answer within "
                f"{request.timeout_s:g} s (rid {request.rid})",
                server=self.model_name,
                kind="timeouts",
            ) from None
        except BackendError as exc:
            self._count(exc.kind or "errors")
            raise
        except BaseException as exc:
            if isinstance(exc, asyncio.CancelledError) and _cancelling():
                raise  # the engine cancelled this row: not the function's doing
            # KeyboardInterrupt, SystemExit, GeneratorExit or a CancelledError of its own, raised by the function:
            # let through, it would leave the event loop and end the engine's thread with every row on it.
            base = not isinstance(exc, Exception)
            self._count("errors")
            why = "; a BaseException from the function ends its row, never the engine" if base else ""
            raise BackendError(
                f"{self.model_name}: generate function raised {type(exc).__name__}: {exc} (rid {request.rid}){why}",
                server=self.model_name,
                kind="errors",
            ) from (None if base else exc)
        try:
            result = parse_generate(
                _as_body(answer, params),
                server=self.model_name,
                return_logprob=request.return_logprob,
                rid=request.rid,
                request=request,
            )
        except BackendMalformed as exc:
            self._count(exc.kind or "malformed")
            raise
        result.server = None  # in this process, or behind the function: no server address for spans
        return result

    def _count(self, kind: str) -> None:
        self.faults[kind] = self.faults.get(kind, 0) + 1


def _cancelling() -> bool:
    """Whether this task was asked to cancel (so a CancelledError is the engine's, not the function's)."""
    task = asyncio.current_task()
    cancelling = getattr(task, "cancelling", None)  # Python 3.11+; before, every CancelledError is a cancel
    return task is None or cancelling is None or cancelling() > 0


async def _call(hook: Hook | None) -> None:
    if hook is not None:
        out = hook()
        if inspect.isawaitable(out):
            await out


def _as_body(answer: Any, params: Mapping[str, Any]) -> Any:
    """Any accepted answer -> an SGLang /generate body, checked by the one parser every answer goes through."""
    if isinstance(answer, GenerateResult):
        answer = {
            "token_ids": answer.token_ids,
            "logprobs": answer.logprobs,
            "finish_reason": answer.finish_reason,
            "weight_version": answer.weight_version,
        }
    if not isinstance(answer, Mapping) or "meta_info" in answer:
        return answer  # an SGLang body (or something parse_generate names as malformed)
    ids = answer.get("token_ids", answer.get("output_ids"))
    if not isinstance(ids, list):
        return {"not a generate answer": answer}  # malformed: named by the parser
    finish = answer.get("finish_reason")
    if finish is None:
        stops = params.get("stop_token_ids") or ()
        finish = "stop" if ids and ids[-1] in stops else "length"
    if finish not in FINISH_REASONS:
        return {"finish_reason": finish}
    meta: dict[str, Any] = {"finish_reason": {"type": finish}}
    logprobs = answer.get("logprobs")
    if logprobs is not None:
        if isinstance(logprobs, list):  # SGLang's triples; a count that differs is named by the parser
            same = len(logprobs) == len(ids)
            logprobs = [[lp, t if same else None, None] for lp, t in zip(logprobs, ids if same else logprobs)]
        meta["output_token_logprobs"] = logprobs
    if answer.get("weight_version") is not None:
        meta["weight_version"] = answer["weight_version"]
    versions = answer.get("versions")
    if isinstance(versions, list) and versions:  # per token -> SGLang's spans, checked by the parser
        spans, start = [], 0
        for i in range(1, len(versions) + 1):
            if i == len(versions) or versions[i] != versions[start]:
                spans.append({"version": versions[start], "start": start, "end": i})
                start = i
        meta["weight_versions"] = spans
    return {"output_ids": ids, "meta_info": meta}


__all__ = ["FunctionBackend", "GenerateFn"]
