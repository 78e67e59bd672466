"""Greedy evaluation of the tiny model on fresh calculator prompts, with the tool really executed.

An episode is fully correct when the model's tool call carries the question's exact expression and its
final turn ends with the right `#### answer`.

    python -m backends.tiny.evaluate [--n 200] [--seed 1000] [--model-dir DIR]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
from dataclasses import dataclass
from pathlib import Path

import torch

from backends.tiny import ASSET_DIR, load_model, load_tokenizer
from specs.calculator import TOOL_SCHEMA, calculator, compute_score, make_prompts

MAX_NEW_TOKENS = 64  # an ideal turn is under 40 tokens
TOOL_CALL = re.compile(r"<tool_call>\n(.*?)\n</tool_call>", re.DOTALL)


@dataclass
class Episode:
    question: str
    expected_expression: str
    ground_truth: str
    first_turn: str
    final_turn: str = ""
    error: str = ""

    @property
    def correct(self) -> bool:
        call = TOOL_CALL.search(self.first_turn)
        expected = json.dumps({"name": "calculator", "arguments": {"expression": self.expected_expression}})
        return (
            bool(call)
            and call.group(1) == expected
            and compute_score(self.final_turn, self.ground_truth) == 1.0
        )


def generate(model, tokenizer, conversations: list[list[dict]]) -> list[str]:
    """The greedy next assistant turn of each conversation, batched with left padding."""
    texts = [
        tokenizer.apply_chat_template(c, tools=[TOOL_SCHEMA], add_generation_prompt=True, tokenize=False)
        for c in conversations
    ]
    batch = tokenizer(texts, return_tensors="pt", padding=True, padding_side="left", add_special_tokens=False)
    with torch.no_grad():
        out = model.generate(**batch, max_new_tokens=MAX_NEW_TOKENS, do_sample=False)
    # skip_special_tokens drops <|im_end|> and padding but keeps <tool_call> (an ordinary added token).
    return tokenizer.batch_decode(out[:, batch["input_ids"].shape[1] :], skip_special_tokens=True)


def call_tool(turn: str) -> tuple[dict, str]:
    """Parse the turn's hermes tool call and run the calculator on it."""
    match = TOOL_CALL.search(turn)
    if match is None:
        raise ValueError("no <tool_call> in the turn")
    call = json.loads(match.group(1))
    return call, asyncio.run(calculator(**call["arguments"]))


def run_episodes(model, tokenizer, rows: list[dict], batch_size: int = 32) -> list[Episode]:
    """Question -> tool call -> calculator -> final answer, for every row."""
    episodes = []
    for start in range(0, len(rows), batch_size):
        chunk = rows[start : start + batch_size]
        prompts = [row["raw_prompt"] for row in chunk]
        followups, waiting = [], []
        for row, prompt, turn in zip(chunk, prompts, generate(model, tokenizer, prompts), strict=True):
            question = prompt[-1]["content"]
            episode = Episode(
                question=question,
                expected_expression=question.removeprefix("What is ").removesuffix("?"),
                ground_truth=row["reward_model"]["ground_truth"],
                first_turn=turn,
            )
            episodes.append(episode)
            try:
                call, result = call_tool(turn)
            except Exception as exc:  # a missing or malformed call, or a failing tool, ends the episode
                episode.error = f"{type(exc).__name__}: {exc}"
                continue
            assistant = {
                "role": "assistant",
                "content": "",
                "tool_calls": [{"type": "function", "function": call}],
            }
            followups.append([*prompt, assistant, {"role": "tool", "name": call["name"], "content": result}])
            waiting.append(episode)
        if followups:
            for episode, turn in zip(waiting, generate(model, tokenizer, followups), strict=True):
                episode.final_turn = turn
    return episodes


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--n", type=int, default=200)
    parser.add_argument(
        "--seed", type=int, default=1000, help="prompt seed; training draws from its own stream"
    )
    parser.add_argument("--model-dir", type=Path, default=ASSET_DIR)
    args = parser.parse_args()

    torch.set_num_threads(1)
    episodes = run_episodes(
        load_model(args.model_dir), load_tokenizer(args.model_dir), make_prompts(args.n, args.seed)
    )
    failures = [e for e in episodes if not e.correct]
    for e in failures[:10]:
        print(f"FAIL {e.question!r}: {e.first_turn!r} -> {e.final_turn!r} {e.error}")
    correct = len(episodes) - len(failures)
    print(f"fully correct: {correct}/{len(episodes)} = {correct / len(episodes):.1%}")


if __name__ == "__main__":
    main()
