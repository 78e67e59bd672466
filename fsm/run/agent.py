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
from pathlib import Path
from typing import Any, cast

from transitions import Machine, Transition

from fsm.spec.failures import ERRORS, matches, without_default_failures
from fsm.spec.loader import LoadedSpec
from fsm.spec.model import SPECS_DIR, AgentSpec, RewardSpec, TreeSpec
from fsm.spec.registry import Predicate
from fsm.tools.base import ToolSet

TRIGGER = "advance"
# Built-in actions that start no spans of their own (only model and tool spans); every other action runs
# user code (a user action, or `interact` calling the user's interaction).
SPANLESS_ACTIONS = frozenset({"encode_prompt", "generate", "call_tools", "observe_error"})


@dataclass(frozen=True, slots=True)
class Edge:
    """A compiled transition. `index` is global (stable across runs): run statistics key on it."""

    index: int
    source: str
    dest: str
    guard: Predicate | None
    label: str  # the guard as written, or "default"
    reason: str | None
    catch: tuple[str, ...] | None = None  # a state's `catch:` rule (the errors it names), not a guarded edge


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
    lane: Any = None  # where a sync function runs (fsm/tools/isolation.py); None: a coroutine, awaited


def child_spec_path(ref: str, spec_path: Path | None) -> Path | None:
    """Where a child machine's `spec:` points: None for `self`, a shipped spec's file for its name, else a path
    relative to the spec file (or the working directory for a spec without one)."""
    if ref == "self":
        return None
    shipped = SPECS_DIR / f"{ref}.yaml"
    if "/" not in ref and not ref.endswith((".yaml", ".yml")) and shipped.is_file():
        return shipped
    base = spec_path.resolve().parent if spec_path is not None else Path.cwd()
    return (base / ref).resolve()


def _hashed(spec: AgentSpec) -> dict[str, Any]:
    """The spec as its hash reads it: the tree keys (docs/trees.md), the failure rules (fsm/spec/failures.py) and
    the reward's isolation left out where they hold their defaults, so a spec without them keeps the hash it had
    before they existed (run statistics, snapshots and resumes compare it)."""
    data = without_default_failures(spec.model_dump(mode="json", by_alias=True))
    if (data.get("reward") or {}).get("isolation") == RewardSpec.model_fields["isolation"].default:
        data["reward"].pop("isolation")
    for key, default in (("policies", {}), ("children", {}), ("tree", TreeSpec().model_dump(mode="json"))):
        if data.get(key) == default:
            data.pop(key)
    for state in data["states"].values():
        for key in ("policy", "fork"):
            if state.get(key) is None:
                state.pop(key, None)
    return data


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
            s: tuple(e for e in edges if e.source == s and e.catch is None) for s in spec.states
        }
        # Catch rules, in declared order: taken by fsm.run.failures when the action fails, never by `advance`.
        self.catches: dict[str, tuple[Edge, ...]] = {
            s: tuple(e for e in edges if e.source == s and e.catch is not None) for s in spec.states
        }
        self.actions = actions
        # States with failure rules (run by fsm.run.failures.run_state), and the tool errors each one's rules
        # name (CallOutcome.error values that then raise instead of being observations).
        self.ruled = frozenset(
            n for n, st in spec.states.items() if st.retry or st.catch or st.timeout_s or st.heartbeat_s
        )
        self.tool_rules: dict[str, frozenset[str]] = {
            n: frozenset(
                e.removeprefix("tool.")
                for e in ERRORS
                if e.startswith("tool.")
                and (
                    any(matches(r.errors, e) for r in st.retry) or any(matches(c.errors, e) for c in st.catch)
                )
            )
            for n, st in spec.states.items()
        }
        # States whose action runs user code, which may start spans of its own: telemetry makes their
        # state span current.
        self.user_code_states = frozenset(
            name for name, st in spec.states.items() if not st.final and st.action not in SPANLESS_ACTIONS
        )
        self.tools = tools
        self.interaction_cls = interaction_cls
        self.reward = reward
        self.forks = {name: st.fork for name, st in spec.states.items() if st.fork is not None}
        self.compile: Any = None  # fsm/run/compile.py's compile_spec, for child machines (set by it)
        self.hash = hashlib.sha256(json.dumps(_hashed(spec), sort_keys=True).encode()).hexdigest()[:12]
        self.machine = _SharedMachine(
            model=None,
            states=list(spec.states),
            initial=spec.initial,
            auto_transitions=False,
            send_event=False,
        )
        for edge in (e for e in edges if e.catch is None):
            self.machine.add_transition(TRIGGER, edge.source, edge.dest)
            added = self.machine.events[TRIGGER].transitions[edge.source][-1]
            cast(_LeanTransition, added).edge = edge  # (the machine's transition_cls)
        # The machine's own per-state transition lists, in declared order. `advance` walks them directly:
        # `Event.trigger` would wrap each step in an EventData, a partial and empty callback lists.
        event = self.machine.events.get(TRIGGER)  # none when the initial state is final: no edges at all
        self._table = cast(dict[str, list[_LeanTransition]], dict(event.transitions) if event else {})

    def child_agent(self, name: str) -> CompiledAgent:
        """The compiled spec of child machine `name` (this agent itself for `spec: self`)."""
        path = child_spec_path(self.spec.children[name].spec, self.path)
        if path is None:
            return self
        if self.compile is None:
            raise RuntimeError(f"{self.name}: child machine {name} needs an agent compiled by compile_spec")
        return self.compile(path)

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
