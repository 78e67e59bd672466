"""The tokenizer's two calls on every prompt, made cheap and exact: the chat template's render, and the
tokenization of its text piece by piece between the added tokens, pieces seen before from a cache.

Hugging Face tokenizers split a text at its added tokens (<|im_start|>, <tool_call>...) before normalizing or
pre-tokenizing anything, so a text's ids are its pieces' ids, in order. Every prompt of a run repeats the same
system message and tool schemas between such tokens: cut there, those pieces are tokenized once per process,
not once per row. The split is used only where it is exact by construction: no added token strips its
neighbours' whitespace, matches only whole words or is matched after normalization (lstrip, rstrip,
single_word, normalized). The first texts are also checked against the whole text's ids; a tokenizer where the
two differ gets the whole-text path for good.

The chat template's render is compiled once and called directly where transformers' wrapper would change
nothing (docs/benchmarks.md has what it saves). `apply_chat_template` copies every message and tool schema
into plain JSON types (`_plain_template_data`), drops the keys whose value is None, copies reasoning under its
other names (`_alias_reasoning_fields`), picks the template (a tokenizer may have several) and passes the
special tokens as variables; only then does it call the compiled jinja template. For the messages an engine
builds (dicts of str, lists and numbers) the copies are the same data, so the render is the template's, called
with the same variables. Anything else (a None value, a reasoning field, a tuple, an object,
`continue_final_message`) goes through the wrapper as before; so does a transformers without the compiler this
calls (`_compile_jinja_template`). tests/test_chat_render.py holds the two renders equal on every family's
real template.
"""

from __future__ import annotations

import builtins
import logging
import re
import sys
import threading
from array import array
from collections import OrderedDict
from typing import Any

import orjson

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


def _byte_chars() -> dict[str, int]:
    """The byte-level alphabet's char -> byte (GPT-2's `bytes_to_unicode`, inverted): printable bytes stand
    for themselves, the others for chars from U+0100 on, in byte order."""
    shown = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    others = [b for b in range(256) if b not in shown]
    return {chr(b): b for b in shown} | {chr(0x100 + k): b for k, b in enumerate(others)}


class ByteDecoder:
    """The Rust decode of a fast tokenizer whose decoder is byte-level alone (Qwen, Llama-3, DeepSeek, gpt-oss),
    computed as it does: each token's bytes (its chars mapped back, or its UTF-8 where one is outside the
    alphabet), joined, read as UTF-8 with each invalid sequence replaced (`from_utf8_lossy` and Python's
    "replace" replace the same maximal subparts); a special token left out when skipped. Why: between two turns
    an engine's other work pushes the Rust decode's tables and code out of the CPU's caches, where these dicts
    of the ids seen are read by the interpreter's hot code (docs/benchmarks.md). An id that is no vocabulary
    entry's goes to the Rust decode (its error, or its dropping of unknown ids); the first texts are compared
    with it, and a difference sends every later call there."""

    def __init__(self, tokenizer: Any, checked: int = CHECKED_TEXTS):
        self._rust = tokenizer._tokenizer
        self.name = getattr(tokenizer, "name_or_path", "")
        self._unchecked = checked
        added = self._rust.get_added_tokens_decoder()
        self._special = {t.content for t in added.values() if t.special}
        self._chars = _byte_chars()
        self._kept: dict[int, bytes] = {}  # id -> its bytes
        self._skipping: dict[int, bytes] = {}  # the same, b"" for a special token
        self.exact = True

    @classmethod
    def of(cls, tokenizer: Any) -> ByteDecoder | None:
        """The tokenizer's ByteDecoder, None where its decode is not the byte-level one alone."""
        if not _own(tokenizer, "decode", "_decode"):
            return None
        from tokenizers import decoders  # loaded with the tokenizer

        rust = getattr(tokenizer, "_tokenizer", None)
        return cls(tokenizer) if type(getattr(rust, "decoder", None)) is decoders.ByteLevel else None

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        kept = self._skipping if skip_special_tokens else self._kept
        try:
            raw = b"".join([kept[i] for i in ids])
        except (KeyError, TypeError):
            if not self._learn(ids):
                return self._rust.decode(ids, skip_special_tokens=skip_special_tokens)
            raw = b"".join([kept[i] for i in ids])
        text = raw.decode("utf-8", "replace")
        if self._unchecked:
            self._unchecked -= 1
            rust = self._rust.decode(ids, skip_special_tokens=skip_special_tokens)
            if text != rust:
                log.warning(
                    "tokenizer %s: a decode from its tokens' bytes differs; its own from now on", self.name
                )
                self.exact = False
                self._kept, self._skipping = {}, {}
                return rust
        return text

    def _learn(self, ids: list[int]) -> bool:
        """Keep the bytes of `ids` not kept yet; False when one is not a vocabulary entry's id (or after a
        difference)."""
        chars, kept = self._chars, self._kept
        for i in ids:
            if type(i) is not int or i < 0 or not self.exact:
                return False
            if i in kept:
                continue
            token = self._rust.id_to_token(i)
            if token is None:
                return False
            try:
                raw = bytes([chars[c] for c in token])
            except KeyError:
                raw = token.encode()
            kept[i] = raw
            self._skipping[i] = b"" if token in self._special else raw
        return True


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


