"""OpenTelemetry for agentfsm: every trajectory is one trace.

    invoke_agent calculator                  root, INTERNAL: its own trace, current while the trajectory runs
      PENDING -> GENERATING                  one span per transition, covering the source state's work
      GENERATING -> PROCESSING_TOOLS
        text_completion tiny                 a model call, CLIENT (GenAI inference span), current during the call
      PROCESSING_TOOLS -> GENERATING
        execute_tool calculator              a tool call, INTERNAL (GenAI tool span), current during the call
      GENERATING -> TERMINATED
        text_completion tiny

Where the cost goes, and how it is kept down (`agentfsm bench tracing` measures it, see `bench_tracing`):

- Tracing off: the driver (fsm/runtime.py) calls nothing when no tracer is given.
- Sampling keeps or drops whole trajectories, decided once in `trajectory()` from a hash of the session id
  (a re-run of the same ids keeps the same ones). A sampled-out trajectory gets None and no hook is called
  for it: the driver marks the tasks of traced ones (a ContextVar), which its model and tool calls check.
- A traced trajectory's spans are not SDK spans. A span's attributes are values lined up with a `_Shape`
  (one per edge, backend, tool and agent: name, kind, the constant attributes), so nothing builds a dict.
  A transition span is one tuple queued when the edge fires; its id and start wait on the root meanwhile,
  and it is made current only when the state runs a user action (a built-in action starts no spans but the
  model and tool calls, which are given their parent). Model and tool calls are small slotted spans, current
  during the call, so spans that a backend or a tool starts (through `Telemetry.tracer`) are their children.
- Export: a queue and a thread per exporter, with the SDK's BatchSpanProcessor rules (OTEL_BSP_*; a full
  queue evicts its oldest span, counted and reported by `flush()`/`stats()`, never silently). OTLP/HTTP is
  encoded here, straight from the shapes (`_Encoder`, checked against the official protobuf classes in the
  tests), gzipped and POSTed with the SDK's retry rules (`OtlpHttpExporter`). Any other exporter (console,
  the SDK's in-memory one, yours) gets the SDK's ReadableSpans, made in the export thread.

What it costs, on `agentfsm bench engine`'s workload (the engine alone, ~50 µs CPU per transition on a
2-core CI machine, 20 spans a trajectory; `agentfsm bench tracing`): every trajectory traced, +20% CPU
kept in memory and +42% exported over OTLP/HTTP (~5 µs a span on the event loop, ~5 in the export thread);
a tenth traced +8%; a hundredth +2%; none (sample 0) within noise. The floor is Python's: the bare hooks
cost ~0.5 µs (a transition) to ~1.5 µs (a model or tool call) a span with hot caches and 2-3x that among
thousands of trajectories in flight, and encoding ~2 µs plus gzip ~0.8, so 5% of this engine (~1.2 µs a span)
is out of reach at sample 1.0: sample 0.05 or less on a CPU-bound run. With a real model, each call
outlasts its spans by orders of magnitude.

The TracerProvider is our own (for `Telemetry.tracer`): the global one is never touched. The `gen_ai.*` names
are kept here as string literals: the semconv package marks its GenAI constants deprecated (they moved to
the semantic-conventions-genai repository; the strings are unchanged).
"""

from __future__ import annotations

import contextvars
import gzip
import hashlib
import http.client
import json
import logging
import math
import os
import random
import ssl
import struct
import threading
import time
import traceback
import weakref
import zlib
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from email.utils import parsedate_to_datetime
from typing import Any
from urllib.parse import urlsplit

from opentelemetry import context as otel_context
from opentelemetry import trace as otel_trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import Event, ReadableSpan, SpanProcessor, TracerProvider
from opentelemetry.sdk.trace.export import ConsoleSpanExporter, SpanExporter, SpanExportResult
from opentelemetry.sdk.trace.sampling import ALWAYS_ON
from opentelemetry.sdk.util.instrumentation import InstrumentationScope
from opentelemetry.trace import Link, SpanContext, SpanKind, Status, StatusCode, TraceFlags
from opentelemetry.util.re import parse_env_headers

log = logging.getLogger(__name__)

# --- attribute names ----------------------------------------------------------------------------------------
# GenAI semantic conventions (Development stability), see ../shared/reference/otel-genai.md.
GEN_AI_OPERATION_NAME = "gen_ai.operation.name"
GEN_AI_PROVIDER_NAME = "gen_ai.provider.name"
GEN_AI_AGENT_NAME = "gen_ai.agent.name"
GEN_AI_AGENT_DESCRIPTION = "gen_ai.agent.description"
GEN_AI_CONVERSATION_ID = "gen_ai.conversation.id"
GEN_AI_REQUEST_MODEL = "gen_ai.request.model"
GEN_AI_REQUEST_TEMPERATURE = "gen_ai.request.temperature"
GEN_AI_REQUEST_TOP_P = "gen_ai.request.top_p"
GEN_AI_REQUEST_TOP_K = "gen_ai.request.top_k"
GEN_AI_REQUEST_MAX_TOKENS = "gen_ai.request.max_tokens"
GEN_AI_REQUEST_SEED = "gen_ai.request.seed"
GEN_AI_RESPONSE_ID = "gen_ai.response.id"
GEN_AI_RESPONSE_FINISH_REASONS = "gen_ai.response.finish_reasons"
GEN_AI_USAGE_INPUT_TOKENS = "gen_ai.usage.input_tokens"
GEN_AI_USAGE_OUTPUT_TOKENS = "gen_ai.usage.output_tokens"
GEN_AI_USAGE_CACHE_READ_INPUT_TOKENS = "gen_ai.usage.cache_read.input_tokens"
GEN_AI_TOOL_NAME = "gen_ai.tool.name"
GEN_AI_TOOL_CALL_ID = "gen_ai.tool.call.id"
GEN_AI_TOOL_TYPE = "gen_ai.tool.type"
GEN_AI_TOOL_DESCRIPTION = "gen_ai.tool.description"
# opt-in content (capture_content=True)
GEN_AI_INPUT_MESSAGES = "gen_ai.input.messages"
GEN_AI_OUTPUT_MESSAGES = "gen_ai.output.messages"
GEN_AI_TOOL_DEFINITIONS = "gen_ai.tool.definitions"
GEN_AI_TOOL_CALL_ARGUMENTS = "gen_ai.tool.call.arguments"
GEN_AI_TOOL_CALL_RESULT = "gen_ai.tool.call.result"
# stable, borrowed by GenAI
ERROR_TYPE = "error.type"
SERVER_ADDRESS = "server.address"
SERVER_PORT = "server.port"
# agentfsm's own (project conventions, design §7)
FSM_SOURCE = "fsm.source"
FSM_DEST = "fsm.dest"
FSM_GUARD = "fsm.guard"  # the edge's guard as written, "default" for the unguarded edge
FSM_REASON = "fsm.reason"  # the edge's reason, when it has one
FSM_EDGE = "fsm.edge"  # the edge's global index (what run statistics key on)
FSM_TURN = "fsm.turn"  # model turns completed when the transition fired
FSM_TOKENS_MODEL = "fsm.tokens.model"  # tokens the model generated in this state (mask 1)
FSM_TOKENS_OBSERVATION = "fsm.tokens.observation"  # tokens appended with mask 0 (tool/user/template)
FSM_TERMINATION_REASON = "fsm.termination_reason"
FSM_TURNS = "fsm.turns"  # verl's num_turns
FSM_TRANSITIONS = "fsm.transitions"
FSM_FINAL_STATE = "fsm.final_state"
AGENT_HASH = "agentfsm.agent.hash"
INDEX = "agentfsm.index"  # the trajectory's position in the batch
UID = "agentfsm.uid"  # the row's uid: a GRPO group
SAMPLE = "agentfsm.sample"  # the sample's index within its group
REWARD = "agentfsm.reward_score"
ERROR = "agentfsm.error"
PROMPT_TOKENS = "agentfsm.tokens.prompt"
RESPONSE_TOKENS = "agentfsm.tokens.response"
MODEL_TOKENS = "agentfsm.tokens.model"
ROUTE = "agentfsm.route"  # how a router placed the call: sticky | new | group | moved
WEIGHT_VERSION = "agentfsm.weight_version"
TOOL_ATTEMPTS = "agentfsm.tool.attempts"
INPUT_TOKEN_IDS = "agentfsm.input_token_ids"  # opt-in content
OUTPUT_TOKEN_IDS = "agentfsm.output_token_ids"  # opt-in content


_random_bits = random.getrandbits
_time_ns = time.time_ns
_new = object.__new__
_Context = otel_context.Context
_SAMPLED = TraceFlags(TraceFlags.SAMPLED | TraceFlags.RANDOM_TRACE_ID)
_UNSET = Status(StatusCode.UNSET)
_INTERNAL, _CLIENT = SpanKind.INTERNAL.value, SpanKind.CLIENT.value  # spans keep ints: enum access is slow
_KINDS = {kind.value: kind for kind in SpanKind}
_MAX_ATTRIBUTES = 128  # the SDK's default span limit, for attributes and events set through the API
_SAMPLING_ATTRS = ((GEN_AI_REQUEST_TEMPERATURE, "temperature"), (GEN_AI_REQUEST_TOP_P, "top_p"),
                   (GEN_AI_REQUEST_TOP_K, "top_k"))  # fmt: skip


# --- the current span -----------------------------------------------------------------------------------------
# The OTel API's attach/detach cost ~0.6 µs a pair; with the default (contextvars) runtime context we set its
# ContextVar directly, with the same Context objects the API would make.

_SPAN_KEY = next(iter(otel_trace.set_span_in_context(otel_trace.INVALID_SPAN, otel_context.Context())))
_CV = getattr(getattr(otel_context, "_RUNTIME_CONTEXT", None), "_current_context", None)
if not isinstance(_CV, contextvars.ContextVar):  # another runtime context (OTEL_PYTHON_CONTEXT): use the API
    _CV = None


def _current_span() -> Any:
    """The current span, or None."""
    return (_CV.get() if _CV is not None else otel_context.get_current()).get(_SPAN_KEY)


def _attach(span: Any, alone: bool = False) -> Any:
    """Make `span` current (in a copy of the current context, or `alone` in an otherwise empty one)."""
    if _CV is not None:
        return _CV.set(otel_context.Context({_SPAN_KEY: span} if alone else {**_CV.get(), _SPAN_KEY: span}))
    base = otel_context.Context() if alone else None
    return otel_context.attach(otel_trace.set_span_in_context(span, base))


def _detach(token: Any) -> None:
    if _CV is None:
        otel_context.detach(token)
        return
    try:
        _CV.reset(token)
    except ValueError:  # detached in another context than it was attached in: what the API would log
        log.exception("agentfsm telemetry: failed to detach a span's context")


