"""Names the YAML can use: registries of guards and actions, and `module:attr` import paths.

XState-style: the spec names behaviour, Python implements it. A user registers a guard with
`@fsm.guard("name")` (or an action with `@fsm.action("name")`) in a module the spec lists under
`imports:`, or references a callable directly by import path.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

GUARDS: dict[str, Callable[..., Any]] = {}  # name -> factory(param, limits) -> predicate(traj)
ACTIONS: dict[str, Callable[..., Any]] = {}  # name -> async action(ctx, traj)


class ImportPathError(Exception):
    pass


def is_import_path(ref: str) -> bool:
    return ":" in ref


def resolve(ref: str) -> Any:
    """`package.module:attr.sub` -> the object. Raises ImportPathError with a readable reason."""
    module_name, _, attr = ref.partition(":")
    if not module_name or not attr:
        raise ImportPathError(f"{ref!r} is not an import path of the form 'package.module:name'")
    try:
        obj: Any = importlib.import_module(module_name)
    except Exception as exc:  # a user module may fail with anything
        raise ImportPathError(f"cannot import module {module_name!r}: {type(exc).__name__}: {exc}") from None
    for part in attr.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            raise ImportPathError(f"module {module_name!r} has no attribute {attr!r}") from None
    return obj


def guard(name: str) -> Callable[[Callable[..., bool]], Callable[..., bool]]:
    """Register a user guard `fn(traj) -> bool` (or `fn(traj, param)`) under `name`."""

    def register(fn: Callable[..., bool]) -> Callable[..., bool]:
        GUARDS[name] = _user_guard_factory(fn)
        return fn

    return register


def action(name: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Register a user action `async fn(ctx, traj)` under `name`."""

    def register(fn: Callable[..., Any]) -> Callable[..., Any]:
        ACTIONS[name] = fn
        return fn

    return register


def _user_guard_factory(fn: Callable[..., bool]) -> Callable[..., Callable[[Any], bool]]:
    def factory(param: Any, limits: Any) -> Callable[[Any], bool]:
        if param is None:
            return fn
        if isinstance(param, dict):
            return lambda traj: fn(traj, **param)
        return lambda traj: fn(traj, param)

    return factory
