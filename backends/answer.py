"""The trust boundary for model servers: one check of every `/generate` answer before it becomes a turn.

A server is outside the trust boundary (../README.md "What can go wrong"): a bug, a proxy or a hostile peer can
answer 200 with ids outside the vocabulary, NaN or positive logprobs, tokens past a stop id, more tokens than
were asked for, a weight-version span of a billion tokens or a string where a count belongs. Each of these
would enter `responses` or `rollout_log_probs` as a plausible row and fail a trainer many steps later, so every
answer is checked here, once, in the client (backends/sglang.py), and a violation raises `BackendMalformed`
with a kind that names it. That makes it a server fault like a 5xx: counted by kind, retried, failed over, and
past the retry budget an error row naming the server. The checks are C-speed builtins over the lists
(`min`, `max`, `all(map(...))`), cheap next to the HTTP exchange.

What is accepted, exactly:
- `output_ids`: ints (not bools) in [0, vocab_size) (vocab_size from the request; unchecked above 0 when
  unknown), at most `max_new_tokens`, no stop id before the last position (SGLang ends a turn at its first
  stop id);
- `output_token_logprobs`: [logprob, id, text] triples whose logprobs are finite real numbers <= 0 and whose
  ids are the output ids, position by position (entries for other tokens are logprobs of another answer);
- `prompt_tokens`, `cached_tokens`: absent, null or non-negative ints;
- `weight_version`: absent, null, a string or an int, kept as a string of at most 256 characters;
- `meta_info.weight_versions`: well-formed spans are expanded only when they cover exactly the output.
Whatever the checks themselves trip on (a number too large for a float, a triple too short to index) is a
malformed answer too, never an exception of another type: the engine would end the row outside the server-fault
path (no count, no failover).

Every JSON body a server sends (answers, errors, info) is read by `read_json`, bounded in size and nesting
depth before `json.loads` sees it: a 50,000-deep body would raise RecursionError inside the decoder (or later,
in whatever walks it), which is not a server fault either.
"""

from __future__ import annotations

import json
import math
import re
from itertools import accumulate
from operator import itemgetter
from typing import Any

import orjson

from backends.base import BackendMalformed, GenerateRequest, GenerateResult

# Kinds of malformed answers, counted in a client's stats()["faults"] beside the transport faults.
ANSWER_FAULTS = ("malformed", "bad_ids", "bad_logprobs", "past_stop", "over_budget", "bad_fields", "oversize")
MAX_TOKEN_ID = 2**31 - 1  # trajectories hold ids as int32
MAX_VERSION_CHARS = 256
# A /generate body is bounded by what was asked: a fixed allowance plus this much per token asked for (ids,
# logprob triples with their text, spans) is far above any real answer and far below a memory problem.
BODY_BASE_BYTES = 1 << 20
BODY_BYTES_PER_TOKEN = 4096
DEFAULT_MAX_NEW_TOKENS = 128  # SGLang's default when the key is absent
# SGLang's deepest answer (top logprobs) nests 5 levels and its server info a few more; far below the
# interpreter's recursion limit, which every walk of the parsed value (json.dumps for a message) shares.
MAX_JSON_DEPTH = 64
_JSON_STRING = re.compile(rb'"[^"\\]*+(?:\\.[^"\\]*+)*+"')  # brackets inside strings do not nest
_NOT_BRACKETS = bytes(b for b in range(256) if b not in b"[]{}")
_BEFORE_NUMBER = frozenset(b",:[- \t\n\r")  # what a JSON number can follow (and "-")
# digits -> "0", what a JSON number can follow -> ",", anything else -> "x"
_NUMBER_CLASSES = bytes(
    ord("0") if b in b"0123456789" else ord(",") if b in _BEFORE_NUMBER else ord("x") for b in range(256)
)
_LONG_INT_REVERSED = b"0" * 19 + b","
_RUNS_LOOKED_AT = (
    32  # runs of 19 digits looked at one by one (a vLLM answer has a few); past them, one search
)
_DIGITS = bytes(ord("0") if b in b"0123456789" else ord("x") for b in range(256))  # digits -> "0", else "x"
_NINETEEN_DIGITS = b"0" * 19
_SQUARE = bytes.maketrans(b"{}", b"[]")  # one kind of bracket: depth does not tell them apart
_NOT_QUOTES_OR_BRACKETS = bytes(b for b in range(256) if b not in b'[]{}"')
_BRACKET_STEP = [1 if b in b"[{" else -1 if b in b"]}" else 0 for b in range(256)]


