"""What a spec compiles to: `CompiledAgent`, immutable and shared by every trajectory of the spec.

The machine is a `transitions.Machine`. Trajectories are passed to its event as the model instead of being
attached with `add_model` (which is O(n) per add and builds reference cycles). Its transitions are lean:
they only evaluate the compiled guard. Choosing an edge changes nothing; the driver records the edge it
takes with `Trajectory.enter`, so "an edge fired" has one owner. `agentfsm bench engine` measures this path
against transitions' stock `Event.trigger`.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Any, cast

from transitions import Machine, Transition

from fsm.spec.guards import Predicate
from fsm.spec.loader import LoadedSpec
from fsm.spec.model import AgentSpec
from fsm.tools.base import ToolSet

TRIGGER = "advance"
# Built-in actions that start no spans of their own (only model and tool spans); every other action runs
# user code (a user action, or `interact` calling the user's interaction).
SPANLESS_ACTIONS = frozenset({"encode_prompt", "generate", "call_tools"})


@dataclass(frozen=True, slots=True)
class Edge:
    """A compiled transition. `index` is global (stable across runs): run statistics key on it."""

    index: int
    source: str
    dest: str
    guard: Predicate | None
    label: str  # the guard as written, or "default"
    reason: str | None


class _LeanTransition(Transition):
    """A transition that only evaluates its guard; the driver owns every side effect."""

    edge: Edge

    def holds(self, traj: Any) -> bool:
        guard = self.edge.guard
        return guard is None or guard(traj)

    def execute(self, event_data) -> bool:  # the stock `machine.events[...].trigger(model)` path
        if not self.holds(event_data.model):
            return False
        event_data.model.enter(self.edge)
        return True


class _SharedMachine(Machine):
    transition_cls = _LeanTransition


# What a reward function may see besides verl's arguments, when it names the parameter: the Trajectory, its
# tool results (texts, in call order), its conversation, its metrics (fsm.run.trajectory.Metrics as a dict).
REWARD_EXTRAS = ("trajectory", "tool_results", "messages", "metrics")


@dataclass
class Reward:
    fn: Any
    kwargs: dict[str, Any]
    extras: tuple[str, ...] = ()  # the REWARD_EXTRAS its signature names (a **kwargs alone gets none of them)


class CompiledAgent:
    """Immutable after construction; safe to share across trajectories, tasks and runs."""

    def __init__(
        self,
        spec: AgentSpec,
        source: LoadedSpec | None,
        edges: list[Edge],
        actions: dict[str, Any],
        tools: ToolSet,
        interaction_cls: Any,
        reward: Reward | None,
    ):
        self.spec = spec
        self.name = spec.name
        self.source = source
        self.path = source.path if source else None
        self.limits = spec.limits
        self.initial = spec.initial
        self.final_states = frozenset(spec.final_states)
        self.edges = edges
        self.edges_from: dict[str, tuple[Edge, ...]] = {
            s: tuple(e for e in edges if e.source == s) for s in spec.states
        }
        self.actions = actions
        # States whose action runs user code, which may start spans of its own: telemetry makes their
        # state span current.
        self.user_code_states = frozenset(
            name for name, st in spec.states.items() if not st.final and st.action not in SPANLESS_ACTIONS
        )
        self.tools = tools
        self.interaction_cls = interaction_cls
        self.reward = reward
        self.hash = hashlib.sha256(
            json.dumps(spec.model_dump(mode="json", by_alias=True), sort_keys=True).encode()
        ).hexdigest()[:12]
        self.machine = _SharedMachine(
            model=None,
            states=list(spec.states),
            initial=spec.initial,
            auto_transitions=False,
            send_event=False,
        )
        for edge in edges:
            self.machine.add_transition(TRIGGER, edge.source, edge.dest)
            added = self.machine.events[TRIGGER].transitions[edge.source][-1]
            cast(_LeanTransition, added).edge = edge  # (the machine's transition_cls)
        # The machine's own per-state transition lists, in declared order. `advance` walks them directly:
        # `Event.trigger` would wrap each step in an EventData, a partial and empty callback lists.
        event = self.machine.events.get(TRIGGER)  # none when the initial state is final: no edges at all
        self._table = cast(dict[str, list[_LeanTransition]], dict(event.transitions) if event else {})

    def advance(self, traj: Any, state: str | None = None) -> Edge:
        """The first edge out of `state` (default: the trajectory's) whose guard holds.

        A pure query (XState's transition function): nothing changes until the driver calls
        `traj.enter(edge)`. Validation guarantees every non-final state ends with a default edge.
        """
        for transition in self._table[state or traj.state]:
            if transition.holds(traj):
                return transition.edge
        raise RuntimeError(
            f"no transition fired from {state or traj.state}; validation guarantees a default edge"
        )

    def trigger(self, traj: Any) -> Edge:
        """The same step through transitions' stock `Event.trigger`, which also enters the edge (slower;
        kept to prove the two paths equivalent)."""
        if not self.machine.events[TRIGGER].trigger(traj):
            raise RuntimeError(f"no transition fired from {traj.state}")
        return self.edges[traj.transitions_fired[-1]]
