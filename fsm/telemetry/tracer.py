"""The tracer: `Telemetry`, what the driver is given as `tracer=`, and the owner of everything else here.

It decides which trajectories are traced (a hash of the session id against `sample`, so a re-run of the
same ids traces the same ones), opens their spans (spans.py) with the shapes of the run (shapes.py), and
owns the export pipelines (export.py) and a TracerProvider of its own for spans of your code: the global
provider is never touched. Tracing off costs nothing because there is no tracer at all, not a disabled one.
"""

from __future__ import annotations

import hashlib
import logging
import sys
import threading
from collections.abc import Callable, Sequence
from typing import Any, TextIO

from opentelemetry import context as otel_context
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import ConsoleSpanExporter, SpanExporter
from opentelemetry.sdk.trace.sampling import ALWAYS_ON, TraceIdRatioBased
from opentelemetry.sdk.util.instrumentation import InstrumentationScope
from opentelemetry.trace import INVALID_SPAN

from fsm.telemetry.calls import _ModelSpan, _ToolSpan
from fsm.telemetry.config import (
    CAPTURE_CONTENT,
    OtlpSettings,
    QueueSizes,
    flag,
    otlp_from_env,
    sampler_from_env,
    samples,
    sdk_disabled,
)
from fsm.telemetry.content import _roles
from fsm.telemetry.export import (
    MemoryExporter,
    NativeExporter,
    OtlpHttpExporter,
    SdkPipeline,
    SpanCounts,
    SpanPipeline,
    _traces_url,
)
from fsm.telemetry.shapes import _SAMPLING_ATTRS, _Shapes
from fsm.telemetry.spans import (
    _attach_context,
    _in_context,
    _random_bits,
    _Root,
    _Span,
    _span_of,
    _time_ns,
)

log = logging.getLogger("agentfsm.telemetry")  # the package's one logger, whichever module logs

_new = object.__new__  # call spans are made without __init__: `model_call`/`tool_call` set every slot


def _why_lost(
    before: dict[str, Any], after: dict[str, Any], otlp_endpoint: str | None, reported: set[str]
) -> str:
    """Per exporter, why spans were lost while closing: the export failed (collector down or refusing), the
    queue was full, or they were still queued when the flush's wait ran out. Failures an exporter has
    already reported (`reported`: our OTLP exporter's one line) are not said again."""
    parts = []
    for name, c in after["by_exporter"].items():
        b = before["by_exporter"].get(name, {})
        failed = 0 if name in reported else c["export_failed"] - b.get("export_failed", 0)
        full = c["dropped_queue_full"] - b.get("dropped_queue_full", 0)
        reasons = [
            f"{failed} failed to export (is the collector up?)" if failed else "",
            f"{full} found the queue full" if full else "",
            f"{c['dropped_at_exit']} still queued when the flush's wait ran out"
            if c["dropped_at_exit"]
            else "",
        ]
        if any(reasons):
            where = otlp_endpoint if name == "otlp" and otlp_endpoint else name
            parts.append(f"{name} to {where}: " + ", ".join(r for r in reasons if r))
    return "; ".join(parts)