def _depth(data: bytes) -> int:
    """How deep the JSON text `data` nests: strings dropped, then the brackets left measured. Linear, C-speed.

    Strings are dropped in the common case by keeping only quotes and brackets: when no string holds a bracket
    or an escape, each string is then an adjacent pair of quotes, removed in one replace; otherwise a regex that
    knows escapes drops them. Balanced brackets lose one level per pass of removing every innermost pair (a
    few passes for an answer); unbalanced ones get a running count."""
    outside = b""
    if b"\\" not in data:
        outside = data.translate(_SQUARE, _NOT_QUOTES_OR_BRACKETS).replace(b'""', b"")
    if not outside or b'"' in outside:  # a bracket inside a string, an escape or a string left open
        outside = _JSON_STRING.sub(b"", data).translate(_SQUARE, _NOT_BRACKETS)
    brackets = outside.replace(b'"', b"")
    left, passes = brackets, 0
    while left and passes <= MAX_JSON_DEPTH:
        shorter = left.replace(b"[]", b"")
        if len(shorter) == len(left):
            break
        left, passes = shorter, passes + 1
    if not left:
        return passes
    return max(accumulate(map(_BRACKET_STEP.__getitem__, brackets)), default=0)


def _long_number(data: bytes) -> bool:
    """Whether `data` may hold an integer of 19 digits or more, which orjson reads as a float (json.loads as an
    int): a run of 19 digits at the start or after a separator (a float's digits follow '.' or 'e'). One
    translation shows where the runs of 19 digits are: most bodies have none, and a vLLM answer a few, each a
    logprob's fraction, so each run's byte before is looked at; a body with more runs than that is searched
    whole, backwards, where the needle ends in the rarer separator and the search skips along."""
    digits = data.translate(_DIGITS)
    at = digits.find(_NINETEEN_DIGITS)
    for _ in range(_RUNS_LOOKED_AT):  # `at` starts a run: a digit before it would have matched there
        if at < 0:
            return False
        if at == 0 or data[at - 1] in _BEFORE_NUMBER:
            return True
        end = digits.find(b"x", at)  # the run's end, then the next run of 19
        if end < 0:
            return False
        at = digits.find(_NINETEEN_DIGITS, end)
    return at >= 0 and _LONG_INT_REVERSED in (b"," + data).translate(_NUMBER_CLASSES)[::-1]


def read_json(
    data: bytes,
    *,
    what: str,
    server: str,
    status: int | None,
    max_bytes: int,
    max_depth: int = MAX_JSON_DEPTH,
) -> Any:
    """A server's body -> its JSON value; the text when it is not JSON (an error page; None when empty).

    Bounded: a body past `max_bytes` or nested past `max_depth` raises BackendMalformed ("oversize",
    "malformed") naming `what` (server, method and path), as does anything else the decoder raises."""

    def bad(kind: str, why: str) -> BackendMalformed:
        return BackendMalformed(
            f"{what}: answered {status} with {why}; a server fault", server=server, status=status, kind=kind
        )

    if len(data) > max_bytes:
        raise bad("oversize", f"a body of {len(data)} bytes, past the {max_bytes}-byte bound")
    if not data:
        return None
    # no deeper than its opening brackets, strings' included: a short answer needs no closer look
    if data.count(b"[") + data.count(b"{") > max_depth:
        depth = _depth(data)
        if depth > max_depth:
            raise bad("malformed", f"JSON nested {depth} levels deep, past the {max_depth}-level bound")
    if not _long_number(data):  # orjson reads JSON 4x faster; what it refuses (NaN, 1e400, bad UTF-8) and
        try:  # the integers it would read as floats go the old way
            return orjson.loads(data)
        except orjson.JSONDecodeError:
            pass
    text = data.decode("utf-8", errors="replace")
    try:
        return json.loads(text)
    except ValueError:
        return text
    except (RecursionError, MemoryError, OverflowError) as e:  # bounded above; kept as a net
        raise bad("malformed", f"JSON the decoder could not read ({type(e).__name__})") from None


