"""Rows: every input form becomes the same row, in one place.

A trainer hands rows as a list of dicts, verl's dict of columns, or a DataProto; `agentfsm run` reads them
from files (fsm/data/files.py). Whatever the form: verl's `prompt` column is `raw_prompt`, a plain string is
one user message, numpy object arrays become lists, and `tools_kwargs`, `interaction_kwargs` and
`tool_selection` may sit at the top level or in `extra_info` (verl keeps them there). A row that cannot run
(no prompt, messages of the wrong shape) runs as an error row (`RowError`, "error: bad row"), so one bad row
never stops a batch and none is dropped.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import orjson


class RowError(Exception):
    """The row itself is unusable (no usable raw_prompt, a field of the wrong type, prompt too long under the
    'error' policy); `kind` names it for metrics and spans (fsm/run/trajectory.py `Failure`)."""

    def __init__(self, message: str, kind: str = "row"):
        super().__init__(message)
        self.kind = kind


_SURROGATE = re.compile("[\ud800-\udfff]")


def encodable(text: str) -> str:
    """`text` with every lone surrogate (a code point UTF-8 cannot encode, e.g. from JSON's "\\ud800") as
    U+FFFD. Applied where text enters a trajectory (rows, tool results, user replies, error reasons), so the
    tokenizer and every output file can take all of it."""
    return text if text.isascii() else _SURROGATE.sub("\ufffd", text)


def encodable_value(value: Any) -> Any:
    """`encodable` through dicts, lists and tuples (a row's fields); other values as they are. A value with
    nothing to replace is returned itself, not copied (a row's copy would cost every trajectory a few hundred
    bytes for nothing)."""
    try:  # orjson refuses a lone surrogate anywhere it walks: one C pass for the common row
        orjson.dumps(value, option=orjson.OPT_NON_STR_KEYS)
        return value
    except TypeError:  # a surrogate, or a value orjson cannot write: walk it
        return value if _encodable_already(value) else _encodable_copy(value)


def _encodable_already(value: Any) -> bool:
    if isinstance(value, str):
        return value.isascii() or _SURROGATE.search(value) is None
    if isinstance(value, dict):
        return all(_encodable_already(k) and _encodable_already(v) for k, v in value.items())
    if isinstance(value, (list, tuple)):
        return all(_encodable_already(v) for v in value)
    return True


def _encodable_copy(value: Any) -> Any:
    if isinstance(value, str):
        return encodable(value)
    if isinstance(value, dict):
        return {_encodable_copy(k): _encodable_copy(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_encodable_copy(v) for v in value)
    return value


SCORE_LIMIT = float(np.finfo(np.float32).max)  # 3.4028235e38: rm_scores is float32


def score_fault(value: float) -> str | None:
    """Why `value` cannot be a reward or score (None when it can). Checked where a reward function, a tool or an
    interaction hands one over: NaN would poison a trainer's loss and JSON cannot hold it, and a finite number
    past float32's range becomes inf in rm_scores (and 1e308 overflows the run's mean into inf, which the
    summary cannot hold either), so such a value fails its row instead."""
    if not math.isfinite(value):
        return "not a finite number"
    if abs(value) > SCORE_LIMIT:
        return f"beyond float32's range (at most {SCORE_LIMIT:.8g} in size), which rm_scores holds"
    return None


def is_dataproto(obj: Any) -> bool:
    """A verl DataProto, recognised by shape (verl is never imported here)."""
    return (
        type(obj).__name__ == "DataProto" and hasattr(obj, "non_tensor_batch") and hasattr(obj, "meta_info")
    )


def normalize_record(row: dict[str, Any], prompt_key: str = "raw_prompt") -> dict[str, Any]:
    """One record, in place: the chat messages under `raw_prompt` (from `prompt_key`, or verl's `prompt`),
    a plain string as one user message, verl's object arrays as lists."""
    if prompt_key != "raw_prompt" and prompt_key in row:
        row["raw_prompt"] = row.pop(prompt_key)
    elif "raw_prompt" not in row and "prompt" in row:
        row["raw_prompt"] = row.pop("prompt")
    prompt = row.get("raw_prompt")
    if isinstance(prompt, np.ndarray):
        row["raw_prompt"] = prompt.tolist()
    elif isinstance(prompt, str):
        row["raw_prompt"] = [{"role": "user", "content": prompt}]
    return row


def to_rows(batch: Any) -> tuple[list[Any], dict[str, Any]]:
    """Any accepted batch form -> (rows, the input's meta_info). A non-dict row is kept, to fail alone;
    the engine normalises each row as it makes its trajectories."""
    meta: dict[str, Any] = {}
    if hasattr(batch, "non_tensor_batch") and hasattr(batch, "meta_info"):  # DataProto, RolloutBatch
        meta = dict(batch.meta_info or {})
        batch = batch.non_tensor_batch
    if isinstance(batch, Mapping):
        if "raw_prompt" not in batch:
            raise ValueError(
                "the batch has no 'raw_prompt' column (the chat messages of each row); "
                f"columns: {', '.join(map(str, batch)) or 'none'}. In verl, set data.return_raw_chat=True"
            )
        columns = {
            k: v.tolist() if isinstance(v, np.ndarray) and v.dtype != object else list(v)
            for k, v in batch.items()
        }
        sizes = {k: len(v) for k, v in columns.items()}
        if len(set(sizes.values())) > 1:
            raise ValueError(f"columns differ in length: {sizes}")
        n = next(iter(sizes.values()), 0)
        rows: list[Any] = [{k: columns[k][i] for k in columns} for i in range(n)]
    elif isinstance(batch, Sequence) and not isinstance(batch, (str, bytes)):
        rows = list(batch)
    else:
        what = type(batch).__name__
        raise TypeError(f"rows must be a list of dicts, a dict of columns or a DataProto, not {what}")
    return rows, meta


@dataclass(slots=True)
class RowInputs:
    """What the engine reads from a row besides its prompt."""

    tools_kwargs: dict[str, Any]
    # None: the row does not opt in to the interaction (verl's rule)
    interaction_kwargs: dict[str, Any] | None
    tool_selection: list[str] | None  # verl's extra_info.tool_selection: the tools active for this row


def describe(value: Any) -> str:
    """A value in a message: its type and the start of its repr."""
    text = repr(value)
    return f"{type(value).__name__} {text[:60]}{'...' if len(text) > 60 else ''}"


def check_prompt(row: Mapping[str, Any]) -> None:
    """A row's `raw_prompt`, where it has one, is a non-empty list of chat messages whose content is text or a
    list of content parts; RowError naming the field otherwise (a row without one fails where it is encoded)."""
    messages = row.get("raw_prompt")
    if messages is None:
        return
    if not isinstance(messages, list) or not messages:
        raise RowError(f"'raw_prompt' must be a non-empty list of chat messages, got {describe(messages)}")
    for k, message in enumerate(messages):
        if not isinstance(message, Mapping):
            what = describe(message)
            raise RowError(
                f"'raw_prompt[{k}]' must be a chat message (a mapping with role and content), got {what}"
            )
        if not isinstance(message.get("role"), str):
            raise RowError(f"'raw_prompt[{k}].role' must be a string, got {describe(message.get('role'))}")
        content = message.get("content")
        parts = isinstance(content, (list, tuple, np.ndarray)) and all(
            isinstance(p, Mapping) for p in content
        )
        if not (content is None or isinstance(content, str) or parts):
            what = describe(content)
            raise RowError(f"'raw_prompt[{k}].content' must be text or a list of content parts, got {what}")


def row_inputs(row: Mapping[str, Any]) -> RowInputs:
    """What the engine reads from a row; RowError naming the field when a type is wrong."""
    check_prompt(row)
    extra = row.get("extra_info")
    if extra is not None and not isinstance(extra, Mapping):
        raise RowError(f"'extra_info' must be a mapping, got {describe(extra)}")
    extra = extra or {}
    tools_kwargs = row.get("tools_kwargs") or extra.get("tools_kwargs") or {}
    if not isinstance(tools_kwargs, Mapping) or not all(
        isinstance(v, Mapping) for v in tools_kwargs.values()
    ):
        what = describe(tools_kwargs)
        raise RowError(f"'tools_kwargs' must map tool names to mappings (create_kwargs, ...), got {what}")
    kwargs = row.get("interaction_kwargs", extra.get("interaction_kwargs"))
    if kwargs is not None and not isinstance(kwargs, Mapping):
        raise RowError(f"'interaction_kwargs' must be a mapping, got {describe(kwargs)}")
    selection = extra.get("tool_selection")
    if isinstance(selection, np.ndarray):
        selection = selection.tolist()
    if selection is not None and (
        not isinstance(selection, (list, tuple)) or not all(isinstance(n, str) for n in selection)
    ):
        raise RowError(f"'extra_info.tool_selection' must be a list of tool names, got {describe(selection)}")
    return RowInputs(
        tools_kwargs=dict(tools_kwargs),
        interaction_kwargs=dict(kwargs) if kwargs is not None else None,
        tool_selection=list(selection) if selection is not None else None,
    )


def prompt_messages(row: Mapping[str, Any], which: str = "bad row") -> list[dict[str, Any]]:
    """The row's chat messages (copied), or RowError saying what is wrong with them, `which` row first."""
    messages = row.get("raw_prompt")
    if not isinstance(messages, list) or not messages or not all(isinstance(m, Mapping) for m in messages):
        what = "nothing" if messages is None else describe(messages)
        raise RowError(f"{which}: 'raw_prompt' must be a non-empty list of chat messages, got {what}")
    return [dict(m) for m in messages]
