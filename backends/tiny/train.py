"""Train the tiny calculator model from scratch on CPU and save it into the assets.

Each example is one ideal episode from specs.calculator (question -> hermes tool call -> tool result ->
"The answer is N.\\n#### N"), rendered with the shipped chat template; the loss covers only what the
assistant generates. What makes this work in minutes on one thread: the system turn, identical in every
example, is run once per step and its KV cache shared by the batch; digits, operators and spaces weigh
more in the loss (`--digit-weight`), without which runs can get stuck confusing `+` and `*`; and the
learning rate warms up linearly before its cosine decay (`--warmup-steps`), without which runs plateau
far below the accuracy the model can reach. The README's benchmark table has the recipe's measured
accuracy and training time.

    python -m backends.tiny.train --max-steps 9000 --time-budget-s 1e9   # the shipped recipe (seed 0)
    python -m backends.tiny.train --max-steps 5 --out /tmp/x              # smoke run

The shipped weights ran this loop with `--device cuda` in float32 (the CPU run of the same recipe differs
only in float rounding).
"""

from __future__ import annotations

import argparse
import math
import random
import shutil
import time
from pathlib import Path

import torch
from transformers import GenerationConfig, Qwen2Config, Qwen2ForCausalLM

from backends.tiny import ASSET_DIR, load_tokenizer
from specs.calculator import SYSTEM_PROMPT, TOOL_SCHEMA, make_question, reference_messages

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")
BATCH_SIZE = 16
LR = 2e-3  # peak, after WARMUP_STEPS of linear warmup (3e-3 from step 0 failed in 6 of 6 runs)
WARMUP_STEPS = 300
WEIGHTED_CHARS = set("0123456789+-*/ ")  # tokens made only of these weigh DIGIT_WEIGHT in the loss
DIGIT_WEIGHT = 4.0


def make_hard_question(rng: random.Random) -> str:
    """Three operands of 2-3 digits: the long expressions and 5-9-digit results where the model slips."""
    operands = [str(rng.randint(0, 10 ** rng.randint(2, 3) - 1)) for _ in range(3)]
    return f"{operands[0]} {rng.choice('+-*')} {operands[1]} {rng.choice('+-*')} {operands[2]}"


def model_config(tokenizer) -> Qwen2Config:
    return Qwen2Config(
        vocab_size=576,  # 516 tokens padded to a multiple of 64
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=8,
        max_position_embeddings=4096,
        tie_word_embeddings=True,
        bos_token_id=None,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        dtype="float32",
    )


class Episodes:
    """Batches of fresh episodes as (suffix ids, per-token loss weights), after the shared system turn."""

    def __init__(self, tokenizer, seed: int, digit_weight: float = DIGIT_WEIGHT, hard_fraction: float = 0.0):
        self.tokenizer = tokenizer
        self.hard_fraction = hard_fraction
        self.rng = random.Random(f"train-{seed}")  # a stream apart from make_prompts(n, seed)
        self.prefix = self._render([{"role": "system", "content": SYSTEM_PROMPT}])
        self.generation_prompt = tokenizer.encode("<|im_start|>assistant\n", add_special_tokens=False)
        vocab = range(len(tokenizer))
        weights = [digit_weight if set(tokenizer.decode([i])) <= WEIGHTED_CHARS else 1.0 for i in vocab]
        self.token_weight = torch.tensor(weights)

    def _render(self, messages: list[dict]) -> list[int]:
        return self.tokenizer.apply_chat_template(
            messages, tools=[TOOL_SCHEMA], tokenize=True, return_dict=False
        )

    def _assistant_mask(self, ids: list[int]) -> list[float]:
        """1 from after each generation prompt through its `<|im_end|>`: exactly what the model generates."""
        mask, inside, n = [0.0] * len(ids), False, len(self.generation_prompt)
        for i, token in enumerate(ids):
            if inside:
                mask[i] = 1.0
                inside = token != self.tokenizer.eos_token_id
            elif i + 1 >= n and ids[i + 1 - n : i + 1] == self.generation_prompt:
                inside = True
        return mask

    def batch(self, size: int) -> tuple[torch.Tensor, torch.Tensor]:
        suffixes = []
        for _ in range(size):
            hard = self.hard_fraction > 0 and self.rng.random() < self.hard_fraction
            question = make_hard_question(self.rng) if hard else make_question(self.rng)
            ids = self._render(reference_messages(question))
            assert ids[: len(self.prefix)] == self.prefix
            suffixes.append((ids[len(self.prefix) :], self._assistant_mask(ids)[len(self.prefix) :]))
        width = max(len(ids) for ids, _ in suffixes)
        pad = self.tokenizer.pad_token_id
        batch = torch.tensor([s + [pad] * (width - len(s)) for s, _ in suffixes])
        mask = torch.tensor([m + [0.0] * (width - len(m)) for _, m in suffixes])
        return batch, mask * self.token_weight[batch]


