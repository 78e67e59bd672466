"""OpenTelemetry for agentfsm: every trajectory is one trace.

    invoke_agent calculator                  root, INTERNAL: its own trace, current while the trajectory runs
      PENDING -> GENERATING                  one span per transition, covering the source state's work
      GENERATING -> PROCESSING_TOOLS
        text_completion agentfsm-tiny-calculator   a model call, CLIENT (GenAI inference span), current during it
      PROCESSING_TOOLS -> GENERATING
        execute_tool calculator              a tool call, INTERNAL (GenAI tool span), current during the call
      GENERATING -> TERMINATED
        text_completion agentfsm-tiny-calculator

Model spans are named by the backend's served model name (an SGLang server's `served_model_name` from
/model_info, read with the first call: spans started before are named when they end). Every span also has
OpenInference's `openinference.span.kind` (AGENT, CHAIN for transitions, LLM, TOOL), what Arize Phoenix and
similar UIs classify by. With content capture on, model spans carry their token ids and, decoded with the
run's tokenizer when the call ends, `gen_ai.input.messages` / `gen_ai.output.messages` (GenAI JSON: one
message per prompt message and per segment of the trajectory, special tokens kept); nothing is decoded
otherwise.

The driver's hooks run on every transition and call of every trajectory, so each idea here is kept where
its cost can be seen:

- Tracing off: the driver (fsm/run/runtime.py) calls nothing when no tracer is given (fsm/run/tracer.py says what
  it calls when one is).
- Sampling keeps or drops whole trajectories, decided once in `Telemetry.trajectory()` (tracer.py) from a
  hash of the session id (a re-run of the same ids keeps the same ones). A sampled-out trajectory gets None
  and no hook is called for it: the driver marks the tasks of traced ones (a ContextVar), which its model
  and tool calls check.
- A traced trajectory's spans are not SDK spans (spans.py). A span's attributes are values lined up with a
  `_Shape` (shapes.py: one per edge, backend, tool and agent: name, kind, the constant attributes), so
  nothing builds a dict. A transition span is one tuple queued when the edge fires; its id and start wait
  on the root meanwhile, and it is made current only when the state runs a user action (a built-in action
  starts no spans but the model and tool calls, which are given their parent). Model and tool calls are
  small slotted spans, current during the call, so spans that a backend or a tool starts (through
  `Telemetry.tracer`) are their children.
- Export (export.py): agentfsm's own exporters (OTLP/HTTP, memory) get a queue and a thread each, with the
  SDK's BatchSpanProcessor rules (OTEL_BSP_*; a full queue evicts its oldest span, counted and reported by
  `flush()`/`stats()`, never silently). OTLP/HTTP is encoded here, straight from the shapes (wire.py, checked
  against the official protobuf classes in the tests), gzipped and POSTed with the SDK's retry rules
  (`OtlpHttpExporter`): the SDK's exporter costs twice the engine's CPU on the calculator workload
  (docs/benchmarks.md). Any other exporter (console, the SDK's, yours) runs behind the SDK's own
  BatchSpanProcessor (`SdkPipeline`), given each span as the SDK's ReadableSpan.
- Only the OpenTelemetry API's and SDK's public names: spans are made current with `attach`/`detach`.
- Content capture (opt-in): the conversation and each model call's token ids decoded as GenAI messages
  (content.py).
- Attribute names: semconv.py.

`agentfsm bench tracing` (bench/tracing.py) measures what tracing costs the engine, off and on, per
exporter and sampling rate.
"""

# The underscored names (`_Encoder as _Encoder`...) are internals tests/test_telemetry.py reaches here.
from fsm.telemetry.config import otlp_from_env
from fsm.telemetry.export import (
    DEFAULT_MAX_EXPORT_BATCH_SIZE,
    DEFAULT_MAX_QUEUE_SIZE,
    MemoryExporter,
    NativeExporter,
    OtlpHttpExporter,
    SdkPipeline,
    SpanCounts,
    SpanPipeline,
)
from fsm.telemetry.export import _Encoder as _Encoder
from fsm.telemetry.semconv import *  # noqa: F403  (the attribute names are public: fsm.telemetry.GEN_AI_...)
from fsm.telemetry.shapes import _CLIENT as _CLIENT
from fsm.telemetry.shapes import _MODEL_SLOTS as _MODEL_SLOTS
from fsm.telemetry.shapes import _server as _server
from fsm.telemetry.shapes import _Shape as _Shape
from fsm.telemetry.spans import _readable as _readable
from fsm.telemetry.spans import _Root as _Root
from fsm.telemetry.spans import _Span as _Span
from fsm.telemetry.tracer import Telemetry

__all__ = [
    "DEFAULT_MAX_EXPORT_BATCH_SIZE",
    "DEFAULT_MAX_QUEUE_SIZE",
    "MemoryExporter",
    "NativeExporter",
    "OtlpHttpExporter",
    "SdkPipeline",
    "SpanCounts",
    "SpanPipeline",
    "Telemetry",
    "otlp_from_env",
]
