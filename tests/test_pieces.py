"""fsm/families/pieces.py: a text cut at added tokens, pieces from a cache, gives exactly the whole text's ids; where a
tokenizer does not split that way, the encoder says so or finds out and tokenizes whole texts."""

from __future__ import annotations

import random

import pytest
from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from fsm.families.pieces import PieceEncoder
from tests.fixtures.family_tokenizers import FAMILIES, family_tokenizer

ALPHABET = [
    "a",
    "é",
    " ",
    "  ",
    "\n",
    "\n\n",
    "ü",
    "{",
    '"',
    "<",
    "|",
    ">",
    "_",
    "1",
    "é\u0301",
    "の",
    "\t",
    "<|im_",
]


def random_text(rng: random.Random, added: list[str]) -> str:
    """Added tokens glued to text, spaces and newlines on either side, and look-alikes of the tokens."""
    out = []
    for _ in range(rng.randint(1, 30)):
        r = rng.random()
        if r < 0.3:
            out.append(rng.choice(added))
        elif r < 0.4:
            token = rng.choice(added)
            out.append(token[: rng.randint(1, max(1, len(token) - 1))])  # a token's prefix: not the token
        else:
            out.append("".join(rng.choice(ALPHABET) for _ in range(rng.randint(1, 12))))
    return "".join(out)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_cut_at_added_tokens_gives_the_whole_texts_ids(family):
    tok = family_tokenizer(family)
    encoder = PieceEncoder(tok, checked=0)  # no fallback: every text below must match on its own
    assert encoder.splitting
    added = [t.content for t in tok.added_tokens_decoder.values()]
    rng = random.Random(family)
    for _ in range(300):
        text = random_text(rng, added)
        whole = tok.encode(text, add_special_tokens=False)
        assert encoder.encode(text) == whole, text
        assert encoder.encode(text) == whole, text  # the same again, now from the cache


def test_the_shipped_tokenizer_and_a_chat_prompt(tok):
    encoder = PieceEncoder(tok, checked=0)
    tools = [
        {
            "type": "function",
            "function": {"name": "f", "description": "d é", "parameters": {"type": "object"}},
        }
    ]
    for question in (
        "What is 37 * 12 + 5?",
        " leading space",
        "trailing\n\n",
        "<tool_call>\n{}\n</tool_call>",
        "",
    ):
        text = tok.apply_chat_template(
            [{"role": "user", "content": question}], tools=tools, tokenize=False, add_generation_prompt=True
        )
        assert encoder.encode(text) == tok.encode(text, add_special_tokens=False)


def test_an_added_token_that_strips_its_neighbours_is_not_cut_at():
    base = Tokenizer(models.WordLevel({"[UNK]": 0, "a": 1, "b": 2}, unk_token="[UNK]"))
    base.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    base.add_special_tokens([AddedToken("<x>", special=True, lstrip=True, normalized=False)])
    tok = PreTrainedTokenizerFast(tokenizer_object=base)
    encoder = PieceEncoder(tok)
    assert not encoder.splitting
    assert encoder.encode("a <x> b") == tok.encode("a <x> b", add_special_tokens=False)


def test_a_tokenizer_where_pieces_differ_falls_back_for_good(caplog):
    """Metaspace with prepend_scheme=first marks only the text's first piece as a word start: cut at <x>, "b"
    alone would be a first piece too. The first checked text shows it; from then on whole texts are tokenized."""
    base = Tokenizer(models.WordLevel({"[UNK]": 0, "▁a": 1, "a": 2, "▁b": 3, "b": 4}, unk_token="[UNK]"))
    base.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="first")
    base.add_special_tokens([AddedToken("<x>", special=True, normalized=False)])
    tok = PreTrainedTokenizerFast(tokenizer_object=base)
    encoder = PieceEncoder(tok)
    assert encoder.splitting
    whole = tok.encode("a<x>b", add_special_tokens=False)
    assert encoder.encode("a<x>b") == whole == [1, 5, 4]
    assert not encoder.splitting and "tokenizing whole texts" in caplog.text
    assert encoder.encode("b<x>a") == tok.encode("b<x>a", add_special_tokens=False)


def test_the_cache_is_bounded_and_a_huge_piece_is_not_kept(tok):
    encoder = PieceEncoder(tok, cache_chars=4000, checked=0)
    system = "<|im_start|>system\nYou are a calculator." + "<|im_end|>\n"
    huge = "<|im_start|>tool\n" + "é 12345 " * 50_000 + "<|im_end|>"  # 400k characters, one piece
    assert encoder.encode(huge) == tok.encode(huge, add_special_tokens=False)
    assert encoder._cached_chars < 1000  # the huge piece was tokenized, not kept
    for i in range(
        500
    ):  # distinct questions, as a dataset has: the oldest go, the repeated system piece stays
        text = system + f"<|im_start|>user\nWhat is {i} * 7?<|im_end|>\n"
        assert encoder.encode(text) == tok.encode(text, add_special_tokens=False)
        assert encoder._cached_chars <= 4000
