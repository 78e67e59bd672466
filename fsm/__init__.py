"""agentfsm: declarative agent loops for RL rollouts.

agent = fsm.compile_spec("specs/calculator.yaml")       # validate + compile once
runner = fsm.Runner(agent, backend, tokenizer)           # backend: any backends.base.Backend
trajs = await runner.run(rows, n=8)                      # one trajectory per (row, sample)
batch = fsm.collate(trajs, ...)                          # verl's padded batch (TensorDict)

The names below load on first use, so `agentfsm validate` (and `import fsm.spec.loader`) reads a spec without
importing torch, tensordict or a backend (the CLI's validate stays light).
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
    "ToolCall": "fsm.families.parsers",
    "register_parser": "fsm.families.parsers",
    "Trajectory": "fsm.run.trajectory",
    "Family": "fsm.families",
    "register_family": "fsm.families",
    "Group": "fsm.run.stream",
    "StreamEmpty": "fsm.run.stream",
    "SnapshotError": "fsm.run.snapshot",
    "Sample": "fsm.output.sample",
    "SampleBatch": "fsm.output.sample",
    "RunDir": "fsm.output.keep",
    "RunInterrupted": "fsm.output.keep",
    "load_batch": "fsm.output.batchfile",
}
__all__ = [
    "AgentSpec",
    "BaseInteraction",
    "BaseTool",
    "CompiledAgent",
    "DataError",
    "Diagnostic",
    "Edge",
    "Family",
    "Group",
    "RayRunner",
    "RolloutBatch",
    "RolloutEngine",
    "RunContext",
    "RunDir",
    "RunInterrupted",
    "Runner",
    "Sample",
    "SampleBatch",
    "Sampling",
    "SnapshotError",
    "SpecError",
    "StreamEmpty",
    "ToolCall",
    "ToolResponse",
    "Trajectory",
    "action",
    "collate",
    "compile_spec",
    "guard",
    "load_batch",
    "load_rows",
    "load_spec",
    "register_family",
    "register_parser",
    "summarize",
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


if TYPE_CHECKING:  # for type checkers and IDEs: the same names, imported eagerly
    from fsm.adapters.ray_runner import RayRunner
    from fsm.api import RolloutEngine
    from fsm.data.files import DataError, load_rows
    from fsm.families import Family, register_family
    from fsm.families.parsers import ToolCall, register_parser
    from fsm.output.batch import RolloutBatch, collate, summarize
    from fsm.output.batchfile import load_batch
    from fsm.output.sample import Sample, SampleBatch
    from fsm.run.agent import CompiledAgent, Edge
    from fsm.run.compile import compile_spec, validate_file
    from fsm.run.context import RunContext, Sampling
    from fsm.run.interaction import BaseInteraction
    from fsm.run.runtime import Runner
    from fsm.run.snapshot import SnapshotError
    from fsm.run.stream import Group, StreamEmpty
    from fsm.run.trajectory import Trajectory
    from fsm.spec.loader import Diagnostic, SpecError, load_spec
    from fsm.spec.model import AgentSpec
    from fsm.spec.registry import action, guard
    from fsm.tools.base import BaseTool, ToolResponse
