"""agentfsm: declarative agent loops for RL rollouts.

agent = fsm.compile_spec("specs/calculator.yaml")       # validate + compile once
runner = fsm.Runner(agent, backend, tokenizer)           # backend: any backends.base.Backend
trajs = await runner.run(rows, n=8)                      # one trajectory per (row, sample)
batch = fsm.collate(trajs, ...)                          # verl's padded batch (TensorDict)
"""

from fsm.api import RolloutEngine
from fsm.batch import RolloutBatch, collate, summarize
from fsm.compile import CompiledAgent, Edge, compile_spec, validate_file
from fsm.context import RunContext, Sampling
from fsm.data import DataError, load_rows
from fsm.interaction import BaseInteraction
from fsm.loader import Diagnostic, SpecError, load_spec
from fsm.parsers import ToolCall
from fsm.ray_runner import RayRunner
from fsm.registry import action, guard
from fsm.runtime import Runner
from fsm.spec import AgentSpec
from fsm.tools import BaseTool, ToolResponse
from fsm.trajectory import Trajectory

__all__ = [
    "AgentSpec", "BaseInteraction", "BaseTool", "CompiledAgent", "DataError", "Diagnostic", "Edge", "RayRunner",
    "RolloutBatch", "RolloutEngine", "RunContext", "Runner", "Sampling", "SpecError", "ToolCall",
    "ToolResponse", "Trajectory", "action", "collate", "compile_spec", "guard", "load_rows", "load_spec",
    "summarize", "validate_file",
]  # fmt: skip
