"""backends.answer.read_json reads every body exactly as json.loads does, bounded in depth as before: orjson is
only its fast path (it refuses NaN and 1e400 and reads integers past 64 bits as floats; those go to json.loads)."""

from __future__ import annotations

import itertools
import json
import random
import re

import pytest

from backends.answer import (
    _BRACKET_STEP,
    _JSON_STRING,
    _NOT_BRACKETS,
    _RUNS_LOOKED_AT,
    _depth,
    _long_number,
    read_json,
)
from backends.base import BackendMalformed


def _reference_depth(data: bytes) -> int:
    """The depth bound as it was first written: strings dropped by a regex, a running count over brackets."""
    brackets = _JSON_STRING.sub(b"", data).translate(None, _NOT_BRACKETS)
    return max(itertools.accumulate(map(_BRACKET_STEP.__getitem__, brackets)), default=0)


def _read(data: bytes) -> object:
    return read_json(data, what="test: POST /generate", server="test", status=200, max_bytes=1 << 20)


@pytest.mark.parametrize(
    "body",
    [
        b"123456789012345678901234567890",  # orjson: a float
        b'{"output_ids": [1, 2, 18446744073709551616], "x": -9223372036854775809}',
        b"[-0.00012345678901234567, 1e-05, -2.312633478140924e-05]",  # long fractions stay floats
        b"[NaN, Infinity, -Infinity, 1e400]",  # orjson refuses these
        b'{"a": 1, "a": 2}',
        b'"\\ud800"',  # a lone surrogate
        b"\xef\xbb\xbf[1]",  # a BOM: not JSON for either, kept as text
        b"[1, 2",
        b"   ",
        b'{"k": "caf\xc3\xa9", "t": [true, false, null]}',
    ],
)
def test_read_json_reads_as_json_loads_does(body):
    expected: object
    try:
        expected = json.loads(body.decode("utf-8", errors="replace"))
    except ValueError:
        expected = body.decode("utf-8", errors="replace")
    got = _read(body)
    assert repr(got) == repr(expected)  # repr: an int stays an int, a float keeps every bit


def test_read_json_matches_json_loads_on_random_documents():
    rng = random.Random(0)

    def value(depth: int = 0) -> object:
        r = rng.random()
        if depth > 4 or r < 0.3:
            return rng.choice(
                [
                    rng.randint(-(10**25), 10**25),
                    rng.randint(-1000, 1000),
                    -rng.random() * 1e-3,
                    2**63,
                    -(2**63) - 1,
                    'q"[{\\',
                    None,
                    True,
                ]
            )
        if r < 0.6:
            return [value(depth + 1) for _ in range(rng.randint(0, 4))]
        return {str(rng.randint(0, 5)): value(depth + 1) for _ in range(rng.randint(0, 4))}

    for _ in range(1000):
        text = json.dumps(value()).encode()
        assert repr(_read(text)) == repr(json.loads(text))


def test_a_long_integer_is_found_among_the_fractions_vllms_logprobs_have():
    """`_long_number` against its definition (19 digits at the start or after a separator), on texts with
    up to twice the runs it looks at one by one: vLLM's logprobs (-0.00028248611488379542) put a run of 19
    digits after each '.', and an integer may come after all of them."""
    reference = re.compile(rb"(?:^|[,:\[\- \t\n\r])[0-9]{19}")
    rng = random.Random(2)
    pieces = [b"-0.0002824861148837954", b"1e-05", b"1.5e+1234567890123456789", b"12345678901234567890"]
    pieces += [b"x1234567890123456789", b'"1234567890123456789"', b"123", b", ", b"[", b"]", b":"]
    for _ in range(3000):
        parts = [rng.choice(pieces) for _ in range(rng.randint(0, 2 * _RUNS_LOOKED_AT + 4))]
        text = b"".join(parts)
        assert _long_number(text) == bool(reference.search(text)), text
    runs = b"[" + b", ".join([b"-0.0002824861148837954"] * (2 * _RUNS_LOOKED_AT)) + b"]"
    assert not _long_number(runs)
    assert _long_number(runs[:-1] + b", 12345678901234567890]")
    assert (
        read_json(
            runs[:-1] + b", 12345678901234567890]", what="t", server="t", status=200, max_bytes=1 << 20
        )[-1]
        == 12345678901234567890
    )


def test_depth_is_the_running_count_of_brackets_outside_strings():
    rng = random.Random(1)
    for n in range(5000):
        data = bytes(rng.choice(b'[]{}"x\\' if n % 2 else b'[]{}"x') for _ in range(rng.randint(0, 40)))
        assert _depth(data) == _reference_depth(data), data
    deep = b"[" * 65 + b"]" * 65
    with pytest.raises(BackendMalformed, match="JSON nested 65 levels deep, past the 64-level bound"):
        _read(deep)
    assert _read(b'["' + b"[" * 100 + b'"]') == ["[" * 100]  # brackets in a string do not nest
