"""Span shapes: what the spans of one kind share, so that a span carries only the values that vary.

Building and encoding an attribute dict per span is what makes SDK spans expensive; a `_Shape` is made once
per edge, backend, tool and agent (`_Shapes`, per run) and interned for the process, and the export thread
encodes its constant part once and caches the encoded values that repeat (with wire.py's functions).
"""

from __future__ import annotations

import threading
from collections.abc import Mapping, Sequence
from typing import Any, cast
from urllib.parse import urlsplit

from opentelemetry.trace import SpanKind

from fsm.telemetry.semconv import (
    AGENT_HASH,
    CATCH_ERRORS,
    ERROR,
    ERROR_TYPE,
    FSM_DEST,
    FSM_EDGE,
    FSM_FINAL_STATE,
    FSM_GUARD,
    FSM_REASON,
    FSM_SOURCE,
    FSM_TERMINATION_REASON,
    FSM_TOKENS_MODEL,
    FSM_TOKENS_OBSERVATION,
    FSM_TRANSITIONS,
    FSM_TURN,
    FSM_TURNS,
    GEN_AI_AGENT_NAME,
    GEN_AI_CONVERSATION_ID,
    GEN_AI_INPUT_MESSAGES,
    GEN_AI_OPERATION_NAME,
    GEN_AI_OUTPUT_MESSAGES,
    GEN_AI_PROVIDER_NAME,
    GEN_AI_REQUEST_MAX_TOKENS,
    GEN_AI_REQUEST_MODEL,
    GEN_AI_REQUEST_SEED,
    GEN_AI_REQUEST_TEMPERATURE,
    GEN_AI_REQUEST_TOP_K,
    GEN_AI_REQUEST_TOP_P,
    GEN_AI_RESPONSE_FINISH_REASONS,
    GEN_AI_RESPONSE_ID,
    GEN_AI_TOOL_CALL_ARGUMENTS,
    GEN_AI_TOOL_CALL_ID,
    GEN_AI_TOOL_CALL_RESULT,
    GEN_AI_TOOL_DEFINITIONS,
    GEN_AI_TOOL_DESCRIPTION,
    GEN_AI_TOOL_NAME,
    GEN_AI_TOOL_TYPE,
    GEN_AI_USAGE_CACHE_READ_INPUT_TOKENS,
    GEN_AI_USAGE_INPUT_TOKENS,
    GEN_AI_USAGE_OUTPUT_TOKENS,
    INDEX,
    INPUT_TOKEN_IDS,
    MODEL_TOKENS,
    OI_AGENT,
    OI_CHAIN,
    OI_LLM,
    OI_TOOL,
    OPENINFERENCE_SPAN_KIND,
    OUTPUT_TOKEN_IDS,
    PROMPT_TOKENS,
    RESPONSE_TOKENS,
    REWARD,
    ROUTE,
    SAMPLE,
    SERVER_ADDRESS,
    SERVER_PORT,
    TOOL_ATTEMPTS,
    UID,
    WEIGHT_VERSION,
)
from fsm.telemetry.wire import (
    _FLAGS,
    _IDS,
    _IDS_ROOT,
    _M64,
    _STATUS_UNSET,
    _TIMES,
    _U8,
    _any_value,
    _attributes,
    _key_value,
    _ld,
)

_INTERNAL, _CLIENT = SpanKind.INTERNAL.value, SpanKind.CLIENT.value  # spans keep ints: enum access is slow
_CACHE_MAX = 4096  # encoded attributes kept per shape slot (counts, names; recent ids), cleared when full
# A backend's model_name until it knows it (backends/base.py; an SGLang client reads the served name from the
# server's /model_info with its first call): spans of such a shape are named again when they end.
UNKNOWN_MODEL = "unknown"

# How a shape slot's value becomes attributes: as it is, encoded once per distinct value (counts, names) or
# every time (ids, content); as a one-item array (finish reasons); a request's sampling parameters, read in
# the export thread (gen_ai.request.*); a server URL (server.address/port).
_CACHED, _PLAIN, _ONE, _PARAMS, _SERVER = range(5)
_PARAM_KEYS = (
    (GEN_AI_REQUEST_TEMPERATURE, "temperature"),
    (GEN_AI_REQUEST_TOP_P, "top_p"),
    (GEN_AI_REQUEST_TOP_K, "top_k"),
    (GEN_AI_REQUEST_MAX_TOKENS, "max_new_tokens"),
    (GEN_AI_REQUEST_SEED, "sampling_seed"),
)
_SAMPLING_ATTRS = _PARAM_KEYS[:3]  # the root span's: the run's temperature, top_p and top_k
# Every shape, by id. Queued spans name their shape by id: a tuple of ints and strings is one the garbage
# collector stops tracking, and collection is a large part of the engine's own cost with thousands in flight.
# Shapes are interned by content (`_shape`) and never freed: a few per spec, backend and sampling setting.
_SHAPES: list[_Shape] = []
_SHAPES_LOCK = threading.Lock()


