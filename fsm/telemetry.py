"""OpenTelemetry for agentfsm: every trajectory is one trace.

    invoke_agent calculator                  root, INTERNAL: its own trace, current while the trajectory runs
      PENDING -> GENERATING                  one span per transition, covering the source state's work
      GENERATING -> PROCESSING_TOOLS
        text_completion tiny                 a model call, CLIENT (GenAI inference span)
      PROCESSING_TOOLS -> GENERATING
        execute_tool calculator              a tool call, INTERNAL (GenAI tool span)
      GENERATING -> TERMINATED
        text_completion tiny

The driver (fsm/runtime.py) calls the hooks of `Telemetry` only when a tracer is given, so tracing off
costs nothing. Sampling keeps or drops whole trajectories (decided from the session id, so a re-run of
the same ids keeps the same ones); a dropped trajectory's hooks return shared no-op handles.

Spans leave through a BatchSpanProcessor per exporter (OTLP/HTTP, console, in-memory), each wrapped so
that what the SDK drops when its queue is full is counted and reported by `flush()`/`stats()` and logged,
never lost silently. The TracerProvider is our own: the global one is never touched.

Costs, measured by `bench_tracing` on a 2-core CI machine: the driver's spans are lean (`_Span`, ~7-15 µs
of event-loop CPU each, ~8 per tool-calling trajectory, against ~1.2 ms of engine CPU per trajectory when
no model runs); the SDK's OTLP protobuf encoding, in the export thread but holding the GIL, costs ~65 µs a
span on the same machine, so large CPU-bound runs should sample (`sample=0.05`). With a real model, every
model call takes far longer than its spans.

The `gen_ai.*` names are kept here as string literals: the semconv package marks its GenAI constants
deprecated (they moved to the semantic-conventions-genai repository; the strings are unchanged).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import random
import threading
import time
import traceback
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any
from urllib.parse import urlsplit

from opentelemetry import context as otel_context
from opentelemetry import trace as otel_trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import Event, ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import (
    BatchSpanProcessor,
    ConsoleSpanExporter,
    SpanExporter,
    SpanExportResult,
)
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.sdk.trace.sampling import ALWAYS_ON
from opentelemetry.sdk.util.instrumentation import InstrumentationScope
from opentelemetry.trace import Link, SpanContext, SpanKind, Status, StatusCode, TraceFlags

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

_EMPTY = otel_context.Context()
_random_bits = random.getrandbits
_SAMPLED = TraceFlags(TraceFlags.SAMPLED | TraceFlags.RANDOM_TRACE_ID)
_UNSET = Status(StatusCode.UNSET)
_INTERNAL, _CLIENT = SpanKind.INTERNAL.value, SpanKind.CLIENT.value  # spans keep ints: enum access is slow
_MAX_ATTRIBUTES = 128  # the SDK's default span limit, for attributes and events set through the API
_SAMPLING_ATTRS = ((GEN_AI_REQUEST_TEMPERATURE, "temperature"), (GEN_AI_REQUEST_TOP_P, "top_p"),
                   (GEN_AI_REQUEST_TOP_K, "top_k"))  # fmt: skip
# What a sampled-out trajectory runs under: no current span, so the hooks return no-ops (and spans the
# caller had open are not parents of anything in it).
_UNTRACED = otel_trace.set_span_in_context(otel_trace.INVALID_SPAN, _EMPTY)


# --- counting what the batch processor keeps and drops ------------------------------------------------------


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


class _CountingExporter(SpanExporter):
    """Turns queued driver spans into ReadableSpans, passes batches on, and counts how each export went."""

    def __init__(self, inner: SpanExporter, resource: Resource, scope: InstrumentationScope):
        self.inner, self.resource, self.scope = inner, resource, scope
        self.submitted = self.exported = self.failed = 0

    def export(self, spans: Sequence[ReadableSpan | _Span]) -> SpanExportResult:
        self.submitted += len(spans)
        spans = [_readable(s, self.resource, self.scope) if isinstance(s, _Span) else s for s in spans]
        try:
            result = self.inner.export(spans)
        except Exception:
            self.failed += len(spans)
            raise
        if result is SpanExportResult.SUCCESS:
            self.exported += len(spans)
        else:
            self.failed += len(spans)
        return result

    def shutdown(self) -> None:
        self.inner.shutdown()

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return self.inner.force_flush(timeout_millis)


class CountingBatchSpanProcessor(BatchSpanProcessor):
    """A BatchSpanProcessor that knows how many spans its full queue evicted.

    The SDK's queue is a deque(maxlen=max_queue_size): appending to a full one silently evicts the oldest
    span (it logs "Queue full" once per 20 s). Every span handed in is either still queued, submitted to
    the exporter, or was evicted, so evicted = ended - submitted - queued.
    """

    def __init__(self, exporter: SpanExporter, name: str, resource: Resource, scope: InstrumentationScope,
                 **options: Any):  # fmt: skip
        self.counting = _CountingExporter(exporter, resource, scope)
        self.name = name
        super().__init__(self.counting, **options)
        self.ended = 0
        self.max_queue_size = self._batch_processor._max_queue_size

    def on_end(self, span: ReadableSpan) -> None:
        """A span of the SDK's own Tracer (`Telemetry.tracer`)."""
        if span.context.trace_flags.sampled:
            self.ended += 1
            self._batch_processor.emit(span)

    def emit_ended(self, span: _Span) -> None:
        """A driver span (`_Span`), ended."""
        self.ended += 1
        self._batch_processor.emit(span)

    def counts(self) -> SpanCounts:
        queued = len(getattr(self._batch_processor, "_queue", ()))
        c = self.counting
        evicted = max(0, self.ended - c.submitted - queued)
        return SpanCounts(self.ended, c.exported, evicted, c.failed, queued)


