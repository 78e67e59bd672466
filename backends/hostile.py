"""Hostile /generate answers: a real answer, rewritten the way a buggy or malicious server would send it.

backends/faults.py passes a real server's answer through one of the functions below (HOSTILE) before sending
it on. Each returns the new body, or None when this answer cannot carry the fault (a one-token answer has no
position after a stop id): nothing is injected then. What the client must make of each is backends/answer.py's.
Some are JSON edge cases rather than wrong values: a 400-digit logprob, logprob entries too short to index, a
body nested 50,000 levels deep.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

OUT_OF_VOCAB_ID = 9999  # far past any test tokenizer, inside int32
OVERSIZE_BYTES = 8 << 20  # past the client's bound for any test request (backends/answer.body_limit)


def _ids_and_triples(answer: dict[str, Any]) -> tuple[list[int], list[list[Any]] | None]:
    meta = answer.setdefault("meta_info", {})
    return answer["output_ids"], meta.get("output_token_logprobs")


def out_of_vocab(answer: dict[str, Any], sent: dict[str, Any]) -> dict[str, Any] | None:
    ids, triples = _ids_and_triples(answer)
    if not ids:
        return None
    ids[-1] = OUT_OF_VOCAB_ID
    if triples:
        triples[-1][1] = OUT_OF_VOCAB_ID
    return answer


def negative_id(answer: dict[str, Any], sent: dict[str, Any]) -> dict[str, Any] | None:
    ids, triples = _ids_and_triples(answer)
    if not ids:
        return None
    ids[0] = -5
    return answer


def _set_logprob(value: Any) -> Callable[[dict[str, Any], dict[str, Any]], dict[str, Any] | None]:
    def corrupt(answer: dict[str, Any], sent: dict[str, Any]) -> dict[str, Any] | None:
        _, triples = _ids_and_triples(answer)
        if not triples:
            return None
        triples[len(triples) // 2][0] = value
        return answer

    return corrupt


def past_stop(answer: dict[str, Any], sent: dict[str, Any]) -> dict[str, Any] | None:
    """A stop id first, the rest of the answer after it (SGLang ends a turn at its first stop id)."""
    ids, triples = _ids_and_triples(answer)
    stops = (sent.get("sampling_params") or {}).get("stop_token_ids") or []
    if len(ids) < 2 or not stops:
        return None
    ids[0] = stops[0]
    if triples:
        triples[0][1] = stops[0]
    return answer


def more_than_asked(answer: dict[str, Any], sent: dict[str, Any]) -> dict[str, Any] | None:
    ids, triples = _ids_and_triples(answer)
    asked = (sent.get("sampling_params") or {}).get("max_new_tokens")
    if not ids or asked is None:
        return None
    extra = asked - len(ids) + 3
    ids += [ids[0]] * extra
    if triples:
        triples += [list(triples[0]) for _ in range(extra)]
    return answer


def timestamp_version(answer: dict[str, Any], sent: dict[str, Any]) -> dict[str, Any] | None:
    """A trainer's timestamp as the weight version: a valid SGLang form (absorbed: mapped, not stored raw)."""
    meta = answer.setdefault("meta_info", {})
    meta["weight_version"] = "1735689600123"
    meta["weight_versions"] = [{"version": "1735689600123", "start": 0, "end": len(answer["output_ids"])}]
    return answer


def huge_version_span(answer: dict[str, Any], sent: dict[str, Any]) -> dict[str, Any] | None:
    answer.setdefault("meta_info", {})["weight_versions"] = [{"version": "0", "start": 0, "end": 10**8}]
    return answer


def string_count(answer: dict[str, Any], sent: dict[str, Any]) -> dict[str, Any] | None:
    answer.setdefault("meta_info", {})["cached_tokens"] = "5"
    return answer


def short_triples_phantom(answer: dict[str, Any], sent: dict[str, Any]) -> dict[str, Any] | None:
    """One-element logprob "triples", one more than the output ids (the leading phantom entry's shape)."""
    ids, triples = _ids_and_triples(answer)
    if not ids or triples is None:
        return None
    answer["meta_info"]["output_token_logprobs"] = [[-0.0]] + [[t[0]] for t in triples]
    return answer


