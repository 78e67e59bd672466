"""Tokenize a text piece by piece between the tokenizer's added tokens, pieces seen before from a cache.

Hugging Face tokenizers split a text at its added tokens (<|im_start|>, <tool_call>...) before normalizing or
pre-tokenizing anything, so a text's ids are its pieces' ids, in order. Every prompt of a run repeats the same
system message and tool schemas between such tokens: cut there, those pieces are tokenized once per process,
not once per row. The split is used only where it is exact by construction: no added token strips its
neighbours' whitespace, matches only whole words or is matched after normalization (lstrip, rstrip,
single_word, normalized). The first texts are also checked against the whole text's ids; a tokenizer where the
two differ gets the whole-text path for good.
"""

from __future__ import annotations

import logging
import re
import sys
import threading
from array import array
from collections import OrderedDict
from typing import Any

log = logging.getLogger("agentfsm.families")

CACHE_CHARS = 4 << 20  # characters of pieces kept, all pieces together (least recently used go first)
# and pieces kept: each costs a few hundred bytes however short (a dict entry, a list, an array)
CACHE_ENTRIES = 1 << 14
CHECKED_TEXTS = 16  # texts compared with the whole text's tokenization before the split is trusted


def decode(tokenizer: Any, ids: Any, *, skip_special_tokens: bool = True) -> str:
    """The text of `ids` exactly as the model wrote it: every decode of the engine goes through here. Never
    `clean_up_tokenization_spaces`: transformers 4.x applies a tokenizer's default, True for Llama-3.1, and
    turns "id , name" into "id, name" and "it 's" into "it's", so tools, parsers, interactions and rewards
    would read text the model did not write. A list through a fast tokenizer whose decode nobody overrides goes
    straight to its Rust tokenizer, what transformers' decode calls after checking every id's type (~25 us)."""
    if type(ids) is list and _own(tokenizer, "decode", "_decode"):
        return tokenizer._tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)
    return tokenizer.decode(ids, skip_special_tokens=skip_special_tokens, clean_up_tokenization_spaces=False)


def _own(tokenizer: Any, *names: str) -> bool:
    """Whether the methods `names` of the tokenizer's class are transformers' fast tokenizer's own (a wrapper
    that hands its tokenizer's attributes on, like TemplateKwargs, has none of its own: not plain)."""
    key = (type(tokenizer), names)
    if (plain := _PLAIN.get(key)) is None:
        fast: Any = getattr(sys.modules.get("transformers"), "PreTrainedTokenizerFast", None)
        plain = _PLAIN[key] = fast is not None and all(
            getattr(fast, n) is getattr(key[0], n, None) for n in names
        )
    return plain


_PLAIN: dict[tuple[type, tuple[str, ...]], bool] = {}


class Ids(list[int]):
    """A text's ids and `packed`, the same ids as array("i"), the caller's own: a cached piece keeps both, so a
    prompt seen before reaches a trajectory's array without converting each id (docs/gateway.md)."""

    __slots__ = ("packed",)
    packed: array


def to_array(ids: list[int]) -> array:
    """`ids` as array("i"): an encode's own array when it has one."""
    if isinstance(ids, Ids):
        return ids.packed
    out = array("i")
    out.fromlist(ids)  # a list's own path: twice as fast as array("i", a list)
    return out