def extend_array(out: array, items: Any) -> None:
    """`out.extend(items)` by the fastest path: an encoder's own array of the ids (`Ids`) copied whole, a list
    through `fromlist` (`extend` converts a list's items one at a time, through its iterator)."""
    if isinstance(items, Ids) and items.packed.typecode == out.typecode:
        out.extend(items.packed)
    elif isinstance(items, list):
        out.fromlist(items)
    else:
        out.extend(items)


def expand_runs(runs: array, n: int) -> array:
    """Per-token values of `n` tokens from their runs [start, value, start, value...]: a trajectory's weight
    versions (fsm/run/trajectory.py), kept as one run per model turn."""
    out = array("i")
    for k in range(0, len(runs), 2):
        end = runs[k + 2] if k + 2 < len(runs) else n
        out.extend(array("i", (runs[k + 1],)) * (end - runs[k]))
    return out


_HOLDS_GIL = 1024  # the longest piece tokenized by `encode`, which holds the GIL (a few ms at most)


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
        when truncation or padding is set on it. A long piece goes through `encode_batch`, which lets go of the GIL
        as transformers' path does: `encode` holds it, and a large request tokenized off the loop would stall it."""
        rust = self._rust
        if rust is not None and rust.truncation is None and rust.padding is None:
            if len(piece) <= _HOLDS_GIL:
                return rust.encode(piece, add_special_tokens=False).ids
            return rust.encode_batch([piece], add_special_tokens=False)[0].ids
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


# The chat template's render.


def _compiler() -> Any:
    """transformers' template compiler, imported when a render is built (a tokenizer is loaded by then), so that
    importing the package costs no transformers; None for another transformers: every render then goes through
    apply_chat_template."""
    try:
        from transformers.utils.chat_template_utils import _compile_jinja_template
    except ImportError:
        return None
    return _compile_jinja_template


_DICT_NAMES = frozenset(dir(dict))
_LOOP_NAMES = frozenset("depth first index index0 last length nextitem previtem revindex revindex0".split())
# orjson options under which a value that json.dumps would not write the same way raises instead of dumping
_STRICT = orjson.OPT_PASSTHROUGH_SUBCLASS | orjson.OPT_PASSTHROUGH_DATETIME | orjson.OPT_PASSTHROUGH_DATACLASS
_REMEMBERED = 256, 16 << 10  # tojson texts a render keeps (forgotten together past it), and the longest kept


def _environment(shared: Any) -> Any:
    """transformers' sandboxed environment, overlaid with two shortcuts that change no render (the profile of a
    model call: docs/benchmarks.md). `message.role` on a dict reads the item at once (the sandbox first tries
    the attribute, which a dict lacks: an exception), and `loop.first` without the sandbox's checks, which it
    passes. `tojson` remembers the text of what it has seen, keyed by orjson's exact bytes (the tool schemas,
    the same in every prompt); a value orjson writes alike for two inputs (NaN and null, both `null`) or cannot
    write is dumped anew."""
    from jinja2.runtime import LoopContext

    env = shared.overlay()
    sandboxed, tojson, undefined = env.getattr, env.filters["tojson"], env.undefined
    texts: dict[bytes, str] = {}

    def getattr(obj: Any, attribute: str) -> Any:
        kind = type(obj)
        if kind is dict and attribute not in _DICT_NAMES:
            return obj[attribute] if attribute in obj else undefined(obj=obj, name=attribute)
        if kind is LoopContext and attribute in _LOOP_NAMES:  # public, none a str.format: the sandbox allows
            return builtins.getattr(obj, attribute)
        return sandboxed(obj, attribute)

    def remembered(value: Any, *args: Any, **kwargs: Any) -> str:
        if args or kwargs:
            return tojson(value, *args, **kwargs)
        try:
            key = orjson.dumps(value, option=_STRICT)
        except TypeError:
            return tojson(value)
        if (text := texts.get(key)) is None:
            text = tojson(value)
            if b"null" not in key and len(key) <= _REMEMBERED[1]:
                if len(texts) >= _REMEMBERED[0]:
                    texts.clear()
                texts[key] = text
        return text

    env.getattr = getattr
    env.filters = {**env.filters, "tojson": remembered}
    return env