# --- spans ------------------------------------------------------------------------------------------------


class _Span(otel_trace.Span):
    """A recording span that costs one slotted object and its attribute dict on the event loop.

    The SDK's `Tracer.start_span` + `end` costs ~10x this (sampler, SpanContext checks, a lock and
    attribute cleaning on every set, a ReadableSpan copy at end) and a trajectory opens ~4 spans per model
    turn, so the spans the driver opens are these. They are real spans to everything else: current in the
    context (so a span started inside, by user code through `Telemetry.tracer` or the global provider,
    becomes a child), attributes/events/status settable through the API, and the export thread turns each
    into the SDK's ReadableSpan for the exporters. Our own attributes are plain str/int/float/bool/tuple
    values and skip cleaning; values set through the public API are checked.
    """

    __slots__ = ("tel", "_name", "_trace_id", "_span_id", "_parent_id", "_context", "_kind", "_attrs", "_events",
                 "_links", "_status", "_start", "_end")  # fmt: skip

    def _open(self, tel: Telemetry, name: str, parent: Any, kind: int, attrs: dict[str, Any],
              links: tuple = ()) -> None:  # fmt: skip
        """Start; `parent` is a `_Span`, another span (user code's), or None for a new trace; `kind` is a
        SpanKind value."""
        if parent is None:
            self._trace_id, self._parent_id = tel._ids.generate_trace_id(), 0
        elif isinstance(parent, _Span):
            self._trace_id, self._parent_id = parent._trace_id, parent._span_id
        else:
            ctx = parent.get_span_context()
            self._trace_id, self._parent_id = ctx.trace_id, ctx.span_id
        self._span_id = _random_bits(64) or 1  # as the SDK's RandomIdGenerator: 64 random bits, never 0
        self.tel, self._name, self._kind, self._attrs, self._links = tel, name, kind, attrs, links
        self._context: SpanContext | None = None  # made when asked for
        self._events: tuple | list[Event] = ()  # a list once an event is added
        self._status = _UNSET
        self._end: int | None = None
        self._start = time.time_ns()

    # the opentelemetry.trace.Span API
    def get_span_context(self) -> SpanContext:
        if self._context is None:
            self._context = SpanContext(self._trace_id, self._span_id, False, _SAMPLED)
        return self._context

    def is_recording(self) -> bool:
        return self._end is None

    def set_attribute(self, key: str, value: Any) -> None:
        if self._end is None and isinstance(key, str) and key and len(self._attrs) < _MAX_ATTRIBUTES:
            value = _attribute_value(value)
            if value is not None:
                self._attrs[key] = value

    def set_attributes(self, attributes: Any) -> None:
        for key, value in attributes.items():
            self.set_attribute(key, value)

    def add_event(self, name: str, attributes: Any = None, timestamp: int | None = None) -> None:
        if self._end is None and len(self._events) < _MAX_ATTRIBUTES:
            self._events = [*self._events, Event(name, dict(attributes or {}), timestamp or time.time_ns())]

    def add_link(self, context: SpanContext, attributes: Any = None) -> None:
        if self._end is None and context.is_valid:
            self._links = (*self._links, Link(context, attributes))

    def update_name(self, name: str) -> None:
        if self._end is None:
            self._name = name

    def set_status(self, status: Status | StatusCode, description: str | None = None) -> None:
        if self._end is not None or self._status.status_code is StatusCode.OK:  # OK is final, as in the SDK
            return
        if isinstance(status, StatusCode):
            status = Status(status, description)
        if status.status_code is not StatusCode.UNSET:
            self._status = status

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
        if self._end is not None:
            return
        self._end = end_time or time.time_ns()
        # The span itself is queued (nothing new to allocate, which would make the garbage collector run more
        # often); the export thread turns it into the SDK's ReadableSpan.
        for processor in self.tel.processors:
            processor.emit_ended(self)

    def _error(self, error_type: str, message: str) -> None:
        self._attrs[ERROR_TYPE] = error_type
        self._status = Status(StatusCode.ERROR, message)


