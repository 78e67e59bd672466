"""What the driver asks of a tracer, typed beside the driver as backends/base.py types what it asks of a
backend.

fsm/run/runtime.py calls these hooks and nothing else, so a tracer is anything that has them: fsm/telemetry's
`Telemetry` (OpenTelemetry) or one of your own. They sit on the path of every transition and every call, so
a tracer answers "not traced" with None, and the driver then calls nothing more for that trajectory or call.

Parameters are positional-only: the driver passes them by position, and an implementation may name them as
it likes. The types come from modules that import nothing of the driver (backends/base.py, fsm/run/agent.py,
fsm/run/trajectory.py, fsm/tools/base.py), so that any engine module can import this one without an import cycle.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol, TypeVar

if TYPE_CHECKING:
    from backends.base import Backend, GenerateRequest, GenerateResult
    from fsm.families.parsers import ToolCall
    from fsm.run.agent import CompiledAgent, Edge
    from fsm.run.trajectory import Trajectory
    from fsm.tools.base import BoundTool, CallOutcome

_Result = TypeVar("_Result", contravariant=True)


class TracedRun(Protocol):
    """What a tracer may read of the run a trajectory belongs to (the driver's RunContext)."""

    agent: CompiledAgent  # its name, hash, states and edges name the spans
    backend: Backend  # the run's backend (a call may name another in `Tracer.model_call`)
    sampling: Any  # fsm/run/context.py's Sampling (typed Any: context imports this module); `.params` by SGLang names
    # fsm/families/codec.py's Codec: its `.tokenizer` decodes opt-in content (model calls' messages)
    codec: Any


class RootSpan(Protocol):
    """One traced trajectory, from `Tracer.trajectory()` to `finish()`, in the trajectory's task."""

    def transition(self, edge: Edge, /) -> None:
        """An edge fired after the state's action: the state left is done, `edge.dest`
        is entered (the trajectory's path and termination reason already updated)."""

    def state_failed(self, exc: BaseException, /) -> None:
        """The state's action or guards raised `exc` (a cancellation or a timeout included); the trajectory
        stops in that state, and `finish()` follows."""

    def finish(self) -> None:
        """The trajectory is over (finished, failed or cancelled), after it was scored and its session
        released; called exactly once, last, even when finishing was cancelled."""


class CallSpan(Protocol[_Result]):
    """One model or tool call of a traced trajectory: exactly one of `done` and `fail` ends it."""

    def done(self, result: _Result, /) -> None:
        """The call returned `result` (for a tool, maybe an outcome that carries an error)."""

    def fail(self, exc: BaseException, /) -> None:
        """The call raised `exc` (a backend error, a timeout, a cancellation), which propagates after this."""


class Tracer(Protocol):
    """What fsm/run/runtime.py calls on the `tracer` a Runner (or a RolloutEngine) is given."""

    def trajectory(self, traj: Trajectory, ctx: TracedRun, /) -> RootSpan | None:
        """A trajectory starts, in its own task: its root span, or None when it is not traced (sampled out;
        then no hook is called for its states or calls)."""

    def model_call(
        self, traj: Trajectory, request: GenerateRequest, backend: Backend, /
    ) -> CallSpan[GenerateResult] | None:
        """`backend` is about to generate for `request` in a traced trajectory: the call's span, or None when
        this call is not traced (the backend is then called alone)."""

    def tool_call(
        self, traj: Trajectory, call: ToolCall, tool: BoundTool | None, /
    ) -> CallSpan[CallOutcome] | None:
        """`call` is about to run (`tool`: the spec's tool of that name, None when there is none) in a traced
        trajectory: the call's span, or None when this call is not traced."""

    def flush(self) -> object:
        """`Runner.run` has driven all its trajectories: export what is queued before it returns (whatever
        this returns is ignored)."""
