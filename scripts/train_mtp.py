"""Distil the bundled model's MTP module towards what speculative decoding verifies against.

    python scripts/train_mtp.py --minutes 10     # then: python scripts/eval_default_model.py

The main model stays frozen; only the MTP module trains (its embedding and output head stay
the main model's copies). At position p the module sees the main model's state at p and the
true token p+1, and a draft is accepted when its top token equals the main model's own
prediction at p+1, so the loss is the KL divergence from the main model's next-token
distribution at p+1 to the module's (plain pre-training used the true token p+2 instead).
Data: the training part of the corpus only (the held-out modules stay held out). Writes the
module's tensors back into --out (bf16) and --out-fp8; every other tensor stays byte for byte.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from safetensors.torch import load_file, save_file  # noqa: E402
from tokenizers import Tokenizer  # noqa: E402
from train_default_model import CONFIG, export_weights, tokenize  # noqa: E402

from mci.layers.attention_metadata import AttentionMetadata, SequenceChunk  # noqa: E402
from mci.models.layout import mtp_prefixes  # noqa: E402
from mci.models.loader import load_model  # noqa: E402
from mci.tools.corpus import corpus_files  # noqa: E402
from mci.tools.make_checkpoint import write_checkpoint  # noqa: E402


def distil_step(model, batch: torch.Tensor, seq: int) -> torch.Tensor:
    """batch: [B, seq + 1] -> the module's KL loss against the frozen main model."""
    cfg = model.cfg
    b = batch.shape[0]
    slots = torch.arange(b * seq).view(b, seq)
    meta = AttentionMetadata.build([SequenceChunk(slots[i], seq) for i in range(b)])
    cache = torch.zeros(model.num_cache_layers, b * seq, cfg.kv_latent_dim)
    inputs, next1 = batch[:, :seq].reshape(-1), batch[:, 1 : seq + 1]
    with torch.no_grad():
        hidden = model.hidden_states(inputs, meta, cache, "expanded")
        teacher = model.lm_head(hidden).float().log_softmax(-1).view(b, seq, -1)
    mtp = model.mtp[0]
    row = cache[cfg.num_hidden_layers]
    expanded = model.resolve_path(meta, "expanded")
    out = mtp(next1.reshape(-1), hidden, meta, model.rope_for(meta), row, expanded)
    student = mtp.logits(out).float().log_softmax(-1).view(b, seq, -1)
    # module row p predicts what the main model predicts at row p + 1
    return F.kl_div(student[:, :-1], teacher[:, 1:], log_target=True, reduction="batchmean") / (
        seq - 1
    )


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path("mci/assets/default-model"))
    ap.add_argument("--out-fp8", type=Path, default=Path("mci/assets/default-model-fp8"))
    ap.add_argument("--minutes", type=float, default=10.0)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--lr", type=float, default=5e-4)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    torch.manual_seed(args.seed)
    model = load_model(args.out, "float32")
    for name, p in model.named_parameters():
        trainable = name.startswith("mtp.") and not name.endswith(
            ("embed_tokens.weight", "shared_head.head.weight", "e_score_correction_bias")
        )
        p.requires_grad_(trainable)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=args.lr, betas=(0.9, 0.95), weight_decay=0.0)
    tokenizer = Tokenizer.from_file(str(args.out / "tokenizer.json"))
    data = torch.from_numpy(tokenize(tokenizer, corpus_files()[0]).astype(np.int64))
    print(f"{len(data):,} training tokens; {sum(p.numel() for p in params):,} MTP parameters")
    rng = np.random.default_rng(args.seed)
    start, step, budget = time.monotonic(), 0, args.minutes * 60
    while time.monotonic() - start < budget:
        at = rng.integers(0, len(data) - args.seq - 2, args.batch)
        batch = torch.stack([data[i : i + args.seq + 1] for i in at])
        frac = (time.monotonic() - start) / budget
        for group in opt.param_groups:  # cosine from lr to 10%
            group["lr"] = args.lr * (0.1 + 0.45 * (1 + np.cos(np.pi * min(frac, 1.0))))
        loss = distil_step(model, batch, args.seq)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        step += 1
        if step % 20 == 0:
            print(f"step {step} {(time.monotonic() - start) / 60:.1f} min kl {loss.item():.4f}")
    weights = export_weights(model)
    prefixes = tuple(p + "." for p in mtp_prefixes(CONFIG))
    for out, fp8 in ((args.out, False), (args.out_fp8, True)):
        with tempfile.TemporaryDirectory() as tmp:
            write_checkpoint(tmp, CONFIG, weights, tokenizer, dtype="bfloat16", fp8=fp8)
            fresh = load_file(str(Path(tmp) / "model.safetensors"))
        target = out / "model.safetensors"
        tensors = load_file(str(target))
        tensors.update({k: v for k, v in fresh.items() if k.startswith(prefixes)})
        save_file(tensors, str(target), metadata={"format": "pt"})
    print(f"updated the MTP module in {args.out} and {args.out_fp8} after {step} steps")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
