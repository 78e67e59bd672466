"""The tiny model with 32-dim attention heads, computing the same function: for vLLM's CPU engine.

vLLM 0.32's CPU attention kernels support head dims 32, 64, 80, ... 512; the tiny model's heads are 16 wide
(hidden 128, 8 heads), and vLLM fails its first request with "Unsupported CPU attention configuration:
head_dim=16". vLLM's Qwen2 also derives head_dim from hidden_size / heads, so the copy here is a
`LlamaForCausalLM` (Qwen2 is Llama with a bias on q, k and v) with `head_dim: 32`:
- each head's 16 query and key dims are placed in 32, the rest zero, so that RoPE pairs and frequencies
  match: Qwen2 rotates dim i with i+8 at theta^(-i/8) (i < 8); with 32 dims dim j turns with j+16 at
  theta^(-j/16), so dim i goes to 2i and dim i+8 to 2i+16. Zero dims add exact zeros to every dot product;
- the attention scale is 1/sqrt(head_dim), so the queries are multiplied by sqrt(32/16) to keep q.k/4;
- values are padded the same way and o_proj reads only the real dims; Llama's o_proj bias is zero.
The only difference from the original is rounding (the sqrt(2) on the queries): greedy tokens agree with the
Qwen2 original's and logprobs within about 1e-5 (tests/vllm checks it with transformers).

    python -m backends.tiny.head_pad OUT              # the shipped model, early/ and mid/ alongside
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
from pathlib import Path

from backends.tiny import ASSET_DIR

HEAD_DIM = 32
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json")
CHECKPOINTS = ("early", "mid")  # weights-only checkpoints under the model directory, converted alongside


def _placement(old: int, new: int) -> list[int]:
    """Where each of a head's `old` dims goes among `new`: RoPE pair (i, i + old/2) to (2i, 2i + new/2)."""
    half_old, half_new = old // 2, new // 2
    step = half_new // half_old
    return [step * i for i in range(half_old)] + [half_new + step * i for i in range(half_old)]


def pad_state(state: dict, config: dict, head_dim: int = HEAD_DIM) -> dict:
    """A Qwen2 state dict -> the Llama state dict with `head_dim`-wide heads (module docstring)."""
    import torch

    heads, kv_heads = (
        config["num_attention_heads"],
        config.get("num_key_value_heads", config["num_attention_heads"]),
    )
    old = config["hidden_size"] // heads
    if head_dim % old or head_dim < old or old % 2:
        raise ValueError(f"cannot place {old}-dim heads in {head_dim} dims")
    place = torch.tensor(_placement(old, head_dim))
    scale = math.sqrt(head_dim / old)

    def rows(
        t: torch.Tensor, n: int, factor: float = 1.0
    ) -> torch.Tensor:  # [n*old, ...] -> [n*head_dim, ...]
        out = t.new_zeros((n, head_dim, *t.shape[1:]))
        out[:, place] = t.reshape(n, old, *t.shape[1:]) * factor
        return out.reshape(n * head_dim, *t.shape[1:])

    out = {}
    for name, t in state.items():
        if name.endswith(("q_proj.weight", "q_proj.bias")):
            out[name] = rows(t, heads, scale)
        elif name.endswith(("k_proj.weight", "k_proj.bias", "v_proj.weight", "v_proj.bias")):
            out[name] = rows(t, kv_heads)
        elif name.endswith("o_proj.weight"):
            out[name] = rows(t.t(), heads).t().contiguous()
            out[name.replace(".weight", ".bias")] = t.new_zeros(t.shape[0])
        else:
            out[name] = t
    return out


def llama_config(config: dict, head_dim: int = HEAD_DIM) -> dict:
    """The Qwen2 config as a Llama config with `head_dim`-wide heads and biased attention."""
    keep = (
        "hidden_size intermediate_size num_hidden_layers num_attention_heads num_key_value_heads hidden_act "
        "max_position_embeddings rms_norm_eps rope_parameters rope_theta rope_scaling vocab_size "
        "tie_word_embeddings bos_token_id eos_token_id pad_token_id initializer_range use_cache dtype "
        "torch_dtype transformers_version"
    ).split()
    out = {k: config[k] for k in keep if k in config}
    return {
        **out,
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "head_dim": head_dim,
        "attention_bias": True,
        "mlp_bias": False,
        "attention_dropout": 0.0,
    }


def convert(src: Path, dst: Path, *, tokenizer_from: Path | None = None) -> Path:
    """One checkpoint directory (config.json, model.safetensors) -> its padded Llama copy in `dst`, with the
    tokenizer files of `tokenizer_from` (default: `src`) where they exist."""
    from safetensors.torch import load_file, save_file

    config = json.loads((src / "config.json").read_text())
    if config.get("model_type") != "qwen2":
        raise ValueError(f"{src}: a {config.get('model_type')} model; this converts the tiny Qwen2 only")
    dst.mkdir(parents=True, exist_ok=True)
    state = pad_state(load_file(src / "model.safetensors"), config)
    save_file(state, dst / "model.safetensors", metadata={"format": "pt"})
    (dst / "config.json").write_text(json.dumps(llama_config(config), indent=2) + "\n")
    for name in TOKENIZER_FILES:
        for where in (src, tokenizer_from or src):
            if (where / name).exists():
                shutil.copyfile(where / name, dst / name)
                break
    return dst


def convert_tiny(dst: Path, src: Path = ASSET_DIR) -> Path:
    """The shipped tiny model into `dst`, its early/ and mid/ checkpoints into `dst/early`, `dst/mid`."""
    convert(src, dst)
    for name in CHECKPOINTS:
        if (src / name / "config.json").exists():
            convert(src / name, dst / name, tokenizer_from=src)
    return dst


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out", type=Path, help="the directory to write")
    ap.add_argument(
        "--src", type=Path, default=ASSET_DIR, help="the tiny Qwen2 model (default: the shipped one)"
    )
    args = ap.parse_args()
    print(convert_tiny(args.out, args.src))


if __name__ == "__main__":
    main()
