"""The standard OTEL_* variables, read as the OpenTelemetry SDK reads them (its names, sampler, header parser,
OTLP/HTTP defaults and precedence: the traces variable over the general one; a boolean is true only when it
says "true"), so that our own OTLP exporter (export.py) sends what they configure."""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from typing import NamedTuple

from opentelemetry.environment_variables import OTEL_TRACES_EXPORTER
from opentelemetry.exporter.otlp.proto.http import Compression
from opentelemetry.exporter.otlp.proto.http.trace_exporter import (
    DEFAULT_ENDPOINT,
    DEFAULT_TIMEOUT,
    DEFAULT_TRACES_EXPORT_PATH,
)
from opentelemetry.sdk import environment_variables as sdk
from opentelemetry.sdk.trace import TracerProvider, sampling
from opentelemetry.util.re import parse_env_headers

log = logging.getLogger("agentfsm.telemetry")
# the GenAI instrumentations' opt-in to message content (not an SDK variable)
CAPTURE_CONTENT = "OTEL_INSTRUMENTATION_GENAI_CAPTURE_MESSAGE_CONTENT"


def flag(name: str) -> bool:
    """A boolean variable as the SDK reads one (OTEL_SDK_DISABLED): true only when it says "true"."""
    return os.environ.get(name, "").strip().lower() == "true"


def _otlp(traces: str, general: str) -> str | None:
    """An OTLP exporter setting as the SDK's exporter resolves it: the traces variable, else the general one."""
    return os.environ.get(traces) or os.environ.get(general) or None


def sdk_disabled() -> bool:
    return flag(sdk.OTEL_SDK_DISABLED)


def otlp_from_env() -> bool:
    """Whether the standard variables ask for OTLP export (an endpoint set, OTEL_TRACES_EXPORTER not none)."""
    if sdk_disabled() or os.environ.get(OTEL_TRACES_EXPORTER, "").strip().lower() == "none":
        return False
    return _otlp(sdk.OTEL_EXPORTER_OTLP_TRACES_ENDPOINT, sdk.OTEL_EXPORTER_OTLP_ENDPOINT) is not None


def sampler_from_env() -> sampling.Sampler:
    """The sampler the SDK builds from OTEL_TRACES_SAMPLER(_ARG) for a TracerProvider given none (its warnings
    included). A trajectory's root has no parent, so a parentbased_* one decides as its root sampler."""
    return TracerProvider(shutdown_on_exit=False).sampler


def samples(sampler: sampling.Sampler, trace_id: int) -> bool:
    """Whether `sampler` keeps a root span with this trace id."""
    return sampler.should_sample(None, trace_id, "invoke_agent").decision.is_sampled()


def env_int(name: str, default: int) -> int:
    """An integer variable (OTEL_BSP_*) as the SDK's BatchSpanProcessor reads one: unset or unreadable is the
    default."""
    try:
        return int(os.environ.get(name) or default)
    except ValueError:
        log.warning("agentfsm telemetry: %s=%r is not an integer, using %d", name, os.environ[name], default)
        return default


# The SDK's defaults (2048 queued, 512 per request) lose spans when thousands of trajectories move in
# lockstep on a CPU-bound run: the export thread waits for the GIL at every wake-up and every socket call,
# so it keeps up only with bigger requests, and a deeper queue absorbs the bursts.
DEFAULT_MAX_QUEUE_SIZE = 16384
DEFAULT_MAX_EXPORT_BATCH_SIZE = 2048


class QueueSizes(NamedTuple):
    """An export pipeline's sizes, as the SDK's BatchSpanProcessor takes them."""

    max_queue_size: int = DEFAULT_MAX_QUEUE_SIZE  # spans waiting; a full queue drops its oldest, counted
    max_export_batch_size: int = DEFAULT_MAX_EXPORT_BATCH_SIZE  # spans per export request (<= the queue)
    schedule_delay_millis: float = 5000  # the export thread wakes at least this often

    @classmethod
    def from_env(cls, queue: int | None, batch: int | None, delay: float | None) -> QueueSizes:
        """The arguments, else OTEL_BSP_MAX_QUEUE_SIZE, _MAX_EXPORT_BATCH_SIZE and _SCHEDULE_DELAY, else ours."""
        queue = queue or env_int(sdk.OTEL_BSP_MAX_QUEUE_SIZE, DEFAULT_MAX_QUEUE_SIZE)
        batch = batch or env_int(sdk.OTEL_BSP_MAX_EXPORT_BATCH_SIZE, DEFAULT_MAX_EXPORT_BATCH_SIZE)
        return cls(queue, max(1, min(batch, queue)), delay or env_int(sdk.OTEL_BSP_SCHEDULE_DELAY, 5000))


@dataclass
class OtlpSettings:
    """What the OTEL_EXPORTER_OTLP_[TRACES_]* variables configure (the traces one, else the general one, whose
    endpoint gets /v1/traces), with the SDK exporter's defaults (http://localhost:4318/v1/traces, 10 s)."""

    endpoint: str = ""
    headers: dict[str, str] = field(default_factory=dict)
    timeout_s: float = float(DEFAULT_TIMEOUT)
    compression: str | None = None  # "none", "gzip" or "deflate"; None: not set
    certificate: str | None = None
    client_certificate: str | None = None
    client_key: str | None = None

    @classmethod
    def from_env(cls) -> OtlpSettings:
        base = os.environ.get(sdk.OTEL_EXPORTER_OTLP_ENDPOINT) or DEFAULT_ENDPOINT
        endpoint = os.environ.get(sdk.OTEL_EXPORTER_OTLP_TRACES_ENDPOINT) or (
            f"{base.removesuffix('/')}/{DEFAULT_TRACES_EXPORT_PATH}"
        )
        raw = _otlp(sdk.OTEL_EXPORTER_OTLP_TRACES_HEADERS, sdk.OTEL_EXPORTER_OTLP_HEADERS)
        out = cls(endpoint, dict(parse_env_headers(raw or "", liberal=True)))
        timeout = _otlp(sdk.OTEL_EXPORTER_OTLP_TRACES_TIMEOUT, sdk.OTEL_EXPORTER_OTLP_TIMEOUT)
        try:
            out.timeout_s = float(timeout or DEFAULT_TIMEOUT)
        except ValueError:
            log.warning("agentfsm telemetry: invalid OTLP timeout %r, using %s s", timeout, DEFAULT_TIMEOUT)
        compression = _otlp(sdk.OTEL_EXPORTER_OTLP_TRACES_COMPRESSION, sdk.OTEL_EXPORTER_OTLP_COMPRESSION)
        if compression is not None:
            out.compression = compression_name(compression)
        out.certificate = _otlp(sdk.OTEL_EXPORTER_OTLP_TRACES_CERTIFICATE, sdk.OTEL_EXPORTER_OTLP_CERTIFICATE)
        out.client_certificate = _otlp(
            sdk.OTEL_EXPORTER_OTLP_TRACES_CLIENT_CERTIFICATE, sdk.OTEL_EXPORTER_OTLP_CLIENT_CERTIFICATE
        )
        out.client_key = _otlp(sdk.OTEL_EXPORTER_OTLP_TRACES_CLIENT_KEY, sdk.OTEL_EXPORTER_OTLP_CLIENT_KEY)
        return out


def compression_name(text: str) -> str:
    """A compression by the SDK's names (its `Compression`); an unknown one sends uncompressed, with a line."""
    try:
        return Compression(text.strip().lower()).value
    except ValueError:
        log.warning("agentfsm telemetry: unknown OTLP compression %r, sending uncompressed", text)
        return Compression.NoCompression.value
