"""The tiny model's assets: tokenizer and template, the calculator domain, training and the shipped model."""

from __future__ import annotations

import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers.utils import get_json_schema

from backends.tiny import ASSET_DIR, load_model, load_tokenizer
from specs.calculator import (
    SYSTEM_PROMPT,
    TOOL_SCHEMA,
    calculator,
    compute_score,
    evaluate,
    make_prompts,
    make_question,
    reference_messages,
)

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer()


def render(tokenizer, messages, add_generation_prompt=False) -> list[int]:
    return tokenizer.apply_chat_template(
        messages,
        tools=[TOOL_SCHEMA],
        add_generation_prompt=add_generation_prompt,
        tokenize=True,
        return_dict=False,
    )


# --- tokenizer ------------------------------------------------------------------------------------------


def test_tokenizer_is_fast_with_template(tokenizer):
    assert tokenizer.is_fast
    assert "<tools>" in tokenizer.chat_template
    assert len(tokenizer) == 516


def test_special_and_added_tokens(tokenizer):
    assert (tokenizer.pad_token, tokenizer.pad_token_id) == ("<|endoftext|>", 0)
    assert (tokenizer.eos_token, tokenizer.eos_token_id) == ("<|im_end|>", 2)
    assert tokenizer.convert_tokens_to_ids("<|im_start|>") == 1
    assert tokenizer.bos_token is None
    for tag in ["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"]:
        ids = tokenizer.encode(f"a{tag}b", add_special_tokens=False)
        assert len(ids) == 3 and tokenizer.decode(ids[1:2]) == tag
    ids = tokenizer.encode("<tool_call>\n{}\n</tool_call><|im_end|>", add_special_tokens=False)
    assert tokenizer.decode(ids, skip_special_tokens=True) == "<tool_call>\n{}\n</tool_call>"


def test_every_digit_is_a_token(tokenizer):
    ids = tokenizer.encode("1234567890", add_special_tokens=False)
    assert [tokenizer.decode([i]) for i in ids] == list("1234567890")


def test_generation_prompt_render(tokenizer):
    ids = render(tokenizer, reference_messages("37 * 12 + 5")[:2], add_generation_prompt=True)
    assert all(isinstance(i, int) for i in ids)
    assert tokenizer.decode(ids).endswith("What is 37 * 12 + 5?<|im_end|>\n<|im_start|>assistant\n")


def test_episode_text(tokenizer):
    text = tokenizer.apply_chat_template(
        reference_messages("37 * 12 + 5"), tools=[TOOL_SCHEMA], tokenize=False
    )
    assert text.startswith(f"<|im_start|>system\n{SYSTEM_PROMPT}\n\n# Tools\n")
    assert text.endswith(
        "<|im_start|>user\nWhat is 37 * 12 + 5?<|im_end|>\n"
        "<|im_start|>assistant\n<tool_call>\n"
        '{"name": "calculator", "arguments": {"expression": "37 * 12 + 5"}}\n'
        "</tool_call><|im_end|>\n"
        "<|im_start|>user\n<tool_response>\n449\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\nThe answer is 449.\n#### 449<|im_end|>\n"
    )


def test_turn_by_turn_equals_full_render(tokenizer):
    """Each render extends the previous one, and generated text re-encoded on its own fits in place."""
    rng = random.Random(7)
    eos = tokenizer.eos_token_id
    for _ in range(50):
        messages = reference_messages(make_question(rng))
        ask = render(tokenizer, messages[:2], add_generation_prompt=True)
        called = render(tokenizer, messages[:3])
        told = render(tokenizer, messages[:4], add_generation_prompt=True)
        full = render(tokenizer, messages)
        call = tokenizer.encode(tokenizer.decode(called[len(ask) : -2]), add_special_tokens=False)
        answer = tokenizer.encode(messages[4]["content"], add_special_tokens=False)
        assert called == ask + call + [eos] + called[-1:]
        assert told[: len(called)] == called
        assert full == told + answer + [eos] + full[-1:]


def test_tokenizer_config_loads_in_transformers_4():
    """4.x reads the class and the template from tokenizer_config.json, not chat_template.jinja."""
    import json

    config = json.loads((ASSET_DIR / "tokenizer_config.json").read_text())
    assert config["tokenizer_class"] == "Qwen2Tokenizer"
    assert config["chat_template"] == (ASSET_DIR / "chat_template.jinja").read_text()


@pytest.mark.slow
def test_tokenizer_build_is_reproducible(tmp_path):
    subprocess.run(
        [sys.executable, "-m", "backends.tiny.build_tokenizer", "--out", tmp_path], cwd=REPO, check=True
    )
    for name in ["tokenizer.json", "tokenizer_config.json", "chat_template.jinja"]:
        assert (tmp_path / name).read_bytes() == (ASSET_DIR / name).read_bytes(), name


# --- calculator -----------------------------------------------------------------------------------------


def test_tool_schema_matches_the_function():
    schema = get_json_schema(calculator)
    schema["function"].pop("return")
    assert schema == TOOL_SCHEMA