def _expanded(how: int, value: Any) -> list[tuple[str, Any]]:
    if how == _PARAMS:
        return [(key, value.get(name)) for key, name in _PARAM_KEYS]
    address, port = _server(value)
    return [(SERVER_ADDRESS, address), (SERVER_PORT, port)]


_ATTR_CACHES: dict[tuple[str, type], dict[Any, bytes]] = {}
_BLOCKS: dict[Any, bytes] = {}  # encoded attributes of an expanded value (sampling parameters, a server)


def _span_attr(key: str, value: Any) -> bytes:
    """The Span.attributes field (key, value), cached per key and type for str/int/float values."""
    t = type(value)
    if t is str or t is int or t is float:
        cache = _ATTR_CACHES.get((key, t))
        if cache is None:
            cache = _ATTR_CACHES.setdefault((key, t), {})
        b = cache.get(value)
        if b is None:
            b = _ld(b"\x4a", _key_value(key, value))
            if len(cache) < _CACHE_MAX:
                cache[value] = b
        return b
    encoded = _any_value(value)
    return b"" if encoded is None else _ld(b"\x4a", _ld(b"\x0a", key.encode()) + _ld(b"\x12", encoded))


class _Shape:
    """What the spans of one kind share: name, kind, constant attributes, and the keys of the varying ones.

    A span of this shape carries only its values, lined up with `slots` (None: not set); the export thread
    keeps the encoded (key, value) of values that repeat (counts, finish reasons, state names) per slot.
    """

    __slots__ = ("id", "name", "kind", "const", "keys", "hows", "unresolved", "_pb")

    def __init__(self, name: str, kind: int, const: Mapping[str, Any], slots: Sequence[tuple[str, int]]):
        with _SHAPES_LOCK:
            self.id = len(_SHAPES)
            _SHAPES.append(self)
        self.name, self.kind = name, kind
        self.const = {k: v for k, v in const.items() if v is not None}
        self.unresolved = self.const.get(GEN_AI_REQUEST_MODEL) == UNKNOWN_MODEL  # see UNKNOWN_MODEL
        self.keys = tuple(k for k, _ in slots)
        self.hows = tuple(h for _, h in slots)
        self._pb: tuple[bytes, bytes, list[tuple[bytes, int, dict | None]]] | None = None

    def attributes(self, values: Sequence[Any], extra: Mapping[str, Any] | None = None) -> dict[str, Any]:
        attrs = dict(self.const)
        for key, how, v in zip(self.keys, self.hows, values):
            if v is None:
                continue
            if how <= _PLAIN:
                attrs[key] = v
            elif how == _ONE:
                attrs[key] = (v,)
            else:
                attrs.update((k, x) for k, x in _expanded(how, v) if x is not None)
        if extra:
            attrs.update(extra)
        return attrs

    def encoded(self) -> tuple[bytes, bytes, list[tuple[bytes, int, dict | None]]]:
        if self._pb is None:
            head = _ld(b"\x2a", self.name.encode("utf-8", "replace")) + b"\x30" + _U8[self.kind + 1]
            slots: list[tuple[bytes, int, dict | None]] = [
                (_ld(b"\x0a", k.encode()), h, {} if h in (_CACHED, _ONE) else None)
                for k, h in zip(self.keys, self.hows)
            ]
            self._pb = (head, _attributes(b"\x4a", self.const), slots)
        return self._pb


_INTERNED: dict[tuple, _Shape] = {}


def _shape(name: str, kind: int, const: Mapping[str, Any], slots: Sequence[tuple[str, int]]) -> _Shape:
    """The shape with this content, made once per process: the registry stays as small as the set of specs,
    backends and sampling settings traced, and the export caches stay warm across runs and tracers."""
    key = (name, kind, tuple((k, v, type(v)) for k, v in const.items()), tuple(slots))  # 1 and 1.0 differ
    with _SHAPES_LOCK:
        shape = _INTERNED.get(key)
    if shape is None:
        shape = _Shape(name, kind, const, slots)
        with _SHAPES_LOCK:
            shape = _INTERNED.setdefault(key, shape)
    return shape


