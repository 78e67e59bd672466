"""A Backend over any async token-in/token-out generate function: a trainer's own engine client, an
OpenAI-style completions endpoint or an in-process model plugs in without subclassing (docs/trainers.md).

    async def generate(prompt_ids: list[int], sampling_params: dict) -> dict: ...
    backend = FunctionBackend(generate, start=open_client, close=close_client)

A function that also takes a `request` keyword gets the whole `GenerateRequest` (keys for sticky routing). It
answers `{"token_ids", "logprobs"?, "finish_reason"?, "weight_version"?, "versions"?}` (a missing finish_reason
is "stop" after a stop id, else "length"), an SGLang `/generate` body, or a `GenerateResult`. The answer crosses
the trust boundary a server's does (backends/answer.py): a violation, an exception or a missed deadline is a
counted server fault, retried when retryable. A BaseException it raises ends its row, never retried: left to
propagate it would kill the engine's thread, hanging every caller. `start` and `close` run on the engine's
loop, once each, so a session they hold never outlives the engine nor meets a second loop.
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
