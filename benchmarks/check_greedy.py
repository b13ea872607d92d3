#!/usr/bin/env python3
"""Do the engines compute the same model? Greedy output of each engine for the same token ids.

Starts each engine in turn (the same commands as benchmarks/run.py, one at a time), sends the
same token-id prompts to /v1/completions with temperature 0, `ignore_eos` and `logprobs: 1`, and
compares the generated token pieces with mci's: how many leading tokens agree. The model has random
weights, so its logits are close together and bf16 rounding differences between engines can flip
an argmax after a few tokens; agreement on the first tokens is what shows the same computation.

    python benchmarks/check_greedy.py [--engines mci,vllm,llama.cpp] [--mci-src DIR] [--tokens 16]

Writes benchmarks/results/greedy-<timestamp>.json and prints a markdown table.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import random
import shlex
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import run as bench  # noqa: E402


def pieces(choice: dict) -> list[str]:
    lp = choice.get("logprobs") or {}
    toks = lp.get("tokens")
    if toks is None and isinstance(lp.get("content"), list):  # chat-style logprobs
        toks = [c.get("token") for c in lp["content"]]
    return list(toks or [])


def first_top(choice: dict) -> dict[str, float]:
    """The first generated position's top alternatives: {token piece: logprob}."""
    lp = choice.get("logprobs") or {}
    top = lp.get("top_logprobs") or []
    if top and isinstance(top[0], dict):
        return {k: float(v) for k, v in top[0].items()}
    return {}


HF_SCRIPT = r"""
import json, sys, torch
from transformers import AutoModelForCausalLM, AutoTokenizer
ckpt, n, prompts = sys.argv[1], int(sys.argv[2]), json.loads(sys.stdin.read())
tok = AutoTokenizer.from_pretrained(ckpt)
model = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32).eval()
out = []
for p in prompts:
    ids = torch.tensor([p])
    with torch.no_grad():
        first = torch.log_softmax(model(ids).logits[0, -1].float(), -1)
        gen = model.generate(ids, max_new_tokens=n, do_sample=False, eos_token_id=None,
                             pad_token_id=0)[0, len(p):].tolist()
    v, i = torch.topk(first, 5)
    out.append({"text": tok.decode(gen), "tokens": [tok.decode([t]) for t in gen],
                "first_top5": {tok.decode([t]): x for x, t in zip(v.tolist(), i.tolist())}})
print("HF-JSON" + json.dumps(out))
"""


def hf_reference(py: str, prompts: list, n: int) -> list:
    """transformers' DeepseekV3ForCausalLM in float32 on the same checkpoint: the reference."""
    import subprocess

    proc = subprocess.run(
        [py, "-c", HF_SCRIPT, str(bench.CKPT), str(n)],
        input=json.dumps(prompts),
        capture_output=True,
        text=True,
        cwd="/",
        timeout=1200,
    )
    for line in proc.stdout.splitlines():
        if line.startswith("HF-JSON"):
            return json.loads(line[7:])
    raise RuntimeError(f"transformers reference failed: {proc.stderr[-500:]}")


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--engines", default=",".join(bench.ENGINES))
    ap.add_argument("--mci-src", default=str(bench.ROOT))
    ap.add_argument("--mci-python", default=str(bench.ROOT / ".venv" / "bin" / "python"))
    ap.add_argument("--mci-cmd", default=None)
    ap.add_argument("--kv-cache-gb", type=int, default=4)
    ap.add_argument("--vllm-extra", default="")
    ap.add_argument("--llama-extra", default="")
    ap.add_argument("--tokens", type=int, default=16)
    ap.add_argument(
        "--hf-python",
        default=None,
        help="a python with transformers and torch: adds transformers' float32 "
        "forward as a reference row ('hf')",
    )
    ap.add_argument("--prompts", type=int, default=3)
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--ready-timeout", type=float, default=600)
    ap.add_argument("--results", default=str(bench.HERE / "results"))
    args = ap.parse_args()
    args.mci_cmd = args.mci_cmd or (
        f"env PYTHONPATH={shlex.quote(args.mci_src)} {shlex.quote(args.mci_python)} -m mci serve"
    )
    engines = [e.strip() for e in args.engines.split(",") if e.strip()]
    rng = random.Random(args.seed)
    prompts = [[rng.randrange(10, bench.VOCAB) for _ in range(32)] for _ in range(args.prompts)]
    stamp = dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    out_dir = Path(args.results) / f"greedy-{stamp}"
    out_dir.mkdir(parents=True)
    got: dict[str, list] = {}
    for e in engines:
        port = bench.free_port()
        cmd, env = bench.engine_cmd(e, port, args)
        bench.log(f"{e}: starting on port {port}")
        server = bench.Server(e, cmd, env, port, out_dir / f"{e}.log")
        try:
            server.wait_ready(args.ready_timeout)
            got[e] = []
            for p in prompts:
                body = {
                    "model": bench.SERVED_NAME,
                    "prompt": p,
                    "max_tokens": args.tokens,
                    "temperature": 0,
                    "ignore_eos": True,
                    "logprobs": 5,
                }
                c = bench.http_json(server.base + "/v1/completions", body, timeout=600)
                ch = c["choices"][0]
                got[e].append(
                    {"text": ch.get("text", ""), "tokens": pieces(ch), "first_top5": first_top(ch)}
                )
            bench.log(f"{e}: {got[e][0]['tokens'][:8]}")
        except Exception as exc:
            got[e] = [{"error": f"{type(exc).__name__}: {exc}"}]
            bench.log(f"{e}: FAILED {exc}")
        finally:
            server.stop()

    if args.hf_python:
        try:
            got["hf"] = hf_reference(args.hf_python, prompts, args.tokens)
        except Exception as exc:
            got["hf"] = [{"error": f"{type(exc).__name__}: {exc}"}]
        engines.append("hf")
    ref = got.get("mci")
    rows = [
        "| engine | prompt | leading tokens equal to mci's | 1st position: top-5 shared with "
        "mci's, largest logprob gap on those | first 8 token pieces |",
        "|---|---|---|---|---|",
    ]
    summary = {"prompts": prompts, "outputs": got, "agreement": {}}
    for e in engines:
        for i, out in enumerate(got[e]):
            if "error" in out:
                rows.append(f"| {e} | {i} | error: {out['error'][:80]} | | |")
                continue
            toks = out["tokens"]
            if ref and i < len(ref) and "tokens" in ref[i]:
                n = 0
                for a, b in zip(ref[i]["tokens"], toks):
                    if a != b:
                        break
                    n += 1
                agree = f"{n} / {min(len(toks), len(ref[i]['tokens']))}"
                a, b = ref[i].get("first_top5", {}), out.get("first_top5", {})
                shared = set(a) & set(b)
                gap = max((abs(a[k] - b[k]) for k in shared), default=float("nan"))
                top = f"{len(shared)} / {len(a)}, {gap:.3f}" if a and b else "n/a"
            else:
                agree = top = "n/a"
            summary["agreement"].setdefault(e, []).append(agree)
            shown = " ".join(json.dumps(t, ensure_ascii=False) for t in toks[:8])
            rows.append(f"| {e} | {i} | {agree} | {top} | {shown.replace('|', '&#124;')} |")
    table = "\n".join(rows)
    print(table)
    path = Path(args.results) / f"greedy-{stamp}.json"
    path.write_text(json.dumps(summary, indent=2, ensure_ascii=False))
    bench.log(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
