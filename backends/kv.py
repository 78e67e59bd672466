"""KV caches of the embedded backend (backends/hf.py): the running batch that requests join and leave between
decode steps, and each trajectory's cache kept from one turn to the next.

A trajectory's next turn sends its whole context again: the previous prompt, the tokens the model generated
and then an observation. Kept, the previous turn's keys and values cover all but that turn's last token (it
was sampled, never fed), so the next turn prefills only that token and the observation instead of the whole
context. The kept prefix is used only when the new prompt starts with exactly those tokens, and only under the
weights that computed it.

Rows in a batch are left-padded: each row's tokens fill the last columns of its cache, contiguous, its newest
token in the last column; the attention mask marks them and explicit position ids count from 0 at each row's
first token. Rows that join bring caches of their own width; the narrower side is padded on the left.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, cast

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

KV = list[
    tuple[torch.Tensor, torch.Tensor]
]  # per layer (keys, values): (B, heads, T, head_dim), or one row's (heads, T, head_dim)


def joinable(config: Any) -> bool:
    """Whether the model's cache is plain per-layer key/value tensors that rows can join, leave and keep
    (not sliding-window or recurrent layers, whose state is not a list of positions)."""
    try:
        return all(type(layer) is DynamicLayer for layer in DynamicCache(config=config).layers)
    except Exception:  # a cache transformers cannot build from this config: keep to whole batches
        return False


def _pad_left(t: torch.Tensor, width: int, dim: int) -> torch.Tensor:
    short = width - t.shape[dim]
    if short <= 0:
        return t
    shape = list(t.shape)
    shape[dim] = short
    return torch.cat([t.new_zeros(shape), t], dim=dim)


def layers(cache: DynamicCache) -> KV:
    # the caches built here hold DynamicLayers (or subclasses), whose keys and values are set once filled
    return [(cast(torch.Tensor, layer.keys), cast(torch.Tensor, layer.values)) for layer in _dynamic(cache)]


def _dynamic(cache: DynamicCache) -> list[DynamicLayer]:
    return cast(list[DynamicLayer], cache.layers)


def _slots(cache: DynamicCache) -> list[SlotLayer]:
    """A running batch's SlotCache layers (typed as such; `Rows` checks which cache it holds)."""
    return cast(list[SlotLayer], cache.layers)


def make_cache(kv: KV | None, config: Any) -> DynamicCache:
    """A DynamicCache holding `kv` as is (not copied)."""
    cache = DynamicCache(config=config)
    for layer, (keys, values) in zip(_dynamic(cache), kv, strict=True) if kv else ():
        layer.lazy_initialization(keys, values)
        layer.keys, layer.values = keys, values
    return cache


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
        self.hits = self.misses = 0
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
        self.hits += 1
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
        self.keys, self.values = (
            self.kb[: self.n, :, self.lo : self.hi],
            self.vb[: self.n, :, self.lo : self.hi],
        )

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
        """Rows (G, heads, W, head_dim) that join, their last column aligned with the batch's last column; the
        columns they add on the left hold stale values, masked."""
        rows, width = keys.shape[0], keys.shape[2]
        lo = min(self.lo, self.hi - width) if self.n else self.hi - width
        self._fit(keys, self.n + rows, lo, self.hi)
        assert self.kb is not None and self.vb is not None
        self.lo = min(self.lo, self.hi - width) if self.n else self.hi - width
        self.kb[self.n : self.n + rows, :, self.hi - width : self.hi] = keys
        self.vb[self.n : self.n + rows, :, self.hi - width : self.hi] = values
        self.n += rows
        self._view()

    def open(self, past: tuple[torch.Tensor, torch.Tensor] | None, rows: int, width: int) -> Opened:
        """Room for `rows` more rows whose `width` columns end at the batch's last column, their past (keys and
        values (rows, heads, P, head_dim)) written first: a cache layer for their prefill (see `Opened`)."""
        like = past[0] if past is not None else self.kb
        assert like is not None and self.n
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

    def __len__(self) -> int:
        return self.mask.shape[0]

    def row_kv(self, row: int, length: int) -> KV:
        """Row `row`'s last `length` positions, copied (the batch's buffers are reused as it moves on)."""
        return [(k[row, :, -length:].clone(), v[row, :, -length:].clone()) for k, v in layers(self.cache)]

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
            layer.n += len(other)
            layer._view()
        width = max(self.mask.shape[1], other.mask.shape[1])
        self.mask = torch.cat([_pad_left(self.mask, width, 1), _pad_left(other.mask, width, 1)])
        self.pos, self.tokens = torch.cat([self.pos, other.pos]), torch.cat([self.tokens, other.tokens])
        self.temp, self.top_p = torch.cat([self.temp, other.temp]), torch.cat([self.top_p, other.top_p])
        self.top_k = torch.cat([self.top_k, other.top_k])


def prefill_inputs(
    contexts: Sequence[Sequence[int]], kept: Sequence[KeptKV | None], pad_id: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, KV | None]:
    """Inputs to prefill rows together, each from its kept KV where it has one: (ids (G, S), attention mask
    (G, P + S), position ids (G, S), past KV (G, heads, P, head_dim) per layer or None).

    S is the longest part any row must compute (its context past what it kept). A row that kept more than its
    context minus S computes its last S tokens anyway (uses less of what it kept), so the past and the new
    columns of every row stay contiguous.
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
