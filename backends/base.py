"""The token-in-token-out contract every backend honours.

The engine (`fsm`) sees only this module's types. A backend takes the full running context of one
trajectory as token ids and returns the tokens it generated, with the engine's logprob of each. Sampling
parameters use SGLang's names (`max_new_tokens`, `temperature`, `top_p`, `top_k`, `stop_token_ids`,
`sampling_seed`, `repetition_penalty`) so that the SGLang client can pass them through unchanged. A failed call
raises a `BackendError` that says whether another try can help, and `RetryPolicy` / `retry` are how every remote
call (clients, router, tools, the OTLP exporter) acts on that.
"""

from __future__ import annotations

import asyncio
import email.utils
import math
import random
import time
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, Protocol, Self, TypeVar, runtime_checkable

import orjson

GREEDY_BELOW = 1e-6  # SGLang's rule: a smaller temperature means greedy decoding


# A long-horizon trajectory sends its whole context each call (238k ids at turn 1,000): building that list again,
# copying it and JSON-encoding all of it per call made the client's CPU per call grow with the context (issue 49).
# The trajectory keeps one `PromptIds` per segment that it only appends to, and `server_client.encode_json` splices
# its kept JSON into the body, so a call costs what its new tokens cost.
class PromptIds(list[int]):
    """Token ids that only grow (appended to, never changed in place), with `json()` their encoding."""

    __slots__ = ("_json", "_json_n")

    def __init__(self, ids: Iterable[int] = ()):
        super().__init__(ids)
        self._json = bytearray()  # the ids' JSON without its brackets: b"1,2,3"
        self._json_n = 0  # how many ids it holds

    def json(self) -> bytearray:
        """`orjson.dumps(list(self))` without the brackets, encoding only the ids added since the last call.
        The buffer is this object's own: read it before the list grows again."""
        n = len(self)
        if n < self._json_n:  # cut short: encode again from the start
            del self._json[:]
            self._json_n = 0
        if n > self._json_n:
            if self._json_n:
                self._json += b","
            self._json += orjson.dumps(self[self._json_n :])[1:-1]
            self._json_n = n
        return self._json

    def copy(self) -> PromptIds:
        """A copy that keeps the JSON encoded so far (one memory copy, no encoding)."""
        out = PromptIds(self)
        out._json[:] = self._json
        out._json_n = self._json_n
        return out


@dataclass(slots=True)
class GenerateRequest:
    session_id: str  # trajectory id: the sticky routing key for every turn of one trajectory
    prompt_ids: list[int]  # the whole context so far (prompt + every earlier turn)
    sampling_params: dict[str, Any]  # SGLang names; max_new_tokens already clamped by the engine
    rid: str | None = None  # per-turn request id, "{session_id}_t{turn:02d}": no prefix of another live rid
    group_id: str | None = None  # GRPO group (the row's uid): samples of a group share their prompt
    return_logprob: bool = True
    timeout_s: float | None = None  # per-attempt deadline (the spec's request_timeout_s); None: the backend's
    resumed: int = 0  # how often this turn was aborted and resumed before this request (0: a fresh turn)
    vocab_size: int | None = None  # ids an answer may hold lie in [0, vocab_size); None: not checked
    turn: int = 0  # model turns the trajectory made before this one (what a scheduling policy reads)
    priority: int | None = None  # engine request priority, lower runs first (vLLM); None: not sent


@dataclass(slots=True)
class GenerateResult:
    token_ids: list[int]  # generated ids, the matched stop token included (as SGLang's output_ids)
    logprobs: list[float] | None  # one per token id, or None when not requested
    finish_reason: str  # "stop" | "length" | "abort"
    prompt_tokens: int | None = None  # absent when SGLang aborted the request in its waiting queue
    cached_tokens: int | None = None  # prompt tokens served from the server's prefix cache
    weight_version: str | None = None
    server: str | None = None  # which server answered (base URL, or a backend name)
    route: str | None = None  # how a router placed the call: "sticky" | "new" | "group" | "moved"
    abort_message: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)


class BackendError(Exception):
    """A generation that failed. `retryable` says whether trying again (maybe elsewhere) can help; `kind`
    names the fault for counting ("http_errors", "disconnects", "timeouts", "malformed", ...)."""

    retryable: bool = False

    def __init__(
        self,
        message: str,
        *,
        server: str | None = None,
        status: int | None = None,
        kind: str | None = None,
        retry_after: float | None = None,
    ):
        super().__init__(message)
        self.server = server
        self.status = status
        self.kind = kind
        self.retry_after = retry_after  # seconds the server asked us to wait (Retry-After), if it did


