"""What the embedded backend (backends/hf.py) runs: the model, how it samples, and its KV caches.

- The model on its device and dtype (float32 for small models, even on CUDA: docs/engines.md), with torch's
  threads (all cores but one on the CPU, so the engine's event loop keeps a core), under its served name.
- Sampling as SGLang's: requests checked as its server checks them (`validate`), greedy or top-k / top-p
  draws, the picked token's logprob as log_softmax(logits / temperature) over the vocabulary (`sample_next`).
- KV caches (docs/engines.md, "How the embedded model batches"): the running batch that rows join and leave
  between decode steps (`Rows`, `SlotCache`), and each trajectory's cache kept between turns (`SessionCache`),
  covering all but the turn's last token (sampled, never fed). Rows are left-padded: each row's tokens fill
  the last columns of its cache, contiguous; the attention mask marks them and position ids count from 0 at
  each row's first token. A joining cache and the batch's are padded on the left to the wider one.
"""

from __future__ import annotations

import math
import os
import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import torch
import torch.nn.functional as F
from transformers import AutoConfig, AutoModelForCausalLM, DynamicCache
from transformers.cache_utils import DynamicLayer

from backends.base import GREEDY_BELOW, BackendRequestError, GenerateRequest
from backends.contract import SAMPLING_KEYS
from backends.tiny import ASSET_DIR

SMALL_MODEL_PARAMS = 1_000_000_000  # below this, float32 on CUDA too (see the module docstring)
TINY_SERVED_NAME = "agentfsm-tiny-calculator"  # the served name of the bundled model (backends/tiny/assets)
DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
}


def default_threads() -> int | None:
    """torch's intra-op threads for a model loaded on the CPU: all cores but one; None (torch's choice) when
    OMP_NUM_THREADS or MKL_NUM_THREADS says how many."""
    if os.environ.get("OMP_NUM_THREADS") or os.environ.get("MKL_NUM_THREADS"):
        return None
    return max(1, len(os.sched_getaffinity(0)) - 1)


def load(
    model: str | os.PathLike[str] | torch.nn.Module,
    device: str | torch.device | None,
    dtype: torch.dtype | str | None,
    torch_threads: int | None,
) -> tuple[torch.nn.Module, torch.device, torch.dtype]:
    """The model in eval mode on its device, in its dtype (module docstring). A module passed in is the caller's:
    its weights are shared and its process's threads are left as they are."""
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if torch_threads is None and device.type == "cpu" and not isinstance(model, torch.nn.Module):
        torch_threads = default_threads()
    if torch_threads is not None:
        torch.set_num_threads(torch_threads)
    dtype = to_dtype(dtype)
    if isinstance(model, torch.nn.Module):
        dtype = dtype or next(model.parameters()).dtype
    else:
        if dtype is None:  # counting parameters builds a skeleton: only where the answer matters
            dtype = default_dtype(device, parameter_count(model) if device.type == "cuda" else None)
        model = AutoModelForCausalLM.from_pretrained(model, dtype=dtype)
    model.to(device=device, dtype=dtype).eval()
    return model, device, dtype


def to_dtype(dtype: torch.dtype | str | None) -> torch.dtype | None:
    """A torch dtype from a dtype or its name ("float32", "bf16"...); None for None or "auto"."""
    if dtype is None or isinstance(dtype, torch.dtype):
        return dtype
    name = str(dtype).strip().lower().removeprefix("torch.")
    if name == "auto":
        return None
    if name not in DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}: expected auto or one of {', '.join(DTYPES)}")
    return DTYPES[name]


def default_dtype(device: torch.device, parameters: int | None) -> torch.dtype:
    """float32 but for models of SMALL_MODEL_PARAMS or more (or unknown) on CUDA: bfloat16 (module docstring)."""
    if device.type != "cuda":
        return torch.float32
    return torch.float32 if parameters is not None and parameters < SMALL_MODEL_PARAMS else torch.bfloat16


def parameter_count(path: str | os.PathLike[str]) -> int | None:
    """The model's parameter count, from its config alone (built on the meta device: no memory, no weights
    read); None when it cannot be built."""
    try:
        config = AutoConfig.from_pretrained(path)
        with torch.device("meta"):
            skeleton = AutoModelForCausalLM.from_config(config)
        return sum(p.numel() for p in skeleton.parameters())
    except Exception:  # an unusual layout: fall back to the large-model default
        return None


