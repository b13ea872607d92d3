"""One sequence through the model alone: prefill the prompt, then decode one token per step.

The simplest driver of the model, with no scheduler, cache pool or batching: the reference
the engine's outputs are compared with (tests/test_engine_parity.py, test_parity_hf.py) and
the model-level decode benchmark's driver. Users run the engine (`mci generate`, `Engine`).
The sequence owns cache slots 0..L-1, so the metadata for each step is a slice of one arange.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from mci.core.request import Request
from mci.core.sampling_params import SamplingParams
from mci.grammar.cache import GrammarState
from mci.layers.attention_metadata import AttentionMetadata, SequenceChunk
from mci.models.deepseek_v3 import DeepseekV3ForCausalLM
from mci.runner.sampler import sample


@dataclass(frozen=True)
class SingleSequenceResult:
    """Generated ids (prompt excluded) and the timing of both phases."""

    token_ids: list[int]
    num_prompt_tokens: int
    prefill_seconds: float
    decode_seconds: float
    finish_reason: str  # "stop" (EOS) or "length"


@torch.inference_mode()
def decode_single_sequence(
    model: DeepseekV3ForCausalLM,
    prompt_ids: list[int],
    max_new_tokens: int,
    temperature: float = 0.0,
    seed: int | None = None,
    top_p: float = 1.0,
    top_k: int = 0,
    stop_token_ids: tuple[int, ...] = (),
    attention_path: str = "auto",
    grammar: GrammarState | None = None,
) -> SingleSequenceResult:
    """Generate up to `max_new_tokens` after `prompt_ids`, stopping early at a stop token;
    `grammar` (ready) masks and follows the output (token healing)."""
    if not prompt_ids:
        raise ValueError("prompt must have at least one token")
    # The engine's sampler, on a one-request batch: same filters, same seeded draws.
    params = SamplingParams(
        max_new_tokens=max_new_tokens,
        temperature=temperature,
        top_p=top_p,
        top_k=top_k,
        seed=seed,
        ignore_eos=True,
    )
    request = Request("single-sequence", list(prompt_ids), params)
    request.grammar = grammar

    def next_token(logits: torch.Tensor) -> torch.Tensor:
        token = sample(logits.cpu(), [request], ()).token_ids[0]
        request.append_token(token)
        if grammar is not None and not grammar.matcher.accept(token):
            raise RuntimeError(f"token {token} breaks the grammar its mask allowed")
        return torch.tensor([token], device=device)

    total = len(prompt_ids) + max_new_tokens
    device = model.lm_head.weight.device
    cache = model.allocate_kv_cache(total, device)
    slots = torch.arange(total, device=device)

    start = time.perf_counter()
    meta = AttentionMetadata.build(
        [SequenceChunk(slots[: len(prompt_ids)], len(prompt_ids))],
        device,
        model.attention_layout,
    )
    ids = torch.tensor(prompt_ids, device=device)
    hidden = model(ids, meta, cache, attention_path)
    token = next_token(model.logits(hidden[-1:]))
    prefill_s = time.perf_counter() - start

    out = [int(token)]
    finish = "stop" if out[-1] in stop_token_ids else "length"
    start = time.perf_counter()
    length = len(prompt_ids)
    while finish == "length" and len(out) < max_new_tokens:
        length += 1
        meta = AttentionMetadata.build(
            [SequenceChunk(slots[:length], 1)], device, model.attention_layout
        )
        hidden = model(token, meta, cache, attention_path)
        token = next_token(model.logits(hidden))
        out.append(int(token))
        if out[-1] in stop_token_ids:
            finish = "stop"
    return SingleSequenceResult(
        out, len(prompt_ids), prefill_s, time.perf_counter() - start, finish
    )
