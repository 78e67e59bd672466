"""Build the tiny model's tokenizer into backends/tiny/assets/ (deterministic; about a second).

A byte-level BPE with Qwen2's exact normalizer, pre-tokenizer and decoder: transformers 5.x rebuilds that
pipeline whenever it loads a Qwen2 tokenizer, so any difference would change ids silently. The merges are
learned from rendered calculator chats, so the template's words and the questions are single tokens, and
every digit stays its own token.

    python -m backends.tiny.build_tokenizer [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import random
import re
from pathlib import Path

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors
from tokenizers.trainers import BpeTrainer
from transformers.utils.chat_template_utils import render_jinja_template

from backends.tiny import ASSET_DIR
from specs.calculator import TOOL_SCHEMA, make_question, reference_messages

# Qwen2Tokenizer.PRETOKENIZE_REGEX, verbatim.
PRETOKENIZE_REGEX = r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]  # ids 0, 1, 2: pad, turn start, eos
# Ordinary added tokens, as in Qwen2.5: never split, but kept by decode(skip_special_tokens=True).
ADDED_TOKENS = ["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"]
VOCAB_SIZE = 512  # before ADDED_TOKENS; the model pads its embedding to 576
SEED = 0
N_CHATS = 3000

# Qwen2.5-Instruct's template, with a neutral default system prompt and arguments given either as a dict
# or as an OpenAI-style JSON string.
CHAT_TEMPLATE = """\
{%- if tools %}
    {{- '<|im_start|>system\\n' }}
    {%- if messages[0].role == 'system' %}
        {{- messages[0].content }}
    {%- else %}
        {{- 'You are a helpful assistant.' }}
    {%- endif %}
    {{- "\\n\\n# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\nYou are provided with function signatures within <tools></tools> XML tags:\\n<tools>" }}
    {%- for tool in tools %}
        {{- "\\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\"name\\": <function-name>, \\"arguments\\": <args-json-object>}\\n</tool_call><|im_end|>\\n" }}
{%- else %}
    {%- if messages[0].role == 'system' %}
        {{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}
    {%- else %}
        {{- '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}
    {%- endif %}
{%- endif %}
{%- for message in messages %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) or (message.role == "assistant" and not message.tool_calls) %}
        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}
    {%- elif message.role == "assistant" %}
        {{- '<|im_start|>' + message.role }}
        {%- if message.content %}
            {{- '\\n' + message.content }}
        {%- endif %}
        {%- for tool_call in message.tool_calls %}
            {%- if tool_call.function is defined %}
                {%- set tool_call = tool_call.function %}
            {%- endif %}
            {{- '\\n<tool_call>\\n{"name": "' }}
            {{- tool_call.name }}
            {{- '", "arguments": ' }}
            {%- if tool_call.arguments is string %}
                {{- tool_call.arguments }}
            {%- else %}
                {{- tool_call.arguments | tojson }}
            {%- endif %}
            {{- '}\\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\\n' }}
    {%- elif message.role == "tool" %}
        {%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\\n<tool_response>\\n' }}
        {{- message.content }}
        {{- '\\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
{%- endif %}
"""

# A little general English, so common words outside the chats are not spelled out byte by byte.
ENGLISH = """\
What is the result? Please tell me the answer. How much is this number? Can you help me with a question?
The user asks a question and the assistant answers it. Here is the sum, the product and the difference.
I think that this is a good example of a short sentence, and we will use it to learn some words.
Thank you for your help. You are welcome. Let me check that for you. The total is shown below.
"""


def render(messages: list[dict], add_generation_prompt: bool = False) -> str:
    """Render with transformers' own jinja environment (its tojson keeps key order, jinja's sorts keys)."""
    # transformers annotates `-> str`; it returns (rendered, generation_indices)
    rendered, _ = render_jinja_template(  # type: ignore[str-unpack]
        conversations=[messages],
        tools=[TOOL_SCHEMA],
        chat_template=CHAT_TEMPLATE,
        add_generation_prompt=add_generation_prompt,
    )
    return rendered[0]


def training_texts() -> list[str]:
    """Rendered chats cut at control tokens: the trainer must not learn merges across them."""
    rng = random.Random(SEED)
    control = re.compile("|".join(re.escape(t) for t in SPECIAL_TOKENS + ADDED_TOKENS))
    texts = [ENGLISH] * 20
    for _ in range(N_CHATS):
        texts += [piece for piece in control.split(render(reference_messages(make_question(rng)))) if piece]
    return texts


def build_tokenizer() -> Tokenizer:
    tokenizer = Tokenizer(models.BPE(unk_token=None, fuse_unk=False, byte_fallback=False))
    tokenizer.normalizer = normalizers.NFC()
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(
        add_prefix_space=False, trim_offsets=False, use_regex=False
    )
    trainer = BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(training_texts(), trainer=trainer)
    tokenizer.add_tokens([AddedToken(t, special=False, normalized=False) for t in ADDED_TOKENS])
    return tokenizer


def tokenizer_config(tokenizer: Tokenizer) -> dict:
    """Qwen2.5's tokenizer_config.json layout: transformers 4.x needs the class and the template in it."""
    added = {
        str(tokenizer.token_to_id(t)): {
            "content": t,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": t in SPECIAL_TOKENS,
        }
        for t in SPECIAL_TOKENS + ADDED_TOKENS
    }
    return {
        "add_bos_token": False,
        "add_prefix_space": False,
        "added_tokens_decoder": added,
        "additional_special_tokens": [],
        "bos_token": None,
        "chat_template": CHAT_TEMPLATE,
        "clean_up_tokenization_spaces": False,
        "eos_token": "<|im_end|>",
        "errors": "replace",
        "model_max_length": 4096,
        "pad_token": "<|endoftext|>",
        "split_special_tokens": False,
        "tokenizer_class": "Qwen2Tokenizer",
        "unk_token": None,
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", type=Path, default=ASSET_DIR)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer()
    tokenizer.save(str(args.out / "tokenizer.json"))
    config = json.dumps(tokenizer_config(tokenizer), indent=2, ensure_ascii=False) + "\n"
    (args.out / "tokenizer_config.json").write_text(config)
    (args.out / "chat_template.jinja").write_text(CHAT_TEMPLATE)
    print(f"wrote {args.out}: {tokenizer.get_vocab_size()} tokens")


if __name__ == "__main__":
    main()