def served_name(model: Any, config: Any) -> str:
    """The bundled tiny model's name, a `served_model_name` in the config, or the model folder's name."""
    named = getattr(config, "served_model_name", None)
    if isinstance(named, str) and named:
        return named
    path = model if not isinstance(model, torch.nn.Module) else config.name_or_path
    if path:
        try:
            if Path(path).resolve() == ASSET_DIR:
                return TINY_SERVED_NAME
        except OSError:
            pass
    if path and not os.path.isdir(path):
        return str(path)  # a hub id ("Qwen/Qwen3-0.6B"), as SGLang names it
    return os.path.basename(os.path.normpath(str(path or ""))) or "hf"


def untied_values(model: torch.nn.Module, values: Any) -> str | None:
    """What in `values` (name -> tensor) `model` cannot hold: different tensors for names that are one tied
    parameter there (an output head tied to the embedding), of which only the last copied would serve,
    silently."""
    shared: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        shared.setdefault(id(param), []).append(name)
    for names in shared.values():
        given = [n for n in names if n in values]
        if any(not torch.equal(values[given[0]], values[n]) for n in given[1:]):
            return f"different {' and '.join(given)}, which the served model ties into one parameter"
    return None


def unfit_tensors(
    model: torch.nn.Module, own: dict[str, torch.Tensor], pairs: list[tuple[str, torch.Tensor]]
) -> str | None:
    """Why (name, tensor) `pairs` cannot be copied into `model` (whose state dict is `own`): a name it lacks,
    a shape it does not have, or tied parameters given different values; None when they fit."""
    for name, t in pairs:
        if name not in own:
            return f"the model has no parameter {name!r}"
        if t.shape != own[name].shape:
            return f"{name} has shape {tuple(t.shape)}, the model's {tuple(own[name].shape)}"
    return untied_values(model, dict(pairs))


# SGLang sampling keys (contract.SAMPLING_KEYS) this backend does not implement: accepted only at their no-op
# value. Those that only shape `text` (skip_special_tokens...: we return token ids only) are accepted and ignored.
UNSUPPORTED: dict[str, Any] = {
    "min_new_tokens": 0,
    "min_p": 0.0,
    "frequency_penalty": 0.0,
    "presence_penalty": 0.0,
    "repetition_penalty": 1.0,
    "n": 1,
    "stop": None,
    "stop_regex": None,
    "json_schema": None,
    "regex": None,
    "ebnf": None,
    "structural_tag": None,
    "logit_bias": None,
    "custom_params": None,
    "beam_width": None,
    "watermark": None,
    "choice": None,
}


@dataclass(frozen=True, slots=True)
class DecodeSampling:
    """One request's sampling parameters, validated."""

    max_new_tokens: int
    temperature: float  # 0.0 means greedy
    top_p: float  # in (0, 1]
    top_k: int  # >= 1; the vocabulary size means "all"
    stop_ids: frozenset[int]  # stop_token_ids, plus the model's eos ids unless ignore_eos
    seed: int | None


def validate(
    request: GenerateRequest,
    *,
    name: str,
    vocab_size: int,
    context_length: int | None,
    eos_ids: frozenset[int],
) -> DecodeSampling:
    """Check a request the way SGLang's server would; raise BackendRequestError (HTTP 400) otherwise."""

    def bad(message: str) -> BackendRequestError:
        return BackendRequestError(f"{name}: {message}", server=name, status=400)

    prompt, params = request.prompt_ids, request.sampling_params
    if not prompt:
        raise bad("prompt_ids is empty")
    if min(prompt) < 0 or max(prompt) >= vocab_size:
        raise bad(f"prompt_ids must lie in [0, {vocab_size})")
    if context_length is not None and len(prompt) >= context_length:
        raise bad(
            f"the input ({len(prompt)} tokens) is longer than the model's context length "
            f"({context_length} tokens); shorten the prompt"
        )
    for key, value in params.items():
        if key in UNSUPPORTED and value not in (UNSUPPORTED[key], None, [], {}):
            raise bad(f"sampling param {key}={value!r} is not supported by HFBackend")
        if key not in SAMPLING_KEYS:
            raise bad(f"unknown sampling param {key!r}")
    try:
        given = params.get("max_new_tokens")
        max_new = int(given if given is not None else 128)
        temperature = float(params.get("temperature", 1.0))
        top_p = float(params.get("top_p", 1.0))
        top_k = int(params.get("top_k", -1))
        stops = frozenset(int(t) for t in params.get("stop_token_ids") or ())
        seed = params.get("sampling_seed")
        seed = None if seed is None else int(seed)
    except (TypeError, ValueError) as e:
        raise bad(f"bad sampling params {params!r}: {e}") from e
    if max_new < 0:
        raise bad(f"max_new_tokens must be >= 0, got {max_new}")
    if not math.isfinite(temperature) or temperature < 0:
        raise bad(f"temperature must be finite and >= 0, got {temperature}")
    if not 0.0 < top_p <= 1.0:
        raise bad(f"top_p must be in (0, 1], got {top_p}")
    if top_k != -1 and top_k < 1:
        raise bad(f"top_k must be -1 (all) or >= 1, got {top_k}")
    if context_length is not None:  # SGLang clamps the budget to what the context has left
        max_new = min(max_new, context_length - len(prompt))
    return DecodeSampling(
        max_new_tokens=max_new,
        temperature=0.0 if temperature < GREEDY_BELOW else temperature,
        top_p=top_p,
        top_k=vocab_size if top_k == -1 else min(top_k, vocab_size),
        stop_ids=stops if params.get("ignore_eos") else stops | eos_ids,
        seed=seed,
    )