_KINDS = {kind.value: kind for kind in SpanKind}


def _readable(span: _Span, resource: Resource, scope: InstrumentationScope) -> ReadableSpan:
    """The ReadableSpan (what exporters take) of an ended `_Span`."""
    trace_id, parent_id = span._trace_id, span._parent_id
    parent = SpanContext(trace_id, parent_id, False, _SAMPLED) if parent_id else None
    return ReadableSpan(span._name, SpanContext(trace_id, span._span_id, False, _SAMPLED), parent, resource,
                        span._attrs, tuple(span._events), span._links, _KINDS[span._kind], None, span._status,
                        span._start, span._end, scope)  # fmt: skip


def _attribute_value(value: Any) -> Any:
    """An OTel attribute value (str/bool/int/float/bytes or a homogeneous sequence of them), or None."""
    if isinstance(value, (str, bool, int, float, bytes)):
        return value
    if isinstance(value, Sequence):
        items = tuple(value)
        if all(isinstance(v, (str, bool, int, float)) for v in items) and len({type(v) for v in items}) <= 1:
            return items
    return None


class _Noop:
    """What a sampled-out trajectory gets from every hook."""

    __slots__ = ()

    def __enter__(self) -> _Noop:
        return self

    def __exit__(self, *exc: Any) -> None:
        return None

    def transition(self, traj: Any, edge: Any, mark: int) -> None:
        return None

    def fail(self, traj: Any, exc: BaseException) -> None:
        return None

    def record(self, result: Any) -> None:
        return None


_NOOP = _Noop()


class _SampledOut:
    """Root of a trajectory that is not traced: no current span while it runs, so every hook is a no-op."""

    __slots__ = ("_token",)

    def __enter__(self) -> _SampledOut:
        self._token = otel_context.attach(_UNTRACED)
        return self

    def __exit__(self, *exc: Any) -> None:
        otel_context.detach(self._token)