class BackendRequestError(BackendError):
    """The server refused the request itself (HTTP 400: bad parameters, input too long): do not retry."""

    retryable = False


class BackendUnavailable(BackendError):
    """The server could not be reached, disconnected, timed out or answered 5xx: retry, maybe elsewhere."""

    retryable = True


class BackendMalformed(BackendUnavailable):
    """The server answered 200 with a body that is not a /generate response (not JSON, an HTML page, another
    schema): a server fault like a 5xx, never an empty turn."""


class BackendTimeout(BackendUnavailable):
    """No answer within the request deadline; the request was aborted at the server. Retried elsewhere: a
    server that hangs once tends to hang again."""


class GenerationAborted(BackendError):
    """The server aborted one model turn more often than the spec's resume budget (`limits.max_resumes`)."""

    retryable = False


# One retry policy for every remote call (the SGLang client retries one server, the router fails over across
# servers, tools and the OTLP exporter retry their own calls), each taking a `RetryPolicy` and, when async,
# letting `retry()` run the loop:
#     policy = RetryPolicy(attempts=3, backoff_s=0.1, window_s=60.0)   # 3 tries, or on until a minute has passed
#     result = await retry(policy, lambda attempt: call(), on_retry=count)
# A failure is retried when its `retryable` attribute is true (BackendUnavailable and its kind) or its HTTP status
# is in `statuses`; a `retry_after` on it (the server's Retry-After) makes the next wait at least that long, up to
# `retry_after_max_s`. Cancellation is never retried: only `Exception` subclasses are caught.

T = TypeVar("T")

# The retryable statuses of SGLang's model gateway (smg): timeouts, throttling, and the 5xx a restart gives.
RETRY_STATUSES = frozenset({408, 429, 500, 502, 503, 504})


@dataclass(frozen=True, slots=True)
class RetryPolicy:
    attempts: int = 4  # total attempts, the first included: 1 means never retry
    backoff_s: float = 0.05  # wait before the second attempt
    multiplier: float = 2.0  # each later wait is this many times the one before...
    backoff_max_s: float = 5.0  # ...up to this, jitter included
    jitter: float = 0.2  # ±20 % on every wait, so clients that failed together do not retry together
    statuses: frozenset[int] = RETRY_STATUSES  # HTTP statuses worth another attempt
    retry_after_max_s: float = 30.0  # a server's Retry-After is honoured up to this
    # Past `attempts`, keep retrying while the next attempt starts within this many seconds of the first:
    # a budget in time rides out an outage (a server restart) whatever the per-attempt cost. None: count only.
    window_s: float | None = None

    def __post_init__(self) -> None:
        if self.attempts < 1:
            raise ValueError(
                f"RetryPolicy.attempts must be >= 1 (the first attempt counts), got {self.attempts}"
            )

    def delay(self, attempt: int, retry_after: float | None = None) -> float:
        """Seconds to wait after failed attempt number `attempt` (1-based) before the next one: never more than
        `backoff_max_s`, jitter included (capped after it), however large `attempt` grows; a server's
        `Retry-After` may ask for longer, up to `retry_after_max_s`."""
        base = self._base(attempt)
        wait = (
            min(self.backoff_max_s, base * random.uniform(1 - self.jitter, 1 + self.jitter))
            if base > 0
            else 0.0
        )
        if retry_after is not None:
            wait = max(wait, min(retry_after, self.retry_after_max_s))
        return wait

    def _base(self, attempt: int) -> float:
        """backoff_s * multiplier ** (attempt - 1), for any attempt: 2.0 ** 1024 is past a float (attempt 1,025
        once raised OverflowError, a backoff of 0 too), so a power that overflows is taken in logs."""
        if self.backoff_s <= 0:
            return 0.0
        try:
            return self.backoff_s * float(self.multiplier) ** (attempt - 1)
        except OverflowError:
            return math.exp(min(math.log(self.backoff_s) + (attempt - 1) * math.log(self.multiplier), 700.0))

    def retryable_status(self, status: int | None) -> bool:
        return status is not None and status in self.statuses

    @staticmethod
    def retryable(exc: BaseException) -> bool:
        """The default test: the exception says it is worth another try (`exc.retryable`)."""
        return bool(getattr(exc, "retryable", False))