# --- OTLP protobuf, encoded by hand ---------------------------------------------------------------------------
# The wire format (protobuf encoding) of opentelemetry-proto's ExportTraceServiceRequest
#   -> ResourceSpans{1 resource, 2 scope_spans, 3 schema_url} -> ScopeSpans{1 scope, 2 spans, 3 schema_url}
#   -> Span{1 trace_id, 2 span_id, 3 trace_state, 4 parent_span_id, 5 name, 6 kind, 7/8 start/end (fixed64),
#           9 attributes, 10 dropped_attributes_count, 11 events, 12 ..., 13 links, 14 ..., 15 status, 16 flags}
# Every field is a tag byte ((number << 3) | wire type) then a varint, a fixed-width value, or a length and
# bytes. Fields are written in number order, as the SDK's encoder (upb) does, so a span encodes to the same
# bytes either way (tests/test_telemetry.py decodes ours with the official classes and compares).

_U8 = [bytes((i,)) for i in range(128)]  # one-byte varints
_M64 = 2**64 - 1
_IDS = struct.Struct(">HQQHQHQ").pack  # tags 0x0a10/0x1208/0x2208: trace id, span id, parent span id
_IDS_ROOT = struct.Struct(">HQQHQ").pack  # no parent
_TIMES = struct.Struct("<BQBQ").pack  # tags 0x39/0x41: start, end (fixed64, little-endian)
_DOUBLE = struct.Struct("<d").pack
_FIXED64 = struct.Struct("<Q").pack
_FIXED32 = struct.Struct("<I").pack
_FLAGS = b"\x85\x01" + _FIXED32(0x100)  # field 16: SPAN_FLAGS_CONTEXT_HAS_IS_REMOTE_MASK, parent local
_FLAGS_REMOTE = b"\x85\x01" + _FIXED32(0x300)  # ... and CONTEXT_IS_REMOTE
_STATUS_UNSET = b"\x7a\x00"  # the SDK always writes the status, an empty message when UNSET
_CACHE_MAX = 4096  # encoded attributes kept per shape slot (counts, names; recent ids), cleared when full


def _uvarint(n: int) -> bytes:
    if n < 0x80:
        return _U8[n]
    out = bytearray()
    while n > 0x7F:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def _ld(tag: bytes, payload: bytes) -> bytes:
    """A length-delimited field: tag, length, bytes."""
    n = len(payload)
    return tag + (_U8[n] if n < 0x80 else _uvarint(n)) + payload


def _any_value(v: Any) -> bytes | None:
    """An AnyValue message (None for what OTLP cannot carry)."""
    t = type(v)
    if t is str:
        return _ld(b"\x0a", v.encode("utf-8", "replace"))
    if t is int:
        if -(2**63) <= v < 2**63:
            return b"\x18" + _uvarint(v & _M64)  # int64: negatives as 10-byte two's complement
        return _ld(b"\x0a", str(v).encode())
    if t is float:
        return b"\x21" + _DOUBLE(v)
    if t is bool:
        return b"\x10\x01" if v else b"\x10\x00"
    if isinstance(v, bool):
        return b"\x10\x01" if v else b"\x10\x00"
    if isinstance(v, str):
        return _any_value(str(v))
    if isinstance(v, int):
        return _any_value(int(v))
    if isinstance(v, float):
        return _any_value(float(v))
    if isinstance(v, (bytes, bytearray)):
        return _ld(b"\x3a", bytes(v))
    if isinstance(v, Mapping):  # KeyValueList
        return _ld(b"\x32", b"".join(_ld(b"\x0a", _key_value(k, x)) for k, x in v.items()))
    if isinstance(v, Sequence):  # ArrayValue
        return _ld(b"\x2a", b"".join(_ld(b"\x0a", a) for a in map(_any_value, v) if a is not None))
    return None


def _key_value(key: str, v: Any) -> bytes:
    value = _any_value(v)
    return _ld(b"\x0a", key.encode()) + (b"" if value is None else _ld(b"\x12", value))


def _attributes(tag: bytes, attrs: Mapping[str, Any] | None) -> bytes:
    return b"".join(_ld(tag, _key_value(k, v)) for k, v in attrs.items()) if attrs else b""


def _status(status: Status | None) -> bytes:
    if status is None:
        return b""
    code = status.status_code.value
    message = status.description
    return _ld(b"\x7a", (_ld(b"\x12", message.encode("utf-8", "replace")) if message else b"")
               + (b"\x18" + _U8[code] if code else b""))  # fmt: skip


def _events(events: Sequence[Event]) -> bytes:
    out = []
    for e in events:
        dropped = getattr(e, "dropped_attributes", 0)
        out.append(_ld(b"\x5a", b"\x09" + _FIXED64(e.timestamp) + _ld(b"\x12", e.name.encode("utf-8", "replace"))
                       + _attributes(b"\x1a", e.attributes) + (b"\x20" + _uvarint(dropped) if dropped else b"")))  # fmt: skip
    return b"".join(out)


def _links(links: Sequence[Link]) -> bytes:
    out = []
    for link in links:
        c, dropped = link.context, getattr(link, "dropped_attributes", 0)
        out.append(_ld(b"\x6a", _IDS_ROOT(0x0A10, c.trace_id >> 64, c.trace_id & _M64, 0x1208, c.span_id)
                       + _attributes(b"\x22", link.attributes) + (b"\x28" + _uvarint(dropped) if dropped else b"")
                       + b"\x35" + _FIXED32(0x300 if c.is_remote else 0x100)))  # fmt: skip
    return b"".join(out)


def _scope(scope: InstrumentationScope | None) -> bytes:
    """An InstrumentationScope message."""
    if scope is None:
        return b""
    return (_ld(b"\x0a", scope.name.encode()) if scope.name else b"") + (
        _ld(b"\x12", scope.version.encode()) if scope.version else b""
    ) + _attributes(b"\x1a", scope.attributes)  # fmt: skip


def _span_message(name: str, kind: int, trace_id: int, span_id: int, parent_id: int, start: int, end: int,
                  attrs: Mapping[str, Any] | None, events: Sequence[Event] = (), links: Sequence[Link] = (),
                  status: Status | None = _UNSET, dropped: tuple[int, int, int] = (0, 0, 0),
                  trace_state: str = "", remote_parent: bool = False) -> bytes:  # fmt: skip
    """Any span (an SDK span, or one of ours with attributes set through the API), field by field."""
    parts = [b"\x0a\x10" + trace_id.to_bytes(16, "big") + b"\x12\x08" + span_id.to_bytes(8, "big")]
    if trace_state:
        parts.append(_ld(b"\x1a", trace_state.encode()))
    if parent_id:
        parts.append(b"\x22\x08" + parent_id.to_bytes(8, "big"))
    if name:
        parts.append(_ld(b"\x2a", name.encode("utf-8", "replace")))
    parts.append(b"\x30" + _U8[kind + 1])  # SpanKind in OTLP = the API's value + 1
    parts.append(_TIMES(0x39, start, 0x41, end or 0))
    parts.append(_attributes(b"\x4a", attrs))
    if dropped[0]:
        parts.append(b"\x50" + _uvarint(dropped[0]))
    parts.append(_events(events))
    if dropped[1]:
        parts.append(b"\x60" + _uvarint(dropped[1]))
    parts.append(_links(links))
    if dropped[2]:
        parts.append(b"\x70" + _uvarint(dropped[2]))
    parts.append(_status(status))
    parts.append(_FLAGS_REMOTE if remote_parent else _FLAGS)
    return b"".join(parts)


# --- shapes ---------------------------------------------------------------------------------------------------

# How a shape slot's value becomes attributes: as it is, encoded once per distinct value (counts, names) or
# every time (ids, content); as a one-item array (finish reasons); a request's sampling parameters, read in
# the export thread (gen_ai.request.*); a server URL (server.address/port).
_CACHED, _PLAIN, _ONE, _PARAMS, _SERVER = range(5)
_PARAM_KEYS = ((GEN_AI_REQUEST_TEMPERATURE, "temperature"), (GEN_AI_REQUEST_TOP_P, "top_p"),
               (GEN_AI_REQUEST_TOP_K, "top_k"), (GEN_AI_REQUEST_MAX_TOKENS, "max_new_tokens"),
               (GEN_AI_REQUEST_SEED, "sampling_seed"))  # fmt: skip
