"""The parser cases of `agentfsm bench faults`: per family, a model turn of 16,000 repeated call openers and
no closer (read in linear time: milliseconds where lazy regexes took 18-75 s), and calls whose arguments are
hostile (100,000 levels deep, a 5,000-digit integer, NaN, 1e999): each must be answered as a malformed call,
never raise. Uses the families' small test tokenizers (real chat templates, no model download)."""

from __future__ import annotations

import sys
import time
from typing import Any

N_OPENERS = 16_000
OPENERS = {  # family -> the opener a looping model repeats
    "qwen2.5": "<tool_call>",
    "qwen3": "<tool_call>",
    "qwen3_coder": "<tool_call><function=add><parameter=a>",
    "glm45": "<tool_call>",
    "seed_oss": "<seed:tool_call>",
    "kimi_k2": "<|tool_calls_section_begin|><|tool_call_begin|>",
    "deepseek_v3": "<｜tool▁call▁begin｜>",
    "gpt_oss": "<|start|>assistant<|channel|>commentary to=functions.add<|message|>",
    "llama3_1": "{",
}
VALUES = {"deep": "[" * 100_000 + "]" * 100_000, "5000_digits": "9" * 5000, "nan": "NaN", "1e999": "1e999"}


def bench_parser_faults() -> dict[str, dict[str, Any]]:
    """Per family: the opener turn's read time and calls, and how many hostile values were answered."""
    from fsm.families import codec_for, make_parser, split_turn
    from tests.fixtures.family_tokenizers import family_tokenizer
    from tests.test_parser_attacks import CALL, OBJECT_TOOLS

    out: dict[str, dict[str, Any]] = {}
    for family, opener in OPENERS.items():
        codec = codec_for(family_tokenizer(family), family)
        parser = make_parser(None, codec, OBJECT_TOOLS)
        text = opener * N_OPENERS
        t0 = time.perf_counter()
        calls = parser.parse(text)
        split_turn(text, codec.family, parser)
        codec.assistant_message(text, calls)
        read_s = time.perf_counter() - t0
        answered = 0
        template = CALL.get(family, CALL["qwen3"])
        for value in VALUES.values():
            got = parser.parse(template.format(v=value))
            answered += len(got) == 1 and got[0].error is not None
        out[f"parser:{family}"] = {
            "openers": N_OPENERS,
            "read_s": read_s,
            "calls": len(calls),
            "malformed": sum(c.error is not None for c in calls),
            "hostile_values": len(VALUES),
            "hostile_answered": answered,
        }
    lines = [
        f"{'parser case':<22}{'openers':>9}{'read ms':>10}{'calls':>7}{'malformed':>11}{'hostile answered':>18}"
    ]
    for name, case in out.items():
        lines.append(
            f"{name:<22}{case['openers']:>9}{case['read_s'] * 1000:>10.1f}{case['calls']:>7}"
            f"{case['malformed']:>11}{case['hostile_answered']:>14} of {case['hostile_values']}"
        )
    print(
        f"parsers: a turn of {N_OPENERS} openers and no closer per family; hostile argument values",
        file=sys.stderr,
    )
    print("\n".join(lines), file=sys.stderr)
    return out
