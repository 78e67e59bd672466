"""SGLang's /generate request contract as the dev server (backends/devserver.py) enforces it: the
SamplingParams fields, their types, and SGLang's error bodies, so a client that passes the dev server sends
what a real server accepts.
"""

from __future__ import annotations

import json
from typing import Any

# SGLang's SamplingParams fields; anything else in `sampling_params` is a 400 contract violation.
SAMPLING_KEYS = (
    "max_new_tokens", "min_new_tokens", "temperature", "top_p", "top_k", "min_p", "frequency_penalty",
    "presence_penalty", "repetition_penalty", "stop", "stop_token_ids", "stop_regex", "ignore_eos", "no_stop_trim",
    "skip_special_tokens", "spaces_between_special_tokens", "n", "json_schema", "regex", "ebnf", "structural_tag",
    "logit_bias", "sampling_seed", "stream_interval", "custom_params", "beam_width", "watermark", "choice",
)  # fmt: skip
_FLOAT_KEYS = {"temperature", "top_p", "min_p", "frequency_penalty", "presence_penalty", "repetition_penalty"}
_INT_KEYS = {"max_new_tokens", "min_new_tokens", "top_k", "n", "sampling_seed", "stream_interval"}


class Refused(Exception):
    """An HTTP error answer: status and JSON body exactly as SGLang sends them."""

    def __init__(self, status: int, body: Any):
        super().__init__(str(body))
        self.status, self.body = status, body

    @classmethod
    def value_error(cls, message: str) -> Refused:
        """A ValueError in SGLang's tokenizer manager (input too long, duplicate rid, ...)."""
        return cls(400, {"error": {"message": message}})

    @classmethod
    def http(cls, status: int, message: str, kind: str | None = None) -> Refused:
        """FastAPI's parse failure, or a scheduler abort with a non-400 status."""
        body = {
            "object": "error",
            "message": message,
            "type": kind or str(status),
            "param": None,
            "code": status,
        }
        return cls(status, body)


def contract_error(params: Any) -> str | None:
    """SGLang's generated contract check of `sampling_params` (a 400 with `error` as a string)."""
    if not isinstance(params, dict):
        return f"invalid type: {type(params).__name__}, expected struct SamplingParams"
    for key, value in params.items():
        if key not in SAMPLING_KEYS:
            expected = ", ".join(f"`{k}`" for k in SAMPLING_KEYS)
            return f"unknown field `{key}`, expected one of {expected}"
        if value is None:
            continue
        if key in _FLOAT_KEYS and (isinstance(value, bool) or not isinstance(value, (int, float))):
            return f"invalid type: {describe(value)}, expected f64"
        if key in _INT_KEYS and (isinstance(value, bool) or not isinstance(value, int)):
            return f"invalid type: {describe(value)}, expected i64"
    return None


def describe(value: Any) -> str:
    return f"string {json.dumps(value)}" if isinstance(value, str) else f"{type(value).__name__} `{value}`"
