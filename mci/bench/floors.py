"""Physical floors of a serving workload on this machine (`mci bench floors`).

A decode step must read the weights it uses and the KV cache of every sequence in the batch,
and do two FLOPs per multiply-add; a prefill must do its FLOPs. Over the machine's measured
memory bandwidth and matmul rate, that gives the fastest any engine could be:

* TTFT floor: one prompt's prefill FLOPs over the matmul rate (or its weight reads over the
  bandwidth, when larger): no queueing, no other request.
* TPOT floor: one decode step of the workload's concurrency at its mean context
  (input + output / 2): max(bytes / bandwidth, FLOPs / rate).
* output tok/s ceiling: every output token over all prompts' prefill plus `output` such steps.

What is counted (from the checkpoint's own tensor layout, mci/models/layout.py): every weight
but the embedding table (one row per token) and the MTP layers is read once per step; a routed
expert only when some token of the step is routed to it (uniform routing: an expert of E with
k per token is untouched by T tokens with probability (1 - k/E)^T); the KV cache in its MLA
form (kv_lora_rank + qk_rope_head_dim per token and layer, what the model needs, whatever an
engine stores); attention FLOPs as the absorbed decode and the expanded prefill compute them.
Activations, norms' arithmetic and sampling are left out: a floor, not an estimate.
"""

from __future__ import annotations

import json
import re
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from mci.model_config import ModelConfig, load_config
from mci.models.layout import DTYPE_BYTES, checkpoint_layout

_EXPERT = re.compile(r"\.mlp\.experts\.\d+\.")


@dataclass(frozen=True)
class Machine:
    """What this machine sustains, measured with torch on all its threads."""

    bandwidth_gbs: float  # GB/s reading memory: the sum of a 256 MB float32 tensor (GPU: 1 GB)
    bf16_gflops: float  # a bf16 square matmul (2,048^2 where it takes under ~0.1 s; GPU: 8,192^2)
    fp32_gflops: float  # the same in float32

    @property
    def flops(self) -> float:
        """The faster of the two matmul rates, in FLOP/s (a kernel may use either)."""
        return max(self.bf16_gflops, self.fp32_gflops) * 1e9


def measure_machine(repeats: int = 10, budget_s: float = 1.0, device: str = "cpu") -> Machine:
    """Best of up to `repeats` runs for each figure (the machine's capability, not its noise),
    each figure within about `budget_s`: where a dtype has no fast kernel (bf16 on a CPU without
    AVX-512 BF16 runs ~1 GFLOP/s), its matmul stays small instead of taking minutes. On a GPU
    (`device` cuda) the figures are the GPU's: its memory read and its matmuls, timed to their
    end (kernels run asynchronously), with products up to 8,192^2 (2,048^2 is over in
    microseconds there, so launch overhead would set the rate)."""
    import torch

    where = torch.device(device)
    gpu = where.type == "cuda"
    finish = (lambda: torch.cuda.synchronize(where)) if gpu else (lambda: None)

    def best(fn) -> float:
        fn()
        finish()
        times: list[float] = []
        spent = 0.0
        while len(times) < repeats and (spent < budget_s or len(times) < 2):
            t = time.perf_counter()
            fn()
            finish()
            times.append(time.perf_counter() - t)
            spent += times[-1]
        return min(times)

    # 256 MB on a CPU (past its caches); 1 GB on a GPU, whose read of 256 MB is over in
    # ~60 us, near the launch and synchronisation it is timed with
    big = torch.ones((256 if gpu else 64) * 2**20, dtype=torch.float32, device=where)
    bandwidth = big.numel() * 4 / best(big.sum) / 1e9
    largest = 8192 if gpu else 2048
    rates = {}
    for dtype in (torch.bfloat16, torch.float32):
        n = 256  # doubled while one product takes under a tenth of the budget, up to `largest`
        warm = torch.ones(n, n, device=where, dtype=dtype)
        warm @ warm  # the first product's one-off setup (a GPU's library handles) not timed
        finish()
        while True:
            a = torch.randn(n, n, device=where).to(dtype)
            b = torch.randn(n, n, device=where).to(dtype)
            t = time.perf_counter()
            a @ b
            finish()
            if n >= largest or time.perf_counter() - t > budget_s / 10:
                break
            n *= 2
        rates[dtype] = 2 * n**3 / best(lambda a=a, b=b: a @ b) / 1e9
    return Machine(bandwidth, rates[torch.bfloat16], rates[torch.float32])


