"""Export: where ended spans go, kept off the event loop, where the driver's spans end thousands a second.

Our own exporters (`NativeExporter`: OTLP/HTTP, memory) get a queue that an ended span is only appended to,
and a thread that does the rest (`SpanPipeline`); a dropped span is counted (`SpanCounts`, in the tracer's
`flush()`/`stats()`), never silent. OTLP/HTTP is encoded straight from the queued spans (`OtlpHttpExporter`).
Any other exporter (console, the SDK's, yours) runs behind the SDK's own BatchSpanProcessor (`SdkPipeline`).
"""

from __future__ import annotations

import gzip
import http.client
import logging
import os
import ssl
import threading
import time
import weakref
import zlib
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any
from urllib.parse import urlsplit

from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, SpanProcessor
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter, SpanExportResult
from opentelemetry.sdk.util.instrumentation import InstrumentationScope

from backends.base import RetryPolicy, parse_retry_after
from fsm.telemetry.config import OtlpSettings, QueueSizes, compression_name
from fsm.telemetry.shapes import _SHAPES, _lean_message
from fsm.telemetry.spans import _readable, _Span
from fsm.telemetry.wire import _attributes, _ld, _readable_message, _scope

__all__ = [
    "MemoryExporter",
    "NativeExporter",
    "OtlpHttpExporter",
    "SdkPipeline",
    "SpanCounts",
    "SpanPipeline",
]
log = logging.getLogger("agentfsm.telemetry")  # the package's one logger, whichever module logs

# The OTLP exporter retries as the OpenTelemetry SDK's does: 6 attempts on 429/502/503/504 and connection
# errors, waiting 1, 2, 4, 8, 16 s (±20 %), or what Retry-After says, and never past the request's timeout.
OTLP_RETRY = RetryPolicy(
    attempts=6, backoff_s=1.0, backoff_max_s=float("inf"), statuses=frozenset({429, 502, 503, 504})
)


@dataclass
class SpanCounts:
    """Spans per fate. Exact after a flush; between flushes `dropped_queue_full` may lag by a batch."""

    ended: int = 0  # sampled spans handed to the processors (one per exporter)
    exported: int = 0  # accepted by an exporter
    dropped_queue_full: int = 0  # evicted from a full queue before export
    export_failed: int = 0  # in a batch the exporter reported as failed (collector down, 4xx, too large)
    queued: int = 0  # still waiting for export
    dropped_at_exit: int = 0  # queued or being exported when the tracer closed (its flush timed out)
    trajectories: int = 0  # traced
    trajectories_sampled_out: int = 0

    @property
    def dropped(self) -> int:
        return self.dropped_queue_full + self.export_failed + self.dropped_at_exit

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
    """One native exporter's queue and export thread, with the rules of the SDK's BatchSpanProcessor.

    The driver appends each ended span to a deque(maxlen=max_queue_size) (a bare `deque.append`, no Python
    call): a full one evicts its oldest span and the caller never blocks. The thread wakes every
    `schedule_delay_millis`, or when the tracer sees a batch queued, and exports in batches of
    `max_export_batch_size`. The tracer counts what it queues, so evicted = ended - submitted - queued, exact
    after a flush. SDK spans (of `Telemetry.tracer`) come in through `on_end`.
    """

    def __init__(self, exporter: NativeExporter, name: str, sizes: QueueSizes):
        self.exporter, self.name, self.max_queue_size = exporter, name, sizes.max_queue_size
        self.batch_size, self.delay_s = sizes.max_export_batch_size, sizes.schedule_delay_millis / 1e3
        self.queue: deque[Any] = deque(maxlen=sizes.max_queue_size)
        self.append = self.queue.append  # what ended spans are queued with, from any thread
        self.ended_here = 0  # spans that came in through on_end (the tracer counts its own)
        self.submitted = self.exported = self.failed = 0
        # replaced by the Telemetry that owns this pipeline
        self.ended_total: Callable[[], int] = lambda: self.ended_here
        self._warned_evicted = 0
        self._closed = False
        self._final = False  # shut down: what is not exported by now never will be
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
                    log.warning(
                        "agentfsm telemetry: the %s export queue was full (%d spans): %d spans dropped so "
                        "far, counted in stats()",
                        self.name,
                        self.max_queue_size,
                        evicted,
                    )
                    self._warned_evicted = evicted * 2  # warn again only when it doubles
        self._export()

    def _export(self, everything: bool = True) -> None:
        with self._lock:
            queue = self.queue
            least = 1 if everything else self.batch_size
            # (no instrumentation to suppress: the native exporters send with http.client, which none patches)
            while len(queue) >= least:
                batch = []
                for _ in range(min(len(queue), self.batch_size)):
                    try:
                        batch.append(queue.popleft())
                    except IndexError:  # emptied meanwhile
                        break
                self.submitted += len(batch)
                try:
                    ok = self.exporter.export_spans(batch)
                except Exception:
                    log.exception("agentfsm telemetry: exporter %s raised", self.name)
                    ok = False
                if ok:
                    self.exported += len(batch)
                else:
                    self.failed += len(batch)

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        if not self._closed:
            self._export()
        return True

    def shutdown(self, timeout_s: float = 5.0) -> None:
        """Stop: the exporter first (a send in its retries gives up), then the thread (waited for at most
        `timeout_s`). What is still queued or in flight then counts as dropped at exit."""
        if self._closed:
            return
        self._closed = True
        try:
            self.exporter.shutdown()
        except Exception:
            log.exception("agentfsm telemetry: exporter %s failed to shut down", self.name)
        self._wake.set()
        self._thread.join(timeout_s)
        self._final = True

    def counts(self) -> SpanCounts:
        queued, ended = len(self.queue), self.ended_total()
        evicted = max(0, ended - self.submitted - queued)
        if not self._final:
            return SpanCounts(ended, self.exported, evicted, self.failed, queued)
        lost = max(0, ended - self.exported - self.failed - evicted)  # queued, or in a batch being sent
        return SpanCounts(ended, self.exported, evicted, self.failed, 0, lost)