def body_limit(request: GenerateRequest) -> int:
    """The most bytes a /generate answer to `request` may have."""
    asked = request.sampling_params.get("max_new_tokens")
    asked = DEFAULT_MAX_NEW_TOKENS if asked is None else max(0, int(asked))
    return BODY_BASE_BYTES + BODY_BYTES_PER_TOKEN * asked


def snippet(value: Any, n: int = 120) -> str:
    text = value if isinstance(value, str) else json.dumps(value, default=repr)[: n + 1]
    text = " ".join(text.split())
    return repr(text[:n] + ("..." if len(text) > n else ""))


def _is_int_list(value: Any) -> bool:
    return isinstance(value, list) and set(map(type, value)) <= _INT  # C-speed: no generator step per id


_INT, _LIST, _FLOAT = {int}, {list}, {float}
_REAL_TYPES = frozenset({float, int})  # bools are not numbers here
_FIRST, _SECOND = itemgetter(0), itemgetter(1)


def parse_generate(
    body: Any,
    *,
    server: str,
    return_logprob: bool,
    rid: str | None = None,
    request: GenerateRequest | None = None,
) -> GenerateResult:
    """One /generate response object -> a checked GenerateResult. Optional keys stay optional (waiting-queue
    aborts); anything outside the contract raises BackendMalformed, so it is retried, never taken as a turn.
    With `request`, the answer is also held to what was asked (vocabulary, max_new_tokens, stop ids)."""
    try:
        return _parse_generate(body, server=server, return_logprob=return_logprob, rid=rid, request=request)
    except BackendMalformed:
        raise
    except Exception as e:  # a shape no check foresaw: still a counted server fault, never a crash of the row
        raise BackendMalformed(
            f"{server}: /generate (rid {rid}) answered 200 with a body the check could not "
            f"read ({type(e).__name__}: {str(e)[:120]}); a server fault",
            server=server,
            status=200,
            kind="malformed",
        ) from None


