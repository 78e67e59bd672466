"""Record verl 0.9.1's tool-call extraction for tests/fixtures/family_parser_cases.py (run with verl installed):

    .venv-verl/bin/python -m tests.verl.family_parsers_golden

The family test tokenizer encodes each text and verl's parser decodes the ids, as in verl's agent loop (the
tools are passed as verl's loop passes them). Writes tests/fixtures/verl_family_parsers.json.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

from tests.fixtures.family_parser_cases import CASES, TOOLS
from tests.fixtures.family_tokenizers import family_tokenizer

OUT = Path(__file__).resolve().parents[1] / "fixtures" / "verl_family_parsers.json"


async def verl_calls(family: str, parser_name: str, text: str) -> list[dict]:
    from verl.experimental.agent_loop.tool_parser import ToolParser
    from verl.tools.schemas import OpenAIFunctionToolSchema

    tok = family_tokenizer(family)
    parser = ToolParser.get_tool_parser(parser_name, tok)
    tools = [OpenAIFunctionToolSchema.model_validate(t) for t in TOOLS]
    _content, calls = await parser.extract_tool_calls(tok.encode(text, add_special_tokens=False), tools)
    return [{"name": c.name, "arguments": json.loads(c.arguments), "id": c.tool_call_id} for c in calls]


def main() -> None:
    import verl

    record = {"verl": verl.__version__, "cases": {}}
    for case, family, parser_name, text, _differs in CASES:
        record["cases"][case] = asyncio.run(verl_calls(family, parser_name, text))
    OUT.write_text(json.dumps(record, indent=1, ensure_ascii=False) + "\n")
    print(f"wrote {OUT}: {len(record['cases'])} cases")


if __name__ == "__main__":
    main()
