"""SGLang's sampling semantics for the embedded backend (backends/hf.py): its sampling parameters checked as
SGLang's server checks them, greedy or top-k / top-p draws, and the logprob of the picked token as
log_softmax(logits / temperature) over the whole vocabulary."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from backends.base import GREEDY_BELOW, BackendRequestError, GenerateRequest

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
