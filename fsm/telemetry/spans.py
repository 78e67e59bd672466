"""The spans the driver opens: recording OpenTelemetry spans that are cheap enough for every transition.

An SDK span builds dicts, locks and a ReadableSpan on the event loop. These keep ids, times and their
`_Shape`'s values (shapes.py) and reach the export queue as a tuple, so the export thread does the rest; to
everything else they are real spans (`_Span`). The hot methods (`_Root.transition`, the call spans' `done`)
are written flat, with `_queue` inlined: they run once per transition or call of every trajectory.
"""

from __future__ import annotations

import logging
import random
import time
import traceback
from collections.abc import Sequence
from contextvars import Token
from typing import Any, Protocol

from opentelemetry import context as otel_context
from opentelemetry import trace as otel_trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import Event, ReadableSpan
from opentelemetry.sdk.util.instrumentation import InstrumentationScope
from opentelemetry.trace import Link, SpanContext, SpanKind, Status, StatusCode, TraceFlags

from fsm.telemetry import semconv
from fsm.telemetry.content import _NO_CONTENT, _conversation
from fsm.telemetry.semconv import ERROR_TYPE
from fsm.telemetry.shapes import _SHAPES, _lean_message, _Shape, _Shapes
from fsm.telemetry.wire import _UNSET, _links, _span_message, _status

log = logging.getLogger("agentfsm.telemetry")  # the package's one logger, whichever module logs

_random_bits = random.getrandbits
_time_ns = time.time_ns
_SAMPLED = TraceFlags(TraceFlags.SAMPLED | TraceFlags.RANDOM_TRACE_ID)
_KINDS = {kind.value: kind for kind in SpanKind}
_MAX_ATTRIBUTES = 128  # the SDK's default span limit, for attributes and events set through the API


# --- the current span -----------------------------------------------------------------------------------------
# Through the OTel API only (attach/detach, set_span_in_context, get_current_span): whichever runtime context
# is configured (OTEL_PYTHON_CONTEXT), spans of your code started inside one of ours are its children.

# detach logs a token from another context
_attach_context, _detach = otel_context.attach, otel_context.detach
_in_context, _span_of = otel_trace.set_span_in_context, otel_trace.get_current_span


def _current_span() -> Any:
    """The current span, or None."""
    span = _span_of()
    return None if span is otel_trace.INVALID_SPAN else span


def _attach(span: Any, alone: bool = False) -> Any:
    """Make `span` current (in a copy of the current context, or `alone` in an otherwise empty one)."""
    return _attach_context(_in_context(span, otel_context.Context() if alone else None))