def loss_fn(
    model: Qwen2ForCausalLM, prefix: torch.Tensor, ids: torch.Tensor, weight: torch.Tensor
) -> torch.Tensor:
    """Weighted next-token loss on the suffixes; the prefix runs once and its cache is repeated per row.

    Right padding needs no attention mask: causal attention keeps real tokens from seeing the pads after
    them, and the pads' own predictions weigh 0.
    """
    cache = model(prefix[None], use_cache=True).past_key_values
    cache.batch_repeat_interleave(ids.shape[0])
    logits = model(ids, past_key_values=cache).logits  # (B, T, V)
    # The prefix's last logit would predict ids[:, 0], the user turn's `<|im_start|>`, which weighs 0.
    ce = torch.nn.functional.cross_entropy(
        logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten(), reduction="none"
    )
    w = weight[:, 1:].flatten()
    return (ce * w).sum() / w.sum()


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--time-budget-s",
        type=float,
        default=840.0,
        help="CPU seconds the cosine schedule spans: other work on the machine slows training but not its result",
    )
    parser.add_argument("--max-steps", type=int, default=None, help="stop (and end the schedule) here")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--batch-size", type=int, default=BATCH_SIZE)
    parser.add_argument("--lr", type=float, default=LR, help="peak learning rate")
    parser.add_argument(
        "--warmup-steps", type=int, default=WARMUP_STEPS, help="linear warmup before the cosine decay"
    )
    parser.add_argument("--digit-weight", type=float, default=DIGIT_WEIGHT)
    parser.add_argument(
        "--hard-fraction", type=float, default=0.0, help="share of examples drawn by make_hard_question"
    )
    parser.add_argument("--device", default="cpu", help="for experiments; the shipped model trains on CPU")
    parser.add_argument("--out", type=Path, default=ASSET_DIR)
    parser.add_argument(
        "--stop-at-step",
        type=int,
        default=None,
        help="stop here and save, the schedule unchanged (a checkpoint partway through a recipe)",
    )
    parser.add_argument(
        "--flatten",
        type=float,
        default=None,
        help="save with the logits divided by this temperature (how assets/mid was made, see flatten())",
    )
    parser.add_argument(
        "--save-every", type=int, default=None, help="also save weights to OUT/step-N every N steps"
    )
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    torch.set_num_threads(1)  # steadier than two on a shared 2-core machine
    torch.manual_seed(args.seed)
    tokenizer = load_tokenizer()
    episodes = Episodes(tokenizer, args.seed, args.digit_weight, args.hard_fraction)
    model = Qwen2ForCausalLM(model_config(tokenizer)).to(args.device).train()
    print(f"{sum(p.numel() for p in model.parameters()) / 1e6:.3f}M parameters")
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    prefix = torch.tensor(episodes.prefix, device=args.device)

    start, cpu_start, step, smoothed = time.monotonic(), time.process_time(), 0, None
    while True:
        progress = (time.process_time() - cpu_start) / args.time_budget_s
        if args.max_steps:
            progress = max(progress, step / args.max_steps)
        if progress >= 1 or step == args.stop_at_step:
            break
        lr = args.lr * 0.5 * (1 + math.cos(math.pi * progress))
        if step < args.warmup_steps:
            lr *= (step + 1) / args.warmup_steps
        for group in optimizer.param_groups:
            group["lr"] = lr
        ids, weight = episodes.batch(args.batch_size)
        loss = loss_fn(model, prefix, ids.to(args.device), weight.to(args.device))
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        step += 1
        smoothed = loss.item() if smoothed is None else 0.98 * smoothed + 0.02 * loss.item()
        if args.save_every and step % args.save_every == 0:
            save(model, tokenizer, args.out / f"step-{step}", tokenizer_files=False)
        if step % 100 == 0 or step == args.max_steps:
            print(
                f"step {step} {time.process_time() - cpu_start:.0f}s cpu {time.monotonic() - start:.0f}s wall"
                f" loss {loss.item():.4f} (smoothed {smoothed:.4f})"
            )
    print(
        f"trained {step} steps in {time.process_time() - cpu_start:.0f}s cpu {time.monotonic() - start:.0f}s wall,"
        f" final smoothed loss {smoothed:.4f}"
    )

    if args.flatten:
        flatten(model, args.flatten)
    save(model, tokenizer, args.out)
    print(f"saved to {args.out}")


def flatten(model: Qwen2ForCausalLM, temperature: float) -> None:
    """Divide the model's logits by `temperature` for good: the final norm's weight scales the last hidden
    state, and the (tied) output layer is linear without bias, so its samples at temperature 1 become the
    trained model's at `temperature`. Greedy answers stay; sampled ones get worse: a checkpoint that knows
    the answers but rarely samples them whole, which a binary reward can train (examples/grpo.py)."""
    with torch.no_grad():
        model.model.norm.weight.div_(temperature)


def save(model: Qwen2ForCausalLM, tokenizer, out: Path, tokenizer_files: bool = True) -> None:
    """Weights and config into `out`; with `tokenizer_files`, also the tokenizer (a complete directory)."""
    out.mkdir(parents=True, exist_ok=True)
    model.generation_config = GenerationConfig(
        bos_token_id=None, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id
    )
    device = next(model.parameters()).device
    model.cpu().save_pretrained(out)
    model.to(device)  # type: ignore[arg-type]  # transformers' wrapped `to` loses its bound self in the stubs
    if tokenizer_files and out.resolve() != ASSET_DIR:
        for name in TOKENIZER_FILES:
            shutil.copy(ASSET_DIR / name, out / name)


if __name__ == "__main__":
    main()
