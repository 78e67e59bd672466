"""What the embedded backend (backends/hf.py) serves: the model loaded on its device, in its dtype, with torch's
threads, and the name it is served under (in spans and /model_info).

- device: cuda when `torch.cuda.is_available()`, else cpu.
- dtype, for a model loaded from a directory: float32 on CPU, and on CUDA for models under SMALL_MODEL_PARAMS;
  bfloat16 above. Small models are bound by per-step overhead, so bfloat16 buys them little, and in bfloat16 a
  row's logprobs (sometimes its greedy tokens) change with the batch it is decoded in, where float32 holds. A model
  object passed in keeps its dtype unless `dtype=` is given (docs/engines.md, "The embedded model on a GPU").
- threads: on the CPU, all of this process's cores but one, so the engine's event loop keeps a core
  (docs/benchmarks.md, "Threads of the embedded model and the dev server").

And how it samples, as SGLang does: a request's sampling parameters checked as SGLang's server checks them
(`validate`), greedy or top-k / top-p draws, and the logprob of the picked token as
log_softmax(logits / temperature) over the whole vocabulary (`sample_next`).
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from transformers import AutoConfig, AutoModelForCausalLM

from backends.base import GREEDY_BELOW, BackendRequestError, GenerateRequest

SMALL_MODEL_PARAMS = 1_000_000_000  # below this, float32 on CUDA too (see the module docstring)
TINY_SERVED_NAME = "agentfsm-tiny-calculator"  # the served name of the bundled model (backends/tiny/assets)
DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
}


def default_threads() -> int | None:
    """torch's intra-op threads for a model loaded on the CPU: all cores but one; None (torch's choice) when
    OMP_NUM_THREADS or MKL_NUM_THREADS says how many."""
    if os.environ.get("OMP_NUM_THREADS") or os.environ.get("MKL_NUM_THREADS"):
        return None
    return max(1, len(os.sched_getaffinity(0)) - 1)


def load(
    model: str | os.PathLike[str] | torch.nn.Module,
    device: str | torch.device | None,
    dtype: torch.dtype | str | None,
    torch_threads: int | None,
) -> tuple[torch.nn.Module, torch.device, torch.dtype]:
    """The model in eval mode on its device, in its dtype (module docstring). A module passed in is the caller's:
    its weights are shared and its process's threads are left as they are."""
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if torch_threads is None and device.type == "cpu" and not isinstance(model, torch.nn.Module):
        torch_threads = default_threads()
    if torch_threads is not None:
        torch.set_num_threads(torch_threads)
    dtype = to_dtype(dtype)
    if isinstance(model, torch.nn.Module):
        dtype = dtype or next(model.parameters()).dtype
    else:
        if dtype is None:  # counting parameters builds a skeleton: only where the answer matters
            dtype = default_dtype(device, parameter_count(model) if device.type == "cuda" else None)
        model = AutoModelForCausalLM.from_pretrained(model, dtype=dtype)
    model.to(device=device, dtype=dtype).eval()
    return model, device, dtype


def eos_ids(model: Any) -> frozenset[int]:
    """Like SGLang's: the config's and the generation config's eos ids."""
    ids: list[int] = []
    for value in (
        model.config.eos_token_id,
        getattr(getattr(model, "generation_config", None), "eos_token_id", None),
    ):
        ids += [value] if isinstance(value, int) else list(value or ())
    return frozenset(ids)


def to_dtype(dtype: torch.dtype | str | None) -> torch.dtype | None:
    """A torch dtype from a dtype or its name ("float32", "bf16"...); None for None or "auto"."""
    if dtype is None or isinstance(dtype, torch.dtype):
        return dtype
    name = str(dtype).strip().lower().removeprefix("torch.")
    if name == "auto":
        return None
    if name not in DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}: expected auto or one of {', '.join(DTYPES)}")
    return DTYPES[name]


def default_dtype(device: torch.device, parameters: int | None) -> torch.dtype:
    """float32 on CPU, and on CUDA for models under SMALL_MODEL_PARAMS; bfloat16 for larger (or unknown)
    ones on CUDA (module docstring)."""
    if device.type != "cuda":
        return torch.float32
    return torch.float32 if parameters is not None and parameters < SMALL_MODEL_PARAMS else torch.bfloat16


