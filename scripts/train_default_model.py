"""Train the bundled default model: a small DeepSeek-V3 on the Python standard library.

    python scripts/train_default_model.py --out mci/assets/default-model --minutes 45

Plain PyTorch on CPU, fixed seeds, resumable (`--resume`; training state is saved as
safetensors, never pickle). It trains mci's own model classes (MLA, DeepSeekMoE with a shared
expert, MTP), so what is trained is exactly what is served:

* data: the stdlib's `.py` sources (no tests, no site-packages), minus HELD_OUT modules, which
  the evaluation script scores; a byte-level BPE tokenizer trained on the same files
* loss: next-token cross-entropy + MTP_WEIGHT x the MTP module's cross-entropy on token t+2
  (DeepSeek-V3's multi-token prediction loss, depth 1; the MTP module shares the embedding and
  output head with the main model, as in the report)
* balancing: auxiliary-loss-free. After each step every router's `e_score_correction_bias`
  moves by BIAS_RATE towards balance: up for under-loaded experts, down for over-loaded ones
* output: the bf16 checkpoint at --out and its FP8 block-quantised twin at --out-fp8, in the
  real Hugging Face layout (MTP layer included), plus `train_log.csv`
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import json
import math
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from tqdm import tqdm

from mci.layers.attention_metadata import AttentionMetadata, SequenceChunk
from mci.layers.moe import TopKRouter
from mci.model_config import ModelConfig
from mci.models.deepseek_v3 import DeepseekV3ForCausalLM
from mci.models.layout import checkpoint_layout
from mci.models.loader import checkpoint_to_param, destination
from mci.tools.bpe import BOS, train_bpe
from mci.tools.corpus import corpus_files
from mci.tools.make_checkpoint import random_weights, write_checkpoint

MTP_WEIGHT = 0.3
BIAS_RATE = 1e-3

CONFIG = ModelConfig(
    vocab_size=4096,
    hidden_size=256,
    intermediate_size=768,
    moe_intermediate_size=192,
    num_hidden_layers=4,
    num_attention_heads=4,
    n_routed_experts=8,
    n_shared_experts=1,
    num_experts_per_tok=2,
    n_group=4,
    topk_group=2,
    routed_scaling_factor=1.0,
    norm_topk_prob=True,
    first_k_dense_replace=1,
    moe_layer_freq=1,
    kv_lora_rank=64,
    q_lora_rank=128,
    qk_rope_head_dim=32,
    qk_nope_head_dim=32,
    v_head_dim=32,
    max_position_embeddings=2048,
    num_nextn_predict_layers=1,
)


def tokenize(tokenizer, files: list[Path]) -> np.ndarray:
    """All files as one id stream, each file starting with BOS."""
    bos = tokenizer.token_to_id(BOS)
    texts = [p.read_text(encoding="utf-8", errors="replace") for p in files]
    out = []
    for enc in tokenizer.encode_batch(texts):
        out.append(bos)
        out.extend(enc.ids)
    return np.asarray(out, dtype=np.int32)


def build_model(cfg: ModelConfig, seed: int) -> DeepseekV3ForCausalLM:
    model = DeepseekV3ForCausalLM(cfg, torch.float32)
    modules = dict(model.named_modules())
    for name, w in random_weights(cfg, seed, bias_std=0.0).items():
        if "embed_tokens" in name:
            w = w * 0.02 * math.sqrt(cfg.hidden_size)  # N(0, 0.02*sqrt(H)): scaled by norms
        elif name.endswith(("o_proj.weight", "down_proj.weight")):
            w = w / math.sqrt(2 * (cfg.num_hidden_layers + 1))  # residual branches start small
        destination(modules, checkpoint_to_param(name, cfg)).copy_(w)
    # MTP shares embedding and output head with the main model (DeepSeek-V3 report, sec. 2.2).
    for mtp in model.mtp:
        mtp.embed_tokens.weight = model.model.embed_tokens.weight
        mtp.shared_head.head.weight = model.lm_head.weight
    for name, p in model.named_parameters():
        p.requires_grad_(not name.endswith("e_score_correction_bias"))
    return model


def export_weights(model: DeepseekV3ForCausalLM) -> dict[str, torch.Tensor]:
    """Our parameters under their checkpoint names (the loader's mapping, inverted)."""
    cfg = model.cfg
    modules = dict(model.named_modules())
    return {
        s.name: destination(modules, checkpoint_to_param(s.name, cfg)).detach().float().clone()
        for s in checkpoint_layout(dataclasses.replace(cfg, fp8=None), dtype="F32")
    }


def train_step(model, batch: torch.Tensor, seq: int) -> tuple[torch.Tensor, torch.Tensor]:
    """batch: [B, seq + 2] -> (main loss, MTP loss)."""
    cfg = model.cfg
    b = batch.shape[0]
    slots = torch.arange(b * seq).view(b, seq)
    meta = AttentionMetadata.build([SequenceChunk(slots[i], seq) for i in range(b)])
    cache = torch.zeros(model.num_cache_layers, b * seq, cfg.kv_latent_dim)
    inputs, next1, next2 = batch[:, :seq], batch[:, 1 : seq + 1], batch[:, 2 : seq + 2]
    hidden = model.hidden_states(inputs.reshape(-1), meta, cache, "expanded")
    main = F.cross_entropy(model.lm_head(hidden), next1.reshape(-1))
    mtp = model.mtp[0]
    expanded = model.resolve_path(meta, "expanded")
    h2 = mtp(
        next1.reshape(-1),
        hidden,
        meta,
        model.rope_for(meta),
        cache[cfg.num_hidden_layers],
        expanded,
    )
    mtp_loss = F.cross_entropy(mtp.logits(h2), next2.reshape(-1))
    return main, mtp_loss


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path("mci/assets/default-model"))
    ap.add_argument("--out-fp8", type=Path, default=Path("mci/assets/default-model-fp8"))
    ap.add_argument("--work-dir", type=Path, default=Path("checkpoints/train-default"))
    ap.add_argument("--minutes", type=float, default=45.0, help="training time budget")
    ap.add_argument(
        "--steps",
        type=int,
        default=None,
        help="train exactly this many steps instead (bit-for-bit reproducible)",
    )
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--resume", action="store_true", help="continue from --work-dir")
    args = ap.parse_args()
    torch.manual_seed(args.seed)
    work = args.work_dir
    work.mkdir(parents=True, exist_ok=True)

    train_files, _ = corpus_files()
    tok_file = work / "tokenizer.json"
    if args.resume and tok_file.exists():
        from tokenizers import Tokenizer

        tokenizer = Tokenizer.from_file(str(tok_file))
    else:
        texts = (p.read_text(encoding="utf-8", errors="replace") for p in train_files)
        tokenizer = train_bpe(CONFIG.vocab_size, texts)
        tokenizer.save(str(tok_file))
    data = torch.from_numpy(tokenize(tokenizer, train_files).astype(np.int64))
    print(f"{len(train_files)} files, {len(data):,} training tokens")

    model = build_model(CONFIG, args.seed)
    params = [p for p in model.parameters() if p.requires_grad]
    decay = [p for p in params if p.dim() >= 2]
    no_decay = [p for p in params if p.dim() < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
        lr=args.lr,
        betas=(0.9, 0.95),
    )
    routers = [m for m in model.modules() if isinstance(m, TopKRouter)]
    loads: dict[int, torch.Tensor] = {}
    for i, router in enumerate(routers):
        router.register_forward_hook(
            lambda mod, inp, out, i=i: loads.__setitem__(
                i, torch.bincount(out[1].flatten(), minlength=mod.num_experts)
            )
        )

    state_file, meta_file = work / "state.safetensors", work / "state.json"
    step, elapsed = 0, 0.0
    if args.resume and state_file.exists():
        saved = load_file(str(state_file))
        for name, p in model.named_parameters():
            p.data.copy_(saved[f"param.{name}"])
        for gi, group in enumerate(opt.param_groups):
            for pi, p in enumerate(group["params"]):
                if f"adam.{gi}.{pi}.m" in saved:
                    opt.state[p] = {
                        "step": torch.tensor(float(saved[f"adam.{gi}.{pi}.step"])),
                        "exp_avg": saved[f"adam.{gi}.{pi}.m"],
                        "exp_avg_sq": saved[f"adam.{gi}.{pi}.v"],
                    }
        meta = json.loads(meta_file.read_text())
        step, elapsed = meta["step"], meta["elapsed"]
        print(f"resumed at step {step} ({elapsed / 60:.1f} min)")

    budget = args.minutes * 60
    gen = torch.Generator().manual_seed(args.seed + step)
    log_file = (work / "train_log.csv").open("a", newline="")
    log = csv.writer(log_file)
    if step == 0:
        log.writerow(["step", "minutes", "loss", "mtp_loss", "lr", "tokens_per_s"])
    bar = tqdm(total=int(budget), initial=int(elapsed), unit="s", desc="training")
    last_save = time.monotonic()
    start = time.monotonic() - elapsed

    def progress() -> float:  # 0 -> 1 over the run: drives the schedule and the stop
        return step / args.steps if args.steps else elapsed / budget

    while progress() < 1:
        t0 = time.monotonic()
        warmup = 100
        lr = (
            args.lr
            * min(1.0, (step + 1) / warmup)
            * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, progress()))))
        )
        for group in opt.param_groups:
            group["lr"] = lr
        starts = torch.randint(0, len(data) - args.seq - 2, (args.batch,), generator=gen)
        batch = torch.stack([data[s : s + args.seq + 2] for s in starts])
        main_loss, mtp_loss = train_step(model, batch, args.seq)
        loss = main_loss + MTP_WEIGHT * mtp_loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        with torch.no_grad():  # auxiliary-loss-free balancing
            for i, router in enumerate(routers):
                load = loads[i].float()
                router.e_score_correction_bias += BIAS_RATE * torch.sign(load.mean() - load)
        step += 1
        elapsed = time.monotonic() - start
        tps = args.batch * args.seq / (time.monotonic() - t0)
        bar.update(int(elapsed) - bar.n)
        bar.set_postfix(
            loss=f"{main_loss.item():.3f}", mtp=f"{mtp_loss.item():.3f}", tok_s=f"{tps:.0f}"
        )
        if step % 10 == 0:
            log.writerow(
                [
                    step,
                    f"{elapsed / 60:.2f}",
                    f"{main_loss.item():.4f}",
                    f"{mtp_loss.item():.4f}",
                    f"{lr:.2e}",
                    f"{tps:.0f}",
                ]
            )
            log_file.flush()
        if time.monotonic() - last_save > 300 or progress() >= 1:
            _save_state(model, opt, state_file, meta_file, step, elapsed)
            last_save = time.monotonic()
    bar.close()
    log_file.close()

    weights = export_weights(model)
    write_checkpoint(args.out, CONFIG, weights, tokenizer, dtype="bfloat16")
    write_checkpoint(args.out_fp8, CONFIG, weights, tokenizer, dtype="bfloat16", fp8=True)
    (args.out / "train_log.csv").write_text((work / "train_log.csv").read_text())
    print(f"wrote {args.out} and {args.out_fp8} after {step} steps, {elapsed / 60:.1f} min")
    return 0


def _save_state(model, opt, state_file: Path, meta_file: Path, step: int, elapsed: float):
    tensors = {f"param.{n}": p.detach().contiguous() for n, p in model.named_parameters()}
    for gi, group in enumerate(opt.param_groups):
        for pi, p in enumerate(group["params"]):
            st = opt.state.get(p)
            if st:
                tensors[f"adam.{gi}.{pi}.m"] = st["exp_avg"].contiguous()
                tensors[f"adam.{gi}.{pi}.v"] = st["exp_avg_sq"].contiguous()
                tensors[f"adam.{gi}.{pi}.step"] = torch.tensor(float(st["step"]))
    save_file(tensors, str(state_file))
    meta_file.write_text(json.dumps({"step": step, "elapsed": elapsed}))


if __name__ == "__main__":
    raise SystemExit(main())
