"""OpenTelemetry for agentfsm: every trajectory is one trace (the README's "Trace it").

The driver's hooks run on every transition and call, so each cost is kept where it can be seen: with no
tracer the driver calls nothing (fsm/run/tracer.py); tracer.py samples whole trajectories and owns the rest;
spans.py and shapes.py make spans that are tuples of values, not SDK spans; calls.py spans model and tool
calls; export.py and wire.py export off the event loop and encode OTLP by hand; content.py is the opt-in
content capture; semconv.py names the attributes. Only the OpenTelemetry API's and SDK's public names are
used; `agentfsm bench tracing` measures what tracing costs.
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
