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

import functools
import logging
import re
from typing import Any

log = logging.getLogger(__name__)

PIECE_CACHE = 4096  # distinct pieces kept (least recently used go first)
CHECKED_TEXTS = 16  # texts compared with the whole text's tokenization before the split is trusted


class SegmentEncoder:
    """`encode(text)`: the ids `tokenizer.encode(text, add_special_tokens=False)` gives, cheaper on repeats."""

    def __init__(self, tokenizer: Any, cache_size: int = PIECE_CACHE, checked: int = CHECKED_TEXTS):
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
        self._piece = functools.lru_cache(maxsize=cache_size)(self._whole)

    @property
    def splitting(self) -> bool:
        return self._split is not None

    def _whole(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False)

    def encode(self, text: str) -> list[int]:
        if self._split is None:
            return self._whole(text)
        ids: list[int] = []
        for k, piece in enumerate(self._split(text)):
            if k % 2:
                ids.append(self._ids[piece])
            elif piece:
                ids.extend(self._piece(piece))
        if self._unchecked:
            self._unchecked -= 1
            whole = self._whole(text)
            if ids != whole:
                log.warning("tokenizer %s: a text's ids differ when it is cut at added tokens; tokenizing whole "
                            "texts from now on", getattr(self.tokenizer, "name_or_path", ""))  # fmt: skip
                self._split = None
                return whole
        return ids
