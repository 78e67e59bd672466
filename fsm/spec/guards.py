"""Guards: pure, synchronous predicates over a trajectory, compiled once per spec.

A guard expression in YAML is a name, `{name: param}`, or `{all: [...]}` / `{any: [...]}` / `{not: ...}`.
`compile_guard` turns it into one closure; nothing is parsed or looked up per trajectory.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

from fsm.spec.model import LimitsSpec
from fsm.spec.registry import GUARDS, ImportPathError, _user_guard_factory, is_import_path, resolve

Predicate = Callable[[Any], bool]


class GuardError(Exception):
    def __init__(self, code: str, message: str, name: str | None = None):
        super().__init__(message)
        self.code = code
        self.name = name  # the guard name at fault, for "did you mean" (it may sit deep inside all/any/not)


def _builtin(name: str):
    def register(factory):
        GUARDS[name] = factory
        return factory

    return register


@_builtin("response_budget_exhausted")
def _response_budget(param: Any, limits: LimitsSpec) -> Predicate:
    budget = int(param) if param is not None else limits.response_length
    # An observation that did not fit was not appended, and the budget counts as spent (verl): without
    # the flag the trajectory would go on generating as if the tool or user had never answered.
    return lambda t: t.observation_overflow or len(t.response_mask) >= budget


def _turn_limit(name: str, attr: str):
    @_builtin(name)
    def factory(param: Any, limits: LimitsSpec) -> Predicate:
        n = param if param is not None else getattr(limits, name)
        if n is None:  # as in verl, an unset limit never stops a trajectory
            return lambda t: False
        if not isinstance(n, int) or n < 1:
            raise GuardError("type", f"guard {name!r} takes a positive integer, got {n!r}")
        return lambda t: getattr(t, attr) >= n

    return factory


_turn_limit("max_assistant_turns", "assistant_turns")
_turn_limit("max_user_turns", "user_turns")


@_builtin("has_tool_calls")
def _has_tool_calls(param: Any, limits: LimitsSpec) -> Predicate:
    return lambda t: bool(t.pending_calls)


@_builtin("should_terminate")
def _should_terminate(param: Any, limits: LimitsSpec) -> Predicate:
    return lambda t: t.should_terminate


@_builtin("has_interaction")
def _has_interaction(param: Any, limits: LimitsSpec) -> Predicate:
    return lambda t: t.interaction_kwargs is not None  # the row carries interaction_kwargs (verl's rule)


@_builtin("finish_reason")
def _finish_reason(param: Any, limits: LimitsSpec) -> Predicate:
    if param not in ("stop", "length", "abort"):
        raise GuardError("type", f"finish_reason takes stop, length or abort, got {param!r}")
    return lambda t: t.last_finish_reason == param


@_builtin("context_tokens_over")
def _context_tokens_over(param: Any, limits: LimitsSpec) -> Predicate:
    if not isinstance(param, int) or isinstance(param, bool) or param < 1:
        raise GuardError(
            "type", f"guard 'context_tokens_over' takes a positive number of tokens, got {param!r}"
        )
    # the current segment's prompt and response: what the next model turn would be given (fsm/run/rewrites.py)
    return lambda t: len(t.prompt_ids) + len(t.response_ids) > param


@_builtin("segments_at_least")
def _segments_at_least(param: Any, limits: LimitsSpec) -> Predicate:
    if not isinstance(param, int) or isinstance(param, bool) or param < 1:
        raise GuardError("type", f"guard 'segments_at_least' takes a positive integer, got {param!r}")
    return lambda t: len(t.closed) + 1 >= param


def _all(preds: list[Predicate]) -> Predicate:
    return lambda t: all(p(t) for p in preds)


def _any(preds: list[Predicate]) -> Predicate:
    return lambda t: any(p(t) for p in preds)


def compile_guard(
    expr: Any, limits: LimitsSpec, resolve_ref: Callable[[str], Any] = resolve
) -> tuple[Predicate, str]:
    """Guard expression -> (predicate, label for diagrams and spans). Raises GuardError.

    `resolve_ref` turns a `module:function` guard into the function (fsm.run.compile passes one that applies
    the spec's trust opt-ins, or, for static checks, one that imports nothing).
    """
    if isinstance(expr, str):
        return _named(expr, None, limits, resolve_ref), expr
    if isinstance(expr, dict) and len(expr) == 1:
        ((key, value),) = expr.items()
        if key in ("all", "any"):
            if not isinstance(value, list) or not value:
                raise GuardError("type", f"{key}: expects a non-empty list of guards")
            parts = [compile_guard(v, limits, resolve_ref) for v in value]
            combine = _all if key == "all" else _any
            return combine([p for p, _ in parts]), f" {'and' if key == 'all' else 'or'} ".join(
                lbl for _, lbl in parts
            )
        if key == "not":
            pred, label = compile_guard(value, limits, resolve_ref)
            return (lambda t: not pred(t)), f"not {label}"
        return _named(str(key), value, limits, resolve_ref), f"{key}={value}"
    raise GuardError("type", f"a guard is a name, {{name: param}}, or {{all|any|not: ...}}; got {expr!r}")


def _named(name: str, param: Any, limits: LimitsSpec, resolve_ref: Callable[[str], Any]) -> Predicate:
    factory = GUARDS.get(name)
    if factory is None and is_import_path(name):
        try:
            fn = resolve_ref(name)
        except ImportPathError as exc:
            raise GuardError(exc.code, str(exc)) from None
        if not callable(fn):
            raise GuardError("import", f"{name!r} is not callable")
        factory = _user_guard_factory(fn)
    if factory is None:
        raise GuardError(
            "unknown-guard", f"unknown guard {name!r}; built-in: {', '.join(sorted(GUARDS))}", name
        )
    if hasattr(factory, "guard_fn"):
        _check_signature(name, factory.guard_fn, param)
    return factory(param, limits)


def _check_signature(name: str, fn: Callable[..., Any], param: Any) -> None:
    """A user guard is called `fn(traj)`, `fn(traj, param)` or `fn(traj, **param)` and returns a bool at once:
    one written as an action (`async def fn(ctx, traj)`) would fail every row at run time, so refuse it here."""
    if inspect.iscoroutinefunction(fn):
        raise GuardError(
            "type",
            f"guard {name!r} must be a plain function fn(traj) -> bool, not async (guards "
            "are synchronous; an action is `async def fn(ctx, traj)`)",
        )
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):  # a builtin, or static validation's unimported placeholder
        return
    called = (
        "fn(traj)" if param is None else "fn(traj, **param)" if isinstance(param, dict) else "fn(traj, param)"
    )
    try:
        if param is None:
            sig.bind(None)
        elif isinstance(param, dict):
            sig.bind(None, **param)
        else:
            sig.bind(None, param)
    except TypeError as exc:
        with_param = "" if param is None else f" with {param!r}"
        bare = sig.replace(
            parameters=[p.replace(annotation=p.empty) for p in sig.parameters.values()],
            return_annotation=sig.empty,
        )  # what it takes, without annotations (strings here)
        raise GuardError(
            "type",
            f"guard {name!r} takes {bare}: it cannot be called as {called}{with_param} ({exc}); a guard is "
            "fn(traj) -> bool, or fn(traj, param) when the spec gives it a parameter",
        ) from None