# Every shape, by id. Queued spans name their shape by id: a tuple of ints and strings is one the garbage
# collector stops tracking, and the engine's own GC cost is large (~40% of its CPU at 2k in flight).
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

    A span of this shape carries only its values, lined up with `slots` (None: not set). The export thread
    encodes the name, kind and constant attributes once, and keeps the encoded (key, value) of values that
    repeat (counts, finish reasons, state names) per slot.
    """

    __slots__ = ("id", "name", "kind", "const", "keys", "hows", "_pb")

    def __init__(self, name: str, kind: int, const: Mapping[str, Any], slots: Sequence[tuple[str, int]]):
        with _SHAPES_LOCK:
            self.id = len(_SHAPES)
            _SHAPES.append(self)
        self.name, self.kind = name, kind
        self.const = {k: v for k, v in const.items() if v is not None}
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
            slots = [(_ld(b"\x0a", k.encode()), h, {} if h in (_CACHED, _ONE) else None)
                     for k, h in zip(self.keys, self.hows)]  # fmt: skip
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


def _lean_message(shape: _Shape, trace_id: int, span_id: int, parent_id: int, start: int, end: int,
                  values: Sequence[Any], status: bytes = _STATUS_UNSET, links: bytes = b"") -> bytes:  # fmt: skip
    """A span of a shape: the same bytes as `_span_message(...shape.attributes(values)...)`, ~10x faster."""
    head, const, slots = shape._pb or shape.encoded()
    hi, lo = trace_id >> 64, trace_id & _M64
    parts = [_IDS(0x0A10, hi, lo, 0x1208, span_id, 0x2208, parent_id) if parent_id else
             _IDS_ROOT(0x0A10, hi, lo, 0x1208, span_id), head, _TIMES(0x39, start, 0x41, end), const]  # fmt: skip
    append = parts.append
    for (key, how, cache), v in zip(slots, values):
        if v is None:
            continue
        if cache is not None and (type(v) is str or type(v) is int):
            b = cache.get(v)
            if b is None:
                b = _ld(b"\x4a", key + _ld(b"\x12", _any_value((v,) if how == _ONE else v)))
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


class _Encoder:
    """Batches of queued spans -> an ExportTraceServiceRequest (bytes). One per exporter (not thread-safe
    beyond the GIL; the shapes' caches are shared and only ever grow by whole entries)."""

    def __init__(self, resource: Resource, scope: InstrumentationScope):
        self.resource = _ld(b"\x0a", _attributes(b"\x0a", resource.attributes))  # ResourceSpans.resource
        self.resource_schema = _ld(b"\x1a", resource.schema_url.encode()) if resource.schema_url else b""
        self.scope = scope
        self._scopes: dict[Any, bytes] = {}

    def _scope_head(self, scope: InstrumentationScope | None) -> bytes:
        key = self._key(scope)
        head = self._scopes.get(key)
        if head is None:
            schema = scope.schema_url if scope is not None else ""
            head = self._scopes[key] = _ld(b"\x0a", _scope(scope)) + (
                _ld(b"\x1a", schema.encode()) if schema else b"")  # fmt: skip
        return head

    def request(self, items: Sequence[Any]) -> bytes:
        """ResourceSpans{resource, ScopeSpans per instrumentation scope, spans in queue order}, as the SDK's
        encoder groups them."""
        ours = self._key(self.scope)
        groups: dict[Any, list[bytes]] = {ours: [self._scope_head(self.scope)]}
        spans = groups[ours]
        for item in items:
            if type(item) is tuple:  # (shape id, trace id, span id, parent id, start, end, *values)
                body = _lean_message(_SHAPES[item[0]], item[1], item[2], item[3], item[4], item[5], item[6:])
                spans.append(_ld(b"\x12", body))  # ScopeSpans.spans
            elif isinstance(item, _Span):
                spans.append(_ld(b"\x12", item._message()))
            else:  # a ReadableSpan (a span of `Telemetry.tracer`)
                scope = item.instrumentation_scope
                key = self._key(scope)
                group = groups.get(key)
                if group is None:
                    group = groups[key] = [self._scope_head(scope)]
                group.append(_ld(b"\x12", _readable_message(item)))
        scope_spans = b"".join(_ld(b"\x12", b"".join(group)) for group in groups.values() if len(group) > 1)
        return _ld(b"\x0a", self.resource + scope_spans + self.resource_schema)

    @staticmethod
    def _key(scope: InstrumentationScope | None) -> Any:
        return None if scope is None else (scope.name, scope.version, scope.schema_url)


def _readable_message(span: ReadableSpan) -> bytes:
    ctx, parent = span.context, span.parent
    state = ctx.trace_state
    return _span_message(
        span.name, span.kind.value, ctx.trace_id, ctx.span_id, parent.span_id if parent else 0, span.start_time,
        span.end_time, span.attributes, span.events, span.links, span.status,
        (span.dropped_attributes, span.dropped_events, span.dropped_links),
        ",".join(f"{k}={v}" for k, v in state.items()) if state else "", bool(parent and parent.is_remote),
    )  # fmt: skip


# --- spans ----------------------------------------------------------------------------------------------------


class _Extra:
    """What few spans have: things set through the Span API, an error, the root's link to the caller's span."""

    __slots__ = ("name", "attrs", "events", "links", "status", "context")

    def __init__(self) -> None:
        self.name: str | None = None
        self.attrs: dict[str, Any] = {}
        self.events: list[Event] = []
        self.links: list[Link] = []
        self.status = _UNSET
        self.context: SpanContext | None = None


class _Span(otel_trace.Span):
    """A recording span of a `_Shape`: ids, times, values, and `_extra` once anything else is set.

    It is a real span to everything else: current in the context where the driver makes it so (a span
    started inside, by user code through `Telemetry.tracer` or the global provider, becomes a child),
    attributes/events/status/links settable through the API (values set that way are checked as the SDK
    does), and an exporter gets the SDK's ReadableSpan of it. Ended, it is queued as it is.
    """

    __slots__ = ("tel", "shape", "values", "_trace_id", "_span_id", "_parent_id", "_start", "_end", "_extra",
                 "_token")  # fmt: skip

    def __init__(self, tel: Telemetry, shape: _Shape, trace_id: int, span_id: int, parent_id: int,
                 values: tuple = (), start: int | None = None):  # fmt: skip
        self.tel, self.shape, self.values = tel, shape, values
        self._trace_id, self._span_id, self._parent_id = trace_id, span_id, parent_id
        self._extra: _Extra | None = None
        self._end: int | None = None
        self._start = _time_ns() if start is None else start

    def _x(self) -> _Extra:
        if self._extra is None:
            self._extra = _Extra()
        return self._extra

    # the opentelemetry.trace.Span API
    def get_span_context(self) -> SpanContext:
        x = self._x()
        if x.context is None:
            x.context = SpanContext(self._trace_id, self._span_id, False, _SAMPLED)
        return x.context

    def is_recording(self) -> bool:
        return self._end is None

    def set_attribute(self, key: str, value: Any) -> None:
        if self._end is None and isinstance(key, str) and key:
            attrs = self._x().attrs
            value = _attribute_value(value)
            if value is not None and (key in attrs or len(attrs) < _MAX_ATTRIBUTES):
                attrs[key] = value

    def set_attributes(self, attributes: Any) -> None:
        for key, value in attributes.items():
            self.set_attribute(key, value)

    def add_event(self, name: str, attributes: Any = None, timestamp: int | None = None) -> None:
        x = self._x()
        if self._end is None and len(x.events) < _MAX_ATTRIBUTES:
            x.events.append(Event(name, dict(attributes or {}), timestamp or _time_ns()))

    def add_link(self, context: SpanContext, attributes: Any = None) -> None:
        if self._end is None and context.is_valid:
            self._x().links.append(Link(context, attributes))

    def update_name(self, name: str) -> None:
        if self._end is None:
            self._x().name = name

    def set_status(self, status: Status | StatusCode, description: str | None = None) -> None:
        x = self._x()
        if self._end is not None or x.status.status_code is StatusCode.OK:  # OK is final, as in the SDK
            return
        if isinstance(status, StatusCode):
            status = Status(status, description)
        if status.status_code is not StatusCode.UNSET:
            x.status = status

    def record_exception(self, exception: BaseException, attributes: Any = None, timestamp: int | None = None,
                         escaped: bool = False) -> None:  # fmt: skip
        cls = type(exception)
        name = cls.__qualname__ if cls.__module__ == "builtins" else f"{cls.__module__}.{cls.__qualname__}"
        attrs = {
            "exception.type": name,
            "exception.message": str(exception),
            "exception.stacktrace": "".join(traceback.format_exception(exception)),
            "exception.escaped": str(escaped),
            **(attributes or {}),
        }
        self.add_event("exception", attrs, timestamp)

    def end(self, end_time: int | None = None) -> None:
        if self._end is None:
            self._end = end_time or _time_ns()
            self._queue()

    # ours
    def _queue(self) -> None:
        """Hand the ended span to the exporters: as a tuple when only its values are set (this object is
        freed now, and a tuple of ints and strings is one the garbage collector stops tracking), else as it is."""
        tel, x = self.tel, self._extra
        tel._ended += 1
        if x is None or (x.status is _UNSET and not (x.attrs or x.events or x.links) and x.name is None):
            tel._emit((self.shape.id, self._trace_id, self._span_id, self._parent_id, self._start, self._end,
                       *self.values))  # fmt: skip
        else:
            tel._emit(self)
        if len(tel._queue) >= tel._batch:
            tel._wake_exporters()

    def _fail(self, exc: BaseException) -> None:
        """The work of this span raised: status ERROR, error.type, and the exception as an event."""
        x = self._x()
        x.attrs[ERROR_TYPE] = type(exc).__qualname__
        x.status = Status(StatusCode.ERROR, f"{type(exc).__name__}: {exc}")
        self.record_exception(exc, escaped=True)

    def _message(self) -> bytes:
        """The OTLP Span message (in the export thread)."""
        x, shape = self._extra, self.shape
        if x is None:
            return _lean_message(shape, self._trace_id, self._span_id, self._parent_id, self._start, self._end,
                                 self.values)  # fmt: skip
        if not x.attrs and not x.events and x.name is None:
            return _lean_message(shape, self._trace_id, self._span_id, self._parent_id, self._start, self._end,
                                 self.values, _status(x.status), _links(x.links))  # fmt: skip
        return _span_message(x.name or shape.name, shape.kind, self._trace_id, self._span_id, self._parent_id,
                             self._start, self._end, shape.attributes(self.values, x.attrs), x.events, x.links,
                             x.status)  # fmt: skip

    def _readable(self, resource: Resource, scope: InstrumentationScope) -> ReadableSpan:
        x, shape = self._extra, self.shape
        return _make_readable(
            shape, self._trace_id, self._span_id, self._parent_id, self._start, self._end, self.values, resource,
            scope, x,
        )  # fmt: skip


def _make_readable(shape: _Shape, trace_id: int, span_id: int, parent_id: int, start: int, end: int,
                   values: Sequence[Any], resource: Resource, scope: InstrumentationScope,
                   x: _Extra | None = None) -> ReadableSpan:  # fmt: skip
    return ReadableSpan(
        name=(x.name if x is not None else None) or shape.name,
        context=SpanContext(trace_id, span_id, False, _SAMPLED),
        parent=SpanContext(trace_id, parent_id, False, _SAMPLED) if parent_id else None,
        resource=resource,
        attributes=shape.attributes(values, x.attrs if x is not None else None),
        events=tuple(x.events) if x is not None else (),
        links=tuple(x.links) if x is not None else (),
        kind=_KINDS[shape.kind],
        status=x.status if x is not None else _UNSET,
        start_time=start,
        end_time=end,
        instrumentation_scope=scope,
    )


def _readable(item: Any, resource: Resource, scope: InstrumentationScope) -> ReadableSpan:
    """The ReadableSpan (what SDK exporters take) of a queued span."""
    if type(item) is tuple:
        return _make_readable(_SHAPES[item[0]], item[1], item[2], item[3], item[4], item[5], item[6:], resource,
                              scope)  # fmt: skip
    if isinstance(item, _Span):
        return item._readable(resource, scope)
    return item


def _attribute_value(value: Any) -> Any:
    """An OTel attribute value (str/bool/int/float/bytes or a homogeneous sequence of them), or None."""
    if isinstance(value, (str, bool, int, float, bytes)):
        return value
    if isinstance(value, Sequence):
        items = tuple(value)
        if all(isinstance(v, (str, bool, int, float)) for v in items) and len({type(v) for v in items}) <= 1:
            return items
    return None


# The varying attributes of each kind of span, in the order of the values the spans carry.
_ROOT_SLOTS = (
    (GEN_AI_CONVERSATION_ID, _CACHED), (INDEX, _CACHED), (UID, _CACHED), (SAMPLE, _CACHED),
    (FSM_TERMINATION_REASON, _CACHED), (FSM_FINAL_STATE, _CACHED), (FSM_TRANSITIONS, _CACHED),
    (FSM_TURNS, _CACHED), (PROMPT_TOKENS, _CACHED), (RESPONSE_TOKENS, _CACHED), (MODEL_TOKENS, _CACHED),
    (GEN_AI_USAGE_INPUT_TOKENS, _CACHED), (GEN_AI_USAGE_OUTPUT_TOKENS, _CACHED),
    (GEN_AI_USAGE_CACHE_READ_INPUT_TOKENS, _CACHED), (REWARD, _PLAIN), (ERROR, _PLAIN), (ERROR_TYPE, _CACHED),
    (GEN_AI_INPUT_MESSAGES, _PLAIN), (GEN_AI_OUTPUT_MESSAGES, _PLAIN), (GEN_AI_TOOL_DEFINITIONS, _PLAIN),
)  # fmt: skip
_EDGE_SLOTS = ((FSM_TURN, _CACHED), (FSM_TOKENS_MODEL, _CACHED), (FSM_TOKENS_OBSERVATION, _CACHED),
               (FSM_TERMINATION_REASON, _CACHED))  # fmt: skip
_MODEL_SLOTS = (
    (GEN_AI_CONVERSATION_ID, _CACHED), ("", _PARAMS), (INPUT_TOKEN_IDS, _PLAIN), (GEN_AI_RESPONSE_FINISH_REASONS, _ONE),
    (GEN_AI_USAGE_OUTPUT_TOKENS, _CACHED), (GEN_AI_USAGE_INPUT_TOKENS, _CACHED),
    (GEN_AI_USAGE_CACHE_READ_INPUT_TOKENS, _CACHED), ("", _SERVER), (ROUTE, _CACHED), (WEIGHT_VERSION, _CACHED),
    (GEN_AI_RESPONSE_ID, _PLAIN), (OUTPUT_TOKEN_IDS, _PLAIN),
)  # fmt: skip
_TOOL_SLOTS = ((GEN_AI_TOOL_CALL_ID, _PLAIN), (GEN_AI_TOOL_CALL_ARGUMENTS, _PLAIN), (TOOL_ATTEMPTS, _CACHED),
               (ERROR_TYPE, _CACHED), (GEN_AI_TOOL_CALL_RESULT, _PLAIN))  # fmt: skip


class _Shapes:
    """The shapes of one run's spans (agent, backend, sampling), shared by its trajectories."""

    def __init__(self, agent: Any, backend: Any, sampling: Mapping[str, Any]):
        self.agent, self.backend = agent, backend  # kept alive: the tracer's cache is keyed by their ids
        self.finals = agent.final_states
        # States whose action is user code (which may start spans under the state's): their span is current.
        self.user_states = agent.user_code_states
        const = {
            GEN_AI_OPERATION_NAME: "invoke_agent",
            GEN_AI_PROVIDER_NAME: backend.provider,
            GEN_AI_AGENT_NAME: agent.name,
            GEN_AI_REQUEST_MODEL: backend.model_name,
            AGENT_HASH: agent.hash,
            **{key: sampling.get(name) for key, name in _SAMPLING_ATTRS},
        }
        self.root = _shape(f"invoke_agent {agent.name}", _INTERNAL, const, _ROOT_SLOTS)
        self.edges = [
            _shape(f"{e.source} -> {e.dest}", _INTERNAL, {FSM_SOURCE: e.source, FSM_DEST: e.dest, FSM_GUARD: e.label,
                                                         FSM_EDGE: e.index, FSM_REASON: e.reason}, _EDGE_SLOTS)
            for e in agent.edges
        ]  # fmt: skip
        self.states: dict[str, _Shape] = {}  # a state's span before an edge fires (user actions, failures)
        self.models: dict[str, _Shape] = {}
        self.run_model: _Shape | None = None  # the run backend's
        self.tools: dict[str, _Shape] = {}

    def state(self, source: str) -> _Shape:
        shape = self.states.get(source)
        if shape is None:
            shape = self.states[source] = _shape(source, _INTERNAL, {FSM_SOURCE: source}, _EDGE_SLOTS)
        return shape

    def model(self, backend: Any) -> _Shape:
        """The shape of calls to `backend` (the request's sampling parameters are values: a call may set
        its own)."""
        if backend is self.backend and self.run_model is not None:
            return self.run_model
        name = backend.model_name
        shape = self.models.get(name)
        if shape is None:
            const = {GEN_AI_OPERATION_NAME: "text_completion", GEN_AI_PROVIDER_NAME: backend.provider,
                     GEN_AI_REQUEST_MODEL: name}  # fmt: skip
            shape = self.models[name] = _shape(f"text_completion {name}", _CLIENT, const, _MODEL_SLOTS)
        if backend is self.backend:
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
            }
            shape = self.tools[name] = _shape(f"execute_tool {name}", _INTERNAL, const, _TOOL_SLOTS)
        return shape