def _lean_message(
    shape: _Shape,
    trace_id: int,
    span_id: int,
    parent_id: int,
    start: int,
    end: int,
    values: Sequence[Any],
    status: bytes = _STATUS_UNSET,
    links: bytes = b"",
) -> bytes:
    """A span of a shape: the same bytes as `_span_message(...shape.attributes(values)...)`, no dict built."""
    head, const, slots = shape._pb or shape.encoded()
    hi, lo = trace_id >> 64, trace_id & _M64
    parts = [
        _IDS(0x0A10, hi, lo, 0x1208, span_id, 0x2208, parent_id)
        if parent_id
        else _IDS_ROOT(0x0A10, hi, lo, 0x1208, span_id),
        head,
        _TIMES(0x39, start, 0x41, end),
        const,
    ]
    append = parts.append
    for (key, how, cache), v in zip(slots, values):
        if v is None:
            continue
        if cache is not None and (type(v) is str or type(v) is int):
            b = cache.get(v)
            if b is None:
                # a str or an int (or a one-item array of one) always encodes
                b = _ld(b"\x4a", key + _ld(b"\x12", cast(bytes, _any_value((v,) if how == _ONE else v))))
                if len(cache) >= _CACHE_MAX:  # ids: what recurs soon (a trajectory's spans) stays cached
                    cache.clear()
                cache[v] = b
            append(b)
        elif how <= _ONE:
            value = _any_value((v,) if how == _ONE else v)
            if value is not None:
                append(_ld(b"\x4a", key + _ld(b"\x12", value)))
        else:  # one value, several attributes: cached as a block (params by their values and types)
            if how == _PARAMS:
                g = v.get
                t, p, k = g("temperature"), g("top_p"), g("top_k")
                block_key: Any = (t, p, k, g("max_new_tokens"), g("sampling_seed"), type(t), type(p), type(k))
            else:
                block_key = v
            b = _BLOCKS.get(block_key)
            if b is None:
                b = b"".join(_span_attr(k, x) for k, x in _expanded(how, v) if x is not None)
                if len(_BLOCKS) < _CACHE_MAX:
                    _BLOCKS[block_key] = b
            append(b)
    if links:
        append(links)
    append(status)
    append(_FLAGS)
    return b"".join(parts)


# The varying attributes of each kind of span, in the order of the values the spans carry.
_ROOT_SLOTS = (
    (GEN_AI_CONVERSATION_ID, _CACHED),
    (INDEX, _CACHED),
    (UID, _CACHED),
    (SAMPLE, _CACHED),
    (FSM_TERMINATION_REASON, _CACHED),
    (FSM_FINAL_STATE, _CACHED),
    (FSM_TRANSITIONS, _CACHED),
    (FSM_TURNS, _CACHED),
    (PROMPT_TOKENS, _CACHED),
    (RESPONSE_TOKENS, _CACHED),
    (MODEL_TOKENS, _CACHED),
    (GEN_AI_USAGE_INPUT_TOKENS, _CACHED),
    (GEN_AI_USAGE_OUTPUT_TOKENS, _CACHED),
    (GEN_AI_USAGE_CACHE_READ_INPUT_TOKENS, _CACHED),
    (REWARD, _PLAIN),
    (ERROR, _PLAIN),
    (ERROR_TYPE, _CACHED),
    (GEN_AI_INPUT_MESSAGES, _PLAIN),
    (GEN_AI_OUTPUT_MESSAGES, _PLAIN),
    (GEN_AI_TOOL_DEFINITIONS, _PLAIN),
)
_EDGE_SLOTS = (
    (FSM_TURN, _CACHED),
    (FSM_TOKENS_MODEL, _CACHED),
    (FSM_TOKENS_OBSERVATION, _CACHED),
    (FSM_TERMINATION_REASON, _CACHED),
)
_MODEL_SLOTS = (
    (GEN_AI_CONVERSATION_ID, _CACHED),
    ("", _PARAMS),
    (INPUT_TOKEN_IDS, _PLAIN),
    (GEN_AI_RESPONSE_FINISH_REASONS, _ONE),
    (GEN_AI_USAGE_OUTPUT_TOKENS, _CACHED),
    (GEN_AI_USAGE_INPUT_TOKENS, _CACHED),
    (GEN_AI_USAGE_CACHE_READ_INPUT_TOKENS, _CACHED),
    ("", _SERVER),
    (ROUTE, _CACHED),
    (WEIGHT_VERSION, _CACHED),
    (GEN_AI_RESPONSE_ID, _PLAIN),
    (OUTPUT_TOKEN_IDS, _PLAIN),
    # opt-in content, decoded (spans.py `_messages`); a span without content carries the values up to here
    (GEN_AI_INPUT_MESSAGES, _PLAIN),
    (GEN_AI_OUTPUT_MESSAGES, _PLAIN),
)
_TOOL_SLOTS = (
    (GEN_AI_TOOL_CALL_ID, _PLAIN),
    (GEN_AI_TOOL_CALL_ARGUMENTS, _PLAIN),
    (TOOL_ATTEMPTS, _CACHED),
    (ERROR_TYPE, _CACHED),
    (GEN_AI_TOOL_CALL_RESULT, _PLAIN),
)


