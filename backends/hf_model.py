"""What the embedded backend (backends/hf.py) serves: the model loaded on its device, in its dtype, with torch's
threads, and the name it is served under (in spans and /model_info).

- device: cuda when `torch.cuda.is_available()`, else cpu.
- dtype, for a model loaded from a directory: float32 on CPU, and on CUDA for models under SMALL_MODEL_PARAMS;
  bfloat16 above. Small models are bound by per-step overhead, so bfloat16 buys them little, and in bfloat16 a
  row's logprobs (sometimes its greedy tokens) change with the batch it is decoded in, where float32 holds. A model
  object passed in keeps its dtype unless `dtype=` is given (docs/engines.md, "The embedded model on a GPU").
- threads: on the CPU, all of this process's cores but one, so the engine's event loop keeps a core
  (docs/benchmarks.md, "Threads of the embedded model and the dev server").
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
from transformers import AutoConfig, AutoModelForCausalLM

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