class _Root(_Span):
    """`invoke_agent {agent}`, current in the trajectory's task from `trajectory()` to `finish()`.

    It also holds the open transition span: its id, start, and the token count when it opened. The driver
    calls `transition(edge)` once per edge, which ends that span and opens the next state's (the next
    state's work starts where this one's ends), so a transition costs one call and one queued tuple.
    """

    __slots__ = ("traj", "shapes", "state_id", "state_start", "state_mark", "state_span")

    def __init__(self, tel: Telemetry, traj: Any, shapes: _Shapes):
        ambient = _current_span()  # a span the caller has open (a training step...) is linked, not a parent
        self.tel, self.shape, self.values = tel, shapes.root, ()
        self._trace_id, self._span_id, self._parent_id = _random_bits(128) or 1, _random_bits(64) or 1, 0
        self._extra = self._end = None
        if ambient is not None:
            ambient = ambient.get_span_context()
            if ambient.is_valid:
                self._x().links.append(Link(ambient))
        self.traj, self.shapes, self.state_span = traj, shapes, None
        tel._live[self._trace_id] = self
        self._token = _CV.set(_Context({_SPAN_KEY: self})) if _CV is not None else _attach(self, alone=True)
        self.state_mark = len(traj.segments)  # the span counts the tokens appended after this mark
        self.state_id = _random_bits(64) or 1
        self._start = self.state_start = _time_ns()
        if traj.state in shapes.user_states:
            self._user_state(traj.state)

    def _user_state(self, source: str) -> None:
        """A user action runs in `source`: the state's span is a span object, current, so that spans the
        action starts are its children. (Built-in actions start no spans but model and tool calls, which
        are given their parent.)"""
        span = self.state_span = _Span(self.tel, self.shapes.state(source), self._trace_id, self.state_id,
                                       self._span_id, (), self.state_start)  # fmt: skip
        span._token = _attach(span)

    def transition(self, edge: Any) -> None:
        """`edge` fired: the span `{SOURCE} -> {DEST}` ends, with the tokens the state appended, and the
        span of the state entered starts. (Written flat: it runs once per transition of every trajectory.)"""
        now = _time_ns()
        traj, shapes = self.traj, self.shapes
        segments = traj.segments
        model = observation = 0
        for seg in segments[self.state_mark :]:
            if seg.role == "assistant":
                model += seg.end - seg.start
            else:
                observation += seg.end - seg.start
        dest = edge.dest
        final = dest in shapes.finals
        reason = (traj.termination_reason or "") if final else None
        if self.state_span is None:
            tel = self.tel
            tel._ended += 1
            tel._emit((shapes.edges[edge.index].id, self._trace_id, self.state_id, self._span_id, self.state_start,
                       now, traj.assistant_turns, model, observation, reason))  # fmt: skip
            if len(tel._queue) >= tel._batch:
                tel._wake_exporters()
        else:
            span, self.state_span = self.state_span, None
            span.shape = shapes.edges[edge.index]
            span.values = (traj.assistant_turns, model, observation, reason)
            if span._extra is not None:
                span._extra.name = None  # the edge names it
            _detach(span._token)
            span.end(now)
        if not final:
            self.state_mark = len(segments)
            self.state_id = _random_bits(64) or 1
            self.state_start = now
            if dest in shapes.user_states:
                self._user_state(dest)

    def state_failed(self, exc: BaseException) -> None:
        """The state's action (or its guards) raised: the span is `{SOURCE} -> error`, status ERROR."""
        span = self.state_span
        if span is None:
            source = self.traj.state
            span = _Span(self.tel, self.shapes.state(source), self._trace_id, self.state_id, self._span_id, (),
                         self.state_start)  # fmt: skip
        else:
            self.state_span = None
            _detach(span._token)
        span._x().name = f"{self.traj.state} -> error"
        span._fail(exc)
        span.end()

    def finish(self) -> None:
        """The trajectory is done (scored, released): the root ends with its outcome."""
        traj, tel = self.traj, self.tel
        model_tokens = traj.response_mask.count(1)
        content = _conversation(traj) if tel.capture_content else _NO_CONTENT
        error = traj.error
        self.values = (
            traj.session_id, traj.index, traj.uid, traj.sample, traj.termination_reason or "", traj.state,
            len(traj.transitions_fired), traj.num_turns, len(traj.prompt_ids), len(traj.response_ids), model_tokens,
            traj.metrics.prompt_tokens_sent, model_tokens, traj.metrics.cached_tokens,
            None if traj.reward_score is None else float(traj.reward_score), error,
            None if error is None else _error_type(error), *content,
        )  # fmt: skip
        if error is not None:
            self._x().status = Status(StatusCode.ERROR, error)
        if self.state_span is not None:  # a user action's span left open (cancelled): it ends here
            _detach(self.state_span._token)
            self.state_span.end()
            self.state_span = None
        _detach(self._token)
        tel._live.pop(self._trace_id, None)
        self.traj = None  # the root may wait in the export queue; the trajectory need not
        self.end()


class _CallSpan(_Span):
    """A model or tool call, current from its start (`Telemetry.model_call`/`tool_call`) to `done(...)` or
    `fail(exc)`: spans a backend or a tool starts are its children. `values` holds what the start knew
    until `done` lines the values up with the shape."""

    __slots__ = ()

    def fail(self, exc: BaseException) -> None:
        """The call raised: status ERROR, error.type, the exception as an event."""
        _detach(self._token)
        self.values = self._request_values()
        self._fail(exc)
        self.end()

    def _request_values(self) -> tuple:
        return ()


class _ModelSpan(_CallSpan):
    __slots__ = ()

    def _request_values(self) -> tuple:
        request = self.values
        return (request.session_id, request.sampling_params,
                tuple(request.prompt_ids) if self.tel.capture_content else None)  # fmt: skip

    def done(self, result: Any) -> None:
        """The backend answered: usage, finish reason, the server that answered; the span ends. (Flat: it
        runs once per model call; what can wait, the sampling parameters and the server's address, is read
        in the export thread.)"""
        if _CV is not None:
            _CV.reset(self._token)
        else:
            _detach(self._token)
        request, tel = self.values, self.tel
        version, extra = result.weight_version, result.extra
        self._end = end = _time_ns()
        if self._extra is None and not tel.capture_content:  # the common case, as a tuple (`_queue`, inlined)
            tel._ended += 1
            tel._emit((self.shape.id, self._trace_id, self._span_id, self._parent_id, self._start, end,
                       request.session_id, request.sampling_params, None, result.finish_reason,
                       len(result.token_ids), result.prompt_tokens, result.cached_tokens, result.server, result.route,
                       None if version is None else str(version), str(extra["id"]) if extra and extra.get("id") else None))  # fmt: skip
            if len(tel._queue) >= tel._batch:
                tel._wake_exporters()
            return
        self.values = (
            *self._request_values(), result.finish_reason, len(result.token_ids), result.prompt_tokens,
            result.cached_tokens, result.server, result.route, None if version is None else str(version),
            str(extra["id"]) if extra and extra.get("id") else None,
            tuple(result.token_ids) if tel.capture_content else None,
        )  # fmt: skip
        self._queue()


