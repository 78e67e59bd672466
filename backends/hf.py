"""The embedded default backend: a transformers causal LM in this process, on CPU or a CUDA GPU.

Concurrent `generate()` calls queue up for one worker, owned by the backend, that decodes in a thread so the
event loop stays responsive: between two decode steps the requests that arrived are prefilled together and
join the running batch (continuous batching, up to `max_batch_size` rows). A trajectory's KV cache is kept
between its turns, so its next turn prefills only the tokens it adds; rows are left-padded with explicit
position ids, so a request's greedy tokens do not depend on its batch (backends/hf_model.py).
`exact_logprobs=True` rescores each finished turn alone (`_rescore`): a run and its resume give the same bits.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import os
import random
import threading
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from transformers import AutoModelForCausalLM, DynamicCache, PreTrainedModel

from backends.base import (
    BackendError,
    BackendRequestError,
    BackendUnavailable,
    BaseBackend,
    GenerateRequest,
    GenerateResult,
)
from backends.hf_model import (
    DecodeSampling,
    Rows,
    SessionCache,
    SlotCache,
    joinable,
    load,
    prefill_inputs,
    sample_next,
    served_name,
    unfit_tensors,
    untied_values,
    validate,
)

SESSION_KV_BYTES = 1 << 30  # default bound on the KV kept between a trajectory's turns
# SDPA kernels used in float16/bfloat16 on CUDA: all but cuDNN attention, which plans per shape
_NO_CUDNN_ATTENTION = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


def eos_ids(model: Any) -> frozenset[int]:
    """Like SGLang's: the config's and the generation config's eos ids."""
    ids: list[int] = []
    for value in (
        model.config.eos_token_id,
        getattr(getattr(model, "generation_config", None), "eos_token_id", None),
    ):
        ids += [value] if isinstance(value, int) else list(value or ())
    return frozenset(ids)


@dataclass(slots=True, eq=False)
class _Job:
    """A queued request and what the decode loop has generated for it so far."""

    request: GenerateRequest
    sampling: DecodeSampling
    future: asyncio.Future[GenerateResult]
    generator: torch.Generator | None  # None for greedy rows
    seed: int = 0  # the generator's seed: a retracted row starts over with the same draws
    batch: int = -1  # which prefill admitted it (a running count), and how many rows that prefill held
    batch_size: int = 0
    cached: int = 0  # prompt tokens whose KV came from the trajectory's previous turn
    epoch: int = -1  # the session cache's epoch (weights) when the row was prefilled
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[str] = field(default_factory=list)  # the weight version that made each token
    running: bool = False  # in the decode loop's batch (else queued)
    abort: bool = False  # /abort_request: the row ends at the next decode step, with its partial output
    retractions: int = 0


