"""A backend that replays scripted token sequences: the stand-in for a model in engine tests and benchmarks.

A script maps each session to its turns: the token ids the "model" emits on its 1st, 2nd, ... call.
It honours `max_new_tokens` and `stop_token_ids` the way SGLang does (a matched stop id is returned as the
last token; a cut at `max_new_tokens` reports finish reason "length"), so the engine meets the same edge
cases as with a real server.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence

from backends.base import BackendUnavailable, BaseBackend, GenerateRequest, GenerateResult

# Returns the turn's token ids given (session_id, turn index, prompt ids); raise to simulate a failure.
TurnFn = Callable[[str, int, list[int]], Sequence[int]]


class ScriptedBackend(BaseBackend):
    provider = "scripted"

    def __init__(
        self,
        script: dict[str, Sequence[Sequence[int]]] | TurnFn,
        *,
        logprob: float | Callable[[int, int], float] = -0.5,
        latency_s: float = 0.0,
        model_name: str = "scripted",
        context_length: int | None = None,
    ):
        self._script = script
        self._logprob = logprob
        self._latency_s = latency_s
        self._turns: dict[str, int] = {}
        self.model_name = model_name
        self.context_length = context_length
        self.requests: list[GenerateRequest] = []  # every request seen, for assertions
        self.record_requests = True

    def _turn_ids(self, request: GenerateRequest, turn: int) -> Sequence[int]:
        if callable(self._script):
            return self._script(request.session_id, turn, request.prompt_ids)
        turns = self._script.get(request.session_id)
        if turns is None:
            # Fall back to a script keyed by the row part of "row/sample" session ids.
            turns = self._script.get(request.session_id.split("/", 1)[0])
        if turns is None or turn >= len(turns):
            raise BackendUnavailable(f"script has no turn {turn} for session {request.session_id!r}")
        return turns[turn]

    async def generate(self, request: GenerateRequest) -> GenerateResult:
        if self.record_requests:
            self.requests.append(request)
        turn = self._turns.get(request.session_id, 0)
        self._turns[request.session_id] = turn + 1
        if self._latency_s:
            await asyncio.sleep(self._latency_s)
        ids = list(self._turn_ids(request, turn))
        params = request.sampling_params
        stops = set(params.get("stop_token_ids") or ())
        finish = "stop"
        for i, tok in enumerate(ids):
            if tok in stops:
                ids = ids[: i + 1]
                break
        limit = params.get("max_new_tokens")
        if limit is not None and len(ids) > limit:
            ids, finish = ids[:limit], "length"
        if callable(self._logprob):
            logprobs = [self._logprob(turn, i) for i in range(len(ids))]
        else:
            logprobs = [self._logprob] * len(ids)
        return GenerateResult(
            token_ids=ids,
            logprobs=logprobs if request.return_logprob else None,
            finish_reason=finish,
            prompt_tokens=len(request.prompt_ids),
            cached_tokens=0,
            server=self.model_name,
        )

    async def release(self, session_id: str) -> None:
        self._turns.pop(session_id, None)