class _Root(_Span):
    """`invoke_agent {agent}`: the current span from enter to exit, in the trajectory's own task (so its
    contextvars keep trajectories apart), and again between states, which is how `state` finds it."""

    __slots__ = ("traj", "run", "context", "finals", "_token")

    def __init__(self, tel: Telemetry, traj: Any, run: Any):
        self.tel, self.traj, self.run = tel, traj, run

    def __enter__(self) -> _Root:
        traj, agent, backend = self.traj, self.run.agent, self.run.backend
        sampling = self.run.sampling
        attrs = {
            GEN_AI_OPERATION_NAME: "invoke_agent",
            GEN_AI_PROVIDER_NAME: backend.provider,
            GEN_AI_AGENT_NAME: agent.name,
            GEN_AI_CONVERSATION_ID: traj.session_id,
            GEN_AI_REQUEST_MODEL: backend.model_name,
            AGENT_HASH: agent.hash,
            INDEX: traj.index,
            UID: traj.uid,
            SAMPLE: traj.sample,
        }
        for key, name in _SAMPLING_ATTRS:
            if sampling.get(name) is not None:
                attrs[key] = sampling[name]
        # A trajectory is its own trace; a span the caller has open (a training step...) is linked to it.
        ambient = otel_trace.get_current_span().get_span_context()
        self._open(self.tel, f"invoke_agent {agent.name}", None, _INTERNAL, attrs,
                   (Link(ambient),) if ambient.is_valid else ())  # fmt: skip
        self.context = otel_trace.set_span_in_context(self, _EMPTY)
        self.finals = agent.final_states
        self._token = otel_context.attach(self.context)
        return self

    def __exit__(self, *exc: Any) -> None:
        traj = self.traj
        model_tokens = traj.response_mask.count(1)
        attrs = self._attrs
        attrs[FSM_TERMINATION_REASON] = traj.termination_reason or ""
        attrs[FSM_FINAL_STATE] = traj.state
        attrs[FSM_TRANSITIONS] = len(traj.transitions_fired)
        attrs[FSM_TURNS] = traj.num_turns
        attrs[PROMPT_TOKENS] = len(traj.prompt_ids)
        attrs[RESPONSE_TOKENS] = len(traj.response_ids)
        attrs[MODEL_TOKENS] = model_tokens
        attrs[GEN_AI_USAGE_INPUT_TOKENS] = traj.metrics.prompt_tokens_sent
        attrs[GEN_AI_USAGE_OUTPUT_TOKENS] = model_tokens
        attrs[GEN_AI_USAGE_CACHE_READ_INPUT_TOKENS] = traj.metrics.cached_tokens
        if traj.reward_score is not None:
            attrs[REWARD] = float(traj.reward_score)
        if self.tel.capture_content:
            attrs.update(_conversation(traj))
        if traj.error is not None:
            attrs[ERROR] = traj.error
            self._error(_error_type(traj.error), traj.error)
        otel_context.detach(self._token)
        self.end()
        # self.context holds this span: break the cycle so refcounting frees both (and the trajectory)
        self.context = self.traj = self.run = None


class _StateSpan(_Span):
    """The source state's work, current during its action; named `{SOURCE} -> {DEST}` once an edge fires."""

    __slots__ = ("root", "token")

    def transition(self, traj: Any, edge: Any, mark: int) -> None:
        model = observation = 0
        for seg in traj.segments[mark:]:
            if seg.role == "assistant":
                model += seg.end - seg.start
            else:
                observation += seg.end - seg.start
        attrs = self._attrs
        attrs[FSM_DEST] = edge.dest
        attrs[FSM_GUARD] = edge.label
        attrs[FSM_EDGE] = edge.index
        attrs[FSM_TURN] = traj.assistant_turns
        attrs[FSM_TOKENS_MODEL] = model
        attrs[FSM_TOKENS_OBSERVATION] = observation
        if edge.reason is not None:
            attrs[FSM_REASON] = edge.reason
        if edge.dest in self.root.finals:
            attrs[FSM_TERMINATION_REASON] = traj.termination_reason or ""
        self._name = f"{edge.source} -> {edge.dest}"
        otel_context.detach(self.token)
        self.end()

    def fail(self, traj: Any, exc: BaseException) -> None:
        self._name = f"{traj.state} -> error"
        self._error(type(exc).__qualname__, f"{type(exc).__name__}: {exc}")
        self.record_exception(exc, escaped=True)
        otel_context.detach(self.token)
        self.end()


