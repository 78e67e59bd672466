"""The token-in-token-out contract every backend honours.

The engine (`fsm`) sees only this module's types. A backend takes the full running context of one
trajectory as token ids and returns the tokens it generated, with the engine's logprob of each. Sampling
parameters use SGLang's names (`max_new_tokens`, `temperature`, `top_p`, `top_k`, `stop_token_ids`,
`sampling_seed`, `repetition_penalty`) so that the SGLang client can pass them through unchanged.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, Protocol, Self, runtime_checkable

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
