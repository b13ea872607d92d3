"""Token sampling from logits: greedy, temperature, top-k and top-p, reproducible per seed."""

from __future__ import annotations

import torch


def sample_next(
    logits: torch.Tensor,
    temperature: float,
    generator: torch.Generator | None = None,
    top_p: float = 1.0,
    top_k: int = 0,
) -> torch.Tensor:
    """logits: [N, vocab] float32 -> token ids [N]. temperature 0 means greedy (argmax)."""
    if temperature <= 0:
        return logits.argmax(dim=-1)
    logits = logits / temperature
    if top_k > 0:
        kth = logits.topk(min(top_k, logits.shape[-1]), dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = logits.softmax(dim=-1)
    if top_p < 1.0:
        sorted_probs, order = probs.sort(dim=-1, descending=True)
        # drop a token when the mass before it already reaches top_p (the top token always stays)
        drop = (sorted_probs.cumsum(-1) - sorted_probs) >= top_p
        sorted_probs = sorted_probs.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter_(-1, order, sorted_probs)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)