class HFBackend(BaseBackend):
    """A transformers causal LM served token-in-token-out, with batching across concurrent calls."""

    provider = "transformers"

    def __init__(
        self,
        model: str | os.PathLike[str] | PreTrainedModel | torch.nn.Module,  # a directory, or one in memory
        *,
        device: str | torch.device | None = None,  # default: cuda when available, else cpu
        # default: a given model's own, else by size (backends/hf_model.py); also by name: "float32", "auto"...
        dtype: torch.dtype | str | None = None,
        max_batch_size: int = 32,
        # torch's (process-wide) intra-op thread count; None: hf_model.default_threads() for a model loaded on CPU
        torch_threads: int | None = None,
        eos_token_ids: Sequence[int] | None = None,  # default: the model config's eos ids
        pad_token_id: int | None = None,  # any id works (padding is masked); default: config's pad or eos
        # the model's name in spans (`text_completion {name}`) and /model_info; default: TINY_SERVED_NAME for
        # the bundled model, else the config's `served_model_name` if it has one, else the model's folder name
        served_model_name: str | None = None,
        model_name: str | None = None,  # the same, by its older name
        seed: int | None = None,  # seeds the generators of requests that bring no sampling_seed
        # bound on the KV kept between a trajectory's turns (by its session id; 0: none kept)
        session_kv_bytes: int = SESSION_KV_BYTES,
        # each finished turn's logprobs from one forward pass over its context alone (module docstring)
        exact_logprobs: bool = False,
    ):
        # where the weights came from (a directory or a hub id; None: the caller's module), which a resume checks
        self.checkpoint: str | None = None if isinstance(model, torch.nn.Module) else os.fspath(model)
        self.model, self.device, self.dtype = load(model, device, dtype, torch_threads)
        # transformers 5 renamed forward's past_key_values to cache (the old name warns); 4.x knows only the old
        self._cache_kw = (
            "cache" if "cache" in inspect.signature(self.model.forward).parameters else "past_key_values"
        )
        # cuDNN attention plans per shape (slow in decode); float32 never uses it
        self._attention = (
            _NO_CUDNN_ATTENTION
            if self.device.type == "cuda" and self.dtype in (torch.float16, torch.bfloat16)
            else None
        )
        config: Any = self.model.config  # a transformers config (the caller's module may be any nn.Module)
        self.model_name = served_model_name or model_name or served_name(model, config)
        self.context_length = getattr(config, "max_position_embeddings", None)
        self.vocab_size: int = config.vocab_size
        self.eos_token_ids = eos_ids(self.model) if eos_token_ids is None else frozenset(eos_token_ids)
        config_pad = getattr(config, "pad_token_id", None)
        pad = pad_token_id if pad_token_id is not None else config_pad
        self.pad_token_id: int = pad if pad is not None else min(self.eos_token_ids, default=0)
        self.max_batch_size = max_batch_size
        self.exact_logprobs = exact_logprobs
        self.weight_version = "default"
        self._rng = random.Random(seed)
        self._queue: deque[_Job] = deque()  # waiting requests: the loop appends, the decode thread takes
        self._wake = asyncio.Event()  # set when the queue gets a request (or the backend closes)
        self._model_lock = asyncio.Lock()  # decoding and a weight reload never overlap
        self._draining = 0  # weight updates waiting: the running batch admits no one and ends
        # rows join a running batch, and keep KV between turns, only where the cache is plain K/V per layer
        self._joinable = joinable(config)
        self.sessions = SessionCache(session_kv_bytes if self._joinable else 0)
        self._admitted: set[_Job] = set()  # rows the decode thread holds (failed together if it raises)
        self._stopping = False  # read by the decode thread: abort the running batch at its next step
        self._pause_mode: str | None = None  # read by the decode thread at each step (`pause_generation`)
        self._unpaused = asyncio.Event()  # the worker starts no batch while paused
        self._unpaused.set()
        self._held = threading.Event()  # an in-place-paused decode thread waits on it
        self._held.set()
        self._step = threading.Lock()  # one model step, or one weight load, at a time
        self._parked = threading.Event()  # set while an in-place pause holds the decode thread
        self._worker: asyncio.Task[None] | None = None
        self._closed = False
        self._batches = 0
        self._jobs: set[_Job] = set()  # open requests, for abort_request

    # -- lifecycle ---------------------------------------------------------------------------------------

    async def start(self) -> None:
        if self._closed:
            raise BackendUnavailable(f"{self.model_name}: HFBackend is closed", server=self.model_name)
        if self._worker is None:
            self._worker = asyncio.create_task(self._serve(), name=f"HFBackend({self.model_name}) worker")

    async def close(self) -> None:
        """Stop the worker: the running batch ends at its next step and every open request gets "abort"."""
        if self._closed:
            return
        self._closed = self._stopping = True
        self._held.set()  # a paused worker wakes and aborts what it holds
        self._unpaused.set()
        self._wake.set()  # wakes an idle worker
        if self._worker is not None:
            await self._worker
        while self._queue:
            self._resolve(self._queue.popleft(), "abort")
        self.sessions.clear()

    # -- requests ----------------------------------------------------------------------------------------

    async def generate(self, request: GenerateRequest) -> GenerateResult:
        await self.start()  # a closed backend refuses
        sampling = validate(  # as SGLang's server checks a request: BackendRequestError (HTTP 400) otherwise
            request,
            name=self.model_name,
            vocab_size=self.vocab_size,
            context_length=self.context_length,
            eos_ids=self.eos_token_ids,
        )
        if sampling.max_new_tokens == 0:
            return self._result(request, [], [], "length")
        generator = None
        seed = sampling.seed if sampling.seed is not None else self._rng.getrandbits(63)
        if sampling.temperature > 0.0:
            generator = torch.Generator()  # on the CPU: a seed means the same on every device
            generator.manual_seed(seed)
        job = _Job(request, sampling, asyncio.get_running_loop().create_future(), generator, seed)
        self._queue.append(job)  # while paused it waits there, as at SGLang's tokenizer manager
        self._wake.set()
        self._jobs.add(job)
        try:
            return await job.future  # cancelling the caller cancels the future; the decode loop drops the row
        finally:
            self._jobs.discard(job)

    def running_rids(self) -> set[str]:
        """Requests in the decode loop's batch, not queued: what SGLang's load report counts as running."""
        return {job.request.rid for job in list(self._jobs) if job.running and job.request.rid}

    async def abort_request(self, rid: str = "", abort_all: bool = False) -> None:
        """SGLang's /abort_request: every open request whose rid starts with `rid` (or all). A running one ends
        at the next step with its partial output; a queued one at once, as SGLang's waiting-queue abort (no
        output, `extra["waiting"]`)."""
        for job in list(self._jobs):
            if abort_all or (rid and (job.request.rid or "").startswith(rid)):
                if job.running:
                    job.abort = True
                elif not job.future.done():
                    job.tokens, job.logprobs, job.versions = [], [], []
                    self._resolve(job, "abort", "Abort in waiting queue", waiting=True)

    def _result(
        self,
        request: GenerateRequest,
        tokens: list[int],
        logprobs: list[float],
        finish: str,
        abort_message: str | None = None,
        cached: int = 0,
        **extra: Any,
    ) -> GenerateResult:
        return GenerateResult(
            token_ids=tokens,
            logprobs=logprobs if request.return_logprob else None,
            finish_reason=finish,
            prompt_tokens=len(request.prompt_ids),
            cached_tokens=cached,
            weight_version=self.weight_version,
            server=None,  # in this process: no server (spans get no server.address)
            abort_message=(abort_message or f"{self.model_name}: HFBackend closed")
            if finish == "abort"
            else None,
            extra=extra,
        )

    def _resolve(self, job: _Job, finish: str, message: str | None = None, **extra: Any) -> None:
        if not job.future.done():  # the caller may have given up
            result = self._result(
                job.request,
                job.tokens,
                job.logprobs,
                finish,
                message,
                job.cached,
                batch=job.batch,
                batch_size=job.batch_size,
                token_versions=list(job.versions),
                num_retractions=job.retractions,
                **extra,
            )
            job.future.set_result(result)

    def _requeue(self, job: _Job) -> None:
        """A retracted row: back in the queue, with what it generated so far (as SGLang's retract: its context
        is recomputed and it goes on, on whatever weights are loaded then) once generation continues."""
        if job.future.done():
            return
        job.running = False
        job.retractions += 1
        self._queue.append(job)
        self._wake.set()

    # -- the worker --------------------------------------------------------------------------------------

    async def _serve(self) -> None:
        """Whenever requests wait, decode in a thread until no row is left (see `_decode`)."""
        loop = asyncio.get_running_loop()

        def finished(job: _Job, finish: str) -> None:  # called from the decode thread
            if finish == "retract":  # not finished: it goes on
                loop.call_soon_threadsafe(self._requeue, job)
                return
            if self.exact_logprobs:
                self._rescore(job)
            loop.call_soon_threadsafe(self._resolve, job, finish, "Aborted" if finish == "abort" else None)

        while not self._stopping:
            if not self._queue:
                await self._wake.wait()
            self._wake.clear()
            if not self._unpaused.is_set():
                await self._unpaused.wait()  # paused: requests wait (closing sets it too)
            if self._stopping or not self._queue:
                continue
            async with self._model_lock:  # a weight update waiting for it goes first (the lock is fair)
                try:
                    await asyncio.to_thread(self._decode, finished)
                except Exception as e:  # keep serving; fail only the rows that were running
                    error = BackendError(
                        f"{self.model_name}: generation failed: {e!r}", server=self.model_name
                    )
                    for job in self._admitted:
                        if not job.future.done():
                            job.future.set_exception(error)
                finally:
                    self._admitted = set()

    def _take(self, room: int) -> list[_Job]:
        """Up to `room` waiting requests, unless paused, closing or a weight update waits."""
        taken: list[_Job] = []
        if self._stopping or self._pause_mode is not None or self._draining:
            return taken
        while len(taken) < room and self._queue:
            job = self._queue.popleft()
            job.running = True
            if not job.future.done():  # else aborted or given up while it waited
                taken.append(job)
        return taken

    def _decode(self, finished: Callable[[_Job, str], None]) -> None:
        """Decode until no row is left, calling `finished(job, reason)` as each row ends. Before each step,
        the requests waiting are prefilled together and join the running batch (with a cache that cannot take
        rows mid-batch, only once the batch has ended). Runs in a thread."""
        kernels = sdpa_kernel(self._attention) if self._attention else contextlib.nullcontext()
        with torch.inference_mode(), kernels:
            jobs: list[_Job] = []
            rows: Rows | None = None
            while True:
                joining = self._take(self.max_batch_size - len(jobs)) if self._joinable or not jobs else []
                if joining:
                    self._batches += 1
                    for job in joining:
                        job.batch, job.batch_size = self._batches, len(joining)
                    self._admitted.update(joining)
                    for group in self._prefill_groups(joining):
                        running = rows if self._joinable and jobs else None
                        joined, live = self._prefill(group, finished, running)
                        if running is None:  # a new batch (always, for a batch that only shrinks)
                            if not live:
                                continue
                            rows = joined
                        else:  # prefilled into the batch's slots: counted in (and dropped if done already)
                            running.merge(joined)
                        jobs += [job for job, _ in group]
                        if len(live) < len(group):
                            assert rows is not None  # joined, or the running batch it merged into
                            live = list(range(len(jobs) - len(group))) + [
                                len(jobs) - len(group) + row for row in live
                            ]
                            jobs = [jobs[row] for row in rows.select(live)]
                if not jobs:
                    return
                assert rows is not None
                mode = self._pause_mode
                if mode in ("abort", "retract"):  # paused: the rows end here, partial or requeued
                    for job in jobs:
                        finished(job, mode)
                    return
                if mode == "in_place":
                    self._parked.set()
                    self._held.wait()  # the weights may change meanwhile: the rows go on with the new ones
                    self._parked.clear()
                rows.mask = torch.cat([rows.mask, rows.mask.new_ones(len(jobs), 1)], dim=-1)
                rows.pos = rows.pos + 1
                with self._step:
                    logprobs = self._forward(jobs, rows, rows.tokens[:, None], rows.mask, rows.pos)
                live = self._advance(jobs, rows, logprobs, finished)
                if len(live) < len(jobs):  # drop finished rows: the rest of the batch runs smaller
                    jobs = [jobs[row] for row in rows.select(live)]

    def _rescore(self, job: _Job) -> None:
        """Exact logprobs: the turn's logprobs from one forward pass over prompt + tokens alone, at the positions
        that predicted each token, log_softmax(logits / temperature) as when sampled. Nothing but the tokens
        decides this computation's shapes, so it gives the same bits whatever the row was batched with and
        wherever its context came from. A turn that crossed a weight update keeps the logprobs each token
        was sampled with (no single model made it)."""
        n = len(job.tokens)
        if not n or len(set(job.versions)) > 1:
            return
        ids = torch.tensor([job.request.prompt_ids + job.tokens[:-1]], device=self.device)
        with self._step:
            logits = self.model(input_ids=ids, use_cache=False, logits_to_keep=n).logits[0, -n:].float()
        logp = torch.log_softmax(logits / (job.sampling.temperature or 1.0), dim=-1)
        picked = torch.tensor(job.tokens, device=self.device)[:, None]
        job.logprobs = logp.gather(-1, picked).squeeze(-1).tolist()

    def _prefill_groups(self, joining: list[_Job]) -> list[list[tuple[_Job, Any]]]:
        """The joining rows with their kept KV (or None), split into those that have one and those that do
        not: each group is one forward pass, as long as its longest uncached part."""
        kept = [
            (job, self.sessions.take(job.request.session_id, job.request.prompt_ids + job.tokens))
            for job in joining
        ]
        return [g for g in ([x for x in kept if x[1] is not None], [x for x in kept if x[1] is None]) if g]

    def _prefill(
        self, group: list[tuple[_Job, Any]], finished: Callable[[_Job, str], None], into: Rows | None
    ) -> tuple[Rows, list[int]]:
        """One forward pass over rows that join: their first tokens sampled; the rows that go on. They prefill
        straight into the running batch's slots (`into`), or into a new batch's."""
        jobs = [job for job, _ in group]
        contexts = [job.request.prompt_ids + job.tokens for job in jobs]
        ids, mask, pos, past = prefill_inputs(contexts, [k for _, k in group], self.pad_token_id, self.device)
        dev, config = self.device, self.model.config
        rows = Rows(
            cache=into.opened(past, len(jobs), mask.shape[1], config)
            if into is not None
            else SlotCache(config, self.max_batch_size, past)
            if self._joinable
            else DynamicCache(config=config),  # type: ignore[arg-type]  # past is None: such a model keeps no KV
            mask=mask,
            pos=pos[:, -1:],
            tokens=pos[:, -1],
            temp=torch.tensor([job.sampling.temperature or 1.0 for job in jobs], device=dev),
            top_p=torch.tensor([job.sampling.top_p for job in jobs], device=dev),
            top_k=torch.tensor([job.sampling.top_k for job in jobs], device=dev),
        )
        held = mask.shape[1] - ids.shape[1]
        for row, job in enumerate(jobs):
            job.cached = int(mask[row, :held].sum()) if held else 0
        with self._step:
            for job in jobs:
                job.epoch = self.sessions.epoch
            logprobs = self._forward(jobs, rows, ids, mask, pos)
        return rows, self._advance(jobs, rows, logprobs, finished)

    def _forward(
        self, jobs: list[_Job], rows: Rows, ids: torch.Tensor, mask: torch.Tensor, pos: torch.Tensor
    ) -> torch.Tensor:
        """One model step over `rows` (a prefill or a decode step; `_step` held): each row's next token sampled
        into `rows.tokens`; their logprobs returned."""
        cache = {self._cache_kw: rows.cache}
        out = self.model(
            input_ids=ids, attention_mask=mask, position_ids=pos, **cache, use_cache=True, logits_to_keep=1
        )
        rows.tokens, logprobs = sample_next(
            out.logits[:, -1].float(), [j.generator for j in jobs], rows.temp, rows.top_p, rows.top_k
        )
        return logprobs

    def _advance(
        self, jobs: list[_Job], rows: Rows, logprobs: torch.Tensor, finished: Callable[[_Job, str], None]
    ) -> list[int]:
        """Append each row's new token; end the rows that are done (keeping their KV for the trajectory's next
        turn); return the rows that go on."""
        live = []
        for row, (job, token, logprob) in enumerate(
            zip(jobs, rows.tokens.tolist(), logprobs.tolist(), strict=True)
        ):
            job.tokens.append(token)
            job.logprobs.append(logprob)
            job.versions.append(self.weight_version)
            if token in job.sampling.stop_ids:
                finish = "stop"
            elif len(job.tokens) >= job.sampling.max_new_tokens:
                finish = "length"
            elif self._stopping or job.abort:
                finish = "abort"
            else:
                if not job.future.done():  # else the caller gave up
                    live.append(row)
                else:
                    self._admitted.discard(job)
                continue
            if finish != "abort":
                self._keep(job, rows, row)
            self._admitted.discard(job)
            finished(job, finish)
        return live

    def _keep(self, job: _Job, rows: Rows, row: int) -> None:
        """Keep a finished row's KV for its trajectory's next turn: all its tokens but the last (never fed)."""
        if not self.sessions.max_bytes or job.epoch != self.sessions.epoch:
            return  # none kept, or the weights changed under the row
        ids = job.request.prompt_ids + job.tokens[:-1]
        self.sessions.keep(job.request.session_id, ids, rows.row_kv(row, len(ids)), job.epoch)

    # -- control calls (passed through by the dev server) ------------------------------------------------

    async def pause_generation(self, mode: str = "abort") -> None:
        """SGLang's /pause_generation for the in-process model: no new batch starts until
        `continue_generation`; the running batch, at its next step, ends its rows as aborts with their partial
        output ("abort", which also aborts the queued ones; requests arriving later wait), puts them back in
        the queue to start over ("retract"), or holds them in place ("in_place")."""
        if mode not in ("abort", "retract", "in_place"):
            raise BackendRequestError(
                f"{self.model_name}: unknown pause mode {mode!r}", server=self.model_name
            )
        self._unpaused.clear()
        if mode == "in_place":
            self._held.clear()
        self._pause_mode = mode
        if mode == "abort":
            while self._queue:
                self._resolve(self._queue.popleft(), "abort", "Aborted")
        # As SGLang's, the call returns once the pause took effect: the running batch has ended (its rows
        # answered or requeued) or is held, so a continue right after cannot overtake it.
        while self._model_lock.locked() and not self._parked.is_set() and not self._stopping:
            await asyncio.sleep(0.001)

    async def continue_generation(self) -> None:
        self._pause_mode = None
        self._held.set()
        self._unpaused.set()

    @contextlib.asynccontextmanager
    async def _between_steps(self) -> Any:
        """Where a weight update lands: between two steps of a batch held by an in-place pause (which then
        goes on with the new weights), else once the running batch has ended: it admits no one meanwhile."""
        if self._pause_mode == "in_place":
            yield
            return
        self._draining += 1
        try:
            async with self._model_lock:
                yield
        finally:
            self._draining -= 1

    async def update_weights_from_disk(self, model_path: str, *, weight_version: str | None = None) -> None:
        """Reload weights in place from a checkpoint of the same architecture (landing as `_between_steps` says)."""
        async with self._between_steps():
            try:
                await asyncio.to_thread(self._load_weights, model_path)
            except (OSError, ValueError, RuntimeError) as e:
                raise BackendRequestError(
                    f"{self.model_name}: could not load weights from {model_path}: {e}",
                    server=self.model_name,
                ) from e
        if weight_version is not None:
            self.weight_version = weight_version

    def _load_weights(self, model_path: str) -> None:
        state = AutoModelForCausalLM.from_pretrained(model_path, dtype=self.dtype).state_dict()
        if untied := untied_values(self.model, state):
            raise ValueError(f"the checkpoint holds {untied}")
        with torch.no_grad(), self._step:
            self.model.load_state_dict(state)
            self.sessions.clear()  # KV computed by the old weights is never reused

    async def update_weights_from_tensor(
        self,
        named_tensors: Any = None,
        *,
        load_format: str | None = None,
        flush_cache: bool = True,
        weight_version: str | None = None,
        serialized_named_tensors: Any = None,
    ) -> None:
        """SGLang Engine's in-process `update_weights_from_tensor`: copy `named_tensors` ((name, tensor) pairs
        or a mapping, e.g. a trainer's `model.state_dict()`) into the model, no disk round-trip (`_between_steps`)."""
        pairs = list(named_tensors.items() if hasattr(named_tensors, "items") else named_tensors or ())
        own = self.model.state_dict(keep_vars=True)
        wrong = unfit_tensors(self.model, own, pairs)
        if serialized_named_tensors is not None:
            wrong = "pass named_tensors= (tensors in this process), not serialized_named_tensors"
        elif load_format not in (None, "direct"):
            wrong = f"load_format {load_format!r} is not supported (only the default)"
        if wrong:
            raise BackendRequestError(
                f"{self.model_name}: update_weights_from_tensor: {wrong}", server=self.model_name, status=400
            )
        async with self._between_steps():
            await asyncio.to_thread(self._copy_weights, own, pairs)
        if weight_version is not None:
            self.weight_version = weight_version

    def _copy_weights(self, own: dict[str, torch.Tensor], pairs: list[tuple[str, torch.Tensor]]) -> None:
        with torch.no_grad(), self._step:
            for name, tensor in pairs:
                own[name].data.copy_(tensor.detach())
            self.sessions.clear()

    async def flush_cache(self) -> None:
        """Forget the KV kept between trajectories' turns."""
        self.sessions.clear()

    async def release(self, session_id: str) -> None:
        """The trajectory ended: its kept KV goes."""
        self.sessions.drop(session_id)
