"""`agentfsm bench families`: what rendering one tool round costs per model family, agentfsm's codec beside
PrimeIntellect's `renderers` (when installed) on the same test tokenizer and real template; and, per family,
whether `renderers` renders what the model's own template renders (the library decision in the README).

Times are medians of per-call wall times (µs), measured side by side in one process.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

from fsm.families import codec_for, make_parser
from tests.fixtures.family_tokenizers import FAMILIES, family_tokenizer
from tests.test_families_e2e import turns

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "calculator",
            "description": "Evaluate an expression.",
            "parameters": {
                "type": "object",
                "properties": {"expression": {"type": "string"}},
                "required": ["expression"],
            },
        },
    }
]
RENDERERS = {
    "qwen3": "Qwen3RendererConfig",
    "glm45": "GLM45RendererConfig",
    "kimi_k2": "KimiK2RendererConfig",
    "deepseek_v3": "DeepSeekV3RendererConfig",
    "llama3_1": "Llama3RendererConfig",
    "gpt_oss": "GptOssRendererConfig",
}


def _median_us(fn: Any, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return round(statistics.median(times) * 1e6, 1)


def _ours(family: str, repeats: int) -> dict[str, Any]:
    tok = family_tokenizer(family)
    codec = codec_for(tok, family)
    parser = make_parser(None, codec, TOOLS)
    gen = turns(family)[0]  # the model's tool-call turn, its stop token included
    text = codec.turn_text(gen)
    history = [
        {"role": "user", "content": "What is 2 + 3?"},
        codec.assistant_message(text, parser.parse(text)),
    ]
    tool = [{"role": "tool", "content": "5", "tool_call_id": "functions.calculator:0"}]
    return {
        "observation_us": _median_us(lambda: codec.observation(tool, gen[-1:], history), repeats),
        "parse_us": _median_us(lambda: parser.parse(codec.turn_text(gen)), repeats),
    }


def _renderers(family: str, repeats: int) -> dict[str, Any]:
    try:
        import renderers
        from renderers import configs
    except ImportError as exc:
        return {"renderers": f"not installed ({exc})"}
    tok = family_tokenizer(family)
    name = RENDERERS.get(family)
    try:
        r = renderers.create_renderer(
            tok, getattr(configs, name)() if name else configs.DefaultRendererConfig()
        )
    except Exception as exc:  # what a user would meet: e.g. gpt-oss needs a vocabulary download
        return {"renderers": f"{type(exc).__name__}: {str(exc)[:120]}"}
    user = [{"role": "user", "content": "What is 2 + 3?"}]
    prompt = r.render_ids(user, tools=TOOLS, add_generation_prompt=True)
    same = prompt == tok.apply_chat_template(
        user, tools=TOOLS, add_generation_prompt=True, tokenize=True, return_dict=False
    )
    gen = turns(family)[0]
    tool = [{"role": "tool", "content": "5", "tool_call_id": "functions.calculator:0"}]
    bridged = r.bridge_to_next_turn(prompt, gen, tool, tools=TOOLS)
    codec = codec_for(tok, family)
    text = codec.turn_text(gen)
    history = [*user, codec.assistant_message(text, make_parser(None, codec, TOOLS).parse(text))]
    closer, obs = codec.observation(tool, gen[-1:], history)
    ours = [*prompt, *gen, *closer, *obs]
    bridged = list(getattr(bridged, "token_ids", bridged)) if bridged is not None else None
    out: dict[str, Any] = {
        "renders_as_template": same,
        "bridges": bridged is not None,
        "bridge_equals_agentfsm": bridged == ours if bridged is not None else None,
        "parse_us": _median_us(lambda: r.parse_response(gen, prompt_ids=prompt), repeats),
    }
    if bridged is not None:
        out["observation_us"] = _median_us(
            lambda: r.bridge_to_next_turn(prompt, gen, tool, tools=TOOLS), repeats
        )
    return out


def bench_families(repeats: int = 200) -> dict[str, Any]:
    return {
        family: {"agentfsm": _ours(family, repeats), "renderers": _renderers(family, repeats)}
        for family in FAMILIES
    }