def draw(
    logp: torch.Tensor, top_p: torch.Tensor, top_k: torch.Tensor, gens: list[torch.Generator]
) -> torch.Tensor:
    """Sample one token per row from exp(logp) cut to top-k / top-p, by inverse CDF.

    Each row draws its single uniform from its own generator (on the CPU, whatever the model's device), so a
    seeded request picks the same tokens whatever it is batched with, and on whichever device.
    """
    probs, order = logp.exp().sort(dim=-1, descending=True)  # (B, V)
    rank = torch.arange(probs.shape[-1], device=probs.device)
    mass_before = probs.cumsum(-1) - probs
    keep = (rank < top_k[:, None]) & ((mass_before <= top_p[:, None]) | (top_p[:, None] >= 1.0))
    cdf = (probs * keep).cumsum(-1)
    u = torch.stack([torch.rand((), generator=g) for g in gens]).to(probs.device) * cdf[:, -1]
    pick = torch.searchsorted(cdf, u[:, None]).clamp_(max=probs.shape[-1] - 1)
    return order.gather(-1, pick).squeeze(-1)


def sample_next(
    logits: torch.Tensor,
    gens: list[torch.Generator | None],
    temp: torch.Tensor,
    top_p: torch.Tensor,
    top_k: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Pick the next token of every row; return (tokens, their logprobs), both (B,). `temp` is 1.0 for greedy
    rows, so their logprobs are plain log_softmax(logits)."""
    logp = torch.log_softmax(logits / temp[:, None], dim=-1)  # (B, V): what SGLang reports
    tokens = logits.argmax(-1)
    sampled = [row for row, gen in enumerate(gens) if gen is not None]  # a None generator: a greedy row
    if sampled:
        rows = torch.tensor(sampled, device=logits.device)
        tokens[rows] = draw(logp[rows], top_p[rows], top_k[rows], [gens[row] for row in sampled])  # type: ignore[misc]
    return tokens, logp.gather(-1, tokens[:, None]).squeeze(-1)


# per layer (keys, values): (B, heads, T, head_dim), or one row's (heads, T, head_dim)
KV = list[tuple[torch.Tensor, torch.Tensor]]


def joinable(config: Any) -> bool:
    """Whether the model's cache is plain per-layer key/value tensors that rows can join, leave and keep
    (not sliding-window or recurrent layers, whose state is not a list of positions)."""
    try:
        return all(type(layer) is DynamicLayer for layer in DynamicCache(config=config).layers)
    except Exception:  # a cache transformers cannot build from this config: keep to whole batches
        return False


def _slots(cache: DynamicCache) -> list[SlotLayer]:
    """A running batch's SlotCache layers (typed as such; `Rows` checks which cache it holds)."""
    return cast(list[SlotLayer], cache.layers)


@dataclass(slots=True, eq=False)
class KeptKV:
    """One trajectory's keys and values after its last turn: they cover `ids` (all but the last token)."""

    ids: list[int]
    kv: KV  # per layer, (heads, len(ids), head_dim)
    epoch: int  # the weights that computed it
    nbytes: int


class SessionCache:
    """Each session's (trajectory's) KV from its last turn, within `max_bytes` (the least recently used goes
    first). Thread-safe: the decode thread takes and keeps entries, the event loop drops them."""

    def __init__(self, max_bytes: int):
        self.max_bytes = max_bytes
        self.epoch = 0  # bumped by every weight change: KV from older weights is never used
        self.nbytes = 0
        self.misses = 0
        self._entries: OrderedDict[str, KeptKV] = OrderedDict()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._entries)

    def take(self, session: str, prompt: Sequence[int]) -> KeptKV | None:
        """The session's kept KV when `prompt` extends its ids (at least one token more), under the current
        weights; it leaves the cache either way (the row that uses it keeps it again when it ends)."""
        with self._lock:
            kept = self._pop(session)
        n = len(kept.ids) if kept is not None else 0
        if kept is None or kept.epoch != self.epoch or n >= len(prompt) or prompt[:n] != kept.ids:
            self.misses += kept is not None
            return None
        return kept

    def keep(self, session: str, ids: list[int], kv: KV, epoch: int) -> None:
        nbytes = sum(k.nbytes + v.nbytes for k, v in kv)
        with self._lock:
            self._pop(session)
            if epoch != self.epoch or nbytes > self.max_bytes:
                return
            while self._entries and self.nbytes + nbytes > self.max_bytes:
                self.nbytes -= self._entries.popitem(last=False)[1].nbytes
            self._entries[session] = KeptKV(ids, kv, epoch, nbytes)
            self.nbytes += nbytes

    def drop(self, session: str) -> None:
        with self._lock:
            self._pop(session)

    def _pop(self, session: str) -> KeptKV | None:
        """The session's entry, out of the cache (the caller holds the lock)."""
        kept = self._entries.pop(session, None)
        if kept is not None:
            self.nbytes -= kept.nbytes
        return kept

    def clear(self) -> None:
        """Forget everything, and anything computed so far that is kept later (new weights)."""
        with self._lock:
            self.epoch += 1
            self._entries.clear()
            self.nbytes = 0


