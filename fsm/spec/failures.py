"""Failures declared per state, in Step Functions' vocabulary: `retry`, `catch`, `timeout_s`, `heartbeat_s`,
what a failed row becomes (`on_error`) and the run's failure budget (`failures.max_error_rate`).

The error names are the ones the engine already gives failures (docs/errors.md): a tool call's
`CallOutcome.error` under `tool.`, and the classes `fsm.run.runtime` turns into `error: ...` reasons. A name
matches itself and every name below it (`tool` matches `tool.timeout`); `all` matches every error.
"""

from __future__ import annotations

import difflib
from collections.abc import Callable
from typing import Any, Literal

from pydantic import Field

from fsm.spec.base import MAX_SECONDS, Strict

# name -> what it is. Tool names are CallOutcome.error values (fsm/tools/base.py), which are observations
# unless a state's retry or catch names them; the others end the row today unless caught.
ERRORS: dict[str, str] = {
    "tool.timeout": "a tool call ran past its timeout_s",
    "tool.exception": "a tool raised an exception",
    "tool.malformed_call": "the model's tool call could not be parsed (a parse error)",
    "tool.bad_arguments": "the call's arguments do not match the tool's schema",
    "tool.unknown_tool": "the model called a tool that does not exist",
    "tool.crashed": "a tool raised a BaseException or its worker process died",
    "heartbeat": "the state's tools sent no heartbeat (agent_data.heartbeat(), fsm.heartbeat()) within heartbeat_s",
    "timeout": "the state's action ran past timeout_s (or limits.action_timeout_s)",
    "backend": "a server error left after the client's retries and failover (BackendError)",
    "backend.timeout": "a server request past its deadline on every server (BackendTimeout)",
    "backend.aborted": "a model turn aborted past limits.max_resumes (GenerationAborted)",
    "error": "any other exception raised by the state's action (a user action's bug)",
}
WILDCARD = "all"
# per retry rule, and per tool call's own retry: more is a typo or an outage a catch should handle
MAX_ATTEMPTS = 10
MAX_WAIT_S = 3600  # the longest wait between two attempts, a state's or a tool's
# Runs of one tool call in a run: its tool's own attempts times the rounds its state's retry runs. Bounded as each
# factor is (validate: `retry-runs`), so the product of two sane numbers cannot be an outage's worth of calls.
MAX_CALL_RUNS = 10


def known_error(name: str) -> bool:
    """A name `errors:` may hold: an error, a prefix of some (`tool`), or the wildcard."""
    return name == WILDCARD or any(e == name or e.startswith(name + ".") for e in ERRORS)


def matches(names: list[str], error: str) -> bool:
    """Whether a rule naming `names` applies to `error`."""
    return any(n == WILDCARD or error == n or error.startswith(n + ".") for n in names)


class StateRetry(Strict):
    """One retry rule of a state: the action runs again after a failure it names (Step Functions' Retrier, but
    `max_attempts` counts the first attempt: Step Functions' MaxAttempts counts retries only)."""

    errors: list[str] = Field(min_length=1, description=f"Error names, or {WILDCARD!r}: {', '.join(ERRORS)}.")
    max_attempts: int = Field(
        default=3,
        ge=1,
        le=MAX_ATTEMPTS,
        description="Attempts of the action for these errors, the first included (1 never retries): Step "
        "Functions' MaxAttempts counts retries only, so its MaxAttempts 2 is max_attempts 3 here. A tool round "
        "run again runs each call with the tool's own retry again: the runs multiply, at most "
        f"{MAX_CALL_RUNS} per call (validate).",
    )
    backoff_s: float = Field(
        default=1.0, ge=0, le=MAX_WAIT_S, description="Wait before the second attempt (before jitter)."
    )
    multiplier: float = Field(
        default=2.0, ge=1, le=10, description="Each later wait is this many times longer."
    )
    backoff_max_s: float = Field(
        default=30.0, ge=0, le=MAX_WAIT_S, description="No wait is longer than this, jitter included."
    )
    jitter: float = Field(
        default=0.2,
        ge=0,
        le=1,
        description="Each wait is scaled by a uniform factor in [1-jitter, 1+jitter], then capped at "
        "backoff_max_s.",
    )


class StateCatch(Strict):
    """One catch rule of a state: a failure it names (after the retries) moves the row to `to` instead of
    ending it; the failure is last in `traj.failures`, and the built-in `observe_error` action shows it the model."""

    errors: list[str] = Field(min_length=1, description=f"Error names, or {WILDCARD!r}.")
    to: str = Field(description="The state the row goes to.")
    reason: str | None = Field(default=None, description="Recorded as termination_reason, as an edge's.")


OnError = Literal["mask", "drop", "zero_reward"]


class StateFailures(Strict):
    """The failure fields a state may declare (StateSpec inherits them)."""

    retry: list[StateRetry] = Field(
        default_factory=list, description="Retry rules, tried in order; the first naming the error applies."
    )
    catch: list[StateCatch] = Field(
        default_factory=list, description="Catch rules, tried in order after the retries are spent."
    )
    timeout_s: float | None = Field(
        default=None,
        gt=0,
        le=MAX_SECONDS,
        description="Wall-clock limit of this state's action, per attempt (error `timeout`).",
    )
    heartbeat_s: float | None = Field(
        default=None,
        gt=0,
        le=24 * 3600.0,
        description="A tool of this state must call agent_data.heartbeat() (a class tool) or fsm.heartbeat() (a "
        "function tool) at least this often (the call's start counts as one); past it the action is cancelled "
        "(error `heartbeat`).",
    )
    on_error: OnError | None = Field(
        default=None, description="What a row that fails in this state becomes; default: failures.on_error."
    )


