"""Evaluate the tiny model through the rollout engine, exactly as `agentfsm run specs/calculator.yaml` runs it.

An episode is fully correct when its first assistant turn is a hermes tool call carrying the question's
exact expression and the episode's reward (the last `#### answer` against the ground truth) is 1. Two
prompt sets: fresh prompts (`make_prompts(n, seed=1000)`, apart from the demo's seed and from training's
own stream) and the demo's prompts (`make_prompts(64, seed=0)`, what `agentfsm run` uses with no --data).
Two samplings: the spec's default (its `sampling:` block, with `--samples` samples per prompt) and greedy.

    python -m backends.tiny.evaluate [--n 200] [--seed 1000] [--samples 4] [--model-dir DIR]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
from pathlib import Path

from backends.tiny import ASSET_DIR
from specs.calculator import make_prompts

TOOL_CALL = re.compile(r"<tool_call>\n(.*?)\n</tool_call>", re.DOTALL)
SPEC = Path(__file__).resolve().parents[2] / "specs" / "calculator.yaml"
DEMO_PROMPTS, DEMO_SEED = 64, 0  # fsm.cli.commands's defaults: `agentfsm run` with no --data or --num-prompts


def fully_correct(traj) -> bool:
    """The first assistant turn calls the calculator with the question's exact expression, reward 1."""
    question = traj.row["raw_prompt"][-1]["content"]
    expected = json.dumps(
        {
            "name": "calculator",
            "arguments": {"expression": question.removeprefix("What is ").removesuffix("?")},
        }
    )
    turns = [m["content"] for m in traj.messages if m["role"] == "assistant"]
    call = TOOL_CALL.search(turns[0]) if turns else None
    return call is not None and call.group(1) == expected and traj.reward_score == 1.0


def describe(traj) -> str:
    turns = [(m["role"], m["content"]) for m in traj.messages[2:]]
    return f"{traj.row['raw_prompt'][-1]['content']!r}: {turns} ({traj.termination_reason})"


async def evaluate(args: argparse.Namespace) -> tuple[dict, list[str], list[str]]:
    """{(sampling, prompt set): (fully correct, episodes)}, through RolloutEngine on HFBackend."""
    from backends.hf import HFBackend
    from fsm.api import RolloutEngine

    backend = HFBackend(args.model_dir, torch_threads=args.threads, max_batch_size=64)  # as `agentfsm run`
    sets = {
        f"fresh (seed {args.seed})": make_prompts(args.n, seed=args.seed),
        f"demo (seed {DEMO_SEED})": make_prompts(DEMO_PROMPTS, seed=DEMO_SEED),
    }
    table = {}
    # a checkpoint of the tiny model (early, mid) has no tokenizer of its own
    tokenizer = args.model_dir if (args.model_dir / "tokenizer.json").exists() else ASSET_DIR
    async with RolloutEngine(args.spec, tokenizer=tokenizer, backend=backend) as engine:
        sampling = engine.agent.spec.sampling
        modes = {  # mode: (samples per prompt, sampling_params over the spec's)
            f"spec default (T={sampling.temperature:g}, top_p={sampling.top_p:g}) x{args.samples}": (
                args.samples,
                {"seed": args.sampling_seed},
            ),
            "greedy": (1, {"temperature": 0.0, "seed": args.sampling_seed}),
        }
        for mode, (n, params) in modes.items():
            for name, rows in sets.items():
                trajs = await engine.arun(rows, n=n, sampling_params=params)
                ok = [fully_correct(t) for t in trajs]
                table[mode, name] = (sum(ok), len(ok))
                for t in [t for t, good in zip(trajs, ok, strict=True) if not good][: args.show_failures]:
                    print(f"FAIL [{mode}, {name}] {describe(t)}")
    return table, list(modes), list(sets)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--n", type=int, default=200, help="fresh prompts")
    parser.add_argument("--seed", type=int, default=1000, help="seed of the fresh prompts (the demo uses 0)")
    parser.add_argument("--samples", type=int, default=4, help="samples per prompt at the default sampling")
    parser.add_argument("--sampling-seed", type=int, default=0, help="as `agentfsm run --seed`")
    parser.add_argument("--model-dir", type=Path, default=ASSET_DIR)
    parser.add_argument("--spec", type=Path, default=SPEC)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--show-failures", type=int, default=5)
    args = parser.parse_args()

    table, modes, names = asyncio.run(evaluate(args))
    print(f"\nfully correct ({args.model_dir}):")
    width = max(len(m) for m in modes)
    print(f"{'sampling':<{width}}  " + "  ".join(f"{n:>22}" for n in names))
    for mode in modes:
        cells = [table[mode, n] for n in names]
        print(f"{mode:<{width}}  " + "  ".join(f"{c}/{t} = {c / t:6.1%}".rjust(22) for c, t in cells))


if __name__ == "__main__":
    main()