def mismatched_logprob_ids(answer: dict[str, Any], sent: dict[str, Any]) -> dict[str, Any] | None:
    """As many logprob entries as output ids, each for another token (the id's lowest bit flipped): logprobs of
    another answer, which a check of the counts alone takes for this one's."""
    ids, triples = _ids_and_triples(answer)
    if not ids or not triples or len(triples) != len(ids):
        return None
    for triple, token in zip(triples, ids):
        triple[1] = token ^ 1
    return answer


def empty_length(answer: dict[str, Any], sent: dict[str, Any]) -> dict[str, Any] | None:
    """No tokens, finish "length", where more were asked: only a full context answers that (docs/engines.md),
    so the row must end `context_length`, never `done` with an empty turn."""
    asked = (sent.get("sampling_params") or {}).get("max_new_tokens")
    if asked == 0:
        return None
    meta = answer.setdefault("meta_info", {})
    answer["output_ids"] = []
    meta["finish_reason"] = {"type": "length", "length": 0}
    for key in ("output_token_logprobs", "weight_versions"):
        if key in meta:
            meta[key] = []
    if "output_token_logprobs_length" in meta:
        meta["output_token_logprobs_length"] = 0
    return answer


DEEP_LEVELS = 50_000


def deep_json(answer: dict[str, Any], sent: dict[str, Any]) -> bytes:
    """The real answer with one more key nested 50,000 levels deep (json.loads raises RecursionError)."""
    body = json.dumps(answer).encode()
    return body[:-1] + b', "extra": ' + b"[" * DEEP_LEVELS + b"]" * DEEP_LEVELS + b"}"


def oversize(answer: dict[str, Any], sent: dict[str, Any]) -> dict[str, Any] | None:
    answer["text"] = "x" * OVERSIZE_BYTES
    return answer


# kind -> (rewrite, the client's fault counter for it, or None when the client absorbs it). A rewrite answers
# the new body (a dict, or the bytes themselves where JSON's encoder cannot write it), or None.
Rewrite = Callable[[dict[str, Any], dict[str, Any]], dict[str, Any] | bytes | None]
HOSTILE: dict[str, tuple[Rewrite, str | None]] = {
    "out_of_vocab": (out_of_vocab, "bad_ids"),
    "negative_id": (negative_id, "bad_ids"),
    "nan_logprob": (_set_logprob(float("nan")), "bad_logprobs"),
    "inf_logprob": (_set_logprob(float("-inf")), "bad_logprobs"),
    "positive_logprob": (_set_logprob(7.5), "bad_logprobs"),
    "bool_logprob": (_set_logprob(True), "bad_logprobs"),
    "past_stop": (past_stop, "past_stop"),
    "more_than_asked": (more_than_asked, "over_budget"),
    "timestamp_version": (timestamp_version, None),
    "huge_version_span": (huge_version_span, "bad_fields"),
    "string_count": (string_count, "bad_fields"),
    "oversize": (oversize, "oversize"),
    "huge_logprob": (_set_logprob(-(10**399)), "bad_logprobs"),  # valid JSON, too large for a float
    "short_triples_phantom": (short_triples_phantom, "bad_logprobs"),
    "deep_json": (deep_json, "malformed"),
    "mismatched_logprob_ids": (mismatched_logprob_ids, "bad_logprobs"),
    "empty_length": (empty_length, None),  # absorbed: the row ends context_length (CUT_KINDS)
}
# Kinds a client cannot tell from a real answer: the row it lands on ends `context_length`, shorter than the
# fault-free row, and says so; no other row changes.
CUT_KINDS = ("empty_length",)


def rewrite(kind: str, data: bytes, sent: bytes) -> bytes | None:
    """The upstream answer `data` to the request body `sent`, rewritten as `kind`; None if it cannot be."""
    try:
        answer, request = json.loads(data), json.loads(sent or b"{}")
    except ValueError:
        return None
    if not isinstance(answer, dict) or not isinstance(answer.get("output_ids"), list):
        return None
    out = HOSTILE[kind][0](answer, request)
    if out is None or isinstance(out, bytes):
        return out
    return json.dumps(out).encode()  # NaN and Infinity as JSON's common extension
