"""The MTP module equals a hand computation from the checkpoint's own tensors.

The hand computation uses plain torch ops for enorm/hnorm/eh_proj/shared_head and transformers'
DeepseekV3DecoderLayer (loaded with the MTP block's tensors) for the decoder block.
"""

from __future__ import annotations

import logging

import pytest
import torch
from helpers import prefill_logits
from safetensors.torch import load_file

from mci.layers.attention_metadata import AttentionMetadata, SequenceChunk
from mci.models.loader import load_model

TOL = 1e-4


def _rms(x, w, eps=1e-6):
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def _hf_block(path, cfg, tensors, prefix):
    from transformers import AutoConfig
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import (
        DeepseekV3DecoderLayer,
        DeepseekV3RotaryEmbedding,
    )

    hf_cfg = AutoConfig.from_pretrained(str(path))
    hf_cfg._attn_implementation = "eager"
    block = DeepseekV3DecoderLayer(hf_cfg, layer_idx=max(cfg.first_k_dense_replace, 0)).eval()
    state = {k[len(prefix) + 1 :]: v for k, v in tensors.items() if k.startswith(prefix + ".")}
    e = cfg.n_routed_experts
    state["mlp.experts.gate_up_proj"] = torch.stack(
        [
            torch.cat(
                [
                    state.pop(f"mlp.experts.{i}.gate_proj.weight"),
                    state.pop(f"mlp.experts.{i}.up_proj.weight"),
                ]
            )
            for i in range(e)
        ]
    )
    state["mlp.experts.down_proj"] = torch.stack(
        [state.pop(f"mlp.experts.{i}.down_proj.weight") for i in range(e)]
    )
    extra = {
        k: state.pop(k)
        for k in list(state)
        if k.split(".")[0] in ("enorm", "hnorm", "eh_proj", "embed_tokens", "shared_head")
    }
    block.load_state_dict(state, strict=True)
    return block, extra, DeepseekV3RotaryEmbedding(hf_cfg)


def test_mtp_matches_hand_computation(checkpoint):
    path = checkpoint()
    model = load_model(path, "float32")
    cfg = model.cfg
    tensors = load_file(str(path / "model.safetensors"))
    block, w, rotary = _hf_block(path, cfg, tensors, f"model.layers.{cfg.num_hidden_layers}")

    ids = torch.randint(0, cfg.vocab_size, (13,), generator=torch.Generator().manual_seed(7))
    n = len(ids) - 1  # MTP at position i sees hidden_i and token i+1
    cache = model.allocate_kv_cache(32)
    meta = AttentionMetadata.build([SequenceChunk(torch.arange(n), n)])
    hidden = model(ids[:n], meta, cache)
    mtp_hidden, mtp_logits = model.mtp_forward(0, ids[1:], hidden, meta, cache)

    with torch.no_grad():
        x = (
            torch.cat(
                [
                    _rms(w["embed_tokens.weight"][ids[1:]], w["enorm.weight"]),
                    _rms(hidden, w["hnorm.weight"]),
                ],
                dim=-1,
            )
            @ w["eh_proj.weight"].T
        )
        pos = torch.arange(n)[None]
        causal = torch.full((n, n), float("-inf")).triu(1)[None, None]
        out = block(
            x[None],
            attention_mask=causal,
            position_ids=pos,
            position_embeddings=rotary(x[None], pos),
        )
        out = out[0] if isinstance(out, tuple) else out
        out = out[0]
        logits = _rms(out, w["shared_head.norm.weight"]) @ w["shared_head.head.weight"].T
    assert (mtp_hidden - out).abs().max().item() <= TOL
    assert (mtp_logits - logits).abs().max().item() <= TOL


def test_mtp_incremental_equals_prefill(checkpoint):
    """Running MTP one position at a time over its own cache row gives the same predictions."""
    model = load_model(checkpoint(), "float32")
    ids = torch.randint(0, 2048, (10,), generator=torch.Generator().manual_seed(8))
    n = len(ids) - 1
    slots = torch.arange(n)
    cache = model.allocate_kv_cache(16)
    meta = AttentionMetadata.build([SequenceChunk(slots, n)])
    hidden = model(ids[:n], meta, cache)
    _, full = model.mtp_forward(0, ids[1:], hidden, meta, cache)
    cache2 = model.allocate_kv_cache(16)
    steps = []
    for i in range(n):
        m = AttentionMetadata.build([SequenceChunk(slots[: i + 1], 1)])
        h = model(ids[i : i + 1], m, cache2)
        steps.append(model.mtp_forward(0, ids[i + 1 : i + 2], h, m, cache2, "absorbed")[1])
    assert (torch.cat(steps) - full).abs().max().item() <= TOL


def test_checkpoint_without_mtp_weights_loads_with_notice(checkpoint, caplog):
    with_mtp = load_model(checkpoint(), "float32")
    path = checkpoint(include_mtp=False)
    with caplog.at_level(logging.WARNING, logger="mci"):
        model = load_model(path, "float32")
    notices = [r.getMessage() for r in caplog.records if "MTP" in r.getMessage()]
    assert len(notices) == 1 and "\n" not in notices[0]
    assert len(model.mtp) == 0 and model.num_cache_layers == model.cfg.num_hidden_layers
    ids = list(range(3, 20))
    torch.testing.assert_close(prefill_logits(model, ids), prefill_logits(with_mtp, ids))
    with pytest.raises(ValueError, match="not loaded"):
        model.mtp_forward(0, torch.tensor([1]), torch.zeros(1, 128), None, None)