class _CallSpan(_Span):
    """A model or tool call: current during the call; an exception sets status ERROR and error.type."""

    __slots__ = ("token", "capture")

    def __enter__(self) -> _CallSpan:
        self.token = otel_context.attach(otel_trace.set_span_in_context(self))
        return self

    def __exit__(self, exc_type: Any, exc: BaseException | None, tb: Any) -> None:
        if exc is not None:
            self._error(exc_type.__qualname__, f"{exc_type.__name__}: {exc}")
            self.record_exception(exc, escaped=True)
        otel_context.detach(self.token)
        self.end()


class _ModelSpan(_CallSpan):
    __slots__ = ()

    def record(self, result: Any) -> None:
        attrs = self._attrs
        attrs[GEN_AI_RESPONSE_FINISH_REASONS] = _finish_reasons(result.finish_reason)
        attrs[GEN_AI_USAGE_OUTPUT_TOKENS] = len(result.token_ids)
        if result.prompt_tokens is not None:
            attrs[GEN_AI_USAGE_INPUT_TOKENS] = result.prompt_tokens
        if result.cached_tokens is not None:
            attrs[GEN_AI_USAGE_CACHE_READ_INPUT_TOKENS] = result.cached_tokens
        if result.server is not None:
            attrs.update(_server(result.server))
        if result.route is not None:
            attrs[ROUTE] = result.route
        if result.weight_version is not None:
            attrs[WEIGHT_VERSION] = str(result.weight_version)
        if result.extra and result.extra.get("id"):
            attrs[GEN_AI_RESPONSE_ID] = str(result.extra["id"])
        if self.capture:
            attrs[OUTPUT_TOKEN_IDS] = tuple(result.token_ids)


class _ToolSpan(_CallSpan):
    __slots__ = ()

    def record(self, outcome: Any) -> None:
        self._attrs[TOOL_ATTEMPTS] = outcome.attempts
        if outcome.error is not None:
            self._error(outcome.error, outcome.text[:200])
        if self.capture:
            self._attrs[GEN_AI_TOOL_CALL_RESULT] = outcome.text


_FINISH_REASONS: dict[str, tuple[str]] = {}


def _finish_reasons(reason: str) -> tuple[str]:
    """One shared tuple per reason, not one per call."""
    value = _FINISH_REASONS.get(reason)
    if value is None:
        value = _FINISH_REASONS.setdefault(str(reason), (str(reason),))
    return value


_SERVERS: dict[str, dict[str, Any]] = {}


def _server(server: str) -> dict[str, Any]:
    """'http://host:port' -> server.address/port (cached: a run talks to a handful of servers)."""
    attrs = _SERVERS.get(server)
    if attrs is None:
        if "://" in server:
            parts = urlsplit(server)
            attrs = {SERVER_ADDRESS: parts.hostname or server}
            port = parts.port or {"http": 80, "https": 443}.get(parts.scheme)
            if port:
                attrs[SERVER_PORT] = port
        else:
            attrs = {SERVER_ADDRESS: server}
        if len(_SERVERS) < 4096:
            _SERVERS[server] = attrs
    return attrs


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


def _conversation(traj: Any) -> dict[str, Any]:
    prompt = traj.row.get("raw_prompt") or []
    n = len(prompt) if isinstance(prompt, list) else 0
    attrs = {
        GEN_AI_INPUT_MESSAGES: _parts(prompt) if n else "[]",
        GEN_AI_OUTPUT_MESSAGES: _parts(traj.messages[n:]),
    }
    if traj.tool_schemas:
        attrs[GEN_AI_TOOL_DEFINITIONS] = json.dumps(traj.tool_schemas, ensure_ascii=False)
    return attrs


# --- the tracer ---------------------------------------------------------------------------------------------


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


