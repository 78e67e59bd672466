"""OTLP protobuf encoded by hand: the SDK's encoder builds a message object per span and per attribute.

The wire format (protobuf encoding) of opentelemetry-proto's ExportTraceServiceRequest
  -> ResourceSpans{1 resource, 2 scope_spans, 3 schema_url} -> ScopeSpans{1 scope, 2 spans, 3 schema_url}
  -> Span{1 trace_id, 2 span_id, 3 trace_state, 4 parent_span_id, 5 name, 6 kind, 7/8 start/end (fixed64),
          9 attributes, 10 dropped_attributes_count, 11 events, 12 ..., 13 links, 14 ..., 15 status, 16 flags}
Every field is a tag byte ((number << 3) | wire type) then a varint, a fixed-width value, or a length and
bytes. Fields are written in number order, as the SDK's encoder (upb) does, so a span encodes to the same
bytes either way (tests/test_telemetry.py decodes ours with the official classes and compares). This module
knows OTLP only; how our spans are laid out is shapes.py's.
"""

from __future__ import annotations

import struct
from collections.abc import Mapping, Sequence
from typing import Any

from opentelemetry.sdk.trace import Event, ReadableSpan
from opentelemetry.sdk.util.instrumentation import InstrumentationScope
from opentelemetry.trace import Link, Status, StatusCode

_UNSET = Status(StatusCode.UNSET)

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
    return _ld(
        b"\x7a",
        (_ld(b"\x12", message.encode("utf-8", "replace")) if message else b"")
        + (b"\x18" + _U8[code] if code else b""),
    )


def _events(events: Sequence[Event]) -> bytes:
    out = []
    for e in events:
        dropped = getattr(e, "dropped_attributes", 0)
        out.append(
            _ld(
                b"\x5a",
                b"\x09"
                + _FIXED64(e.timestamp)
                + _ld(b"\x12", e.name.encode("utf-8", "replace"))
                + _attributes(b"\x1a", e.attributes)
                + (b"\x20" + _uvarint(dropped) if dropped else b""),
            )
        )
    return b"".join(out)


def _links(links: Sequence[Link]) -> bytes:
    out = []
    for link in links:
        c, dropped = link.context, getattr(link, "dropped_attributes", 0)
        out.append(
            _ld(
                b"\x6a",
                _IDS_ROOT(0x0A10, c.trace_id >> 64, c.trace_id & _M64, 0x1208, c.span_id)
                + _attributes(b"\x22", link.attributes)
                + (b"\x28" + _uvarint(dropped) if dropped else b"")
                + b"\x35"
                + _FIXED32(0x300 if c.is_remote else 0x100),
            )
        )
    return b"".join(out)


def _scope(scope: InstrumentationScope | None) -> bytes:
    """An InstrumentationScope message."""
    if scope is None:
        return b""
    return (
        (_ld(b"\x0a", scope.name.encode()) if scope.name else b"")
        + (_ld(b"\x12", scope.version.encode()) if scope.version else b"")
        + _attributes(b"\x1a", scope.attributes)
    )


def _span_message(
    name: str,
    kind: int,
    trace_id: int,
    span_id: int,
    parent_id: int,
    start: int,
    end: int,
    attrs: Mapping[str, Any] | None,
    events: Sequence[Event] = (),
    links: Sequence[Link] = (),
    status: Status | None = _UNSET,
    dropped: tuple[int, int, int] = (0, 0, 0),
    trace_state: str = "",
    remote_parent: bool = False,
) -> bytes:
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


def _readable_message(span: ReadableSpan) -> bytes:
    ctx, parent = span.context, span.parent
    state = ctx.trace_state
    return _span_message(
        span.name,
        span.kind.value,
        ctx.trace_id,
        ctx.span_id,
        parent.span_id if parent else 0,
        span.start_time or 0,  # set on every ended span (the SDK types them optional)
        span.end_time or 0,
        span.attributes,
        span.events,
        span.links,
        span.status,
        (span.dropped_attributes, span.dropped_events, span.dropped_links),
        ",".join(f"{k}={v}" for k, v in state.items()) if state else "",
        bool(parent and parent.is_remote),
    )
