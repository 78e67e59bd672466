"""OpenTelemetry for agentfsm: every trajectory is one trace (what a user sees: the README's "Trace it").

The driver's hooks run on every transition and call of every trajectory, so each idea here is kept where
its cost can be seen:

- Tracing off: the driver (fsm/run/runtime.py) calls nothing when no tracer is given (fsm/run/tracer.py says what
  it calls when one is).
- Sampling keeps or drops whole trajectories, decided once in `Telemetry.trajectory()` (tracer.py) from a
  hash of the session id. A sampled-out trajectory gets None and no hook is called for it.
- A traced trajectory's spans are not SDK spans (spans.py): their attributes are values lined up with a
  `_Shape` (shapes.py: one per edge, backend, tool and agent), so nothing builds a dict; a transition span is
  one tuple queued when the edge fires; model and tool calls (calls.py) are small slotted spans, current
  during the call, so spans a backend or a tool starts (through `Telemetry.tracer`) are their children.
- Export (export.py): our exporters get a queue and a thread each with the SDK's BatchSpanProcessor rules (a
  full queue evicts its oldest span, counted, never silent); OTLP/HTTP is encoded here straight from the
  shapes (wire.py, checked against the official protobuf classes in the tests), since the SDK's exporter
  costs more than the engine (docs/benchmarks.md). Any other exporter runs behind the SDK's own
  BatchSpanProcessor (`SdkPipeline`).
- Only the OpenTelemetry API's and SDK's public names; content capture (opt-in) in content.py; attribute
  names in semconv.py. `agentfsm bench tracing` measures what tracing costs.
"""

from fsm.telemetry import export
from fsm.telemetry.config import DEFAULT_MAX_EXPORT_BATCH_SIZE, DEFAULT_MAX_QUEUE_SIZE, otlp_from_env
from fsm.telemetry.export import *  # noqa: F403  (its __all__: the exporters and their pipelines)
from fsm.telemetry.semconv import *  # noqa: F403  (the attribute names are public: fsm.telemetry.GEN_AI_...)
from fsm.telemetry.tracer import Telemetry

__all__ = [
    *export.__all__,
    "DEFAULT_MAX_EXPORT_BATCH_SIZE",
    "DEFAULT_MAX_QUEUE_SIZE",
    "Telemetry",
    "otlp_from_env",
]
