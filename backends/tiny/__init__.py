"""The embedded tiny calculator model: a ~0.73M-parameter Qwen2 trained from scratch, shipped in assets/
(built by build_tokenizer.py and train.py, checked by evaluate.py; everything loads offline).

assets/early/ is an early checkpoint of the same architecture (config and weights only; `python -m
backends.tiny.train --max-steps 300 --time-budget-s 1e9 --out DIR`), so that a weight update visibly changes
what the model generates (tests/test_pause.py; its loss: docs/benchmarks.md).

assets/mid/ is one a binary reward can train from (examples/grpo.py), where `early` never gets a reward: step
1,800 of the shipped recipe on one CPU thread, its logits flattened by temperature 1.5 (`train.flatten`: the
final norm's gain divided by 1.5) so that it knows most answers but rarely samples them whole (accuracies:
docs/benchmarks.md). Made with `python -m backends.tiny.train --max-steps 9000 --time-budget-s 1e9
--stop-at-step 1800 --flatten 1.5 --out backends/tiny/assets/mid` (then the tokenizer files removed: it loads
with ASSET_DIR's).
"""

from __future__ import annotations

from pathlib import Path

ASSET_DIR = Path(__file__).resolve().parent / "assets"
EARLY_DIR = ASSET_DIR / "early"  # the early checkpoint: weights only, load with ASSET_DIR's tokenizer
MID_DIR = ASSET_DIR / "mid"  # a checkpoint GRPO can train from (examples/grpo.py): weights only, as early


def load_tokenizer(path: Path = ASSET_DIR):
    """The fast tokenizer with its chat template (pad `<|endoftext|>`, eos `<|im_end|>`, no bos)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path, local_files_only=True)


def load_model(path: Path = ASSET_DIR):
    """The float32 Qwen2ForCausalLM in eval mode."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, local_files_only=True).eval()
