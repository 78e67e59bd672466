"""verl 0.9.1's own parsers still extract, from tests/fixtures/family_parser_cases.py, the calls recorded in
tests/fixtures/verl_family_parsers.json (which tests/test_family_parsers.py holds agentfsm to). Skipped
without verl; run in its virtualenv with the other verl tests."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

from tests.fixtures.family_parser_cases import CASES

GOLDEN = json.loads(
    (Path(__file__).resolve().parents[1] / "fixtures" / "verl_family_parsers.json").read_text()
)


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_recorded_calls_are_verls(case):
    pytest.importorskip("verl.experimental.agent_loop.tool_parser")
    from tests.verl.family_parsers_golden import verl_calls

    name, family, verl_parser, text, _ = case
    assert asyncio.run(verl_calls(family, verl_parser, text)) == GOLDEN["cases"][name]