class SdkPipeline(BatchSpanProcessor):
    """An SDK exporter (console, the SDK's own, yours) behind the SDK's BatchSpanProcessor, which also keeps
    the exporter's own HTTP calls out of any instrumentation. The tracer's spans are handed over as the SDK's
    ReadableSpans, made as they end; the exporter is wrapped to count what it accepts, so that `counts()` says
    what happened to the spans as a `SpanPipeline`'s does (what the SDK's queue evicted: exact after a flush)."""

    def __init__(
        self,
        exporter: SpanExporter,
        name: str,
        resource: Resource,
        scope: InstrumentationScope,
        sizes: QueueSizes,
    ):
        self.counted = _Counted(exporter)
        super().__init__(self.counted, **sizes._asdict())
        self.name, self.resource, self.scope, self.max_queue_size = (
            name,
            resource,
            scope,
            sizes.max_queue_size,
        )
        self.ended_here = 0  # spans that came in through on_end (the tracer counts its own)
        # replaced by the Telemetry that owns this pipeline
        self.ended_total: Callable[[], int] = lambda: self.ended_here
        self.evicted = 0  # known after a flush: spans ended before it that the exporter never saw
        self._final = False

    def on_end(self, span: ReadableSpan) -> None:
        if span.context.trace_flags.sampled:
            self.ended_here += 1
            super().on_end(span)

    def append(self, item: Any) -> None:
        """A span the tracer ended (counted there)."""
        super().on_end(_readable(item, self.resource, self.scope))

    def force_flush(self, timeout_millis: int | None = 30000) -> bool:
        ended = self.ended_total()
        done = super().force_flush(timeout_millis)
        if done:  # every span ended before the flush is exported, failed, or was evicted
            self.evicted = max(self.evicted, ended - self.counted.exported - self.counted.failed)
        return done

    def shutdown(self) -> None:
        """The exporter first (a send in its retries gives up), then the SDK's processor and its thread."""
        self.counted.shutdown()
        super().shutdown()
        self._final = True

    def counts(self) -> SpanCounts:
        c, ended = self.counted, self.ended_total()
        left = max(0, ended - c.exported - c.failed - self.evicted)
        if not self._final:
            return SpanCounts(ended, c.exported, self.evicted, c.failed, left)
        return SpanCounts(ended, c.exported, self.evicted, c.failed, 0, left)


class _Counted(SpanExporter):
    """An SDK exporter, counting the spans of the batches it accepted and refused."""

    def __init__(self, exporter: SpanExporter):
        self.exporter, self.exported, self.failed = exporter, 0, 0
        self._down = False

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        try:
            result = self.exporter.export(spans)
        except Exception:
            log.exception("agentfsm telemetry: exporter %s raised", type(self.exporter).__name__)
            result = SpanExportResult.FAILURE
        if result is SpanExportResult.SUCCESS:
            self.exported += len(spans)
        else:
            self.failed += len(spans)
        return result

    def shutdown(self) -> None:
        if not self._down:
            self._down = True
            self.exporter.shutdown()

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return self.exporter.force_flush(timeout_millis)


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
                _ld(b"\x1a", schema.encode()) if schema else b""
            )
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


