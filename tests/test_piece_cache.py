"""The piece cache of fsm/families/pieces.py is bounded in entries as well as characters: a million distinct
2-character pieces (a dataset of short distinct turns, or a model that writes added tokens between short
fragments) once cost 285 MB of dictionary entries under a 4 M-character bound (issue 27.20). `decode` skips
transformers' per-id checks only where its text is the same. A prompt seen before comes with its array."""

from __future__ import annotations

import random
import tracemalloc

import pytest

from fsm.families.pieces import CACHE_ENTRIES, ByteDecoder, PieceEncoder, decode, to_array
from fsm.run.trajectory import Trajectory


def test_decode_is_transformers_decode_and_an_override_is_kept(tok):
    rng = random.Random(0)
    for _ in range(50):
        ids = [rng.randrange(len(tok)) for _ in range(rng.randrange(40))]
        for skip in (True, False):
            want = tok.decode(ids, skip_special_tokens=skip, clean_up_tokenization_spaces=False)
            assert decode(tok, ids, skip_special_tokens=skip) == want

    class Shouting(type(tok)):  # a tokenizer class with its own decode goes through it
        def decode(self, ids, **kw):
            return super().decode(ids, **kw).upper()

    tok.__class__, cls = Shouting, tok.__class__
    try:
        assert decode(tok, tok.encode("abc", add_special_tokens=False)) == "ABC"
    finally:
        tok.__class__ = cls


def _byte_tokenizers():
    from tests.fixtures.family_tokenizers import FAMILIES, family_tokenizer
    from tests.fixtures.real_tokenizers import DIR, PACKAGES, missing

    yield from (family_tokenizer(f) for f in sorted(FAMILIES))
    from transformers import PreTrainedTokenizerFast

    yield from (PreTrainedTokenizerFast.from_pretrained(str(DIR / p)) for p in PACKAGES if missing(p) is None)


def test_the_byte_decoder_is_the_rust_decode():
    """Random ids, special tokens and bytes cut mid-character among them, both ways of skipping: the text read
    from each id's bytes is the Rust decode's, on every family's byte-level tokenizer and the real ones
    present; an id out of the vocabulary goes to the Rust decode, which drops it."""
    rng = random.Random(1)
    for tok in _byte_tokenizers():
        byte_decoder = ByteDecoder.of(tok)
        assert byte_decoder is not None, tok.name_or_path
        byte_decoder._unchecked = 0  # no comparison inside: every text below must match on its own
        rust, size = tok._tokenizer, len(tok)
        added = list(tok.added_tokens_decoder)
        high = [i for i in range(min(size, 600)) if any(ord(c) > 0x7E for c in rust.id_to_token(i) or "")]
        for _ in range(300):
            ids = [
                rng.choice(added) if r < 0.2 else rng.choice(high) if r < 0.6 else rng.randrange(size)
                for r in (rng.random() for _ in range(rng.randrange(30)))
            ]
            for skip in (True, False):
                assert byte_decoder.decode(ids, skip) == rust.decode(ids, skip_special_tokens=skip), ids
        assert byte_decoder.decode([5, size + 7, 6]) == rust.decode([5, size + 7, 6])
    assert ByteDecoder.of(_sentencepiece()) is None


def _sentencepiece():
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    inner = Tokenizer(models.WordLevel({"a": 0, "[UNK]": 1}, unk_token="[UNK]"))
    inner.decoder = decoders.Metaspace()
    return PreTrainedTokenizerFast(tokenizer_object=inner)


@pytest.mark.slow
def test_many_distinct_short_pieces_are_bounded_in_entries_and_memory(tok):
    """1.5x CACHE_ENTRIES distinct pieces fill the cache and evict a third of it: how far past the bound does not
    matter, and tracemalloc makes each piece slow (60k pieces took 19 s in CI, 67 s under load)."""
    encoder = PieceEncoder(tok, checked=0)
    pieces = [f"{i:05x}" for i in range(CACHE_ENTRIES * 3 // 2)]  # 5-character pieces: ~120k characters, well
    text = "<|im_end|>".join(pieces)  # under the character bound
    want = tok.encode(text, add_special_tokens=False)
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        assert encoder.encode(text) == want
        kept = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert len(encoder._cache) <= CACHE_ENTRIES
    assert kept < 8 << 20, f"{kept / 2**20:.1f} MB kept"
    assert encoder.encode(pieces[-1]) == tok.encode(pieces[-1], add_special_tokens=False)  # recent ones stay


def test_a_prompt_seen_before_comes_with_its_array_and_seeds_the_context(tok):
    """Its ids reach a trajectory's array and the engine's list without a per-id conversion (2 ms at 30k ids,
    docs/gateway.md): the same ids, as the tokenizer gives them."""
    encoder = PieceEncoder(tok)
    text = "<|im_start|>system\nYou are a careful coder.<|im_end|>\n<|im_start|>user\nFix it.<|im_end|>\n"
    want = tok.encode(text, add_special_tokens=False)
    for _ in range(2):  # tokenized, then from the cache
        ids = encoder.encode(text)
        assert ids == want and ids.packed.tolist() == want and to_array(ids) is ids.packed
    assert to_array(want).tolist() == want  # a plain list is converted
    traj = Trajectory(0, 0, "s", "u", {}, "generating")
    traj.set_prompt(ids)
    assert traj.prompt_ids is ids.packed and traj.context() == want and traj.context() is not ids
    traj.response_ids.extend([5, 6])
    assert traj.context_ids() == want + [5, 6]
