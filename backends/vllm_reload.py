"""A vLLM worker extension that makes a weight update serve exactly the checkpoint it names.

Loaded inside vLLM's worker processes (`--worker-extension-cls backends.vllm_reload.ExactReload`, with this
repository on the server's PYTHONPATH; `--launch-vllm` does both), never by agentfsm itself: it imports
torch and vllm, which only the server's virtualenv has. backends/vllm.py calls its methods through
`/collective_rpc`.

Why: vLLM 0.32's `reload_weights` (model_executor/model_loader/reload) reloads layer by layer and re-runs
each layer's `process_weights_after_loading` only for the layers whose weights the checkpoint holds. A
model that ties its output head to the input embedding (`tie_word_embeddings`: the tiny model, Qwen2.5
0.5B-3B) has no `lm_head.weight` in its checkpoint, so the head is never re-processed. On the CPU engine
that processing packs the head's weight for its GEMM kernel (`dispatch_cpu_unquantized_gemm` keeps the
packed copy in a closure), so after the reload the head still computes with the old embedding: new layers,
old head. `agentfsm_refresh_heads` re-processes every unquantized embedding and head after a reload or a
weight transfer, and `agentfsm_stale_heads` checks that each head computes with the weight it holds.
"""

from __future__ import annotations

from typing import Any

STALE_RTOL = 1e-2  # a head whose kernel is off from its weight by more than this (relative) is stale


class ExactReload:
    """Methods added to vLLM's worker (it mixes this class in); `self` is the worker."""

    def agentfsm_reload_weights(self, weights_path: str) -> dict[str, Any]:
        """`reload_weights(weights_path)`, then the heads re-processed and checked."""
        self.reload_weights(weights_path=weights_path)  # type: ignore[attr-defined]
        return self.agentfsm_refresh_heads()

    def agentfsm_refresh_heads(self) -> dict[str, Any]:
        """Re-run `process_weights_after_loading` of every unquantized embedding and head (cheap: one pack of
        vocab x hidden each), then check them: {"refreshed": [names], "stale": [(name, rel. error)]}."""
        from vllm.config import set_current_vllm_config

        refreshed = []
        with set_current_vllm_config(self.vllm_config):  # type: ignore[attr-defined]
            for name, module in _heads(self.model_runner.get_model()):  # type: ignore[attr-defined]
                module.quant_method.process_weights_after_loading(module)
                refreshed.append(name)
        return {"refreshed": refreshed, "stale": self.agentfsm_stale_heads()}

    def agentfsm_stale_heads(self) -> list[list[Any]]:
        """Each head whose kernel computes other than its weight (name, relative error), on a fixed input."""
        import torch
        from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead

        stale = []
        for name, module in _heads(self.model_runner.get_model()):  # type: ignore[attr-defined]
            if not isinstance(module, ParallelLMHead):
                continue
            weight = module.weight
            gen = torch.Generator(device="cpu").manual_seed(0)
            x = torch.randn(4, weight.shape[1], generator=gen).to(device=weight.device, dtype=weight.dtype)
            with torch.no_grad():
                served = module.quant_method.apply(module, x).float()
                held = torch.nn.functional.linear(x, weight).float()
            error = ((served - held).abs().max() / held.abs().max().clamp_min(1e-12)).item()
            if not error <= STALE_RTOL:
                stale.append([name, error])
        return stale


def _heads(model: Any) -> list[tuple[str, Any]]:
    """The model's unquantized input embeddings and output heads (tied or not)."""
    from vllm.model_executor.layers.vocab_parallel_embedding import (
        UnquantizedEmbeddingMethod,
        VocabParallelEmbedding,
    )

    return [
        (name, m)
        for name, m in model.named_modules()
        if isinstance(m, VocabParallelEmbedding) and isinstance(m.quant_method, UnquantizedEmbeddingMethod)
    ]