class SlotLayer(DynamicLayer):
    """One layer's keys and values in buffers with room to spare, so a decode step writes its column in place
    and rows join and leave by copying only themselves (a DynamicLayer concatenates: every step, and every
    row that joins, copies the whole batch's cache). Rows [0, n) and columns [lo, hi) are in use; `keys` and
    `values` are views of that window."""

    SPARE_COLUMNS = 128  # room added on each side when the buffer grows

    def __init__(self, max_rows: int):
        super().__init__()
        self.max_rows = max_rows
        self.kb: torch.Tensor | None = None
        self.vb: torch.Tensor | None = None
        self.n = self.lo = self.hi = 0

    def _view(self) -> None:
        assert self.kb is not None and self.vb is not None
        self.keys = self.kb[: self.n, :, self.lo : self.hi]
        self.values = self.vb[: self.n, :, self.lo : self.hi]

    def _fit(self, like: torch.Tensor, rows: int, lo: int, hi: int) -> None:
        """Make rows [0, rows) and columns [lo, hi) (in the current coordinates) fit the buffers."""
        if self.kb is not None and rows <= self.kb.shape[0] and lo >= 0 and hi <= self.kb.shape[2]:
            return
        if not self.is_initialized:
            self.lazy_initialization(like, like)
        cap = self.kb.shape[0] if self.kb is not None else 0
        cap = max(rows, min(self.max_rows, max(2 * cap, 8)))
        spare = self.SPARE_COLUMNS
        shape = (cap, like.shape[1], spare + (hi - lo) + spare, like.shape[3])
        kb, vb = like.new_zeros(shape), like.new_zeros(shape)
        start = spare + (self.lo - lo)  # where the columns in use land
        if self.kb is not None and self.n:
            assert self.keys is not None and self.values is not None  # set by _view with kb
            kb[: self.n, :, start : start + self.hi - self.lo] = self.keys
            vb[: self.n, :, start : start + self.hi - self.lo] = self.values
        self.kb, self.vb = kb, vb
        self.lo, self.hi = start, start + self.hi - self.lo

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        """A forward pass's new columns for every row (a decode step; the first pass brings the rows)."""
        width = key_states.shape[-2]
        if self.kb is None:
            self.n, self.lo, self.hi = key_states.shape[0], 0, 0
        self._fit(key_states, self.n, self.lo, self.hi + width)
        assert self.kb is not None and self.vb is not None
        self.kb[: self.n, :, self.hi : self.hi + width] = key_states
        self.vb[: self.n, :, self.hi : self.hi + width] = value_states
        self.hi += width
        self._view()
        return self.keys, self.values

    def join(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Rows (G, heads, W, head_dim) that join, opened (`open`) and counted in at once; the columns they add on
        the left hold stale values, masked."""
        self.open((keys, values), keys.shape[0], keys.shape[2])
        self.n += keys.shape[0]
        self._view()

    def open(self, past: tuple[torch.Tensor, torch.Tensor] | None, rows: int, width: int) -> Opened:
        """Room for `rows` more rows whose `width` columns end at the batch's last column, their past (keys and
        values (rows, heads, P, head_dim)) written first: a cache layer for their prefill (see `Opened`)."""
        like = past[0] if past is not None else self.kb
        assert like is not None
        self._fit(like, self.n + rows, min(self.lo, self.hi - width), self.hi)
        self.lo = min(self.lo, self.hi - width)
        start, held = self.hi - width, past[0].shape[2] if past is not None else 0
        if past is not None:
            self.kb[self.n : self.n + rows, :, start : start + held] = past[0]  # type: ignore[index]
            self.vb[self.n : self.n + rows, :, start : start + held] = past[1]  # type: ignore[index]
        return Opened(self, rows, start, held)

    def move(self, pairs: list[tuple[int, int]], rows: int, trim: int) -> None:
        """Copy row `src` onto row `dst` for each pair, keep rows [0, rows), drop `trim` columns on the left."""
        assert self.kb is not None and self.vb is not None
        for dst, src in pairs:  # a few rows: one copy each beats an indexed copy
            self.kb[dst, :, self.lo : self.hi].copy_(self.kb[src, :, self.lo : self.hi])
            self.vb[dst, :, self.lo : self.hi].copy_(self.vb[src, :, self.lo : self.hi])
        self.n, self.lo = rows, self.lo + trim
        self._view()


class Opened(DynamicLayer):
    """Rows a SlotLayer opened past its last row, as a cache layer for their prefill: the forward pass reads
    their past in place and writes its new columns in place (nothing is copied into the batch afterwards);
    `Rows.merge` then counts them in."""

    def __init__(self, slot: SlotLayer, rows: int, start: int, held: int):
        super().__init__()
        self.slot, self.rows, self.start, self.end = slot, rows, start, start + held
        assert slot.kb is not None
        self.lazy_initialization(slot.kb, slot.kb)
        self._view()

    def _view(self) -> None:
        first, kb, vb = self.slot.n, self.slot.kb, self.slot.vb
        assert kb is not None and vb is not None
        self.keys = kb[first : first + self.rows, :, self.start : self.end]
        self.values = vb[first : first + self.rows, :, self.start : self.end]

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        first, width = self.slot.n, key_states.shape[-2]
        assert self.slot.kb is not None and self.slot.vb is not None and self.end + width == self.slot.hi
        self.slot.kb[first : first + self.rows, :, self.end : self.end + width] = key_states
        self.slot.vb[first : first + self.rows, :, self.end : self.end + width] = value_states
        self.end += width
        self._view()
        return self.keys, self.values


class SlotCache(DynamicCache):
    """A DynamicCache of SlotLayers, for a running batch; `kv`: its first rows' past, if any."""

    def __init__(self, config: Any, max_rows: int, kv: KV | None = None):
        super().__init__(config=config)
        slots = [SlotLayer(max_rows) for _ in self.layers]
        self.layers = list(slots)
        for layer, (keys, values) in zip(slots, kv, strict=True) if kv else ():
            layer.join(keys, values)


