"""agentfsm: declarative agent loops for RL rollouts.

agent = fsm.compile_spec("specs/calculator.yaml")       # validate + compile once
runner = fsm.Runner(agent, backend, tokenizer)           # backend: any backends.base.Backend
trajs = await runner.run(rows, n=8)                      # one trajectory per (row, sample)
batch = fsm.collate(trajs, ...)                          # verl's padded batch (TensorDict)

The names below load on first use, so `agentfsm validate` (and `import fsm.loader`) reads a spec without
importing torch, tensordict or a backend (the CLI's validate stays light).
"""

from __future__ import annotations

import importlib
import importlib.util
from typing import TYPE_CHECKING, Any

_EXPORTS = {
    "RolloutEngine": "fsm.api",
    "RolloutBatch": "fsm.batch", "collate": "fsm.batch", "summarize": "fsm.batch",
    "CompiledAgent": "fsm.agent", "Edge": "fsm.agent", "compile_spec": "fsm.compile",
    "validate_file": "fsm.compile",
    "DataError": "fsm.data", "load_rows": "fsm.data",
    "BaseInteraction": "fsm.interaction",
    "Diagnostic": "fsm.loader", "SpecError": "fsm.loader", "load_spec": "fsm.loader",
    "RayRunner": "fsm.ray_runner",
    "action": "fsm.registry", "guard": "fsm.registry",
    "RunContext": "fsm.context", "Sampling": "fsm.context", "Runner": "fsm.runtime",
    "AgentSpec": "fsm.spec",
    "BaseTool": "fsm.tools", "ToolResponse": "fsm.tools",
    "ToolCall": "fsm.families.parsers", "register_parser": "fsm.families.parsers", "Trajectory": "fsm.trajectory",
    "Family": "fsm.families", "register_family": "fsm.families",
    "Group": "fsm.stream", "StreamEmpty": "fsm.stream", "SnapshotError": "fsm.snapshot",
    "Sample": "fsm.adapters.sample", "SampleBatch": "fsm.adapters.sample",
}  # fmt: skip
__all__ = [
    "AgentSpec", "BaseInteraction", "BaseTool", "CompiledAgent", "DataError", "Diagnostic", "Edge", "Family", "Group",
    "RayRunner", "RolloutBatch", "RolloutEngine", "RunContext", "Runner", "Sample", "SampleBatch", "Sampling",
    "SnapshotError", "SpecError",
    "StreamEmpty", "ToolCall",
    "ToolResponse", "Trajectory", "action", "collate", "compile_spec", "guard", "load_rows", "load_spec",
    "register_family", "register_parser", "summarize", "validate_file",
]  # fmt: skip


def __getattr__(name: str) -> Any:
    """`fsm.Runner` imports fsm.runtime on first use; `fsm.telemetry` imports the submodule."""
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
    from fsm.adapters.sample import Sample, SampleBatch
    from fsm.agent import CompiledAgent, Edge
    from fsm.api import RolloutEngine
    from fsm.batch import RolloutBatch, collate, summarize
    from fsm.compile import compile_spec, validate_file
    from fsm.context import RunContext, Sampling
    from fsm.data import DataError, load_rows
    from fsm.families import Family, register_family
    from fsm.families.parsers import ToolCall, register_parser
    from fsm.interaction import BaseInteraction
    from fsm.loader import Diagnostic, SpecError, load_spec
    from fsm.ray_runner import RayRunner
    from fsm.registry import action, guard
    from fsm.runtime import Runner
    from fsm.snapshot import SnapshotError
    from fsm.spec import AgentSpec
    from fsm.stream import Group, StreamEmpty
    from fsm.tools import BaseTool, ToolResponse
    from fsm.trajectory import Trajectory
