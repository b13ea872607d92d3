"""bf16 numerics: mci's token logprobs vs transformers' fp32, against transformers' own bf16 drift.

    python scripts/numerics_bf16.py [--model mci/assets/default-model] [--positions 3000]
                                    [--seq-len 256] [--chunk 64] [--modes a,b] [--layers]

On held-out text (mci.tools.corpus.HELD_OUT, never trained on), every position's "token
logprob" — log_softmax of the logits at the actual next token, what a scoring client gets —
is computed by transformers' DeepseekV3ForCausalLM in float32 (the reference) and in bf16,
and by mci in bf16 along each path the engine can take:

    prefill-expanded / prefill-absorbed   one forward over the sequence, path forced
    prefill-auto                          one forward, the path the engine would choose
    chunked                               `--chunk` tokens per forward after a cached prefix
                                          (chunked prefill, prefix-cache hits), path auto
    decode                                one token per forward (generation), path auto

mci's logits are the runner's: final hidden -> model.logits (lm_head in the model dtype, then
float32). Reported: p50 / p95 / max |delta logprob| vs the fp32 reference on the same
positions, and `flips`: (MoE layer, position) routing decisions unlike the reference's. A flip
at a near-tie moves a logprob by up to a few nats, so flips, not smooth drift, set the max.
mci in fp32 is a sanity row. The bar (issue 8): mci-bf16's p95 and max are no larger than
transformers-bf16's. `--layers` adds each decoder layer's output relative error.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

from mci.layers.attention_metadata import AttentionMetadata, SequenceChunk
from mci.models.loader import load_model
from mci.tokenizer import TextTokenizer
from mci.tools.corpus import corpus_files

DEFAULT_MODEL = Path(__file__).resolve().parents[1] / "mci" / "assets" / "default-model"
MCI_MODES = ("prefill-expanded", "prefill-absorbed", "prefill-auto", "chunked", "decode")


def held_out_sequences(model_dir: Path, num_positions: int, seq_len: int) -> list[list[int]]:
    """Windows of `seq_len` ids, each [BOS] + the next seq_len - 1 tokens of a held-out file.

    Files are visited round-robin (first window of every file, then the second, ...) so a
    small budget still spans all files. Each window scores seq_len - 1 positions. BOS is put
    first here whatever the tokenizer's own post-processing does.
    """
    tok = TextTokenizer.load(model_dir)
    bos = tok.bos_id
    bodies = []
    for path in corpus_files()[1]:
        ids = tok.encode(path.read_text(encoding="utf-8"))
        bodies.append(ids[1:] if ids and ids[0] == bos else ids)
    body_len = seq_len - 1
    seqs, scored, window = [], 0, 0
    while scored < num_positions:
        added = False
        for body in bodies:
            part = body[window * body_len : (window + 1) * body_len]
            if len(part) < body_len or scored >= num_positions:
                continue
            seqs.append([bos] + part)
            scored += body_len
            added = True
        if not added:
            break
        window += 1
    return seqs


def token_logprobs(logits: torch.Tensor, ids: list[int]) -> torch.Tensor:
    """logits [n, V] (row k predicts ids[k + 1]) -> float32 logprobs of the actual tokens [n-1]."""
    logp = logits[:-1].float().log_softmax(-1)
    return logp.gather(1, torch.tensor(ids[1:])[:, None])[:, 0]


def _step(model, ids: list[int], cache, length: int, n: int, path: str) -> torch.Tensor:
    meta = AttentionMetadata.build([SequenceChunk(torch.arange(length), n)])
    hidden = model(torch.tensor(ids[length - n : length]), meta, cache, path)
    return model.logits(hidden)  # the runner's logits: lm_head in the model dtype, then fp32


@torch.inference_mode()
def mci_logits(model, ids: list[int], mode: str, chunk: int = 64) -> torch.Tensor:
    """mci's logits [len(ids), V] for one sequence along `mode` (see the module docstring)."""
    cache = model.allocate_kv_cache(len(ids))
    if mode.startswith("prefill-"):
        return _step(model, ids, cache, len(ids), len(ids), mode.removeprefix("prefill-"))
    step = {"chunked": chunk, "decode": 1}[mode]
    out, length = [], 0
    while length < len(ids):
        n = min(step, len(ids) - length)
        length += n
        out.append(_step(model, ids, cache, length, n, "auto"))
    return torch.cat(out)


@torch.inference_mode()
def hf_logits(hf, ids: list[int]) -> torch.Tensor:
    return hf(torch.tensor([ids])).logits[0]


def load_hf(model_dir: Path, dtype: torch.dtype):
    """transformers' DeepseekV3ForCausalLM on the checkpoint (the MTP layer is ignored)."""
    import transformers
    from transformers import DeepseekV3ForCausalLM

    transformers.logging.set_verbosity_error()
    return DeepseekV3ForCausalLM.from_pretrained(str(model_dir), dtype=dtype).eval()


def delta_stats(got: torch.Tensor, ref: torch.Tensor) -> dict[str, float]:
    d = (got.double() - ref.double()).abs()
    q = torch.quantile(d, torch.tensor([0.5, 0.95], dtype=torch.float64))
    return {"p50": q[0].item(), "p95": q[1].item(), "max": d.max().item()}