@dataclass(slots=True, eq=False)
class Rows:
    """A running batch's decode state: its cache, attention mask (B, W), each row's last position (B, 1), the
    token each row sampled last and has not fed yet (B,), and the per-row sampling tensors (B,)."""

    cache: DynamicCache
    mask: torch.Tensor
    pos: torch.Tensor
    tokens: torch.Tensor
    temp: torch.Tensor
    top_p: torch.Tensor
    top_k: torch.Tensor

    def row_kv(self, row: int, length: int) -> KV:
        """Row `row`'s last `length` positions, copied (the batch's buffers are reused as it moves on)."""
        dynamic = cast(list[DynamicLayer], self.cache.layers)  # the caches built here: keys and values set
        kv = [(cast(torch.Tensor, x.keys), cast(torch.Tensor, x.values)) for x in dynamic]
        return [(k[row, :, -length:].clone(), v[row, :, -length:].clone()) for k, v in kv]

    def select(self, live: list[int]) -> list[int]:
        """Keep only the rows `live`: rows past the end fill the holes the others leave, and columns every
        kept row has as padding go. Returns the new order (old row indices)."""
        if not isinstance(self.cache, SlotCache):  # a model whose batch only shrinks (see `joinable`)
            index = torch.tensor(live, device=self.mask.device)
            self.cache.batch_select_indices(index)
            self._reorder(index)
            return live
        kept, order, staying = len(live), list(range(len(live))), set(live)
        holes = [row for row in range(kept) if row not in staying]
        movers = [row for row in live if row >= kept]
        for hole, mover in zip(holes, movers, strict=True):
            order[hole] = mover
        self._reorder(torch.tensor(order, device=self.mask.device))
        used = self.mask.any(0).nonzero()
        trim = int(used[0]) if len(used) else 0
        self.mask = self.mask[:, trim:]
        pairs = list(zip(holes, movers, strict=True))
        for layer in _slots(self.cache):
            layer.move(pairs, kept, trim)
        return order

    def _reorder(self, index: torch.Tensor) -> None:
        self.mask, self.pos, self.tokens = self.mask[index], self.pos[index], self.tokens[index]
        self.temp, self.top_p, self.top_k = self.temp[index], self.top_p[index], self.top_k[index]

    def opened(self, past: KV | None, rows: int, width: int, config: Any) -> DynamicCache:
        """A cache for the prefill of `rows` rows that join this batch, `width` columns each (see `Opened`)."""
        cache = DynamicCache(config=config)
        cache.layers = [
            layer.open(past[i] if past else None, rows, width) for i, layer in enumerate(_slots(self.cache))
        ]
        return cache

    def merge(self, other: Rows) -> None:
        """Count in `other`'s rows, prefilled into this batch's slots (`opened`); the narrower side's mask is
        padded on the left."""
        for layer in _slots(self.cache):
            layer.n += other.mask.shape[0]
            layer._view()
        width = max(self.mask.shape[1], other.mask.shape[1])
        self.mask = torch.cat([F.pad(m, (width - m.shape[1], 0)) for m in (self.mask, other.mask)])
        self.pos, self.tokens = torch.cat([self.pos, other.pos]), torch.cat([self.tokens, other.tokens])
        self.temp, self.top_p = torch.cat([self.temp, other.temp]), torch.cat([self.top_p, other.top_p])
        self.top_k = torch.cat([self.top_k, other.top_k])