def parameter_count(path: str | os.PathLike[str]) -> int | None:
    """The model's parameter count, from its config alone (built on the meta device: no memory, no weights
    read); None when it cannot be built."""
    try:
        config = AutoConfig.from_pretrained(path)
        with torch.device("meta"):
            skeleton = AutoModelForCausalLM.from_config(config)
        return sum(p.numel() for p in skeleton.parameters())
    except Exception:  # an unusual layout: fall back to the large-model default
        return None


def served_name(model: Any, config: Any) -> str:
    """The bundled tiny model's name, a `served_model_name` in the config, or the model folder's name."""
    named = getattr(config, "served_model_name", None)
    if isinstance(named, str) and named:
        return named
    path = model if not isinstance(model, torch.nn.Module) else config.name_or_path
    if path:
        from backends.tiny import ASSET_DIR

        try:
            if Path(path).resolve() == ASSET_DIR:
                return TINY_SERVED_NAME
        except OSError:
            pass
    if path and not os.path.isdir(path):
        return str(path)  # a hub id ("Qwen/Qwen3-0.6B"), as SGLang names it
    return os.path.basename(os.path.normpath(str(path or ""))) or "hf"


def untied_values(model: torch.nn.Module, values: Any) -> str | None:
    """What in `values` (name -> tensor) `model` cannot hold: different tensors for names that are one tied
    parameter there (an output head tied to the embedding), of which only the last copied would serve,
    silently."""
    shared: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        shared.setdefault(id(param), []).append(name)
    for names in shared.values():
        given = [n for n in names if n in values]
        if any(not torch.equal(values[given[0]], values[n]) for n in given[1:]):
            return f"different {' and '.join(given)}, which the served model ties into one parameter"
    return None


def unfit_tensors(
    model: torch.nn.Module, own: dict[str, torch.Tensor], pairs: list[tuple[str, torch.Tensor]]
) -> str | None:
    """Why (name, tensor) `pairs` cannot be copied into `model` (whose state dict is `own`): a name it lacks,
    a shape it does not have, or tied parameters given different values; None when they fit."""
    wrong = next(
        (
            f"the model has no parameter {name!r}"
            if name not in own
            else f"{name} has shape {tuple(t.shape)}, the model's {tuple(own[name].shape)}"
            for name, t in pairs
            if name not in own or t.shape != own[name].shape
        ),
        None,
    )
    return wrong or untied_values(model, dict(pairs))


# SGLang sampling keys that only shape `text` (we return token ids only): accepted and ignored.
TEXT_ONLY = frozenset(
    {"skip_special_tokens", "spaces_between_special_tokens", "no_stop_trim", "stream_interval"}
)
# SGLang sampling keys this backend does not implement: accepted only at their no-op value.
UNSUPPORTED: dict[str, Any] = {
    "min_new_tokens": 0,
    "min_p": 0.0,
    "frequency_penalty": 0.0,
    "presence_penalty": 0.0,
    "repetition_penalty": 1.0,
    "n": 1,
    "stop": None,
    "stop_regex": None,
    "json_schema": None,
    "regex": None,
    "ebnf": None,
    "structural_tag": None,
    "logit_bias": None,
    "custom_params": None,
    "beam_width": None,
    "watermark": None,
    "choice": None,
}
IMPLEMENTED = frozenset(
    {"max_new_tokens", "temperature", "top_p", "top_k", "stop_token_ids", "sampling_seed", "ignore_eos"}
)


@dataclass(frozen=True, slots=True)
class DecodeSampling:
    """One request's sampling parameters, validated."""

    max_new_tokens: int
    temperature: float  # 0.0 means greedy
    top_p: float  # in (0, 1]
    top_k: int  # >= 1; the vocabulary size means "all"
    stop_ids: frozenset[int]  # stop_token_ids, plus the model's eos ids unless ignore_eos
    seed: int | None