class _ToolSpan(_CallSpan):
    __slots__ = ()

    def _request_values(self) -> tuple:
        call = self.values
        args = None
        if self.tel.capture_content:
            args = call.raw if call.arguments is None else json.dumps(call.arguments, ensure_ascii=False)
        return (call.id or None, args)

    def done(self, outcome: Any) -> None:
        """The tool call finished (maybe with an error outcome: status ERROR); the span ends."""
        if _CV is not None:
            _CV.reset(self._token)
        else:
            _detach(self._token)
        call, tel = self.values, self.tel
        self._end = end = _time_ns()
        error = outcome.error
        if error is None and self._extra is None and not tel.capture_content:  # `_queue`, inlined
            tel._ended += 1
            tel._emit((self.shape.id, self._trace_id, self._span_id, self._parent_id, self._start, end, call.id or None,
                       None, outcome.attempts))  # fmt: skip
            if len(tel._queue) >= tel._batch:
                tel._wake_exporters()
            return
        self.values = (*self._request_values(), outcome.attempts, error,
                       outcome.text if tel.capture_content else None)  # fmt: skip
        if error is not None:
            self._x().status = Status(StatusCode.ERROR, outcome.text[:200])
        self._queue()


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


def _error_type(error: str) -> str:
    """A low-cardinality error.type from a trajectory's error ('backend: ...' -> 'backend')."""
    head = error.removeprefix("error:").strip().split(":", 1)[0].split(" in ", 1)[0].strip()
    return head.replace(" ", "_") or "_OTHER"


def _parts(messages: list[dict[str, Any]]) -> str:
    """Chat messages in the GenAI JSON shape: [{"role", "parts": [{"type": "text", "content"}]}]."""
    return json.dumps(
        [{"role": m.get("role"), "parts": [{"type": "text", "content": m.get("content")}]} for m in messages],
        ensure_ascii=False,
        default=str,
    )


_NO_CONTENT = (None, None, None)


def _conversation(traj: Any) -> tuple[str, str, str | None]:
    """(input messages, output messages, tool definitions) as GenAI JSON: opt-in content."""
    prompt = traj.row.get("raw_prompt") or []
    n = len(prompt) if isinstance(prompt, list) else 0
    tools = json.dumps(traj.tool_schemas, ensure_ascii=False) if traj.tool_schemas else None
    return (_parts(prompt) if n else "[]"), _parts(traj.messages[n:]), tools


# --- export: a queue and a thread per exporter ----------------------------------------------------------------


@dataclass
class SpanCounts:
    """Spans per fate. Exact after a flush; between flushes `dropped_queue_full` may lag by a batch."""

    ended: int = 0  # sampled spans handed to the processors (one per exporter)
    exported: int = 0  # accepted by an exporter
    dropped_queue_full: int = 0  # evicted from a full queue before export
    export_failed: int = 0  # in a batch the exporter reported as failed (collector down, 4xx, too large)
    queued: int = 0  # still waiting for export
    trajectories: int = 0  # traced
    trajectories_sampled_out: int = 0

    @property
    def dropped(self) -> int:
        return self.dropped_queue_full + self.export_failed

    def as_dict(self) -> dict[str, int]:
        return {**asdict(self), "dropped": self.dropped}

    def __add__(self, other: SpanCounts) -> SpanCounts:
        return SpanCounts(*(a + b for a, b in zip(asdict(self).values(), asdict(other).values())))


class NativeExporter:
    """An exporter that takes queued spans as they are (tuples and `_Span`s of shapes, and the SDK's
    ReadableSpans) instead of ReadableSpans. `export_spans` returns whether the batch was accepted."""

    def export_spans(self, items: Sequence[Any]) -> bool:
        raise NotImplementedError

    def shutdown(self) -> None:
        return None


class SpanPipeline(SpanProcessor):
    """One exporter's queue and export thread, with the rules of the SDK's BatchSpanProcessor.

    The queue is a deque(maxlen=max_queue_size) that the driver's spans are appended to as they end (a bare
    `deque.append`, no Python call): appending to a full one evicts the oldest span, and the caller never
    blocks. The thread wakes every `schedule_delay_millis`, or when the tracer sees a batch queued (it looks
    after queueing each span), and exports everything queued in batches of
    `max_export_batch_size`. The tracer counts the spans it queues, so evicted = ended - submitted - queued,
    exact once the trajectories have finished (as after a flush).
    Spans of `Telemetry.tracer` (SDK spans) come in through `on_end`, like any span processor's.
    """

    def __init__(self, exporter: SpanExporter | NativeExporter, name: str, resource: Resource,
                 scope: InstrumentationScope, *, max_queue_size: int = 16384, max_export_batch_size: int = 2048,
                 schedule_delay_millis: float = 5000):  # fmt: skip
        self.exporter, self.name, self.resource, self.scope = exporter, name, resource, scope
        self.native = isinstance(exporter, NativeExporter)
        self.max_queue_size = max_queue_size
        self.batch_size = max(1, min(max_export_batch_size, max_queue_size))
        self.delay_s = schedule_delay_millis / 1e3
        self.queue: deque[Any] = deque(maxlen=max_queue_size)
        self.append = self.queue.append  # what ended spans are queued with, from any thread
        self.ended_here = 0  # spans that came in through on_end (the tracer counts its own)
        self.submitted = self.exported = self.failed = 0
        self.ended_total = lambda: self.ended_here  # replaced by the Telemetry that owns this pipeline
        self._warned_evicted = 0
        self._closed = False
        self._start()
        if hasattr(os, "register_at_fork"):  # as the SDK: a forked child gets an empty queue, its own thread
            ref = weakref.WeakMethod(self._start)
            os.register_at_fork(after_in_child=lambda: (ref() or (lambda: None))())

    def _start(self) -> None:
        self.queue.clear()
        self._lock = threading.Lock()  # one export at a time: the thread's or a flush's
        self._wake = threading.Event()
        self._thread = threading.Thread(target=self._work, name=f"agentfsm-export-{self.name}", daemon=True)
        self._thread.start()

    def on_end(self, span: ReadableSpan) -> None:
        if span.context.trace_flags.sampled:
            self.ended_here += 1
            self.append(span)
            if len(self.queue) >= self.batch_size:
                self.wake()

    def wake(self) -> None:
        """A batch is queued: export now (a no-op while the thread is already awake)."""
        if not self._wake.is_set():
            self._wake.set()

    def _work(self) -> None:
        due = time.monotonic() + self.delay_s
        while not self._closed:
            self._wake.wait(max(0.0, due - time.monotonic()))
            self._wake.clear()
            timer = time.monotonic() >= due
            if timer or len(self.queue) >= self.batch_size:
                self._export(everything=timer)  # woken by a full batch: full batches only
                due = time.monotonic() + self.delay_s
                evicted = self.counts().dropped_queue_full
                if evicted > self._warned_evicted:
                    log.warning("agentfsm telemetry: the %s export queue was full (%d spans): %d spans dropped so "
                                "far, counted in stats()", self.name, self.max_queue_size, evicted)  # fmt: skip
                    self._warned_evicted = evicted * 2  # warn again only when it doubles
        self._export()

    def _export(self, everything: bool = True) -> None:
        with self._lock:
            queue = self.queue
            least = 1 if everything else self.batch_size
            token = otel_context.attach(otel_context.set_value(_SUPPRESS_KEY, True))  # no spans of the export
            try:
                while len(queue) >= least:
                    batch = []
                    for _ in range(min(len(queue), self.batch_size)):
                        try:
                            batch.append(queue.popleft())
                        except IndexError:  # emptied meanwhile
                            break
                    self.submitted += len(batch)
                    try:
                        if self.native:
                            ok = self.exporter.export_spans(batch)
                        else:
                            spans = [_readable(item, self.resource, self.scope) for item in batch]
                            ok = self.exporter.export(spans) is SpanExportResult.SUCCESS
                    except Exception:
                        log.exception("agentfsm telemetry: exporter %s raised", self.name)
                        ok = False
                    if ok:
                        self.exported += len(batch)
                    else:
                        self.failed += len(batch)
            finally:
                otel_context.detach(token)

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        if not self._closed:
            self._export()
        return True

    def shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._wake.set()
        self._thread.join(30)
        self.exporter.shutdown()

    def counts(self) -> SpanCounts:
        queued, ended = len(self.queue), self.ended_total()
        evicted = max(0, ended - self.submitted - queued)
        return SpanCounts(ended, self.exported, evicted, self.failed, queued)


_SUPPRESS_KEY = getattr(otel_context, "_SUPPRESS_INSTRUMENTATION_KEY", "suppress_instrumentation")


class MemoryExporter(NativeExporter):
    """Keeps every span; `finished_spans()` makes the SDK's ReadableSpans of them when asked (tests)."""

    def __init__(self, resource: Resource, scope: InstrumentationScope):
        self.resource, self.scope = resource, scope
        self._items: list[Any] = []
        self._spans: list[ReadableSpan] = []
        self._lock = threading.Lock()

    def export_spans(self, items: Sequence[Any]) -> bool:
        with self._lock:
            self._items.extend(items)
        return True

    def finished_spans(self) -> tuple[ReadableSpan, ...]:
        with self._lock:
            items, self._items = self._items, []
            self._spans.extend(_readable(item, self.resource, self.scope) for item in items)
            return tuple(self._spans)


