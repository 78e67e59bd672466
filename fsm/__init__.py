"""agentfsm: declarative agent loops for RL rollouts. The front door is `RolloutEngine`:

    engine = fsm.RolloutEngine("specs/calculator.yaml")        # the embedded model; or servers=[...] / backend=
    batch = engine.generate_sequences(rows, n=8)              # verl's padded batch
    batch = engine.generate_sequences(rows, keep=fsm.RunDir("out"))   # SIGTERM keeps the run; --resume goes on

`__all__` is the documented surface: the engine and its contract (`Engine`, `EngineRefused`, `RayRunner`), the
run directory, authoring (specs, guards, actions, tools, interactions, families and parsers) and the errors to
catch. The lower level (`Runner`, `collate`, `CompiledAgent`, `Trajectory`...) stays importable, for adapters
and tests; it is not the way in. Names load on first use, so `agentfsm validate` reads a spec without
importing torch, tensordict or a backend.
"""

from __future__ import annotations

import importlib
import importlib.util
from typing import TYPE_CHECKING, Any

_EXPORTS = {
    "RolloutEngine": "fsm.api",
    "RolloutBatch": "fsm.output.batch",
    "collate": "fsm.output.batch",
    "summarize": "fsm.output.batch",
    "CompiledAgent": "fsm.run.agent",
    "Edge": "fsm.run.agent",
    "compile_spec": "fsm.run.compile",
    "validate_file": "fsm.run.compile",
    "DataError": "fsm.data.files",
    "load_rows": "fsm.data.files",
    "BaseInteraction": "fsm.run.interaction",
    "Diagnostic": "fsm.spec.loader",
    "SpecError": "fsm.spec.loader",
    "load_spec": "fsm.spec.loader",
    "RayRunner": "fsm.adapters.ray_runner",
    "action": "fsm.spec.registry",
    "guard": "fsm.spec.registry",
    "RunContext": "fsm.run.context",
    "Sampling": "fsm.run.context",
    "Runner": "fsm.run.runtime",
    "AgentSpec": "fsm.spec.model",
    "BaseTool": "fsm.tools.base",
    "ToolResponse": "fsm.tools.base",
    "heartbeat": "fsm.tools.base",
    "idempotency_key": "fsm.tools.base",
    "ToolCall": "fsm.families.parsers",
    "register_parser": "fsm.families.parsers",
    "Trajectory": "fsm.run.trajectory",
    "Failure": "fsm.run.failures",
    "Family": "fsm.families",
    "register_family": "fsm.families",
    "Group": "fsm.run.stream",
    "StreamEmpty": "fsm.run.stream",
    "SnapshotError": "fsm.run.codec",
    "Sample": "fsm.output.sample",
    "SampleBatch": "fsm.output.sample",
    "RunDir": "fsm.output.keep",
    "RunInterrupted": "fsm.output.keep",
    "load_batch": "fsm.output.batch",
    "Engine": "fsm.output.engine",
    "EngineRefused": "fsm.run.engine",
}
__all__ = [  # the documented surface (the module docstring); the rest of _EXPORTS is the lower level
    "BaseInteraction",
    "BaseTool",
    "DataError",
    "Diagnostic",
    "Engine",
    "EngineRefused",
    "Group",
    "RayRunner",
    "RolloutEngine",
    "RunDir",
    "RunInterrupted",
    "Sample",
    "SampleBatch",
    "SnapshotError",
    "SpecError",
    "StreamEmpty",
    "ToolCall",
    "ToolResponse",
    "action",
    "compile_spec",
    "guard",
    "heartbeat",
    "idempotency_key",
    "load_batch",
    "load_rows",
    "load_spec",
    "register_family",
    "register_parser",
    "validate_file",
]


def __getattr__(name: str) -> Any:
    """`fsm.Runner` imports fsm.run.runtime on first use; `fsm.telemetry` imports the submodule."""
    if name in _EXPORTS:
        value = getattr(importlib.import_module(_EXPORTS[name]), name)
        globals()[name] = value
        return value
    if not name.startswith("_") and importlib.util.find_spec(f"{__name__}.{name}") is not None:
        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))


if TYPE_CHECKING:  # for type checkers and IDEs: the same names, imported eagerly (`X as X`: the lower level)
    from fsm.adapters.ray_runner import RayRunner
    from fsm.api import RolloutEngine
    from fsm.data.files import DataError, load_rows
    from fsm.families import Family as Family
    from fsm.families import register_family
    from fsm.families.parsers import ToolCall, register_parser
    from fsm.output.batch import RolloutBatch as RolloutBatch
    from fsm.output.batch import collate as collate
    from fsm.output.batch import load_batch
    from fsm.output.batch import summarize as summarize
    from fsm.output.engine import Engine
    from fsm.output.sample import Sample, SampleBatch
    from fsm.run.agent import CompiledAgent as CompiledAgent
    from fsm.run.agent import Edge as Edge
    from fsm.run.codec import SnapshotError
    from fsm.run.compile import compile_spec, validate_file
    from fsm.run.context import RunContext as RunContext
    from fsm.run.context import Sampling as Sampling
    from fsm.run.engine import EngineRefused
    from fsm.run.failures import Failure as Failure
    from fsm.run.interaction import BaseInteraction
    from fsm.run.runtime import Runner as Runner
    from fsm.run.stream import Group, StreamEmpty
    from fsm.run.trajectory import Trajectory as Trajectory
    from fsm.spec.loader import Diagnostic, SpecError, load_spec
    from fsm.spec.model import AgentSpec as AgentSpec
    from fsm.spec.registry import action, guard
    from fsm.tools.base import BaseTool, ToolResponse, heartbeat, idempotency_key