class RoutingRecorder:
    """The experts each MoE layer's router picks per position, over any number of forwards
    (transformers' router returns (logits, weights, ids), mci's (weights, ids): ids last)."""

    def __init__(self, model):
        routers = [layer.mlp.gate for layer in model.model.layers if hasattr(layer.mlp, "gate")]
        self.calls: list[list[torch.Tensor]] = [[] for _ in routers]
        for calls, router in zip(self.calls, routers):
            router.register_forward_hook(lambda _m, _in, out, calls=calls: calls.append(out[-1]))

    def take(self) -> torch.Tensor:
        """Sorted expert ids [num_moe_layers, positions, top_k] recorded since the last take."""
        ids = [torch.cat([c.reshape(-1, c.shape[-1]) for c in calls]) for calls in self.calls]
        for calls in self.calls:
            calls.clear()
        return torch.stack(ids).sort(-1).values


def measure(
    model_dir: Path,
    seqs: list[list[int]],
    modes: tuple[str, ...] = MCI_MODES,
    chunk: int = 64,
    with_fp32: bool = True,
) -> dict[str, dict[str, float]]:
    """|delta token logprob| stats vs transformers fp32 for HF-bf16, mci-bf16 per mode (and
    mci-fp32 prefill as a sanity row), plus `flips`: (layer, position) routing decisions that
    differ from the fp32 reference's (the usual cause of the largest deltas)."""
    ref_lp, ref_routes, got, flips = [], [], {}, {}

    def add(name: str, logits: torch.Tensor, ids: list[int], routes: torch.Tensor) -> None:
        got.setdefault(name, []).append(token_logprobs(logits, ids))
        differ = (routes != ref_routes[len(got[name]) - 1]).any(-1)
        flips[name] = flips.get(name, 0) + int(differ.sum())

    hf32, hf16 = load_hf(model_dir, torch.float32), load_hf(model_dir, torch.bfloat16)
    rec32, rec16 = RoutingRecorder(hf32), RoutingRecorder(hf16)
    for ids in seqs:
        ref_lp.append(token_logprobs(hf_logits(hf32, ids), ids))
        ref_routes.append(rec32.take())
        add("hf-bf16", hf_logits(hf16, ids), ids, rec16.take())
    del hf32, hf16
    variants = [("bfloat16", m) for m in modes]
    if with_fp32:
        variants.append(("float32", "prefill-auto"))
    for dtype in dict.fromkeys(d for d, _ in variants):
        model = load_model(model_dir, dtype)
        recorder = RoutingRecorder(model)
        for d, mode in variants:
            if d == dtype:
                name = f"mci-{'bf16' if d == 'bfloat16' else 'fp32'} {mode}"
                for ids in seqs:
                    add(name, mci_logits(model, ids, mode, chunk), ids, recorder.take())
    ref = torch.cat(ref_lp)
    return {
        name: {**delta_stats(torch.cat(v), ref), "flips": flips[name]} for name, v in got.items()
    }


@torch.inference_mode()
def layer_errors(model_dir: Path, ids: list[int], path: str) -> list[dict[str, float]]:
    """Relative L2 error vs HF fp32 of each decoder layer's output (and the final norm), for
    HF bf16 and mci bf16 (prefill along `path`): where the two lose precision."""
    outs: dict[str, list[torch.Tensor]] = {}

    def hook(name):
        def fn(_module, _inputs, output):
            out = output[0] if isinstance(output, tuple) else output
            outs.setdefault(name, []).append(out.reshape(len(ids), -1).float())

        return fn

    for name, dtype in (("hf32", torch.float32), ("hf16", torch.bfloat16)):
        hf = load_hf(model_dir, dtype)
        for module in [*hf.model.layers, hf.model.norm]:
            module.register_forward_hook(hook(name))
        hf_logits(hf, ids)
    model = load_model(model_dir, "bfloat16")
    for module in [*model.model.layers, model.model.norm]:
        module.register_forward_hook(hook("mci16"))
    mci_logits(model, ids, f"prefill-{path}")
    rows = []
    for i, ref in enumerate(outs["hf32"]):
        row = {"layer": i if i < len(outs["hf32"]) - 1 else "norm"}
        for name in ("hf16", "mci16"):
            row[name] = ((outs[name][i] - ref).norm() / ref.norm()).item()
        rows.append(row)
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", type=Path, default=DEFAULT_MODEL)
    ap.add_argument("--positions", type=int, default=3000)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--chunk", type=int, default=64, help="tokens per step in the chunked mode")
    ap.add_argument("--modes", default=",".join(MCI_MODES))
    ap.add_argument("--layers", action="store_true", help="also print per-layer errors")
    args = ap.parse_args()

    start = time.perf_counter()
    seqs = held_out_sequences(args.model, args.positions, args.seq_len)
    modes = tuple(args.modes.split(","))
    stats = measure(args.model, seqs, modes, args.chunk)
    num = sum(len(s) - 1 for s in seqs)
    print(
        f"{num} positions in {len(seqs)} sequences of {args.seq_len} tokens "
        f"({time.perf_counter() - start:.0f} s): |delta token logprob| vs transformers fp32; "
        "flips: routing decisions (MoE layer, position) unlike fp32's"
    )
    bar = stats["hf-bf16"]
    print(f"{'':28} {'p50':>8} {'p95':>8} {'max':>8} {'flips':>6}")
    for name, s in stats.items():
        ok = ""
        if name.startswith("mci-bf16"):
            ok = "ok" if s["p95"] <= bar["p95"] and s["max"] <= bar["max"] else "WORSE than hf-bf16"
        print(f"{name:28} {s['p50']:8.4f} {s['p95']:8.4f} {s['max']:8.4f} {s['flips']:6}  {ok}")
    if args.layers:
        for path in ("expanded", "absorbed"):
            print(f"\nper-layer relative L2 error vs HF fp32 (mci prefill-{path}, sequence 0)")
            for row in layer_errors(args.model, seqs[0], path):
                print(json.dumps(row))
    return 0


if __name__ == "__main__":
    sys.exit(main())
