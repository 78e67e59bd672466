"""The chat template's text render, compiled once and called directly where transformers' wrapper would change
nothing: about half of a calculator prompt's render (73 -> 34 µs) and of an observation's (70 -> 38 µs).

`apply_chat_template` copies every message and tool schema into plain JSON types (`_plain_template_data`), drops
the keys whose value is None, copies reasoning under its other names (`_alias_reasoning_fields`), picks the
template (a tokenizer may have several) and passes the special tokens as variables; only then does it call the
compiled jinja template. For the messages an engine builds (dicts of str, lists and numbers) the copies are the
same data, so the render is the template's, called with the same variables. Anything else (a None value, a
reasoning field, a tuple, an object, `continue_final_message`) goes through the wrapper as before; so does a
transformers without the compiler this calls (`_compile_jinja_template`). tests/test_chat_render.py holds the
two renders equal on every family's real template.
"""

from __future__ import annotations

import builtins
from typing import Any

import orjson


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