def parse_retry_after(value: str | None) -> float | None:
    """An HTTP `Retry-After` value (delta-seconds or an HTTP date) as seconds from now; None if absent or bad."""
    if not value:
        return None
    value = value.strip()
    try:
        seconds = float(value)
    except ValueError:
        pass
    else:
        return max(0.0, seconds) if math.isfinite(seconds) else None
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None
    return max(0.0, when.timestamp() - time.time())


async def retry(
    policy: RetryPolicy,
    attempt_fn: Callable[[int], Awaitable[T]],
    *,
    retryable: Callable[[BaseException], bool] | None = None,
    on_retry: Callable[[int, BaseException, float], None] | None = None,
    failed: tuple[Exception, float] | None = None,
) -> T:
    """Await `attempt_fn(attempt)` (attempt is 1-based) until it returns, or raise its last failure.

    A failure is retried while `retryable(exc)` (default: `policy.retryable`) holds and attempts remain, or
    the policy's time window has room for the next attempt; `on_retry(attempt, exc, wait)` is called before
    each wait (count retries there). `failed`: attempt 1 already ran and raised (its exception, and
    `time.monotonic()` at its start), so a caller's fast path enters this loop only after a failure.
    """
    should = retryable or policy.retryable
    attempt = 1
    first, start = failed or (None, time.monotonic())
    while True:
        try:
            if first is not None:
                raise first
            return await attempt_fn(attempt)
        except Exception as exc:
            first = failed = None  # raised here, it holds this frame: no cycle through `failed`
            if not should(exc):
                raise
            wait = policy.delay(attempt, getattr(exc, "retry_after", None))
            in_window = policy.window_s is not None and time.monotonic() + wait - start < policy.window_s
            if attempt >= policy.attempts and not in_window:
                raise
            if on_retry is not None:
                on_retry(attempt, exc, wait)
        if wait > 0:
            await asyncio.sleep(wait)
        attempt += 1


@runtime_checkable
class Backend(Protocol):
    """What the engine needs from a model server (or a fleet of them behind a router)."""

    @property
    def model_name(self) -> str:
        """Shown in spans as `text_completion {model_name}`."""
        ...

    @property
    def provider(self) -> str:
        """`gen_ai.provider.name`: "sglang", "transformers", "scripted"..."""
        ...

    @property
    def context_length(self) -> int | None:
        """The server's max context, or None when unknown."""
        ...

    async def generate(self, request: GenerateRequest) -> GenerateResult: ...

    async def release(self, session_id: str) -> None:
        """The trajectory ended: a router may forget its session."""
        ...


# What a backend may do beyond the contract: one small protocol per capability, asked with isinstance. Also
# optional: `where(session_id) -> str | None`, the server and request a trajectory waits on (the watchdog's report).


@runtime_checkable
class Lifecycle(Protocol):
    """Connections or background work: started before the first request, closed after the last (idempotent)."""

    async def start(self) -> None: ...
    async def close(self) -> None: ...


@runtime_checkable
class Pausable(Protocol):
    """Servers that hold generation from `pause_generation(mode)` to `continue_generation()` (SGLang's modes)."""

    async def pause_generation(self, mode: str = "abort") -> Any: ...
    async def continue_generation(self) -> Any: ...


@runtime_checkable
class Abortable(Protocol):
    """A trajectory's request in flight can be ended now, with its partial output (SGLang's /abort_request)."""

    async def abort(self, session_id: str) -> None: ...


@runtime_checkable
class Counted(Protocol):
    """Counters for the run summary (`stats()`); a "faults" entry holds the server faults seen, by kind."""

    def stats(self) -> dict[str, Any]: ...


class BaseBackend:
    """Convenience base: no-op lifecycle so simple backends only write `generate`."""

    model_name: str = "unknown"
    provider: str = "unknown"
    context_length: int | None = None

    async def start(self) -> None:
        """Open connections / start background work. Idempotent."""

    async def close(self) -> None:
        """Stop background work and release resources. Idempotent."""

    async def release(self, session_id: str) -> None:
        return None

    def where(self, session_id: str) -> str | None:
        return None

    async def __aenter__(self) -> Self:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()