def validate(
    request: GenerateRequest,
    *,
    name: str,
    vocab_size: int,
    context_length: int | None,
    eos_ids: frozenset[int],
) -> DecodeSampling:
    """Check a request the way SGLang's server would; raise BackendRequestError (HTTP 400) otherwise."""

    def bad(message: str) -> BackendRequestError:
        return BackendRequestError(f"{name}: {message}", server=name, status=400)

    prompt, params = request.prompt_ids, request.sampling_params
    if not prompt:
        raise bad("prompt_ids is empty")
    if min(prompt) < 0 or max(prompt) >= vocab_size:
        raise bad(f"prompt_ids must lie in [0, {vocab_size})")
    if context_length is not None and len(prompt) >= context_length:
        raise bad(
            f"the input ({len(prompt)} tokens) is longer than the model's context length "
            f"({context_length} tokens); shorten the prompt"
        )
    for key, value in params.items():
        if key in UNSUPPORTED and value not in (UNSUPPORTED[key], None, [], {}):
            raise bad(f"sampling param {key}={value!r} is not supported by HFBackend")
        if key not in IMPLEMENTED and key not in TEXT_ONLY and key not in UNSUPPORTED:
            raise bad(f"unknown sampling param {key!r}")
    try:
        given = params.get("max_new_tokens")
        max_new = int(given if given is not None else 128)
        temperature = float(params.get("temperature", 1.0))
        top_p = float(params.get("top_p", 1.0))
        top_k = int(params.get("top_k", -1))
        stops = frozenset(int(t) for t in params.get("stop_token_ids") or ())
        seed = params.get("sampling_seed")
        seed = None if seed is None else int(seed)
    except (TypeError, ValueError) as e:
        raise bad(f"bad sampling params {params!r}: {e}") from e
    if max_new < 0:
        raise bad(f"max_new_tokens must be >= 0, got {max_new}")
    if not math.isfinite(temperature) or temperature < 0:
        raise bad(f"temperature must be finite and >= 0, got {temperature}")
    if not 0.0 < top_p <= 1.0:
        raise bad(f"top_p must be in (0, 1], got {top_p}")
    if top_k != -1 and top_k < 1:
        raise bad(f"top_k must be -1 (all) or >= 1, got {top_k}")
    if context_length is not None:  # SGLang clamps the budget to what the context has left
        max_new = min(max_new, context_length - len(prompt))
    return DecodeSampling(
        max_new_tokens=max_new,
        temperature=0.0 if temperature < GREEDY_BELOW else temperature,
        top_p=top_p,
        top_k=vocab_size if top_k == -1 else min(top_k, vocab_size),
        stop_ids=stops if params.get("ignore_eos") else stops | eos_ids,
        seed=seed,
    )


def draw(
    logp: torch.Tensor, top_p: torch.Tensor, top_k: torch.Tensor, gens: list[torch.Generator]
) -> torch.Tensor:
    """Sample one token per row from exp(logp) cut to top-k / top-p, by inverse CDF.

    Each row draws its single uniform from its own generator (on the CPU, whatever the model's device), so a
    seeded request picks the same tokens whatever it is batched with, and on whichever device.
    """
    probs, order = logp.exp().sort(dim=-1, descending=True)  # (B, V)
    rank = torch.arange(probs.shape[-1], device=probs.device)
    mass_before = probs.cumsum(-1) - probs
    keep = (rank < top_k[:, None]) & ((mass_before <= top_p[:, None]) | (top_p[:, None] >= 1.0))
    cdf = (probs * keep).cumsum(-1)
    u = torch.stack([torch.rand((), generator=g) for g in gens]).to(probs.device) * cdf[:, -1]
    pick = torch.searchsorted(cdf, u[:, None]).clamp_(max=probs.shape[-1] - 1)
    return order.gather(-1, pick).squeeze(-1)


def sample_next(
    logits: torch.Tensor,
    gens: list[torch.Generator | None],
    temp: torch.Tensor,
    top_p: torch.Tensor,
    top_k: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Pick the next token of every row; return (tokens, their logprobs), both (B,).

    `temp` is 1.0 for greedy rows, so their logprobs are plain log_softmax(logits).
    """
    logp = torch.log_softmax(logits / temp[:, None], dim=-1)  # (B, V): what SGLang reports
    tokens = logits.argmax(-1)
    sampled = [row for row, gen in enumerate(gens) if gen is not None]  # a None generator: a greedy row
    if sampled:
        rows = torch.tensor(sampled, device=logits.device)
        tokens[rows] = draw(logp[rows], top_p[rows], top_k[rows], [gens[row] for row in sampled])  # type: ignore[misc]
    return tokens, logp.gather(-1, tokens[:, None]).squeeze(-1)