class Telemetry:
    """The tracer `Runner(..., tracer=...)` calls. Owns its queues, export threads and TracerProvider.

    telemetry = Telemetry(otlp="http://localhost:4318", sample=0.1)   # or Telemetry.from_env()
    with telemetry:                                                   # close(): flush, stop the threads
        await Runner(agent, backend, tok, tracer=telemetry).run(rows)  # run() flushes at its end
    telemetry.stats()         # {"exported": ..., "dropped": ..., "by_exporter": {...}, ...}

    An argument left at None is read from its standard variable, as the SDK reads it (config.py):
    OTEL_EXPORTER_OTLP_TRACES_ENDPOINT (verbatim) or OTEL_EXPORTER_OTLP_ENDPOINT (+ /v1/traces) turn OTLP on;
    OTEL_EXPORTER_OTLP_[TRACES_]HEADERS/TIMEOUT/COMPRESSION (gzip if unset)/CERTIFICATE, OTEL_SERVICE_NAME,
    OTEL_BSP_* (larger defaults here: config.DEFAULT_MAX_QUEUE_SIZE), OTEL_TRACES_SAMPLER(_ARG) when `sample`
    is not given, OTEL_INSTRUMENTATION_GENAI_CAPTURE_MESSAGE_CONTENT=true for `capture_content`.
    The hooks the driver calls are fsm/run/tracer.py's `Tracer`.
    """

    def __init__(
        self,
        *,
        # an OTLP/HTTP URL (base or .../v1/traces); None: the OTEL_EXPORTER_OTLP_* endpoint if set; False: none
        otlp: str | bool | None = None,
        headers: dict[str, str] | None = None,  # OTLP headers; None: OTEL_EXPORTER_OTLP_[TRACES_]HEADERS
        console: bool | TextIO = False,  # print finished spans as JSON on stderr (True) or this stream
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
        if sample is not None and not 0.0 <= sample <= 1.0:
            raise ValueError(f"sample must be a fraction in [0, 1], got {sample}")
        # the SDK's sampler decides, from a trace id made of the session id (`keeps`): `sample`'s ratio, else
        # the one OTEL_TRACES_SAMPLER(_ARG) configure; one that keeps the highest id keeps all (a ratio of 1)
        self.sampler = sampler_from_env() if sample is None else TraceIdRatioBased(float(sample))
        self._all, self._none = samples(self.sampler, 2**64 - 1), not samples(self.sampler, 0)
        self.sample_groups = sample_groups
        if capture_content is None:
            capture_content = flag(CAPTURE_CONTENT)
        self.capture_content = capture_content
        self.flush_timeout_s = flush_timeout_s
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
        named = self._named_exporters(otlp, headers, console, exporters)
        sizes = QueueSizes.from_env(max_queue_size, max_export_batch_size, schedule_delay_millis)
        self.processors: list[SpanPipeline | SdkPipeline] = [
            SpanPipeline(e, name, sizes)
            if isinstance(e, NativeExporter)
            else SdkPipeline(e, name, self.resource, self.scope, sizes)
            for name, e in named
        ]
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

        def ended_total(p: SpanPipeline | SdkPipeline) -> Callable[[], int]:
            return lambda: self._ended + p.ended_here

        for p in self.processors:
            p.ended_total = ended_total(p)
        # the driver wakes the native export threads when a batch is queued (they also wake every schedule
        # delay; the SDK's processor wakes its own)
        self._native = [p for p in self.processors if isinstance(p, SpanPipeline)]
        self._queue: Sequence[Any] = self._native[0].queue if self._native else ()
        self._batch = min((p.batch_size for p in self._native), default=1)
        self._live: dict[int, _Root] = {}  # trace id -> root, for the traced trajectories running now
        self._shapes: dict[tuple, _Shapes] = {}
        self._last: tuple[Any, _Shapes] | None = None  # (run context, its shapes)
        self._traced = self._sampled_out = 0
        self._warned_dropped = 0
        self._closed = False

    def _named_exporters(
        self,
        otlp: str | bool | None,
        headers: dict[str, str] | None,
        console: bool | TextIO,
        exporters: Sequence[SpanExporter | NativeExporter],
    ) -> list[tuple[str, SpanExporter | NativeExporter]]:
        """The exporters `__init__`'s arguments and the OTEL_* variables ask for, each with its name."""
        self.otlp_endpoint: str | None = None
        named: list[tuple[str, SpanExporter | NativeExporter]] = []
        if isinstance(otlp, str) or (otlp is None and otlp_from_env()):
            compressed = OtlpSettings.from_env().compression is not None
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
            # stderr: a program's stdout is its output (agentfsm's run table), never mixed with span dumps
            named.append(("console", ConsoleSpanExporter(out=sys.stderr if console is True else console)))
        if self.memory is not None:
            named.append(("memory", self.memory))
        named.extend((f"{type(e).__name__}{i}", e) for i, e in enumerate(exporters))
        return named

    @classmethod
    def from_env(cls, **options: Any) -> Telemetry | None:
        """A Telemetry when `otlp=`/`console=`/`memory=`/`exporters=` or the OTEL_* variables ask for one;
        None otherwise (tracing off costs nothing) and when OTEL_SDK_DISABLED=true."""
        if sdk_disabled():
            return None
        wanted = any(options.get(k) for k in ("otlp", "console", "memory", "exporters"))
        if not wanted and not (options.get("otlp") is None and otlp_from_env()):
            return None
        return cls(**options)

    def _wake_exporters(self) -> None:
        for p in self._native:
            p.wake()

    # --- sampling -------------------------------------------------------------------------------------------

    def keeps(self, key: str) -> bool:
        """Whether the trajectory with this session id (or uid, with `sample_groups`) is traced: a hash of
        the key against the fraction, so every process and every re-run gives the same answer."""
        if self._all or self._none:
            return self._all
        digest = hashlib.blake2b(key.encode(), digest_size=8).digest()
        return samples(self.sampler, int.from_bytes(digest, "big"))

    # --- the hooks fsm/run/runtime.py calls --------------------------------------------------------------------

    def trajectory(self, traj: Any, run: Any) -> _Root | None:
        """The started root span of one trajectory, current in the calling task until its `finish()`; None
        when the trajectory is sampled out (then nothing of it is traced). `run` is the RunContext."""
        if not self._all and not self.keeps(traj.uid if self.sample_groups else traj.session_id):
            self._sampled_out += 1
            return None
        self._traced += 1
        last = self._last
        if last is not None and last[0] is run:
            shapes = last[1]
        else:
            sampling = run.sampling.params
            codec = getattr(run, "codec", None)
            key = (
                id(run.agent),
                id(run.backend),
                id(codec),
                *(sampling.get(name) for _, name in _SAMPLING_ATTRS),
            )
            cached = self._shapes.get(key)
            if cached is None:
                cached = self._shapes[key] = _Shapes(run.agent, run.backend, sampling, codec)
            shapes = cached
            self._last = (run, shapes)
        return _Root(self, traj, shapes)

    def _joined(self, current: Any) -> tuple[_Root | None, int]:
        """(root, parent span id) when the current span is in a trajectory this tracer traces."""
        if isinstance(current, _Root):  # a tree's nodes share its trace: each node's own root
            return current, current._span_id
        if isinstance(current, _Span):
            return self._live.get(current._trace_id), current._span_id
        if not current.is_recording():  # INVALID_SPAN, or a span another tracer sampled out
            return None, 0
        ctx = current.get_span_context()
        return self._live.get(ctx.trace_id), ctx.span_id

    def _call_parent(self) -> tuple[Any, Any, int] | None:
        """(context, root, parent span id) for a model or tool call span; None when not traced. In a
        built-in action the root is current and the state's span is the parent."""
        context = otel_context.get_current()
        current = _span_of(context)
        if type(current) is _Root and current.tel is self:
            return context, current, current.state_id
        if current is INVALID_SPAN:
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
        if run_model:
            span.shape = run_model
        else:
            span.shape = shape = shapes.model(backend)
            if shape.unresolved:  # named when it ends, as the backend then knows its model (UNKNOWN_MODEL)
                span._late = (shapes, backend)
        span._trace_id, span._span_id, span._parent_id = root._trace_id, _random_bits(64) or 1, parent
        span._extra = span._end = None
        span._start = _time_ns()
        span._token = _attach_context(_in_context(span, context))
        if self.capture_content:  # what decodes the call's content when it ends
            span._content = (shapes.tokenizer, _roles(root))
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
        span._token = _attach_context(_in_context(span, context))
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
            if worker.is_alive() and not self._reported():  # (a collector already said to be down: no news)
                log.warning(
                    "agentfsm telemetry: still exporting after %.0f s (%s); spans not sent by exit are "
                    "counted as dropped",
                    timeout_s,
                    ", ".join(
                        (self.otlp_endpoint or p.name) if p.name == "otlp" else p.name
                        for p in self.processors
                    ),
                )
        stats = self.stats()
        full = stats["dropped_queue_full"]
        if full > self._warned_dropped:  # failed exports are their exporter's to report (ours: one line)
            log.warning(
                "agentfsm telemetry: %d of %d spans dropped because an export queue was full (%s): raise "
                "max_queue_size (OTEL_BSP_MAX_QUEUE_SIZE, now %s) or trace fewer trajectories (sample)",
                full,
                stats["ended"],
                ", ".join(
                    f"{n}: {c['dropped_queue_full']}"
                    for n, c in stats["by_exporter"].items()
                    if c["dropped_queue_full"]
                ),
                ", ".join(str(p.max_queue_size) for p in self.processors),
            )
            self._warned_dropped = full
        return stats

    def finished_spans(self) -> tuple[ReadableSpan, ...]:
        """Spans the in-memory exporter received (flush first). Requires `memory=True`."""
        if self.memory is None:
            raise RuntimeError("finished_spans() needs Telemetry(memory=True)")
        return self.memory.finished_spans()

    def close(self, timeout_s: float | None = None) -> dict[str, Any]:
        """Flush (waiting at most `timeout_s`, default `flush_timeout_s`), stop the exporters and their
        threads, and return the final stats, in which every span ended is exported or dropped (those still
        queued or being sent count as `dropped_at_exit`), with a warning naming where they were going.
        Idempotent."""
        if self._closed:
            return self.stats()
        before = self.flush(timeout_s)
        self._closed = True
        for p in self.processors:  # bounded: each exporter is stopped before its thread is waited for
            p.shutdown()
        self.provider.shutdown()  # the SDK's bookkeeping (our processors are already down)
        stats = self.stats()
        lost = stats["dropped"] - before["dropped"]
        why = _why_lost(before, stats, self.otlp_endpoint, self._reported()) if lost > 0 else ""
        if why:
            log.warning(
                "agentfsm telemetry: %d of %d spans were not exported before exit (%s); counted as dropped",
                lost,
                stats["ended"],
                why,
            )
        return stats

    def _reported(self) -> set[str]:
        """Exporters that have said themselves why their exports fail (ours: one line per outage)."""
        return {p.name for p in self.processors if getattr(getattr(p, "exporter", None), "down", None)}

    def __enter__(self) -> Telemetry:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