class _Owner(Protocol):
    """What a span needs of the tracer that made it (tracer.py's Telemetry): ended spans go straight onto
    its export queues, counted, without a call into the tracer."""

    capture_content: bool
    _ended: int  # spans ended so far
    _queue: Sequence[Any]  # the first exporter's queue: its length says when a batch is ready
    _batch: int  # a batch queued wakes the export threads
    _live: dict[int, _Root]  # trace id -> root, for the traced trajectories running now

    def _emit(self, item: Any) -> None: ...

    def _wake_exporters(self) -> None: ...


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

    A real span to everything else: current where the driver makes it so (a span user code starts inside,
    through `Telemetry.tracer` or the global provider, is its child), settable through the API (checked as
    the SDK does), and an SDK ReadableSpan to an exporter (`_readable`). Ended, it is queued as it is.
    """

    __slots__ = (
        "tel",
        "shape",
        "values",
        "_trace_id",
        "_span_id",
        "_parent_id",
        "_start",
        "_end",
        "_extra",
        "_token",
    )
    # a call span's `values` hold its request (or tool call) until `done` lines them up with the shape
    values: Any
    _end: int | None
    _token: Token[otel_context.Context]  # what `_detach` restores

    def __init__(
        self,
        tel: _Owner,
        shape: _Shape,
        trace_id: int,
        span_id: int,
        parent_id: int,
        values: tuple = (),
        start: int | None = None,
    ):
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

    def record_exception(
        self,
        exception: BaseException,
        attributes: Any = None,
        timestamp: int | None = None,
        escaped: bool = False,
    ) -> None:
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
            tel._emit((self.shape.id, *self._ids(), *self.values))
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
        x, shape, ids = self._extra, self.shape, self._ids()
        if x is None or (not x.attrs and not x.events and x.name is None):
            rest = () if x is None else (_status(x.status), _links(x.links))
            return _lean_message(shape, *ids, self.values, *rest)
        attributes = shape.attributes(self.values, x.attrs)
        return _span_message(x.name or shape.name, shape.kind, *ids, attributes, x.events, x.links, x.status)

    def _readable(self, resource: Resource, scope: InstrumentationScope) -> ReadableSpan:
        return _make_readable(self.shape, self._ids(), self.values, resource, scope, self._extra)

    def _ids(self) -> tuple[int, int, int, int, int]:
        """trace, span and parent ids, start and end: what every form of an ended span begins with."""
        assert self._end is not None  # queued when it ended
        return self._trace_id, self._span_id, self._parent_id, self._start, self._end


def _make_readable(
    shape: _Shape,
    ids: Sequence[int],
    values: Sequence[Any],
    resource: Resource,
    scope: InstrumentationScope,
    x: _Extra | None = None,
) -> ReadableSpan:
    trace_id, span_id, parent_id, start, end = ids  # as `_Span._ids()` has them
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
        return _make_readable(_SHAPES[item[0]], item[1:6], item[6:], resource, scope)
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


_NOT_ATTRS = ("handled", "at_ns")  # a handled failure's record fields its event carries otherwise


class _Root(_Span):
    """`invoke_agent {agent}`, current in the trajectory's task from `trajectory()` to `finish()`.

    It also holds the open transition span: its id, start, and the token count when it opened. The driver
    calls `transition(edge)` once per edge, which ends that span and opens the next state's (the next
    state's work starts where this one's ends), so a transition costs one call and one queued tuple.
    """

    __slots__ = (
        "traj",
        "shapes",
        "state_id",
        "state_start",
        "state_mark",
        "state_span",
        "prompt_roles",
        "segments_seen",
    )
    state_span: _Span | None

    def __init__(self, tel: _Owner, traj: Any, shapes: _Shapes):
        ambient = _current_span()  # a span the caller has open (a training step...) is linked, not a parent
        self.tel, self.shape, self.values = tel, shapes.root, ()
        self._trace_id, self._span_id, self._parent_id = _random_bits(128) or 1, _random_bits(64) or 1, 0
        self._extra = self._end = None
        if traj.node.kind != "root" and isinstance(ambient, _Span) and ambient._trace_id in tel._live:
            # a child machine or a branch (fsm/run/tree.py): its spans go under the span that started it, in
            # its tree's one trace
            self._trace_id, self._parent_id, ambient = ambient._trace_id, ambient._span_id, None
        if ambient is not None:
            ambient = ambient.get_span_context()
            if ambient.is_valid:
                self._x().links.append(Link(ambient))
        self.traj, self.shapes, self.state_span, self.prompt_roles = traj, shapes, None, None
        tel._live.setdefault(self._trace_id, self)  # a tree's: its root's
        self._token = _attach(self, alone=True)
        self.state_mark = len(traj.runs)  # the span counts the tokens appended after this mark
        self.segments_seen = len(traj.closed)  # segments closed when the state's span began
        self.state_id = _random_bits(64) or 1
        self._start = self.state_start = _time_ns()
        if traj.state in shapes.user_states:
            self._user_state(traj.state)

    def _user_state(self, source: str) -> None:
        """A user action runs in `source`: the state's span is a span object, current, so that spans the
        action starts are its children. (Built-in actions start no spans but model and tool calls, which
        are given their parent.)"""
        span = self.state_span = self._state_span(source)
        span._token = _attach(span)

    def _state_span(self, source: str) -> _Span:
        """The span of the state `source` as an object: a user action's, or a failed state's."""
        shape, ids = self.shapes.state(source), (self._trace_id, self.state_id, self._span_id)
        return _Span(self.tel, shape, *ids, (), self.state_start)

    def transition(self, edge: Any) -> None:
        """`edge` fired: the span `{SOURCE} -> {DEST}` ends, with the tokens the state appended, and the
        span of the state entered starts. (Written flat: it runs once per transition of every trajectory.)"""
        now = _time_ns()
        traj, shapes = self.traj, self.shapes
        if len(traj.closed) == self.segments_seen:  # `closed` is empty unless a rewrite ran: one len()
            model, observation = traj.runs.tokens_since(self.state_mark)
        else:
            model, observation = self._new_segments(now)
        dest = edge.dest
        final = dest in shapes.finals
        reason = (traj.termination_reason or "") if final else None
        if self.state_span is None:
            tel = self.tel
            tel._ended += 1
            tel._emit(
                (
                    shapes.edges[edge.index].id,
                    self._trace_id,
                    self.state_id,
                    self._span_id,
                    self.state_start,
                    now,
                    traj.assistant_turns,
                    model,
                    observation,
                    reason,
                )
            )
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
            self.state_mark = len(traj.runs)
            self.state_id = _random_bits(64) or 1
            self.state_start = now
            if dest in shapes.user_states:
                self._user_state(dest)

    def _new_segments(self, now: int) -> tuple[int, int]:
        """A rewrite in this state started segments: an event on the root span for each, and the tokens the
        state appended across them (the closed ones from the state's mark, then the new ones whole)."""
        traj, first = self.traj, self.segments_seen
        model = observation = 0
        for seg in traj.segments[first:]:
            m, o = seg.runs.tokens_since(self.state_mark if seg.index == first else 0)
            model, observation = model + m, observation + o
            if seg.index > first:
                self.add_event(
                    "fsm.segment",
                    {
                        "fsm.segment.index": seg.index,
                        "fsm.segment.reason": seg.reason,
                        "fsm.segment.prompt_tokens": len(seg.prompt_ids),
                    },
                    now,
                )
        self.segments_seen = len(traj.closed)
        return model, observation

    def state_failed(self, exc: BaseException) -> None:
        """The state's action (or its guards) raised: the span is `{SOURCE} -> error`, status ERROR."""
        span = self.state_span
        if span is None:
            span = self._state_span(self.traj.state)
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
            traj.session_id,
            traj.index,
            traj.uid,
            traj.sample,
            traj.termination_reason or "",
            traj.state,
            len(traj.transitions_fired),
            traj.num_turns,
            len(traj.prompt_ids),
            len(traj.response_ids),
            model_tokens,
            traj.metrics.prompt_tokens_sent,
            model_tokens,
            traj.metrics.cached_tokens,
            None if traj.reward_score is None else float(traj.reward_score),
            error,
            None if traj.failure is None else traj.failure.kind,
            *content,
        )
        if error is not None:
            self._x().status = Status(StatusCode.ERROR, error)
        if traj.failures:  # the state rules' retries and catches, as counts and one event each
            self.set_attribute(semconv.RETRIES, sum(f.handled == "retry" for f in traj.failures))
            self.set_attribute(semconv.CATCHES, sum(f.handled == "catch" for f in traj.failures))
            for f in traj.failures:  # its fields as trajectories.jsonl has them, each as semconv.FAILURE_*
                attrs = {f"agentfsm.failure.{k}": v for k, v in f.record().items() if k not in _NOT_ATTRS}
                self.add_event(f"agentfsm.{f.handled}", attrs, f.at_ns)
        versions = traj.weight_versions()
        if versions is not None:  # which weights made its tokens (several when updated mid-trajectory)
            self.set_attribute(semconv.WEIGHT_VERSION_MIN, versions[0])
            self.set_attribute(semconv.WEIGHT_VERSION_MAX, versions[1])
        if self.state_span is not None:  # a user action's span left open (cancelled): it ends here
            _detach(self.state_span._token)
            self.state_span.end()
            self.state_span = None
        _detach(self._token)
        if tel._live.get(self._trace_id) is self:
            del tel._live[self._trace_id]
        self.shape = self.shapes.named_root()  # the model's name, learnt meanwhile (shapes.UNKNOWN_MODEL)
        self.traj = None  # the root may wait in the export queue; the trajectory need not
        self.end()
