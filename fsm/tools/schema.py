"""A tool's JSON schema: inferred from a function's hints and docstring, and the model's arguments checked
against it before the tool runs (a complaint the model reads instead of a TypeError in the tool)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


def infer_schema(fn: Callable[..., Any]) -> dict:
    """OpenAI function schema from type hints and a Google-style docstring (transformers' helper), without the
    `return` entry the helper makes of a `Returns:` section: the OpenAI form has none, chat templates render the
    schema as given, and a model trained on that form meets a tool it never saw (the tiny calculator model then
    stops calling it: reward 0 on every row, issue 46)."""
    from transformers.utils import get_json_schema

    schema = get_json_schema(fn)
    schema["function"].pop("return", None)
    return schema


_JSON_TYPES: dict[str, type | tuple[type, ...]] = {
    "string": str,
    "integer": int,
    "number": (int, float),
    "boolean": bool,
    "array": list,
    "object": dict,
    "null": type(None),
}


def _json_type_ok(value: Any, type_: str) -> bool:
    """`value` (from json.loads) is a JSON Schema `type_`; an unknown type name accepts anything."""
    if not isinstance(type_, str) or type_ not in _JSON_TYPES:
        return True
    if isinstance(value, bool):  # a bool is an int in Python, never in JSON
        return type_ == "boolean"
    if type_ == "integer":  # JSON Schema: a number with no fractional part (2.0 included)
        return isinstance(value, int) or (isinstance(value, float) and value.is_integer())
    return isinstance(value, _JSON_TYPES[type_])


def check_arguments(schema: dict, args: Any) -> str | None:
    """A readable complaint about arguments that do not fit the schema, or None.

    A property's `type` may be one name or a list of names (`int | float` is ["integer", "number"]); the
    value must be one of them. `nullable: true` (transformers' Optional) also accepts null."""
    if not isinstance(args, dict):
        return f"arguments must be a JSON object, got {type(args).__name__}"
    params = schema.get("function", schema).get("parameters") or {}
    props: dict = params.get("properties") or {}
    missing = [name for name in params.get("required", []) if name not in args]
    if missing:
        return f"missing required argument(s) {', '.join(map(repr, missing))}"
    unknown = [name for name in args if props and name not in props]
    if unknown:
        return (
            f"unexpected argument(s) {', '.join(map(repr, unknown))}; expected {', '.join(map(repr, props))}"
        )
    for name, value in args.items():
        prop = props.get(name) or {}
        types = prop.get("type")
        if types is None or (value is None and prop.get("nullable")):
            continue
        types = [types] if isinstance(types, str) else list(types)
        if not any(_json_type_ok(value, t) for t in types):
            return f"argument {name!r} should be {' or '.join(map(str, types))}, got {type(value).__name__}"
    return None