class OtlpHttpExporter(NativeExporter):
    """OTLP/HTTP with protobuf bodies encoded here (`_Encoder`: ~2 µs a span, the same bytes as the SDK's
    encoder, which takes ~35), sent with http.client over one kept-alive connection.

    Configured as the SDK's OTLPSpanExporter, argument first, then the variable for traces, then the general
    one: endpoint (used verbatim; OTEL_EXPORTER_OTLP_ENDPOINT gets /v1/traces appended; default
    http://localhost:4318/v1/traces), headers (OTEL_EXPORTER_OTLP_[TRACES_]HEADERS), timeout in seconds
    (OTEL_EXPORTER_OTLP_[TRACES_]TIMEOUT, 10), compression none|gzip|deflate
    (OTEL_EXPORTER_OTLP_[TRACES_]COMPRESSION), TLS files (OTEL_EXPORTER_OTLP_[TRACES_]CERTIFICATE,
    _CLIENT_CERTIFICATE, _CLIENT_KEY). gzip runs at level 1: ~1 µs a span (level 9, the SDK's: ~2), and the
    random ids and timestamps that dominate a span do not compress further anyway.
    Retries as the SDK's: up to 6 attempts on 429/502/503/504 and connection errors, backing off
    2**attempt × U(0.8, 1.2) s or as the server's Retry-After says, never past the timeout; a kept-alive
    connection found broken is retried at once. A request over `max_request_size` bytes is dropped (counted).
    """

    def __init__(self, resource: Resource, scope: InstrumentationScope, endpoint: str | None = None, *,
                 headers: Mapping[str, str] | None = None, timeout_s: float | None = None,
                 compression: str | None = None, compression_level: int = 1,
                 max_request_size: int = 64 * 2**20):  # fmt: skip
        env = os.environ

        def setting(name: str) -> str | None:
            return env.get(f"OTEL_EXPORTER_OTLP_TRACES_{name}") or env.get(f"OTEL_EXPORTER_OTLP_{name}")

        if endpoint is None:
            base = env.get("OTEL_EXPORTER_OTLP_ENDPOINT") or "http://localhost:4318"
            endpoint = env.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") or base.removesuffix("/") + "/v1/traces"
        self.endpoint = endpoint
        url = urlsplit(endpoint)
        if url.scheme not in ("http", "https") or not url.hostname:
            raise ValueError(f"OTLP endpoint {endpoint!r}: expected http(s)://host[:port]/path")
        self._https = url.scheme == "https"
        self._host, self._port = url.hostname, url.port or (443 if self._https else 80)
        self._path = (url.path or "/") + (f"?{url.query}" if url.query else "")
        try:
            self.timeout_s = float(timeout_s if timeout_s is not None else setting("TIMEOUT") or 10.0)
        except ValueError:
            log.warning("agentfsm telemetry: invalid OTLP timeout %r, using 10 s", setting("TIMEOUT"))
            self.timeout_s = 10.0
        self.compression = (compression or setting("COMPRESSION") or "none").strip().lower()
        if self.compression not in ("none", "gzip", "deflate"):
            log.warning(
                "agentfsm telemetry: unknown OTLP compression %r, sending uncompressed", self.compression
            )
            self.compression = "none"
        self.compression_level = compression_level
        self.max_request_size = max_request_size
        self.headers = {"content-type": "application/x-protobuf", "user-agent": "agentfsm-otlp"}
        self.headers.update(parse_env_headers(setting("HEADERS") or "", liberal=True))
        self.headers.update({k.lower(): v for k, v in (headers or {}).items()})
        if self.compression != "none":
            self.headers.setdefault("content-encoding", self.compression)
        self._ssl: ssl.SSLContext | None = None
        if self._https:
            self._ssl = ssl.create_default_context(cafile=setting("CERTIFICATE"))
            if setting("CLIENT_CERTIFICATE"):
                self._ssl.load_cert_chain(setting("CLIENT_CERTIFICATE"), setting("CLIENT_KEY"))
        self._encoder = _Encoder(resource, scope)
        self._conn: http.client.HTTPConnection | None = None
        self._stop = threading.Event()

    def encode(self, items: Sequence[Any]) -> bytes:
        """The request body, uncompressed."""
        return self._encoder.request(items)

    def compress(self, body: bytes) -> bytes:
        if self.compression == "gzip":
            return gzip.compress(body, self.compression_level, mtime=0)
        if self.compression == "deflate":
            return zlib.compress(body, self.compression_level)
        return body

    def export_spans(self, items: Sequence[Any]) -> bool:
        if self._stop.is_set():
            return False
        body = self.encode(items)
        if 0 < self.max_request_size < len(body):
            log.error("agentfsm telemetry: dropping %d spans: the request (%d bytes) exceeds max_request_size %d",
                      len(items), len(body), self.max_request_size)  # fmt: skip
            return False
        return self.send(self.compress(body))

    def send(self, data: bytes) -> bool:
        """POST one request body, retrying as the SDK does. True if the collector accepted it."""
        deadline = time.monotonic() + self.timeout_s
        for attempt in range(6):
            backoff = 2**attempt * random.uniform(0.8, 1.2)
            status, retry_after, error = self._submit(data, deadline)
            if status is not None and 200 <= status < 400:
                return True
            retryable = status in (429, 502, 503, 504) if status is not None else error is not None
            if not retryable:
                log.error("agentfsm telemetry: OTLP export to %s failed: %s", self.endpoint,
                          f"HTTP {status}" if status is not None else error or "timed out")  # fmt: skip
                return False
            if retry_after is not None:
                backoff = retry_after
            if attempt == 5 or backoff > deadline - time.monotonic() or self._stop.is_set():
                log.error("agentfsm telemetry: OTLP export to %s failed after %d attempts (%s)", self.endpoint,
                          attempt + 1, f"HTTP {status}" if status is not None else error)  # fmt: skip
                return False
            log.warning("agentfsm telemetry: OTLP export to %s: %s, retrying in %.2f s", self.endpoint,
                        f"HTTP {status}" if status is not None else error, backoff)  # fmt: skip
            if self._stop.wait(backoff):
                return False
        return False

    def _submit(self, data: bytes, deadline: float) -> tuple[int | None, float | None, Exception | None]:
        """(HTTP status, Retry-After seconds, connection error); a broken kept-alive connection is retried
        at once, as the SDK does."""
        error: Exception | None = None
        for _ in range(2):
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return None, None, error
            conn = self._conn
            try:
                if conn is None:
                    conn = self._conn = (
                        http.client.HTTPSConnection(self._host, self._port, timeout=remaining, context=self._ssl)
                        if self._https else http.client.HTTPConnection(self._host, self._port, timeout=remaining)
                    )  # fmt: skip
                conn.timeout = remaining
                if conn.sock is not None:
                    conn.sock.settimeout(remaining)
                conn.request("POST", self._path, data, self.headers)
                response = conn.getresponse()
                response.read()
                if response.will_close:
                    self._close()
                return response.status, _retry_after(response.getheader("retry-after")), None
            except TimeoutError:  # the deadline passed while waiting: as the SDK, not retried
                self._close()
                return None, None, None
            except (OSError, http.client.HTTPException) as exc:
                self._close()
                error = exc
        return None, None, error

    def _close(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            conn.close()

    def shutdown(self) -> None:
        self._stop.set()
        self._close()


def _retry_after(value: str | None) -> float | None:
    """A Retry-After header (seconds or an HTTP date) in seconds from now."""
    if not value:
        return None
    try:
        seconds = float(value)
        return max(seconds, 0.0) if math.isfinite(seconds) else None
    except ValueError:
        pass
    try:
        return max(parsedate_to_datetime(value).timestamp() - time.time(), 0.0)
    except (TypeError, ValueError):
        return None


# --- the tracer -----------------------------------------------------------------------------------------------


def _traces_url(url: str) -> str:
    """--otlp accepts a base URL (http://host:4318) or the full traces URL (.../v1/traces)."""
    url = url.rstrip("/")
    return url if url.endswith("/v1/traces") else f"{url}/v1/traces"


def _truthy(value: str | None) -> bool:
    return (value or "").strip().lower() in ("1", "true", "yes", "on")


def otlp_from_env() -> bool:
    """Whether the standard variables ask for OTLP export (an endpoint set, OTEL_TRACES_EXPORTER not none)."""
    env = os.environ
    if _truthy(env.get("OTEL_SDK_DISABLED")) or env.get("OTEL_TRACES_EXPORTER", "").strip().lower() == "none":
        return False
    return bool(env.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") or env.get("OTEL_EXPORTER_OTLP_ENDPOINT"))


def _sample_from_env() -> float:
    sampler = os.environ.get("OTEL_TRACES_SAMPLER", "").strip().lower()
    if sampler == "always_off":
        return 0.0
    if sampler in ("traceidratio", "parentbased_traceidratio"):
        return min(1.0, max(0.0, float(os.environ.get("OTEL_TRACES_SAMPLER_ARG", "1.0"))))
    return 1.0


def _env_int(name: str, default: int) -> int:
    try:
        return int(os.environ.get(name) or default)
    except ValueError:
        log.warning("agentfsm telemetry: %s=%r is not an integer, using %d", name, os.environ[name], default)
        return default


# The SDK's defaults (2048 queued, 512 per request) lose spans when thousands of trajectories move in
# lockstep on a CPU-bound run: the export thread waits ~5 ms for the GIL at every wake-up and every socket
# call, so it keeps up only with bigger requests. 16384 queued spans are ~3 MB; 2048 a request ~80 kB gzipped.
DEFAULT_MAX_QUEUE_SIZE = 16384
DEFAULT_MAX_EXPORT_BATCH_SIZE = 2048


class Telemetry:
    """The tracer `Runner(..., tracer=...)` calls. Owns its queues, export threads and TracerProvider.

    telemetry = Telemetry(otlp="http://localhost:4318", sample=0.1)   # or Telemetry.from_env()
    with telemetry:                                                   # close(): flush, stop the threads
        await Runner(agent, backend, tok, tracer=telemetry).run(rows)  # run() flushes at its end
    telemetry.stats()         # {"exported": ..., "dropped": ..., "by_exporter": {...}, ...}

    Configuration follows the standard variables wherever an argument is left at None:
    OTEL_EXPORTER_OTLP_TRACES_ENDPOINT (verbatim) or OTEL_EXPORTER_OTLP_ENDPOINT (+ /v1/traces) turn OTLP on,
    OTEL_EXPORTER_OTLP_[TRACES_]HEADERS/TIMEOUT/COMPRESSION/CERTIFICATE apply to it (gzip unless a
    compression is set), OTEL_SERVICE_NAME names the service, OTEL_BSP_MAX_QUEUE_SIZE (16384 here) /
    OTEL_BSP_MAX_EXPORT_BATCH_SIZE (2048 here; the SDK's 2048/512 lose spans in bursts, see
    DEFAULT_MAX_QUEUE_SIZE) / OTEL_BSP_SCHEDULE_DELAY size the queues,
    OTEL_TRACES_SAMPLER(_ARG) = always_off | traceidratio + fraction set `sample`, and
    OTEL_INSTRUMENTATION_GENAI_CAPTURE_MESSAGE_CONTENT=true sets `capture_content`.

    The driver's hooks: `trajectory()` (per trajectory: its root, or None when it is not traced), the root's
    `state`/`transition`/`state_failed`/`finish`, and `model_call`/`tool_call` around backend and tool calls.
    """

    def __init__(
        self,
        *,
        # an OTLP/HTTP URL (base or .../v1/traces); None: the OTEL_EXPORTER_OTLP_* endpoint if set; False: none
        otlp: str | bool | None = None,
        headers: dict[str, str] | None = None,  # OTLP headers; None: OTEL_EXPORTER_OTLP_[TRACES_]HEADERS
        console: bool = False,  # print finished spans as JSON on stdout
        memory: bool = False,  # keep spans in memory, see `finished_spans()` (tests)
        exporters: Sequence[SpanExporter | NativeExporter] = (),  # any other exporters
        sample: float | None = None,  # fraction of trajectories traced, whole; decided from the session id
        sample_groups: bool = False,  # decide from the uid instead: a GRPO group is traced whole or not at all
        capture_content: bool | None = None,  # messages, token ids, tool arguments/results (opt-in)
        service_name: str | None = None,  # None: OTEL_SERVICE_NAME, else "agentfsm"
        max_queue_size: int | None = None,  # spans waiting per exporter (16384); beyond: dropped, counted
        max_export_batch_size: int | None = None,  # spans per export request (2048)
        schedule_delay_millis: float | None = None,  # the export thread wakes at least this often
        flush_timeout_s: float = 30.0,  # flush() waits at most this long for a slow collector
    ):
        self.sample = _sample_from_env() if sample is None else float(sample)
        self.sample_groups = sample_groups
        if not 0.0 <= self.sample <= 1.0:
            raise ValueError(f"sample must be a fraction in [0, 1], got {sample}")
        if capture_content is None:
            capture_content = _truthy(os.environ.get("OTEL_INSTRUMENTATION_GENAI_CAPTURE_MESSAGE_CONTENT"))
        self.capture_content = capture_content
        self.flush_timeout_s = flush_timeout_s
        self._threshold = int(self.sample * 2**64)
        resource = Resource.create({"service.name": service_name} if service_name else {})
        if str(resource.attributes.get("service.name", "")).startswith("unknown_service"):
            resource = resource.merge(Resource({"service.name": "agentfsm"}))
        self.provider = TracerProvider(resource=resource, sampler=ALWAYS_ON, shutdown_on_exit=False)
        self.resource = self.provider.resource
        # `tracer` is the SDK's, for spans of your own (in a custom action, a backend...); the driver's spans
        # share its instrumentation scope and leave through the same queues.
        self.tracer = self.provider.get_tracer("agentfsm")
        self.scope = getattr(self.tracer, "instrumentation_scope", None) or InstrumentationScope("agentfsm")
        self.memory = MemoryExporter(self.resource, self.scope) if memory else None
        self.otlp_endpoint: str | None = None
        named: list[tuple[str, SpanExporter | NativeExporter]] = []
        if isinstance(otlp, str) or (otlp is None and otlp_from_env()):
            compressed = any(os.environ.get(f"OTEL_EXPORTER_OTLP_{k}COMPRESSION") for k in ("TRACES_", ""))
            exporter = OtlpHttpExporter(
                self.resource,
                self.scope,
                _traces_url(otlp) if isinstance(otlp, str) else None,  # None: from the OTEL_* variables
                headers=headers,
                compression=None if compressed else "gzip",
            )
            self.otlp_endpoint = exporter.endpoint
            named.append(("otlp", exporter))
        if console:
            named.append(("console", ConsoleSpanExporter()))
        if self.memory is not None:
            named.append(("memory", self.memory))
        named.extend((f"{type(e).__name__}{i}", e) for i, e in enumerate(exporters))
        queue = max_queue_size or _env_int("OTEL_BSP_MAX_QUEUE_SIZE", DEFAULT_MAX_QUEUE_SIZE)
        batch = max_export_batch_size or _env_int(
            "OTEL_BSP_MAX_EXPORT_BATCH_SIZE", DEFAULT_MAX_EXPORT_BATCH_SIZE
        )
        delay = schedule_delay_millis or _env_int("OTEL_BSP_SCHEDULE_DELAY", 5000)
        self.processors = [
            SpanPipeline(e, name, self.resource, self.scope, max_queue_size=queue, max_export_batch_size=batch,
                         schedule_delay_millis=delay)
            for name, e in named
        ]  # fmt: skip
        for p in self.processors:
            self.provider.add_span_processor(p)
        # Ended driver spans are appended straight to the queues, and counted here (one exporter: a bare
        # deque.append, the cheapest way to hand a span over).
        self._ended = 0
        appends = [p.append for p in self.processors]
        if len(appends) == 1:
            self._emit = appends[0]
        else:

            def emit_all(item: Any) -> None:
                for append in appends:
                    append(item)

            self._emit = emit_all
        for p in self.processors:
            p.ended_total = lambda p=p: self._ended + p.ended_here
        # the driver wakes the export threads when a batch is queued (they also wake every schedule delay)
        self._queue: Sequence[Any] = self.processors[0].queue if self.processors else ()
        self._batch = min((p.batch_size for p in self.processors), default=1)
        self._live: dict[int, _Root] = {}  # trace id -> root, for the traced trajectories running now
        self._shapes: dict[tuple, _Shapes] = {}
        self._last: tuple[Any, _Shapes] | None = None  # (run context, its shapes)
        self._traced = self._sampled_out = 0
        self._warned_dropped = 0
        self._closed = False

    @classmethod
    def from_env(cls, **options: Any) -> Telemetry | None:
        """A Telemetry when `otlp=`/`console=`/`memory=`/`exporters=` or the OTEL_* variables ask for one;
        None otherwise (tracing off costs nothing) and when OTEL_SDK_DISABLED=true."""
        if _truthy(os.environ.get("OTEL_SDK_DISABLED")):
            return None
        wanted = any(options.get(k) for k in ("otlp", "console", "memory", "exporters"))
        if not wanted and not (options.get("otlp") is None and otlp_from_env()):
            return None
        return cls(**options)

    def _wake_exporters(self) -> None:
        for p in self.processors:
            p.wake()

    # --- sampling -------------------------------------------------------------------------------------------

    def keeps(self, key: str) -> bool:
        """Whether the trajectory with this session id (or uid, with `sample_groups`) is traced: a hash of
        the key against the fraction, so every process and every re-run gives the same answer."""
        if self.sample >= 1.0:
            return True
        if self.sample <= 0.0:
            return False
        digest = hashlib.blake2b(key.encode(), digest_size=8).digest()
        return int.from_bytes(digest, "big") < self._threshold

    # --- the hooks fsm/runtime.py calls --------------------------------------------------------------------

    def trajectory(self, traj: Any, run: Any) -> _Root | None:
        """The started root span of one trajectory, current in the calling task until its `finish()`; None
        when the trajectory is sampled out (then nothing of it is traced). `run` is the RunContext."""
        if self.sample < 1.0 and not self.keeps(traj.uid if self.sample_groups else traj.session_id):
            self._sampled_out += 1
            return None
        self._traced += 1
        last = self._last
        if last is not None and last[0] is run:
            shapes = last[1]
        else:
            sampling = run.sampling.params
            key = (id(run.agent), id(run.backend), *(sampling.get(name) for _, name in _SAMPLING_ATTRS))
            shapes = self._shapes.get(key)
            if shapes is None:
                shapes = self._shapes[key] = _Shapes(run.agent, run.backend, sampling)
            self._last = (run, shapes)
        return _Root(self, traj, shapes)

    def _joined(self, current: Any) -> tuple[_Root | None, int]:
        """(root, parent span id) when the current span is in a trajectory this tracer traces."""
        if isinstance(current, _Span):
            return self._live.get(current._trace_id), current._span_id
        if not current.is_recording():  # INVALID_SPAN, or a span another tracer sampled out
            return None, 0
        ctx = current.get_span_context()
        return self._live.get(ctx.trace_id), ctx.span_id

    def _call_parent(self) -> tuple[Any, Any, int] | None:
        """(context, root, parent span id) for a model or tool call span; None when not traced. In a
        built-in action the root is current and the state's span is the parent."""
        context = _CV.get() if _CV is not None else otel_context.get_current()
        current = context.get(_SPAN_KEY)
        if type(current) is _Root and current.tel is self:
            return context, current, current.state_id
        if current is None:
            return None
        root, parent = self._joined(current)
        return (context, root, parent) if root is not None else None

    def model_call(self, traj: Any, request: Any, backend: Any) -> _ModelSpan | None:
        """The started span of one backend call, current until its `done(result)` or `fail(exc)`; None when
        the trajectory is not traced. (Flat: it runs once per model call.)"""
        found = self._call_parent()
        if found is None:
            return None
        context, root, parent = found
        shapes = root.shapes
        span = _new(_ModelSpan)
        span.tel, span.values = self, request
        run_model = backend is shapes.backend and shapes.run_model
        span.shape = run_model or shapes.model(backend)
        span._trace_id, span._span_id, span._parent_id = root._trace_id, _random_bits(64) or 1, parent
        span._extra = span._end = None
        span._start = _time_ns()
        span._token = _CV.set(_Context({**context, _SPAN_KEY: span})) if _CV is not None else _attach(span)
        return span

    def tool_call(self, traj: Any, call: Any, tool: Any) -> _ToolSpan | None:
        """The started span of one tool call, current until its `done(outcome)` or `fail(exc)`; None when
        the trajectory is not traced."""
        found = self._call_parent()
        if found is None:
            return None
        context, root, parent = found
        name = call.name or "unknown"
        span = _new(_ToolSpan)
        span.tel, span.values = self, call
        span.shape = root.shapes.tools.get(name) or root.shapes.tool(name, tool)
        span._trace_id, span._span_id, span._parent_id = root._trace_id, _random_bits(64) or 1, parent
        span._extra = span._end = None
        span._start = _time_ns()
        span._token = _CV.set(_Context({**context, _SPAN_KEY: span})) if _CV is not None else _attach(span)
        return span

    # --- export ---------------------------------------------------------------------------------------------

    def stats(self) -> dict[str, Any]:
        """What happened to the spans, summed over exporters (a span sent to two exporters counts twice):
        ended, exported, dropped (= dropped_queue_full + export_failed), queued; trajectories traced and
        sampled out; the same per exporter under "by_exporter". Exact after a flush."""
        total = SpanCounts(trajectories=self._traced, trajectories_sampled_out=self._sampled_out)
        by = {}
        for p in self.processors:
            counts = p.counts()
            by[p.name] = counts.as_dict()
            total = total + counts
        return {**total.as_dict(), "by_exporter": by}

    def flush(self, timeout_s: float | None = None) -> dict[str, Any]:
        """Export everything queued (waiting at most `timeout_s`); returns `stats()`; warns about drops."""
        timeout_s = self.flush_timeout_s if timeout_s is None else timeout_s
        if not self._closed:
            # wait from the side, so that a hung collector costs at most the timeout
            worker = threading.Thread(target=self.provider.force_flush, name="agentfsm-flush", daemon=True)
            worker.start()
            worker.join(timeout_s)
            if worker.is_alive():
                log.warning("agentfsm telemetry: still exporting after %.0f s; is the collector at %s up?",
                            timeout_s, self.otlp_endpoint)  # fmt: skip
        stats = self.stats()
        if stats["dropped"] > self._warned_dropped:
            log.warning(
                "agentfsm telemetry: %d of %d spans dropped (%d queue full, %d export failed): %s. Raise "
                "max_queue_size (OTEL_BSP_MAX_QUEUE_SIZE, now %s) or check the collector.",
                stats["dropped"], stats["ended"], stats["dropped_queue_full"], stats["export_failed"],
                {name: c["dropped"] for name, c in stats["by_exporter"].items()},
                ", ".join(str(p.max_queue_size) for p in self.processors),
            )  # fmt: skip
            self._warned_dropped = stats["dropped"]
        return stats

    def finished_spans(self) -> tuple[ReadableSpan, ...]:
        """Spans the in-memory exporter received (flush first). Requires `memory=True`."""
        if self.memory is None:
            raise RuntimeError("finished_spans() needs Telemetry(memory=True)")
        return self.memory.finished_spans()

    def close(self) -> dict[str, Any]:
        """Flush, stop the export threads, and return the final stats. Idempotent."""
        if self._closed:
            return self.stats()
        stats = self.flush()
        self._closed = True
        self.provider.shutdown()
        return stats

    def __enter__(self) -> Telemetry:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


# --- overhead -------------------------------------------------------------------------------------------------

# A collector that discards (a separate process: its CPU is not the tracer's).
_RECEIVER = """
import http.server
class H(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    def do_POST(self):
        self.rfile.read(int(self.headers.get("content-length") or 0))
        self.send_response(200)
        self.send_header("content-type", "application/x-protobuf")
        self.send_header("content-length", "0")
        self.end_headers()
    def log_message(self, *args):
        pass
server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), H)
print(server.server_address[1], flush=True)
server.serve_forever()
"""

# label -> what it measures
BENCH_EXPORTERS = {
    "memory": "Telemetry(memory=True): spans kept as queued, ReadableSpans made when read",
    "null": "queued, then discarded by the export thread",
    "encode": "OTLP protobuf encoded here and gzipped, not sent",
    "otlp": "OTLP/HTTP, encoded here, gzip, POSTed to a loopback collector that discards",
    "sdk-memory": "the SDK's InMemorySpanExporter (ReadableSpans made in the export thread)",
    "sdk-otlp": "the SDK's OTLPSpanExporter (its encoder, gzip level 9, requests) to the same collector",
}
BENCH_RUNS = (("memory", 1.0), ("otlp", 1.0), ("otlp", 0.1), ("otlp", 0.01), ("otlp", 0.0))


def bench_tracing(n: int = 2000, *, repeats: int = 5, workload: str = "engine",
                  runs: Sequence[tuple[str, float]] = BENCH_RUNS, tool_turns: int = 4,
                  concurrency: int | None = None, show: bool = True) -> dict[str, Any]:  # fmt: skip
    """Trajectories per CPU second with tracing off and on: the engine's own cost, so the worst case.

    `workload` "engine" is `agentfsm bench engine`'s (fsm/bench.py: tool_agent, `tool_turns` tool rounds
    against a zero-latency scripted backend, a table-lookup codec; 20 spans a trajectory at 4 rounds);
    "calculator" is specs/calculator.yaml on the tiny tokenizer (its chat template rendered per turn: a
    heavier engine, 8 spans a trajectory). Each of `runs` is (exporter, sample), exporters as in
    BENCH_EXPORTERS. Every repeat runs each of `runs` right after a run with tracing off; the CPU time is
    this process's (all threads: export included, the collector's process not), from the first trajectory
    to the end of the flush that `Runner.run` ends with; overhead is the median over repeats of on/off - 1
    of those pairs. `show` prints a table on stderr (stdout stays JSON for `agentfsm bench tracing`).
    """
    import asyncio
    import gc
    import statistics
    import subprocess
    import sys

    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    make_run, spans_per_traj = _bench_workload(workload, n, tool_turns, concurrency or n)
    receiver = None
    if any(kind in ("otlp", "sdk-otlp") for kind, _ in runs):
        receiver = subprocess.Popen([sys.executable, "-c", _RECEIVER], stdout=subprocess.PIPE, text=True)
        url = f"http://127.0.0.1:{int(receiver.stdout.readline())}"

    def tracer(kind: str, sample: float) -> Telemetry:
        if kind == "memory":
            return Telemetry(otlp=False, memory=True, sample=sample)
        if kind == "otlp":
            return Telemetry(otlp=url, sample=sample)
        if kind == "null":
            return Telemetry(otlp=False, exporters=[_Discard()], sample=sample)
        if kind == "encode":
            return Telemetry(otlp=False, sample=sample, exporters=[
                _EncodeOnly(Resource.create({"service.name": "agentfsm"}), InstrumentationScope("agentfsm"),
                            "http://127.0.0.1:9/v1/traces", compression="gzip")])  # fmt: skip
        if kind == "sdk-memory":
            return Telemetry(otlp=False, exporters=[InMemorySpanExporter()], sample=sample)
        if kind == "sdk-otlp":
            from opentelemetry.exporter.otlp.proto.http import Compression
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

            return Telemetry(otlp=False, sample=sample, exporters=[
                OTLPSpanExporter(endpoint=f"{url}/v1/traces", compression=Compression.Gzip)])  # fmt: skip
        raise ValueError(f"unknown exporter {kind!r}; known: {', '.join(BENCH_EXPORTERS)}")

    def once(kind: str | None, sample: float) -> tuple[float, dict[str, Any]]:
        tel = tracer(kind, sample) if kind is not None else None
        runner, rows = make_run(tel)
        gc.collect()
        t0 = time.process_time()
        trajs = asyncio.run(runner.run(rows))  # flushes the tracer at its end
        cpu = time.process_time() - t0
        bad = [t for t in trajs if t.failed]
        assert not bad, f"{workload}: {bad[0].error}"
        stats = tel.close() if tel is not None else {}
        return cpu, stats

    try:
        runner, rows = make_run(None)  # warm up (imports, caches)
        asyncio.run(runner.run(rows[:200]))
        # Each run with tracing on right after its own run with tracing off: a run's cost depends on what
        # the runs before it left behind (heap, caches), so pairs drift together.
        off: dict[int, list[float]] = {i: [] for i in range(len(runs))}
        on: dict[int, list[float]] = {i: [] for i in range(len(runs))}
        stats: dict[int, dict[str, Any]] = {}
        for _ in range(repeats):
            for i, (kind, sample) in enumerate(runs):
                off[i].append(once(None, 0.0)[0])
                cpu, stats[i] = once(kind, sample)
                on[i].append(cpu)
    finally:
        if receiver is not None:
            receiver.terminate()
            receiver.wait()
    off_us = statistics.median(x for i in off for x in off[i]) / n * 1e6
    rows_out = []
    for i, (kind, sample) in enumerate(runs):
        cpu_us = statistics.median(on[i]) / n * 1e6
        overhead = statistics.median(b / a - 1.0 for a, b in zip(off[i], on[i]))
        spans = stats[i]["exported"] / n
        rows_out.append({
            "exporter": kind,
            "sample": sample,
            "traj_per_cpu_s": round(1e6 / cpu_us, 1),
            "cpu_us_per_traj": round(cpu_us, 1),
            "overhead": round(overhead, 4),
            "spans_per_traj": round(spans, 3),
            # extra CPU per span exported (sampled-out trajectories' cost included)
            "us_per_span": round(overhead * off_us / spans, 2) if spans >= 1 else None,  # noise below
            "dropped": stats[i]["dropped"],
        })  # fmt: skip
    result = {
        "workload": workload,
        "trajectories": n,
        "concurrency": concurrency or n,
        "repeats": repeats,
        "spans_per_traced_trajectory": spans_per_traj,
        "default_sample": _sample_from_env(),
        "off": {"traj_per_cpu_s": round(1e6 / off_us, 1), "cpu_us_per_traj": round(off_us, 1)},
        "on": rows_out,
    }
    if show:
        print(_bench_table(result), file=sys.stderr)
    return result


def _bench_workload(workload: str, n: int, tool_turns: int, concurrency: int) -> tuple[Any, int]:
    """(make_run(tracer) -> (runner, rows), spans per traced trajectory)."""
    from fsm.runtime import Runner

    if workload == "engine":
        from bench.engine import _workload, bench_agent

        agent = bench_agent(tool_turns)
        rows = [{"raw_prompt": [{"role": "user", "content": "hi"}]} for _ in range(n)]

        def make_run(tel: Telemetry | None) -> tuple[Runner, list]:
            codec, backend = _workload(tool_turns)
            return Runner(agent, backend, codec, max_concurrency=concurrency, tracer=tel), rows

        return make_run, 1 + (2 + 2 * tool_turns) + (tool_turns + 1) + tool_turns
    if workload != "calculator":
        raise ValueError(f"unknown workload {workload!r}: engine | calculator")
    from pathlib import Path

    from transformers import AutoTokenizer

    from backends.base import BaseBackend, GenerateResult
    from fsm.compile import compile_spec
    from specs.calculator import make_prompts

    repo = Path(__file__).resolve().parent.parent
    tok = AutoTokenizer.from_pretrained(str(repo / "backends/tiny/assets"))
    agent = compile_spec(repo / "specs/calculator.yaml")
    call = tok.encode('<tool_call>\n{"name": "calculator", "arguments": {"expression": "1 + 2"}}\n</tool_call>',
                      add_special_tokens=False) + [tok.eos_token_id]  # fmt: skip
    answer = tok.encode("The answer is 3.\n#### 3", add_special_tokens=False) + [tok.eos_token_id]

    class Replay(BaseBackend):
        provider, model_name = "scripted", "replay"

        async def generate(self, request: Any) -> GenerateResult:
            ids = call if request.rid.endswith("_t00") else answer
            return GenerateResult(
                list(ids), [-0.5] * len(ids), "stop", len(request.prompt_ids), 0, server="replay"
            )

    rows = make_prompts(n)

    def make_calculator_run(tel: Telemetry | None) -> tuple[Runner, list]:
        return Runner(agent, Replay(), tok, max_concurrency=concurrency, tracer=tel), rows

    return make_calculator_run, 8


def _bench_table(r: dict[str, Any]) -> str:
    lines = [
        f"agentfsm bench tracing: {r['workload']} workload, {r['trajectories']} trajectories "
        f"({r['spans_per_traced_trajectory']} spans each when traced), CPU time of this process (export thread "
        f"included), median of {r['repeats']} runs, each right after a run with tracing off",
        f"{'tracing':<9} {'sample':>6} {'traj/CPU-s':>11} {'CPU µs/traj':>12} {'overhead':>9} {'µs/span':>8} "
        f"{'spans/traj':>10} {'dropped':>8}",
        f"{'off':<9} {'-':>6} {r['off']['traj_per_cpu_s']:>11.0f} {r['off']['cpu_us_per_traj']:>12.1f} {'-':>9} "
        f"{'-':>8} {0:>10} {'-':>8}",
    ]
    for row in r["on"]:
        sample = f"{row['sample']:g}" + ("*" if row["sample"] == r["default_sample"] else "")
        per_span = "-" if row["us_per_span"] is None else f"{row['us_per_span']:.2f}"
        lines.append(
            f"{row['exporter']:<9} {sample:>6} {row['traj_per_cpu_s']:>11.0f} {row['cpu_us_per_traj']:>12.1f} "
            f"{row['overhead']:>+9.1%} {per_span:>8} {row['spans_per_traj']:>10.2f} {row['dropped']:>8}"
        )
    lines.append(f"* the default sampling (OTEL_TRACES_SAMPLER unset: {r['default_sample']:g}). Exporters: "
                 + "; ".join(f"{k}: {BENCH_EXPORTERS[k]}" for k in dict.fromkeys(x["exporter"] for x in r["on"])))  # fmt: skip
    return "\n".join(lines)


class _Discard(NativeExporter):
    def export_spans(self, items: Sequence[Any]) -> bool:
        return True


class _EncodeOnly(OtlpHttpExporter):
    def send(self, data: bytes) -> bool:
        return True


if __name__ == "__main__":  # python -m fsm.telemetry [n] [workload] [exporter:sample ...]
    import sys

    args = sys.argv[1:]
    chosen = tuple((a.split(":")[0], float(a.split(":")[1])) for a in args[2:]) or BENCH_RUNS
    out = bench_tracing(
        int(args[0]) if args else 2000, workload=args[1] if len(args) > 1 else "engine", runs=chosen
    )
    print(json.dumps(out, indent=1))
