"""SGLang's sampling semantics for the embedded backend (backends/hf.py): greedy or top-k / top-p draws, and
the logprob of the picked token as log_softmax(logits / temperature) over the whole vocabulary."""

from __future__ import annotations

import torch


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
    logits: torch.Tensor, gens: list[torch.Generator | None], temp: torch.Tensor, top_p: torch.Tensor, top_k: torch.Tensor
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