def _parse_generate(
    body: Any, *, server: str, return_logprob: bool, rid: str | None, request: GenerateRequest | None
) -> GenerateResult:
    def bad(kind: str, what: str) -> BackendMalformed:
        return BackendMalformed(
            f"{server}: /generate (rid {rid}) answered 200 with {what}; a server fault",
            server=server,
            status=200,
            kind=kind,
        )

    if isinstance(body, list) and len(body) == 1:  # never sent as a batch, but be exact about what came back
        body = body[0]
    if not isinstance(body, dict):
        raise bad("malformed", f"JSON {type(body).__name__} {snippet(body)} instead of a response object")
    out, meta = body.get("output_ids"), body.get("meta_info")
    fr = meta.get("finish_reason") if isinstance(meta, dict) else None
    if not _is_int_list(out) or not isinstance(fr, dict) or fr.get("type") not in ("stop", "length", "abort"):
        raise bad("malformed", f"a body without output_ids and meta_info.finish_reason: {snippet(body)}")
    assert isinstance(meta, dict) and isinstance(out, list)
    if request is not None:
        _check_ids(out, request, bad)
    kind = fr["type"]
    extra: dict[str, Any] = {"id": meta.get("id"), "finish": fr}
    if kind == "abort":  # SGLang answers a waiting-queue abort without prompt_tokens
        extra["abort_kind"] = "running" if "prompt_tokens" in meta else "waiting"
    logprobs = _logprobs(meta.get("output_token_logprobs"), out, kind, extra, bad) if return_logprob else None
    counts = {}
    for key in ("prompt_tokens", "cached_tokens"):
        value = meta.get(key)
        if value is not None and (type(value) is not int or value < 0):
            raise bad("bad_fields", f"meta_info.{key} {snippet(value)}, not a non-negative integer")
        counts[key] = value
    version = meta.get("weight_version")
    if version is not None:
        if type(version) not in (str, int) or len(str(version)) > MAX_VERSION_CHARS:
            raise bad("bad_fields", f"meta_info.weight_version {snippet(version)}, not a short string")
        version = str(version)
    try:
        versions = token_versions(meta.get("weight_versions"), len(out))
    except ValueError as e:
        raise bad("bad_fields", f"meta_info.weight_versions that cannot describe the output: {e}") from None
    if versions is not None:
        extra["token_versions"] = versions
    message = fr.get("message") if kind == "abort" else None
    return GenerateResult(
        token_ids=out,
        logprobs=logprobs,
        finish_reason=kind,
        prompt_tokens=counts["prompt_tokens"],
        cached_tokens=counts["cached_tokens"],
        weight_version=version,
        server=server,
        abort_message=message if message is None or isinstance(message, str) else repr(message),
        extra=extra,
    )


def _check_ids(out: list[int], request: GenerateRequest, bad: Any) -> None:
    """Ids the engine can decode and the trainer can embed; no more than asked; nothing after a stop id."""
    if not out:
        return
    vocab = request.vocab_size or MAX_TOKEN_ID + 1
    low, high = min(out), max(out)
    if low < 0 or high >= vocab:
        wrong = low if low < 0 else high
        raise bad("bad_ids", f"token id {wrong} outside the vocabulary [0, {vocab})")
    asked = request.sampling_params.get("max_new_tokens")
    if asked is not None and len(out) > asked:
        raise bad("over_budget", f"{len(out)} output ids where max_new_tokens was {asked}")
    stops = request.sampling_params.get("stop_token_ids")
    if stops and not request.sampling_params.get("ignore_eos"):
        early = set(out[:-1]).intersection(stops)
        if early:
            at = next(i for i, t in enumerate(out) if t in early)
            raise bad("past_stop", f"{len(out) - at - 1} token(s) after stop id {out[at]} (at position {at})")


def _logprobs(triples: Any, out: list[int], kind: str, extra: dict[str, Any], bad: Any) -> list[float] | None:
    """The logprob of each output id from SGLang's [logprob, id, text] triples; None when not given."""
    if triples is None:
        extra["logprobs_missing"] = True  # asked for, not given: never invent values
        return None
    if type(triples) is list and len(triples) == len(out) and (plain := _plain_logprobs(triples, out)):
        return plain
    if not isinstance(triples, list) or not all(
        isinstance(t, list) and t and type(t[0]) in _REAL_TYPES for t in triples
    ):
        raise bad(
            "bad_logprobs",
            f"output_token_logprobs that are not [logprob, id, text] triples: {snippet(triples)}",
        )
    values: list[float] | None
    if len(triples) == len(out):
        _same_ids(triples, out, bad)
        values = _floats(triples, bad)
    elif not out:
        values = []  # phantom entry with max_new_tokens=0
    elif len(triples) > len(out) and [t[1] if len(t) > 1 else None for t in triples[-len(out) :]] == out:
        values = _floats(triples[-len(out) :], bad)  # leading phantom entry
    elif kind == "abort":
        extra["logprobs_missing"] = True  # aborts may carry no logprob payload; never invent values
        return None
    else:
        raise bad("bad_logprobs", f"{len(triples)} output logprobs for {len(out)} output ids")
    if values and (not all(map(math.isfinite, values)) or max(values) > 0.0):
        wrong = next(v for v in values if not math.isfinite(v) or v > 0.0)
        raise bad("bad_logprobs", f"logprob {wrong!r}: logprobs are finite and <= 0")
    return values