# Keys the wrapper renames or copies (transformers' _REASONING_FIELDS): such a message goes through it.
_REASONING = frozenset({"reasoning_content", "thinking", "reasoning"})


def _plain(value: Any) -> bool:
    """Whether `value` is JSON data of the exact built-in types, with None only inside (what the wrapper would
    copy unchanged)."""
    kind = type(value)
    if kind is str or kind is int or kind is float or kind is bool or value is None:
        return True
    if kind is dict:
        return all(type(k) is str and _plain(v) for k, v in value.items())
    if kind is list:
        return all(_plain(v) for v in value)
    return False


class TemplateKwargs:
    """A tokenizer whose chat-template renders all get `kwargs` (e.g. Qwen3's enable_thinking): the spec's
    `model.chat_template_kwargs` and verl's `data.apply_chat_template_kwargs` alike. Everything else, len()
    included, is the tokenizer's."""

    def __init__(self, tokenizer: Any, kwargs: dict[str, Any]):
        self._tokenizer, self._kwargs = tokenizer, dict(kwargs)

    def apply_chat_template(self, *args: Any, **kwargs: Any) -> Any:
        return self._tokenizer.apply_chat_template(*args, **{**self._kwargs, **kwargs})

    def __len__(self) -> int:
        return len(self._tokenizer)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._tokenizer, name)


class ChatRender:
    """`text(messages, tools, add_generation_prompt)`: the tokenizer's `apply_chat_template(..., tokenize=False)`,
    past the wrapper when the inputs are plain. `tokenizer` may be a TemplateKwargs (its kwargs are rendered
    too)."""

    def __init__(self, tokenizer: Any):
        self.tokenizer = tokenizer
        self._templates: dict[bool, Any] = {}  # has tools -> the compiled template
        wrapped = isinstance(tokenizer, TemplateKwargs)
        inner = tokenizer._tokenizer if wrapped else tokenizer
        kwargs = tokenizer._kwargs if wrapped else {}
        specials = getattr(inner, "special_tokens_map", None)
        self._variables: dict[str, Any] | None = None
        self._compile = _compiler()
        if (
            self._compile is not None
            and isinstance(specials, dict)
            and callable(getattr(inner, "get_chat_template", None))
            and _plain({**specials, **kwargs})
        ):
            self._variables = {**specials, **kwargs}
        self._inner = inner

    def text(
        self, messages: list[dict[str, Any]], tools: list[dict] | None, add_generation_prompt: bool
    ) -> str:
        tools = tools or None
        if self._variables is not None and self._direct(messages, tools):
            template = self._templates.get(tools is not None)
            if template is None:
                source = self._inner.get_chat_template(None, tools)
                # our own copy in an overlay of transformers' environment, its globals a dict: jinja walks a
                # ChainMap twice a render (new_context, Context), a quarter of a calculator prompt's
                template = _environment(self._compile(source).environment).from_string(source)
                template.globals = dict(template.globals)
                self._templates[tools is not None] = template
            return template.render(
                messages=messages,
                tools=tools,
                documents=None,
                add_generation_prompt=add_generation_prompt,
                **self._variables,
            )
        return self.tokenizer.apply_chat_template(
            messages, tools=tools, add_generation_prompt=add_generation_prompt, tokenize=False
        )

    @staticmethod
    def _direct(messages: list[dict[str, Any]], tools: list[dict] | None) -> bool:
        """Whether the wrapper would pass `messages` and `tools` to the template unchanged."""
        if type(messages) is not list or not messages:
            return False
        for m in messages:
            if type(m) is not dict or not _REASONING.isdisjoint(m):
                return False
            for key, value in m.items():
                if value is None or type(key) is not str or not _plain(value):
                    return False
        return tools is None or (type(tools) is list and _plain(tools))