class OtlpHttpExporter(NativeExporter):
    """OTLP/HTTP with protobuf bodies encoded here (`_Encoder`: the SDK's bytes at a fraction of its cost),
    sent with http.client over one kept-alive connection.

    Configured as the SDK's OTLPSpanExporter (each argument, else its OTEL_EXPORTER_OTLP_[TRACES_]* variable:
    config.py's OtlpSettings). gzip runs at level 1, not the SDK's 9: the random ids and timestamps that
    dominate a span do not compress further. Retries as the SDK's: up to 6 attempts on 429/502/503/504 and
    connection errors, backing off 2**attempt × U(0.8, 1.2) s or per Retry-After, never past the timeout; a
    broken kept-alive connection is retried at once. A request over `max_request_size` bytes is dropped
    (counted). Unlike the SDK's, a collector that is down costs one line and one timeout (`send`, `down`).
    """

    def __init__(
        self,
        resource: Resource,
        scope: InstrumentationScope,
        endpoint: str | None = None,
        *,
        headers: Mapping[str, str] | None = None,
        timeout_s: float | None = None,
        compression: str | None = None,
        compression_level: int = 1,
        max_request_size: int = 64 * 2**20,
    ):
        env = OtlpSettings.from_env()  # the OTEL_EXPORTER_OTLP_* variables, read as the SDK reads them
        self.endpoint = endpoint = otlp_url(endpoint or env.endpoint)
        url = urlsplit(endpoint)
        self._https = url.scheme == "https"
        self._host, self._port = url.hostname or "", url.port or (443 if self._https else 80)  # otlp_url: one
        self._path = (url.path or "/") + (f"?{url.query}" if url.query else "")
        self.timeout_s = float(timeout_s if timeout_s is not None else env.timeout_s)
        self.compression = compression_name(compression) if compression else env.compression or "none"
        self.compression_level = compression_level
        self.max_request_size = max_request_size
        self.headers = {"content-type": "application/x-protobuf", "user-agent": "agentfsm-otlp"}
        self.headers.update(env.headers)
        self.headers.update({k.lower(): v for k, v in (headers or {}).items()})
        if self.compression != "none":
            self.headers.setdefault("content-encoding", self.compression)
        self._ssl: ssl.SSLContext | None = None
        if self._https:
            self._ssl = ssl.create_default_context(cafile=env.certificate)
            if env.client_certificate:
                self._ssl.load_cert_chain(env.client_certificate, env.client_key)
        self._encoder = _Encoder(resource, scope)
        self._conn: http.client.HTTPConnection | None = None
        self._stop = threading.Event()
        self.down: str | None = None  # why the last export failed (reported once); None once one succeeds

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
            log.error(
                "agentfsm telemetry: dropping %d spans: the request (%d bytes) exceeds max_request_size %d",
                len(items),
                len(body),
                self.max_request_size,
            )
            return False
        return self.send(self.compress(body))

    def send(self, data: bytes) -> bool:
        """POST one request body, retrying as the SDK does (OTLP_RETRY). True if the collector accepted it.

        A failed export is one error line, naming the endpoint and why; while the collector keeps failing,
        each batch is tried once more, silently (still counted as failed), until one is accepted."""
        deadline = time.monotonic() + self.timeout_s
        attempts = 1 if self.down else OTLP_RETRY.attempts
        for attempt in range(1, attempts + 1):
            status, retry_after, error = self._submit(data, deadline)
            if status is not None and 200 <= status < 400:
                if self.down:
                    log.info("agentfsm telemetry: OTLP export to %s works again", self.endpoint)
                    self.down = None
                return True
            # A Retry-After is followed as the SDK follows it: exactly, not as a lower bound.
            backoff = retry_after if retry_after is not None else OTLP_RETRY.delay(attempt)
            retryable = OTLP_RETRY.retryable_status(status) if status is not None else error is not None
            if (
                not retryable
                or attempt == attempts
                or backoff > deadline - time.monotonic()
                or self._stop.is_set()
                or self._stop.wait(backoff)
            ):
                self._failed(f"HTTP {status}" if status is not None else str(error or "timed out"), attempt)
                return False
        return False

    def _failed(self, why: str, attempts: int) -> None:
        if self.down is None:
            tries = f" after {attempts} attempts in {self.timeout_s:g} s" if attempts > 1 else ""
            log.error(
                "agentfsm telemetry: OTLP export to %s failed%s (%s): its spans are counted as dropped, and "
                "so are those of later failed exports, without another line until one succeeds",
                self.endpoint,
                tries,
                why,
            )
        self.down = why

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
                        http.client.HTTPSConnection(
                            self._host, self._port, timeout=remaining, context=self._ssl
                        )
                        if self._https
                        else http.client.HTTPConnection(self._host, self._port, timeout=remaining)
                    )
                conn.timeout = remaining
                if conn.sock is not None:
                    conn.sock.settimeout(remaining)
                conn.request("POST", self._path, data, self.headers)
                response = conn.getresponse()
                response.read()
                if response.will_close:
                    self._close()
                return response.status, parse_retry_after(response.getheader("retry-after")), None
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


def otlp_url(url: str) -> str:
    """An OTLP/HTTP endpoint as given, with http:// when it names no scheme (`localhost:4318`, as the SDK reads
    OTEL_EXPORTER_OTLP_ENDPOINT); ValueError, in one line, for one that is no http(s)://host[:port] URL."""
    text = url.strip()
    text = text if "://" in text else f"http://{text}"
    parts = urlsplit(text)
    try:
        parts.port  # noqa: B018 - a port that is no number raises here
    except ValueError:
        parts = parts._replace(netloc="")
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"OTLP endpoint {url!r}: expected http(s)://host[:port], e.g. http://localhost:4318")
    return text


def _traces_url(url: str) -> str:
    """--otlp accepts a base URL (http://host:4318, or localhost:4318) or the full traces URL (.../v1/traces)."""
    url = otlp_url(url).rstrip("/")
    return url if url.endswith("/v1/traces") else f"{url}/v1/traces"
