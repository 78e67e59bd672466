"""Tool-call parsers, one registry for every family (Hermes/Qwen2.5 among them).

Each parser reads a model turn's text (decoded with its special tokens) and returns every call the model made,
in order. A call the family's grammar opens but that does not parse comes back with `error` set, so the engine
answers it (fsm/tools/base.py) instead of dropping it; where verl 0.9.1 has a parser for the family, the calls it
extracts from a text are the calls extracted here (tests/test_family_parsers.py holds the two together).
base.py holds the call, the registry, the shared helpers and the JSON families' parsers; the other modules
register the other families' parsers.
"""

from fsm.families.parsers import harmony, xml_calls  # noqa: F401  (register the parsers)
from fsm.families.parsers.base import (
    PARSERS,
    DeepSeekV3Parser,
    HermesParser,
    KimiK2Parser,
    Llama3JsonParser,
    ToolCall,
    ToolCallParser,
    assistant_message,
    json_arguments,
    register_parser,
    split_reasoning,
    token_ids,
)
from fsm.families.parsers.harmony import HarmonyParser
from fsm.families.parsers.xml_calls import GLM45Parser, Qwen3CoderParser, SeedParser

__all__ = [
    "PARSERS",
    "DeepSeekV3Parser",
    "GLM45Parser",
    "HarmonyParser",
    "HermesParser",
    "KimiK2Parser",
    "Llama3JsonParser",
    "Qwen3CoderParser",
    "SeedParser",
    "ToolCall",
    "ToolCallParser",
    "assistant_message",
    "json_arguments",
    "register_parser",
    "split_reasoning",
    "token_ids",
]