class PieceEncoder:
    """`encode(text)`: the ids `tokenizer.encode(text, add_special_tokens=False)` gives, cheaper on repeats."""

    def __init__(
        self,
        tokenizer: Any,
        cache_chars: int = CACHE_CHARS,
        checked: int = CHECKED_TEXTS,
        cache_entries: int = CACHE_ENTRIES,
    ):
        self.tokenizer = tokenizer
        self._unchecked = checked
        added = getattr(tokenizer, "added_tokens_decoder", None)
        tokens = dict(added) if isinstance(added, dict) else {}
        exact = all(
            not any(getattr(t, flag, True) for flag in ("lstrip", "rstrip", "single_word", "normalized"))
            for t in tokens.values()
        )
        self._ids = {getattr(t, "content", str(t)): i for i, t in tokens.items()}
        self._split = None
        if tokens and exact:
            alternatives = "|".join(re.escape(s) for s in sorted(self._ids, key=len, reverse=True))
            self._split = re.compile(f"({alternatives})").split
        self.cache_chars, self.cache_entries = cache_chars, cache_entries
        self._cache: OrderedDict[str, tuple[list[int], array]] = OrderedDict()
        self._cached_chars = 0
        self._lock = threading.Lock()  # a codec may serve several threads (the adapter's workers, Ray actors)
        self._rust = tokenizer._tokenizer if _own(tokenizer, "encode", "_encode_plus") else None

    @property
    def splitting(self) -> bool:
        return self._split is not None

    def _whole(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False)

    def _new_piece(self, piece: str) -> list[int]:
        """A piece's ids straight from the Rust tokenizer, where transformers' encode would only set its options
        first (the piece holds no added token, so `split_special_tokens` changes nothing); through transformers
        when truncation or padding is set on it."""
        rust = self._rust
        if rust is not None and rust.truncation is None and rust.padding is None:
            return rust.encode(piece, add_special_tokens=False).ids
        return self._whole(piece)

    def _piece(self, text: str) -> tuple[list[int], array]:
        """A piece's ids, as a list and an array, from the cache when it was seen before. A piece longer than a
        quarter of the cache (a 10 MB tool answer) is tokenized and not kept: it would push out the pieces that
        repeat."""
        with self._lock:
            if (kept := self._cache.get(text)) is not None:
                self._cache.move_to_end(text)
                return kept
        ids = self._new_piece(text)
        both = ids, to_array(ids)
        if len(text) <= self.cache_chars // 4:
            with self._lock:
                if text not in self._cache:
                    self._cache[text] = both
                    self._cached_chars += len(text)
                while self._cached_chars > self.cache_chars or len(self._cache) > self.cache_entries:
                    old, _ = self._cache.popitem(last=False)
                    self._cached_chars -= len(old)
        return both

    def encode(self, text: str, shielded: dict[str, str] | None = None) -> list[int]:
        """`shielded`: placeholder -> the special-token string it stands for in the text (an observation's
        content, fsm/families/codec.py): the pieces holding one are tokenized with the strings restored as
        plain text (`split_special_tokens`), so they never become control tokens."""
        if shielded:
            return self._encode_shielded(text, shielded)
        if self._split is None:
            return self._whole(text)
        ids = Ids()
        ids.packed = flat = array("i")
        for k, piece in enumerate(self._split(text)):
            if k % 2:
                ids.append(self._ids[piece])
                flat.append(self._ids[piece])
            elif piece:
                listed, arrayed = self._piece(piece)
                ids.extend(listed)
                flat.extend(arrayed)
        if self._unchecked:
            self._unchecked -= 1
            whole = self._whole(text)
            if ids != whole:
                log.warning(
                    "tokenizer %s: a text's ids differ when it is cut at added tokens; tokenizing whole "
                    "texts from now on",
                    getattr(self.tokenizer, "name_or_path", ""),
                )
                self._split = None
                return whole
        return ids

    def _encode_shielded(self, text: str, shielded: dict[str, str]) -> list[int]:
        marks = re.compile("|".join(re.escape(m) for m in shielded))
        parts = self._split(text) if self._split is not None else [text]
        ids: list[int] = []
        for k, piece in enumerate(parts):
            if k % 2:
                ids.append(self._ids[piece])
            elif piece and marks.search(piece):
                plain = marks.sub(lambda m: shielded[m.group(0)], piece)
                ids.extend(self.tokenizer.encode(plain, add_special_tokens=False, split_special_tokens=True))
            elif piece:
                ids.extend(self._piece(piece)[0] if self._split is not None else self._whole(piece))
        return ids