@pytest.mark.parametrize(
    ("expression", "value"),
    [
        ("37 * 12 + 5", 449),
        ("7 / 2", 3.5),
        ("-(2 + 3) ** 2", -25),
        ("10 // 3", 3),
        ("10 % 3", 1),
        ("2.5 * +2", 5.0),
    ],
)
def test_evaluate(expression, value):
    assert evaluate(expression) == value


@pytest.mark.parametrize(
    "expression",
    [
        "__import__('os')",
        "__import__('os').system('true')",
        "2**99999",
        "9**9**9",
        "10**10 * 10**10",
        "x + 1",
        "abs(-1)",
        "(1).real",
        "[1, 2]",
        "'a' * 3",
        "True + 1",
        "1 if 1 else 2",
        "lambda: 1",
        "1 / 0",
        "1 % 0",
        "1e999",
        "",
        "1 +",
        "(" * 300 + "1" + ")" * 300,
    ],
)
def test_evaluate_rejects(expression):
    with pytest.raises(ValueError):
        evaluate(expression)


async def test_calculator_formats_and_raises():
    assert await calculator("37 * 12 + 5") == "449"
    assert await calculator("6 / 3") == "2"
    assert await calculator("1 / 3") == "0.333333"
    with pytest.raises(ValueError, match="division by zero"):
        await calculator("1 / 0")


@pytest.mark.parametrize(
    ("text", "truth", "score"),
    [
        ("The answer is 449.\n#### 449", "449", 1.0),
        ("#### 449.0", "449", 1.0),
        ("#### -12", "-12", 1.0),
        ("#### 1,000", "1000", 1.0),
        ("#### 448", "449", 0.0),
        ("The answer is 449.", "449", 0.0),
        ("#### 1\n#### 449", "449", 1.0),
    ],
)
def test_compute_score(text, truth, score):
    assert compute_score(text, truth) == score


def test_make_prompts():
    rows = make_prompts(50, seed=3)
    assert rows == make_prompts(50, seed=3) and rows != make_prompts(50, seed=4)
    for i, row in enumerate(rows):
        system, user = row["raw_prompt"]
        assert system == {"role": "system", "content": SYSTEM_PROMPT}
        expression = user["content"].removeprefix("What is ").removesuffix("?")
        tokens = expression.split(" ")
        assert len(tokens) in (3, 5) and set(tokens[1::2]) <= {"+", "-", "*"}
        assert all(t.isdigit() and len(t) <= 3 for t in tokens[::2])
        assert row["reward_model"]["ground_truth"] == str(evaluate(expression))
        assert (row["extra_info"], row["data_source"], row["uid"]) == (
            {"index": i},
            "calculator",
            f"calc-3-{i}",
        )


# --- model ----------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_training_smoke_run(tmp_path):
    cmd = [sys.executable, "-m", "backends.tiny.train", "--max-steps", "3", "--out", tmp_path]
    subprocess.run(cmd, cwd=REPO, check=True, capture_output=True)
    model = load_model(tmp_path)
    assert model.config.vocab_size == 576
    assert 0.7e6 < sum(p.numel() for p in model.parameters()) < 0.75e6
    assert load_tokenizer(tmp_path).eos_token_id == model.generation_config.eos_token_id == 2


@pytest.mark.slow
def test_training_stops_partway_saves_checkpoints_and_flattens(tmp_path):
    """How assets/mid was made: a recipe stopped partway (its schedule unchanged), its logits divided by T."""
    cmd = [
        sys.executable,
        "-m",
        "backends.tiny.train",
        "--max-steps",
        "9000",
        "--stop-at-step",
        "2",
        "--save-every",
        "1",
        "--flatten",
        "2.0",
        "--out",
        tmp_path,
    ]
    subprocess.run(cmd, cwd=REPO, check=True, capture_output=True)
    assert sorted(p.name for p in tmp_path.glob("step-*")) == ["step-1", "step-2"]
    assert not (
        tmp_path / "step-1" / "tokenizer.json"
    ).exists()  # checkpoints: weights only, as early and mid
    last, flat = load_model(tmp_path / "step-2").state_dict(), load_model(tmp_path).state_dict()
    assert torch.allclose(flat.pop("model.norm.weight") * 2.0, last.pop("model.norm.weight"))
    assert all(torch.equal(flat[k], v) for k, v in last.items())


def test_mid_checkpoint_is_the_tiny_model_flattened():
    from backends.tiny import MID_DIR

    mid, final = load_model(MID_DIR), load_model(ASSET_DIR)
    same = {"transformers_version": 0, "_name_or_path": 0}
    assert mid.config.to_dict() | same == final.config.to_dict() | same
    gain = mid.model.norm.weight.abs().mean() / final.model.norm.weight.abs().mean()
    assert gain < 0.9  # its logits are flattened (see backends/tiny/__init__.py)


@pytest.mark.skipif(not (ASSET_DIR / "model.safetensors").exists(), reason="no shipped weights")
async def test_shipped_model_solves_a_prompt():
    from backends.tiny.evaluate import SPEC, describe, fully_correct
    from fsm.api import RolloutEngine

    row = {"raw_prompt": reference_messages("37 * 12 + 5")[:2], "reward_model": {"ground_truth": "449"}}
    async with RolloutEngine(SPEC) as engine:
        (traj,) = await engine.arun([row], sampling_params={"temperature": 0.0})
    assert fully_correct(traj), describe(traj)
