"""A spec's `tools:` entry made into a BoundTool: its function or class resolved, its schema (declared or
inferred), and the lane its code runs in (fsm/tools/isolation.py) chosen from `isolation:`."""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

from fsm.spec.model import ToolSpec
from fsm.spec.registry import resolve
from fsm.tools.base import BoundTool, FunctionTool, tool_retry
from fsm.tools.isolation import InlineLane, Lane, LoopLane, ThreadLane
from fsm.tools.processes import ProcessLane


def infer_schema(fn: Callable[..., Any]) -> dict:
    """OpenAI function schema from type hints and a Google-style docstring (transformers' helper), without the
    `return` entry the helper makes of a `Returns:` section: the OpenAI form has none, chat templates render the
    schema as given, and a model trained on that form meets a tool it never saw (the tiny calculator model then
    stops calling it: reward 0 on every row, issue 46)."""
    from transformers.utils import get_json_schema

    schema = get_json_schema(fn)
    schema["function"].pop("return", None)
    return schema


def _declared_schema(spec: ToolSpec, resolve_ref: Callable[[str], Any]) -> dict | None:
    """The spec's schema: inline, or the dict an import path names."""
    if isinstance(spec.schema_, str):
        schema = resolve_ref(spec.schema_)
        if not isinstance(schema, dict):
            raise TypeError(
                f"schema {spec.schema_!r} is a {type(schema).__name__}, not an OpenAI function schema dict"
            )
        return dict(schema)
    return dict(spec.schema_) if spec.schema_ is not None else None


def build_tool(spec: ToolSpec, resolve_ref: Callable[[str], Any] = resolve) -> BoundTool:
    """ToolSpec -> BoundTool. Raises ImportPathError / TypeError / ValueError with a readable message.

    `resolve_ref` turns import paths into objects (fsm.run.compile passes one with the spec's trust opt-ins).
    """
    if bool(spec.function) == bool(spec.class_):
        raise ValueError("a tool needs exactly one of 'function' or 'class'")
    declared = _declared_schema(spec, resolve_ref)
    if spec.function:
        fn = resolve_ref(spec.function)
        if not callable(fn):
            raise TypeError(f"{spec.function!r} is not callable")
        schema = declared or infer_schema(fn)
    else:
        assert spec.class_  # exactly one of the two (checked above)
        cls = resolve_ref(spec.class_)
        if declared is None:
            raise ValueError(f"tool class {spec.class_!r} needs a 'schema' (OpenAI function schema)")
        schema = declared
    name = spec.name or schema.get("function", {}).get("name")
    if not name:
        raise ValueError("the tool schema has no function name")
    if spec.name and schema.get("function", {}).get("name") != spec.name:
        schema = {**schema, "function": {**schema.get("function", {}), "name": spec.name}}
    if spec.function:
        if spec.isolation == "none" and not inspect.iscoroutinefunction(fn):
            raise TypeError(
                f"isolation: none runs coroutine functions only (they await on the run's event loop), "
                f"and {spec.function!r} is a sync function: drop isolation: none to run it in its own "
                "threads"
            )
        if spec.isolation == "process":
            lane: Lane = ProcessLane(name, spec.function, spec.workers)
        elif spec.isolation == "none":
            lane = InlineLane(name)
        elif inspect.iscoroutinefunction(fn):
            lane = LoopLane(name)
        else:
            lane = ThreadLane(name, spec.workers)
        tool: Any = FunctionTool(fn, schema, lane)
    else:
        tool = cls(dict(spec.config), schema)
        for method in ("create", "execute", "calc_reward", "release"):
            if not callable(getattr(tool, method, None)):
                raise TypeError(f"tool class {spec.class_!r} lacks the lifecycle method {method!r}")
            if spec.isolation == "none" and not inspect.iscoroutinefunction(getattr(tool, method)):
                raise TypeError(
                    f"isolation: none runs coroutines only, and {spec.class_!r}.{method} is not an "
                    "async def: drop isolation: none to run it on the tool's own loop thread"
                )
        lane = InlineLane(name) if spec.isolation == "none" else LoopLane(name)
    if hasattr(tool, "name"):
        tool.name = name
    return BoundTool(
        name, tool, schema, spec.timeout_s, tool_retry(spec.retry.max_attempts, spec.retry.backoff_s), lane
    )