def _plain_logprobs(triples: list[Any], out: list[int]) -> list[float] | None:
    """The common answer's logprobs (one well-formed triple per output id) in C-speed passes, once per model call;
    None for anything else, which `_logprobs` then reads closely to name the fault."""
    if set(map(type, triples)) != _LIST:
        return None
    try:
        ids, firsts = list(map(_SECOND, triples)), list(map(_FIRST, triples))
    except IndexError:  # a short triple
        return None
    if not firsts or ids != out or set(map(type, ids)) != _INT:
        return None  # a bool is an int that == 1: types are checked, not only values
    kinds = set(map(type, firsts))
    if kinds == _FLOAT:
        values = firsts  # floats already, as JSON's decoders read "-0.5": no second list
    elif kinds <= _REAL_TYPES:
        try:
            values = list(map(float, firsts))
        except OverflowError:
            return None
    else:
        return None
    # every value finite: their sum is (a NaN or an infinity makes it NaN or infinite; a sum that overflows
    # only sends the answer to the close read)
    return values if max(values) <= 0.0 and math.isfinite(sum(values)) else None


def _same_ids(triples: list[list[Any]], out: list[int], bad: Any) -> None:
    """Each entry is the logprob of the output id at its position: entries for other tokens (right count, wrong
    ids) would enter rollout_log_probs as plausible values and corrupt every importance ratio trained on them."""
    ids = [t[1] if len(t) > 1 else None for t in triples]
    if ids != out or (ids and set(map(type, ids)) != {int}):  # True == 1: an id is an int, never a bool
        at = next(i for i, (a, b) in enumerate(zip(ids, out)) if a != b or type(a) is not int)
        raise bad(
            "bad_logprobs",
            f"a logprob entry for token id {snippet(ids[at], 20)} at position {at}, where the "
            f"output id is {out[at]}: logprobs for other tokens",
        )


def _floats(triples: list[list[Any]], bad: Any) -> list[float]:
    """The triples' logprobs as floats; an integer too large for a float (JSON allows 400 digits) is bad."""
    try:
        return [float(t[0]) for t in triples]
    except OverflowError:
        wrong = next(t[0] for t in triples if abs(t[0]) > 1e308)
        raise bad("bad_logprobs", f"logprob {snippet(str(wrong), 40)}: too large for a float") from None


def token_versions(spans: Any, n: int) -> list[str] | None:
    """`meta_info.weight_versions` ([{version, start, end}] over output positions, when the server reports
    which weights made which tokens: a request held across a weight update has two) -> one version per
    output token; None when absent or covering fewer tokens (the answer's weight_version then stands for
    all). Spans are checked before any is expanded: one that cannot describe this output (past its end,
    overlapping, ill-typed) raises ValueError, so a span claiming a billion tokens costs nothing."""
    if spans is None or spans == []:
        return None
    if not isinstance(spans, list) or len(spans) > n + 1:
        raise ValueError(f"{len(spans) if isinstance(spans, list) else snippet(spans)} spans for {n} tokens")
    at = 0
    for span in spans:
        end = span.get("end") if isinstance(span, dict) else None
        version = span.get("version") if isinstance(span, dict) else None
        if (
            not isinstance(span, dict)
            or span.get("start") != at
            or type(end) is not int
            or not at <= end <= n
            or type(version) not in (str, int)
            or len(str(version)) > MAX_VERSION_CHARS
        ):
            raise ValueError(f"span {snippet(span)} after position {at} of {n} tokens (end {end})")
        at = end
    if at != n:
        return None
    out: list[str] = []
    for span in spans:
        out += [str(span["version"])] * (span["end"] - span["start"])
    return out