class Telemetry:
    """The tracer `Runner(..., tracer=...)` calls. Owns its TracerProvider, processors and export threads.

    telemetry = Telemetry(otlp="http://localhost:4318", sample=0.1)   # or Telemetry.from_env()
    with telemetry:                                                   # close(): flush, stop the threads
        await Runner(agent, backend, tok, tracer=telemetry).run(rows)  # run() flushes at its end
    telemetry.stats()         # {"exported": ..., "dropped": ..., "by_exporter": {...}, ...}

    Configuration follows the standard variables wherever an argument is left at None:
    OTEL_EXPORTER_OTLP_TRACES_ENDPOINT (verbatim) or OTEL_EXPORTER_OTLP_ENDPOINT (+ /v1/traces) turn OTLP on,
    OTEL_EXPORTER_OTLP_[TRACES_]HEADERS/TIMEOUT/COMPRESSION/CERTIFICATE apply to it (gzip unless a
    compression is set), OTEL_SERVICE_NAME names the service, OTEL_BSP_* size the queues,
    OTEL_TRACES_SAMPLER(_ARG) = always_off | traceidratio + fraction set `sample`, and
    OTEL_INSTRUMENTATION_GENAI_CAPTURE_MESSAGE_CONTENT=true sets `capture_content`.
    """

    def __init__(
        self,
        *,
        # an OTLP/HTTP URL (base or .../v1/traces); None: the OTEL_EXPORTER_OTLP_* endpoint if set; False: none
        otlp: str | bool | None = None,
        headers: dict[str, str] | None = None,  # OTLP headers; None: OTEL_EXPORTER_OTLP_[TRACES_]HEADERS
        console: bool = False,  # print finished spans as JSON on stdout
        memory: bool = False,  # keep spans in memory, see `finished_spans()` (tests)
        exporters: Sequence[SpanExporter] = (),  # any other exporters
        sample: float | None = None,  # fraction of trajectories traced, whole; decided from the session id
        sample_groups: bool = False,  # decide from the uid instead: a GRPO group is traced whole or not at all
        capture_content: bool | None = None,  # messages, token ids, tool arguments/results (opt-in)
        service_name: str | None = None,  # None: OTEL_SERVICE_NAME, else "agentfsm"
        max_queue_size: int | None = None,  # spans waiting per exporter; beyond it they are dropped (counted)
        max_export_batch_size: int | None = None,  # spans per export request
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
        self.scope = InstrumentationScope("agentfsm")
        self.memory = InMemorySpanExporter() if memory else None
        self.otlp_endpoint: str | None = None
        named: list[tuple[str, SpanExporter]] = []
        if isinstance(otlp, str) or (otlp is None and otlp_from_env()):
            from opentelemetry.exporter.otlp.proto.http import Compression
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

            compressed = any(os.environ.get(f"OTEL_EXPORTER_OTLP_{k}COMPRESSION") for k in ("TRACES_", ""))
            exporter = OTLPSpanExporter(
                endpoint=_traces_url(otlp) if isinstance(otlp, str) else None,  # None: the exporter reads env
                headers=headers,
                compression=None if compressed else Compression.Gzip,
            )
            self.otlp_endpoint = exporter._endpoint
            named.append(("otlp", exporter))
        if console:
            named.append(("console", ConsoleSpanExporter()))
        if self.memory is not None:
            named.append(("memory", self.memory))
        named.extend((f"{type(e).__name__}{i}", e) for i, e in enumerate(exporters))
        options: dict[str, Any] = {}
        if max_queue_size is not None:
            options["max_queue_size"] = max_queue_size
            options["max_export_batch_size"] = min(max_queue_size, max_export_batch_size or 512)
        elif max_export_batch_size is not None:
            options["max_export_batch_size"] = max_export_batch_size
        if schedule_delay_millis is not None:
            options["schedule_delay_millis"] = schedule_delay_millis
        self.processors = [CountingBatchSpanProcessor(e, name, self.resource, self.scope, **options)
                           for name, e in named]  # fmt: skip
        for p in self.processors:
            self.provider.add_span_processor(p)
        # The driver's spans are `_Span`s handed straight to these processors; `tracer` is the SDK's, for
        # spans of your own (in a custom action...), exported through the same processors.
        self.tracer = self.provider.get_tracer("agentfsm")
        self._ids = self.provider.id_generator
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

    def trajectory(self, traj: Any, run: Any) -> _Root | _SampledOut:
        """Root span of one trajectory; `run` is the RunContext (agent, backend, sampling)."""
        if self.keeps(traj.uid if self.sample_groups else traj.session_id):
            self._traced += 1
            return _Root(self, traj, run)
        self._sampled_out += 1
        return _SampledOut()

    def state(self, traj: Any, source: str) -> _StateSpan | _Noop:
        root = otel_trace.get_current_span()  # between states the trajectory's root is current
        if type(root) is not _Root:
            return _NOOP
        span = _StateSpan()
        span._open(self, source, root, _INTERNAL, {FSM_SOURCE: source})
        span.root = root
        span.token = otel_context.attach(otel_trace.set_span_in_context(span, root.context))
        return span

    def model_call(self, traj: Any, request: Any, backend: Any) -> _ModelSpan | _Noop:
        parent = otel_trace.get_current_span()  # the state span (or a span user code opened in it)
        if not parent.is_recording():
            return _NOOP
        params = request.sampling_params
        attrs: dict[str, Any] = {
            GEN_AI_OPERATION_NAME: "text_completion",
            GEN_AI_PROVIDER_NAME: backend.provider,
            GEN_AI_REQUEST_MODEL: backend.model_name,
            GEN_AI_CONVERSATION_ID: request.session_id,
            GEN_AI_REQUEST_MAX_TOKENS: params.get("max_new_tokens"),
            GEN_AI_REQUEST_TEMPERATURE: params.get("temperature"),
            GEN_AI_REQUEST_TOP_P: params.get("top_p"),
            GEN_AI_REQUEST_TOP_K: params.get("top_k"),
        }
        if None in attrs.values():  # an unset parameter is left out, not exported as null
            attrs = {k: v for k, v in attrs.items() if v is not None}
        if params.get("sampling_seed") is not None:
            attrs[GEN_AI_REQUEST_SEED] = params["sampling_seed"]
        if self.capture_content:
            attrs[INPUT_TOKEN_IDS] = tuple(request.prompt_ids)
        span = _ModelSpan()
        span._open(self, f"text_completion {backend.model_name}", parent, _CLIENT, attrs)
        span.capture = self.capture_content
        return span

    def tool_call(self, traj: Any, call: Any, tool: Any) -> _ToolSpan | _Noop:
        parent = otel_trace.get_current_span()
        if not parent.is_recording():
            return _NOOP
        name = call.name or "unknown"
        attrs: dict[str, Any] = {
            GEN_AI_OPERATION_NAME: "execute_tool",
            GEN_AI_TOOL_NAME: name,
            GEN_AI_TOOL_TYPE: "function",
        }
        if call.id:
            attrs[GEN_AI_TOOL_CALL_ID] = call.id
        if tool is not None and tool.description:
            attrs[GEN_AI_TOOL_DESCRIPTION] = tool.description
        if self.capture_content:
            args = call.raw if call.arguments is None else json.dumps(call.arguments, ensure_ascii=False)
            attrs[GEN_AI_TOOL_CALL_ARGUMENTS] = args
        span = _ToolSpan()
        span._open(self, f"execute_tool {name}", parent, _INTERNAL, attrs)
        span.capture = self.capture_content
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
            # force_flush ignores its timeout (opentelemetry-python#4568): wait for it from the side instead
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
        return self.memory.get_finished_spans()

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


# --- overhead -----------------------------------------------------------------------------------------------


def bench_tracing(n: int = 2000, *, repeats: int = 4, exporter: str = "memory", sample: float = 1.0,
                  collect: bool = True) -> dict[str, Any]:  # fmt: skip
    """Trajectories/s of one scripted workload with tracing off and on, in alternating runs.

    The workload is specs/calculator.yaml on the tiny tokenizer with a replayed two-turn model (a tool
    call, then the answer): prompt, generate, the calculator, generate, the reward: 8 spans a trajectory.
    No model runs, so this is the engine's own cost, the worst case for relative overhead. Tracing on is
    `sample` of the trajectories, the default BatchSpanProcessor, and `exporter`: "memory" (the SDK's
    InMemorySpanExporter, which keeps every span), "null" (drops them) or "otlp" (encodes each batch to
    OTLP protobuf as OTLPSpanExporter does, without sending it).
    Totals over all runs of a mode are compared, so garbage collections (whose cost grows with what stays
    alive across awaits, spans included) land in proportion; `collect=False` disables the collector during
    runs to show the tracer's own CPU cost.
    """
    import asyncio
    import gc
    from pathlib import Path

    from transformers import AutoTokenizer

    from backends.base import BaseBackend, GenerateResult
    from fsm.compile import compile_spec
    from fsm.runtime import Runner
    from specs.calculator import make_prompts

    root = Path(__file__).resolve().parent.parent
    tok = AutoTokenizer.from_pretrained(str(root / "backends/tiny/assets"))
    agent = compile_spec(root / "specs/calculator.yaml")
    call = tok.encode('<tool_call>\n{"name": "calculator", "arguments": {"expression": "1 + 2"}}\n</tool_call>',
                      add_special_tokens=False) + [tok.eos_token_id]  # fmt: skip
    answer = tok.encode("The answer is 3.\n#### 3", add_special_tokens=False) + [tok.eos_token_id]

    class Replay(BaseBackend):
        provider, model_name = "scripted", "replay"

        async def generate(self, request: Any) -> GenerateResult:
            ids = call if request.rid.endswith("_t00") else answer
            n = len(ids)
            return GenerateResult(list(ids), [-0.5] * n, "stop", len(request.prompt_ids), 0, server="replay")

    class Null(SpanExporter):
        def __init__(self, encode: bool):
            self.encode = encode

        def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
            if self.encode:  # what OTLPSpanExporter does before it sends
                from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans

                encode_spans(spans).SerializeToString()
            return SpanExportResult.SUCCESS

        def shutdown(self) -> None:
            return None

    rows = make_prompts(n)
    wall = {"off": 0.0, "on": 0.0}
    cpu = {"off": 0.0, "on": 0.0}  # process CPU seconds (all threads: the export thread included)
    stats: dict[str, Any] = {}
    asyncio.run(Runner(agent, Replay(), tok).run(rows[:50]))  # warm caches
    gc.collect()
    for _ in range(repeats):
        for mode in ("off", "on"):
            tel = None
            if mode == "on":
                tel = Telemetry(otlp=False, sample=sample, memory=exporter == "memory",
                                exporters=[Null(exporter == "otlp")] if exporter != "memory" else ())  # fmt: skip
            runner = Runner(agent, Replay(), tok, tracer=tel)
            if not collect:
                gc.collect()
                gc.disable()
            t0, c0 = time.perf_counter(), time.process_time()
            trajs = asyncio.run(runner.run(rows))
            wall[mode] += time.perf_counter() - t0
            cpu[mode] += time.process_time() - c0
            gc.enable()
            if tel is not None:
                stats = tel.close()
            del trajs, runner, tel
    runs = n * repeats
    return {
        "trajectories": n,
        "repeats": repeats,
        "exporter": exporter,
        "gc": "on" if collect else "off during runs",
        "off_traj_per_s": round(runs / wall["off"], 1),
        "on_traj_per_s": round(runs / wall["on"], 1),
        "overhead": round(wall["on"] / wall["off"] - 1.0, 4),  # extra wall time per trajectory, a fraction
        "off_cpu_us_per_traj": round(cpu["off"] / runs * 1e6, 1),
        "on_cpu_us_per_traj": round(cpu["on"] / runs * 1e6, 1),
        "overhead_cpu": round(cpu["on"] / cpu["off"] - 1.0, 4),
        "sample": sample,
        "spans_per_trajectory": stats["exported"] / n,
        "dropped": stats["dropped"],
    }


if __name__ == "__main__":  # python -m fsm.telemetry [n] [memory|null|otlp] [sample] [nogc]
    import sys

    args = sys.argv[1:]
    result = bench_tracing(
        int(args[0]) if args else 2000,
        exporter=args[1] if len(args) > 1 else "memory",
        sample=float(args[2]) if len(args) > 2 else 1.0,
        collect="nogc" not in args,
    )
    print(json.dumps(result, indent=1))
