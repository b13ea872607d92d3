"""Single-stream greedy decode: mci vs Hugging Face transformers `generate`, same run.

Both run the same seeded `small` checkpoint, same prompt, same dtype, same thread count, greedy,
EOS ignored, alternating rounds so machine drift hits both alike. Reported: median decode
ms/token and tokens/s of each, and the ratio. Usage:

    python benchmarks/bench_decode.py [--dtype float32] [--prompt-len 32] [--new-tokens 128]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
from bench_common import load_hf, small_checkpoint

from mci.models.loader import load_model
from mci.runner.single_sequence import decode_single_sequence


def hf_decode_ms(model, ids: list[int], new_tokens: int) -> float:
    """HF decode time per token: (time for N tokens - time for 1 token) / (N - 1)."""
    x = torch.tensor([ids])

    def timed(n: int) -> float:
        start = time.perf_counter()
        with torch.no_grad():
            model.generate(
                x,
                max_new_tokens=n,
                min_new_tokens=n,
                do_sample=False,
                eos_token_id=None,
                pad_token_id=0,
            )
        return time.perf_counter() - start

    return (timed(new_tokens) - timed(1)) / (new_tokens - 1) * 1000


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", default="small")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--checkpoint-dir", type=Path, default=Path("checkpoints"))
    ap.add_argument("--output-json", type=Path)
    args = ap.parse_args()

    path = small_checkpoint(args.checkpoint_dir, args.dtype, args.size)
    hf = load_hf(path, args.dtype)
    ours = load_model(path, args.dtype)
    ids = torch.randint(
        10, ours.cfg.vocab_size, (args.prompt_len,), generator=torch.Generator().manual_seed(0)
    ).tolist()

    decode_single_sequence(ours, ids, 8)  # warm-up both
    hf_decode_ms(hf, ids, 4)
    mci_ms, hf_ms = [], []
    for _ in range(args.rounds):
        r = decode_single_sequence(ours, ids, args.new_tokens)
        mci_ms.append(r.decode_seconds / (len(r.token_ids) - 1) * 1000)
        hf_ms.append(hf_decode_ms(hf, ids, args.new_tokens))
    m, h = statistics.median(mci_ms), statistics.median(hf_ms)
    result = {
        "checkpoint": args.size,
        "dtype": args.dtype,
        "threads": torch.get_num_threads(),
        "prompt_len": args.prompt_len,
        "new_tokens": args.new_tokens,
        "mci_ms_per_token": round(m, 3),
        "hf_ms_per_token": round(h, 3),
        "mci_tokens_per_s": round(1000 / m, 1),
        "hf_tokens_per_s": round(1000 / h, 1),
        "speedup_vs_hf": round(h / m, 2),
    }
    print(json.dumps(result, indent=2))
    if args.output_json:
        args.output_json.write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