def prefill_inputs(
    contexts: Sequence[Sequence[int]], kept: Sequence[KeptKV | None], pad_id: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, KV | None]:
    """Inputs to prefill rows together, each from its kept KV where it has one: (ids (G, S), attention mask
    (G, P + S), position ids (G, S), past KV (G, heads, P, head_dim) per layer or None). S is the longest part
    any row must compute (its context past what it kept); a row that kept more than its context minus S
    computes its last S tokens anyway, so the past and the new columns of every row stay contiguous.
    """
    computed = [len(c) - (len(k.ids) if k is not None else 0) for c, k in zip(contexts, kept, strict=True)]
    width = max(computed)
    past = [max(len(c) - width, 0) if k is not None else 0 for c, k in zip(contexts, kept, strict=True)]
    held = max(past)
    g = len(contexts)
    ids = torch.full((g, width), pad_id, dtype=torch.long)
    mask = torch.zeros((g, held + width), dtype=torch.long)
    pos = torch.zeros((g, width), dtype=torch.long)
    for row, (context, p) in enumerate(zip(contexts, past, strict=True)):
        new = context[p:]
        ids[row, width - len(new) :] = torch.tensor(new)
        mask[row, held - p : held] = 1
        mask[row, held + width - len(new) :] = 1
        pos[row, width - len(new) :] = torch.arange(p, len(context))
    kv = None
    if held:
        first = next(k for k in kept if k is not None).kv
        kv = []
        for i, (k0, v0) in enumerate(first):
            keys = k0.new_zeros((g, k0.shape[0], held, k0.shape[2]))
            values = v0.new_zeros((g, v0.shape[0], held, v0.shape[2]))
            for row, (k, p) in enumerate(zip(kept, past, strict=True)):
                if p:
                    keys[row, :, held - p :] = k.kv[i][0][:, :p]  # type: ignore[union-attr]
                    values[row, :, held - p :] = k.kv[i][1][:, :p]  # type: ignore[union-attr]
            kv.append((keys, values))
    return ids.to(device), mask.to(device), pos.to(device), kv
