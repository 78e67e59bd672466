"""SGLang's wire contract as the dev server (backends/devserver.py) speaks it: the /generate request checks
(SamplingParams fields, their types, the length limits and SGLang's error bodies and texts), so a client that
passes the dev server sends what a real server accepts; and the bodies of SGLang's answers. Each shape
here follows real SGLang 0.5.23's recorded answers (tests/fixtures/sglang, compared by
tests/test_devserver_fidelity.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from backends.base import GenerateResult

VERSION = "0.5.23"  # the SGLang release whose wire format the dev server speaks

# SGLang's SamplingParams fields; anything else in `sampling_params` is a 400 contract violation.
# (In SGLang's order: its "unknown field" message lists them so.)
SAMPLING_KEYS = tuple(
    "max_new_tokens stop stop_token_ids stop_regex temperature top_p top_k min_p frequency_penalty "
    "presence_penalty repetition_penalty min_new_tokens n json_schema regex ebnf structural_tag "
    "ignore_eos skip_special_tokens spaces_between_special_tokens no_stop_trim stream_interval logit_bias "
    "sampling_seed custom_params beam_width watermark choice".split()
)
INPUT_MARGIN = 6  # SGLang's max_req_input_len is the context length - 6; an input that long is refused
OUTPUT_MARGIN = 2  # and max_new_tokens is cut, silently, so that input + output <= context length - 2
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

    def event(self) -> dict[str, Any]:
        """This refusal as the error event of a stream (SGLang sends it in the stream, with status 200)."""
        error = self.body.get("error")
        err = error if isinstance(error, dict) else {"message": self.body.get("message")}
        err = {**err, "type": "invalid_request_error", "code": self.status, "retryable": self.status >= 500}
        return {"error": err}


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


def admit_lengths(n_input: int, max_new: int | None, context_length: int) -> int:
    """SGLang's length checks of one request: raises Refused with its words, else the max_new_tokens it runs
    (absent: 128; cut to the room left, as SGLang cuts it without a word)."""
    if n_input >= context_length:
        raise Refused.value_error(
            f"The input ({n_input} tokens) is longer than the model's context length ({context_length} tokens)."
        )
    limit = context_length - INPUT_MARGIN
    if n_input >= limit:
        raise Refused.value_error(
            f"Input length ({n_input} tokens) exceeds the maximum allowed length ({limit} "
            "tokens). Use a shorter input or enable --allow-auto-truncate."
        )
    room = context_length - OUTPUT_MARGIN - n_input
    if max_new is None:
        return min(128, room)
    if max_new < 0:
        raise Refused.value_error(f"max_new_tokens must be at least 0, got {max_new}.")
    if max_new + n_input > context_length:
        raise Refused.value_error(
            f"Requested token count exceeds the model's maximum context length of {context_length} tokens. "
            f"You requested a total of {max_new + n_input} tokens: {n_input} tokens from the input messages and "
            f"{max_new} tokens for the completion. Please reduce the number of tokens in the input messages or the "
            f"completion to fit within the limit."
        )
    return min(max_new, room)


def version_spans(versions: list[str], version: str) -> list[dict[str, Any]]:
    """Per-token weight versions -> SGLang's `weight_versions` [{version, start, end}] runs; SGLang sends one
    empty span (the current version) for a request that made no token."""
    spans: list[dict[str, Any]] = []
    for i, v in enumerate(versions):
        if spans and spans[-1]["version"] == v:
            spans[-1]["end"] = i + 1
        else:
            spans.append({"version": v, "start": i, "end": i + 1})
    return spans or [{"version": version, "start": 0, "end": 0}]


@dataclass(eq=False)
class Live:
    """A /generate request while the dev server holds it, and what its answer reports of it."""

    rid: str
    task: asyncio.Task[GenerateResult] | None = None
    started: bool = False  # left the waiting queue
    cached: int = 0
    max_new: int = 128  # as run: cut to the room left in the context
    t0: float = field(default_factory=time.time)


def generate_answer(
    rec: Live,
    prompt_tokens: int,
    res: GenerateResult | None,  # None: aborted before any output
    version: str,  # the server's weight version now
    logprob: bool,
    upto: int | None = None,  # a streaming chunk's cumulative length; None for the final object
) -> dict[str, Any]:
    """The /generate answer object, key for key as SGLang 0.5.23 orders it (tests/fixtures/sglang)."""
    rid, cached = rec.rid, rec.cached
    out = list(res.token_ids) if res is not None else []
    lps = (res.logprobs if res is not None else None) or []
    if upto is not None:
        out, lps = out[:upto], lps[:upto]
    lp_keys: dict[str, Any] = {}
    if logprob:
        triples = [[lp, tok, None] for lp, tok in zip(lps, out)]
        lp_keys = {
            "input_token_logprobs": [],
            "output_token_logprobs": triples,
            "output_token_logprobs_length": len(triples),
        }
    latency = round(time.time() - rec.t0, 6)
    versions = list(res.extra.get("token_versions") or []) if res is not None else []
    versions = versions[: len(out)] if len(versions) >= len(out) else [version] * len(out)
    spans = version_spans(versions, version)  # always there; one empty span for no tokens
    if (res is None and not rec.started) or (res is not None and res.extra.get("waiting")):
        # aborted in the waiting queue: "text" even without a tokenizer, no prompt/cached tokens
        meta = {
            "id": rid,
            "finish_reason": {"type": "abort", "message": "Abort in waiting queue"},
            "weight_version": version,
            "e2e_latency": latency,
            "weight_versions": spans,
            **lp_keys,
            "completion_tokens": 0,
            "response_sent_to_client_ts": time.time(),
        }
        return {"text": "", "output_ids": [], "meta_info": meta}
    if upto is not None:
        finish: Any = None
    elif res is None or res.finish_reason == "abort":
        message = res.abort_message if res is not None and res.abort_message else "Aborted"
        finish = {"type": "abort", "message": message, "status_code": None, "err_type": None}
    elif res.finish_reason == "length":
        finish = {"type": "length", "length": rec.max_new}
    else:
        finish = {"type": "stop", "matched": out[-1] if out else None}
    meta = {
        "id": rid,
        "finish_reason": finish,
        "prompt_tokens": prompt_tokens,
        "weight_version": version,
        "num_retractions": res.extra.get("num_retractions", 0) if res is not None else 0,
        **lp_keys,
        "reasoning_tokens": 0,
        "completion_tokens": len(out),
        "cached_tokens": cached,
    }
    if upto is None:
        meta["weight_versions"] = spans
    meta["cached_tokens_details"] = {"device": cached, "host": 0} if cached else None
    meta["dp_rank"] = None
    if upto is None:
        meta["e2e_latency"] = latency
    if upto is None or upto == 1:  # SGLang stamps the first chunk of a stream and the final answer
        meta["response_sent_to_client_ts"] = time.time()
    return {"output_ids": out, "meta_info": meta}


# /model_info's `embedding`: what SGLang says of a generation model's embedding support (none).
EMBEDDING_INFO: dict[str, Any] = {
    "family": "none",
    "task": "none",
    "execution": "none",
    "attention": "none",
    "pooling": "model_defined",
    "normalize": False,
    "postprocessor": "none",
    "tokenizer_special_tokens": "model_default",
    "supports_dimensions": False,
    "supports_token_embeddings": False,
    "supports_multimodal": False,
    "requires_embedding_flag": False,
    "auto_enable_embedding": False,
    "bcg_eligibility": "disabled",
    "safe_disable_kv_cache": False,
    "safe_disable_radix_cache": False,
    "safe_disable_chunked_prefill": False,
    "enabled": False,
    "matryoshka_dimensions": [],
    "bcg": {
        "prefill_backend": "disabled",
        "enabled": False,
        "capture_token_budget": 4096,
        "capture_batch_sizes": [4],
    },
    "cache": {"kv_cache_disabled": False, "radix_cache_disabled": False, "chunked_prefill_disabled": False},
}


def loads(*, running: int, waiting: int, used: int, capacity: int, hit_rate: float) -> dict[str, Any]:
    """`/v1/loads` with SGLang's keys, one entry; what the dev server does not measure is 0."""
    entry = {
        "timestamp": time.time(),
        "dp_rank": 0,
        "num_running_reqs": running,
        "num_waiting_reqs": waiting,
        "num_waiting_uncached_tokens": 0,
        "num_used_tokens": used,
        "num_total_tokens": used,
        "num_active_tokens": 0,
        "num_prealloc_ready_tokens": 0,
        "max_total_num_tokens": capacity,
        "max_running_requests": 4096,
        "token_usage": used / max(1, capacity),
        "gen_throughput": 0.0,
        "cache_hit_rate": hit_rate,
        "utilization": 0.0,
        "total_prefill_uncached_tokens": 0,
        "total_prefill_busy_us": 0,
        "decode_moments": [0.0] * 6,
        "memory": {"weight_gb": 0.0, "kv_cache_gb": 0.0, "graph_gb": 0.0, "token_capacity": capacity},
        "disaggregation": {
            "mode": "null",
            "prefill_bootstrap_queue_reqs": 0,
            "prefill_inflight_queue_reqs": 0,
            "decode_prealloc_queue_reqs": 0,
            "decode_transfer_queue_reqs": 0,
            "decode_retracted_queue_reqs": 0,
            "kv_transfer_speed_gb_s": 0.0,
            "kv_transfer_latency_ms": 0.0,
        },
        "queues": {"waiting": waiting, "grammar": 0, "paused": 0, "retracted": 0, "prealloc_ready": 0},
    }
    stamp = datetime.datetime.now(datetime.UTC).isoformat()
    return {
        "timestamp": stamp,
        "version": VERSION,
        "accelerator": None,
        "num_accelerators": 1,
        "loads": [entry],
    }


def model_info(model_path: str, served_model_name: str, tokenizer_path: str, version: str) -> dict[str, Any]:
    """/model_info; model_type and architectures from the model's config.json (None for a backend without one)."""
    config: Any = {}
    with contextlib.suppress(OSError, ValueError):
        config = json.loads((Path(model_path) / "config.json").read_text())
    config = config if isinstance(config, dict) else {}
    return {
        "model_path": model_path,
        "served_model_name": served_model_name,
        "tokenizer_path": tokenizer_path,
        "is_generation": True,
        "preferred_sampling_params": None,
        "weight_version": version,
        "load_format": "auto",
        "reasoning_parser": None,
        "tool_call_parser": None,
        "disaggregation_mode": "null",
        "has_image_understanding": False,
        "has_audio_understanding": False,
        "model_type": config.get("model_type"),
        "architectures": config.get("architectures"),
        "embedding": EMBEDDING_INFO,
    }