class _Shapes:
    """The shapes of one run's spans (agent, backend, sampling), shared by its trajectories; and the run's
    codec, whose tokenizer decodes opt-in content."""

    def __init__(self, agent: Any, backend: Any, sampling: Mapping[str, Any], codec: Any = None):
        self.agent, self.backend, self.sampling = agent, backend, sampling  # kept alive: the tracer's cache
        self.codec = codec  # is keyed by their ids
        self.tokenizer = getattr(codec, "tokenizer", None)
        self.finals = agent.final_states
        # States whose action is user code (which may start spans under the state's): their span is current.
        self.user_states = agent.user_code_states
        self.root = self._root()
        self.edges = [
            _shape(
                f"{e.source} -> {e.dest}",
                _INTERNAL,
                {
                    FSM_SOURCE: e.source,
                    FSM_DEST: e.dest,
                    FSM_GUARD: e.label,
                    FSM_EDGE: e.index,
                    FSM_REASON: e.reason,
                    OPENINFERENCE_SPAN_KIND: OI_CHAIN,
                    **({CATCH_ERRORS: ",".join(e.catch)} if e.catch is not None else {}),
                },
                _EDGE_SLOTS,
            )
            for e in agent.edges
        ]
        self.states: dict[str, _Shape] = {}  # a state's span before an edge fires (user actions, failures)
        self.models: dict[str, _Shape] = {}
        self.run_model: _Shape | None = None  # the run backend's
        self.tools: dict[str, _Shape] = {}

    def _root(self) -> _Shape:
        agent, backend = self.agent, self.backend
        const = {
            GEN_AI_OPERATION_NAME: "invoke_agent",
            GEN_AI_PROVIDER_NAME: backend.provider,
            GEN_AI_AGENT_NAME: agent.name,
            GEN_AI_REQUEST_MODEL: backend.model_name,
            AGENT_HASH: agent.hash,
            **{key: self.sampling.get(name) for key, name in _SAMPLING_ATTRS},
            OPENINFERENCE_SPAN_KIND: OI_AGENT,
        }
        return _shape(f"invoke_agent {agent.name}", _INTERNAL, const, _ROOT_SLOTS)

    def named_root(self) -> _Shape:
        """The root's shape, made again once the backend has learnt its model's name (see UNKNOWN_MODEL)."""
        if self.root.unresolved and self.backend.model_name != UNKNOWN_MODEL:
            self.root = self._root()
        return self.root

    def state(self, source: str) -> _Shape:
        shape = self.states.get(source)
        if shape is None:
            const = {FSM_SOURCE: source, OPENINFERENCE_SPAN_KIND: OI_CHAIN}
            shape = self.states[source] = _shape(source, _INTERNAL, const, _EDGE_SLOTS)
        return shape

    def model(self, backend: Any) -> _Shape:
        """The shape of calls to `backend` (the request's sampling parameters are values: a call may set
        its own). Kept for the run's backend once it knows its model's name."""
        if backend is self.backend and self.run_model is not None:
            return self.run_model
        name = backend.model_name
        shape = self.models.get(name)
        if shape is None:
            const = {
                GEN_AI_OPERATION_NAME: "text_completion",
                GEN_AI_PROVIDER_NAME: backend.provider,
                GEN_AI_REQUEST_MODEL: name,
                OPENINFERENCE_SPAN_KIND: OI_LLM,
            }
            shape = self.models[name] = _shape(f"text_completion {name}", _CLIENT, const, _MODEL_SLOTS)
        if backend is self.backend and not shape.unresolved:
            self.run_model = shape
        return shape

    def tool(self, name: str, tool: Any) -> _Shape:
        shape = self.tools.get(name)
        if shape is None:
            const = {
                GEN_AI_OPERATION_NAME: "execute_tool",
                GEN_AI_TOOL_NAME: name,
                GEN_AI_TOOL_TYPE: "function",
                GEN_AI_TOOL_DESCRIPTION: (tool.description or None) if tool is not None else None,
                OPENINFERENCE_SPAN_KIND: OI_TOOL,
            }
            shape = self.tools[name] = _shape(f"execute_tool {name}", _INTERNAL, const, _TOOL_SLOTS)
        return shape


_SERVERS: dict[str, tuple[str, int | None]] = {}


def _server(server: str) -> tuple[str, int | None]:
    """'http://host:port' -> (server.address, server.port) (cached: a run talks to a handful of servers)."""
    found = _SERVERS.get(server)
    if found is None:
        if "://" in server:
            parts = urlsplit(server)
            found = (parts.hostname or server, parts.port or {"http": 80, "https": 443}.get(parts.scheme))
        else:
            found = (server, None)
        if len(_SERVERS) < 4096:
            _SERVERS[server] = found
    return found