@dataclass(frozen=True)
class ModelCost:
    """Per-token and per-step costs of one checkpoint, in bytes of its weights' dtype."""

    shared_bytes: int  # weights read by every step whatever the routing (embeddings excluded)
    expert_bytes: int  # one routed expert of one layer
    shared_params: int
    expert_params: int
    moe_layers: int
    experts: int
    experts_per_token: int
    kv_bytes_per_token: int  # the MLA latent + rope key, all layers
    decode_attention_flops: int  # per token of context, per decoded token (absorbed MLA)
    prefill_attention_flops: int  # per (query, key) pair (expanded MLA)

    @classmethod
    def of(cls, cfg: ModelConfig, dtype: str = "BF16") -> ModelCost:
        shared_b = shared_p = expert_p = expert_b = 0
        for spec in checkpoint_layout(cfg, dtype, include_mtp=False):
            n = 1
            for d in spec.shape:
                n *= d
            size = n * DTYPE_BYTES[spec.dtype]
            if spec.name.startswith("model.embed_tokens"):
                continue
            if _EXPERT.search(spec.name):
                expert_p += n
                expert_b += size
            else:
                shared_p += n
                shared_b += size
        moe_layers = sum(cfg.is_moe_layer(i) for i in range(cfg.num_hidden_layers))
        per_expert = max(1, moe_layers * cfg.n_routed_experts)
        layers, heads = cfg.num_hidden_layers, cfg.num_attention_heads
        latent = cfg.kv_lora_rank + cfg.qk_rope_head_dim
        qk = cfg.qk_nope_head_dim + cfg.qk_rope_head_dim
        return cls(
            shared_bytes=shared_b,
            expert_bytes=expert_b // per_expert,
            shared_params=shared_p,
            expert_params=expert_p // per_expert,
            moe_layers=moe_layers,
            experts=cfg.n_routed_experts,
            experts_per_token=cfg.num_experts_per_tok,
            kv_bytes_per_token=layers * latent * DTYPE_BYTES[dtype],
            # scores over latent + rope, values over the latent: a multiply-add each
            decode_attention_flops=2 * layers * heads * (latent + cfg.kv_lora_rank),
            prefill_attention_flops=2 * layers * heads * (qk + cfg.v_head_dim),
        )

    def active_params(self) -> int:
        """Parameters one token multiplies (its routed experts in every MoE layer)."""
        return self.shared_params + self.moe_layers * self.experts_per_token * self.expert_params

    def decode_step(self, batch: int, mean_context: float) -> tuple[float, float]:
        """(bytes read, FLOPs) of one decode step of `batch` sequences."""
        k, e = self.experts_per_token, self.experts
        touched = e * (1 - (1 - k / e) ** batch) if e else 0.0
        weights = self.shared_bytes + self.moe_layers * touched * self.expert_bytes
        kv = batch * mean_context * self.kv_bytes_per_token
        flops = batch * (2 * self.active_params() + mean_context * self.decode_attention_flops)
        return weights + kv, flops

    def prefill_flops(self, tokens: int) -> float:
        """FLOPs of one causal prompt of `tokens` (pairs: tokens * (tokens + 1) / 2)."""
        pairs = tokens * (tokens + 1) / 2
        return tokens * 2 * self.active_params() + pairs * self.prefill_attention_flops


@dataclass(frozen=True)
class Shape:
    """A workload's shape: `concurrency` requests at once, each `input` in / `output` out."""

    name: str
    concurrency: int
    input: int
    output: int

    @classmethod
    def parse(cls, text: str) -> Shape:
        """NAME=CONCURRENCY,INPUT,OUTPUT (ValueError naming the problem)."""
        name, _, rest = text.partition("=")
        parts = rest.split(",")
        if not name or len(parts) != 3 or not all(p.strip().isdigit() for p in parts):
            raise ValueError(f"--shape {text!r}: expected NAME=CONCURRENCY,INPUT,OUTPUT")
        c, i, o = (int(p) for p in parts)
        if c < 1 or i < 1 or o < 1:
            raise ValueError(f"--shape {text!r}: every number must be at least 1")
        return cls(name, c, i, o)


def floors(cost: ModelCost, machine: Machine, shape: Shape) -> dict[str, float]:
    """TTFT (ms), TPOT (ms) and output tok/s bounds of `shape` on `machine`."""
    bandwidth = machine.bandwidth_gbs * 1e9

    def seconds(nbytes: float, flops: float) -> float:
        return max(nbytes / bandwidth, flops / machine.flops)

    ttft = seconds(cost.shared_bytes, cost.prefill_flops(shape.input))
    step = seconds(*cost.decode_step(shape.concurrency, shape.input + shape.output / 2))
    prefill_all = seconds(cost.shared_bytes, shape.concurrency * cost.prefill_flops(shape.input))
    total = prefill_all + shape.output * step
    return {
        "ttft_ms": ttft * 1e3,
        "tpot_ms": step * 1e3,
        "output_tok_s": shape.concurrency * shape.output / total,
    }


def main(model_path: Path, shapes: list[Shape], as_json: bool, device: str = "cpu") -> int:
    cost = ModelCost.of(load_config(model_path))
    machine = measure_machine(device=device)
    result = {
        "machine": asdict(machine),
        "model": asdict(cost),
        "floors": {s.name: floors(cost, machine, s) for s in shapes},
    }
    if as_json:
        print(json.dumps(result, indent=2))
        return 0
    print(
        f"machine: {machine.bandwidth_gbs:.1f} GB/s, bf16 {machine.bf16_gflops:.0f} GFLOP/s, "
        f"fp32 {machine.fp32_gflops:.0f} GFLOP/s"
    )
    for s in shapes:
        f = result["floors"][s.name]
        print(
            f"{s.name} ({s.concurrency} x {s.input} in / {s.output} out): TTFT >= "
            f"{f['ttft_ms']:.2f} ms, TPOT >= {f['tpot_ms']:.3f} ms, "
            f"output <= {f['output_tok_s']:.0f} tok/s"
        )
    return 0