class FailuresSpec(Strict):
    """The run's failure policy (top-level `failures:`)."""

    on_error: OnError = Field(
        default="mask",
        description="A failed row: mask (kept, empty response, response_mask 0: today's), drop (left out of the "
        "batch, counted and named in the summary), zero_reward (kept with the tokens it had, reward 0).",
    )
    max_error_rate: float | None = Field(
        default=None,
        ge=0,
        le=1,
        description="`agentfsm run` exits 1 when more than this share of rows failed; --max-error-rate "
        "overrides it; default 0.5.",
    )


def catch_loop(states: dict[str, Any], source: str, dest: str) -> list[str] | None:
    """The path by which a catch from `source` to `dest` comes back to `source` with no guard deciding on the
    way (each state's first edge unguarded, so it always fires), or None. Such a catch retries forever."""
    path, here = [source, dest], dest
    while here != source:
        st = states.get(here)
        if st is None or st.final or not st.next or st.next[0].when is not None or here in path[1:-1]:
            return None
        here = st.next[0].to
        path.append(here)
    return path


def rounds(rules: list[StateRetry]) -> int:
    """The most times a state's action runs under its retry rules: the first attempt, then each rule's retries
    (a rule counts only the failures it names, so a failure that changes kind spends another rule's too)."""
    return 1 + sum(r.max_attempts - 1 for r in rules)


def call_runs(spec: Any, name: str, diagnostic: Callable[..., Any]) -> list[Any]:
    """A `retry-runs` diagnostic when a call of some tool may run more than MAX_CALL_RUNS times in state `name`
    (a `call_tools` state): the tool's own attempts times the rounds its state's retry runs."""
    st = spec.states[name]
    if not st.retry or st.action != "call_tools":
        return []
    n = rounds(st.retry)
    worst = max(spec.tools, key=lambda t: t.retry.max_attempts, default=None)
    if worst is None or worst.retry.max_attempts * n <= MAX_CALL_RUNS:
        return []
    tool = worst.name or worst.function or worst.class_
    message = (
        f"a call of tool {tool!r} may run {worst.retry.max_attempts * n} times in {name}: its own "
        f"retry.max_attempts {worst.retry.max_attempts} in each of the {n} rounds the state's retry runs (1 + "
        f"each rule's max_attempts - 1); at most {MAX_CALL_RUNS}: lower one, and catch an outage instead"
    )
    return [diagnostic("retry-runs", message, "states", name, "retry")]


def _mean(word: str, choices: list[str]) -> str:
    hint = difflib.get_close_matches(word, choices, n=1)
    return f" (did you mean {hint[0]!r}?)" if hint else ""


def check_failures(spec: Any, diagnostic: Callable[..., Any]) -> list[Any]:
    """Diagnostics for the states' failure rules: unknown states and error names, rules on final states,
    catches that loop with no guard, tool calls that the tool's and the state's retries together would run
    more than MAX_CALL_RUNS times. `diagnostic(code, message, *loc, key=)` positions one."""
    diags, states = [], spec.states
    for name, st in states.items():
        diags += call_runs(spec, name, diagnostic)
        if st.final and (st.retry or st.catch or st.timeout_s or st.heartbeat_s or st.on_error):
            message = f"final state {name} runs no action: it has nothing to retry, catch or time out"
            diags.append(diagnostic("final-failures", message, "states", name))
        for kind, rules in (("retry", st.retry), ("catch", st.catch)):
            for i, rule in enumerate(rules):
                for j, error in enumerate(rule.errors):
                    if not known_error(error):
                        message = f"unknown error name {error!r}{_mean(error, [*ERRORS, WILDCARD])}; known: "
                        message += f"{', '.join(ERRORS)}, {WILDCARD}"
                        where = ("states", name, kind, i, "errors", j)
                        diags.append(diagnostic("unknown-error", message, *where, key=False))
        for i, c in enumerate(st.catch):
            if c.to not in states:
                message = f"catch to unknown state {c.to!r}{_mean(c.to, list(states))}"
                diags.append(
                    diagnostic("unknown-state", message, "states", name, "catch", i, "to", key=False)
                )
            elif (loop := catch_loop(states, name, c.to)) is not None:
                message = (
                    f"the catch of {name} to {c.to} comes back to {name} through unguarded edges only "
                    f"({' -> '.join(loop)}): a failure that persists loops until limits.max_transitions; "
                    "guard an edge on the way (e.g. max_assistant_turns) or catch to a final state"
                )
                diags.append(diagnostic("catch-loop", message, "states", name, "catch", i, "to", key=False))
    return diags


def without_default_failures(dump: dict[str, Any]) -> dict[str, Any]:
    """A spec's dump without the failure fields left at their defaults, so a spec that declares none hashes
    as it did before they existed (run directories and snapshots name their spec by that hash)."""
    defaults = StateFailures().model_dump(mode="json")
    for st in dump.get("states", {}).values():
        for key, value in defaults.items():
            if st.get(key) == value:
                st.pop(key, None)
    if dump.get("failures") == FailuresSpec().model_dump(mode="json"):
        dump.pop("failures")
    return dump
