#!/usr/bin/env python3
"""Speculative decoding on vs off, served: the bundled default model (it writes Python, so its
drafts mean something; on random weights acceptance is meaningless), through `mci serve` and
`mci bench serve`, greedy, 128 output tokens.

    workload   prompts                                             compared
    code       held-out stdlib code, ~200 tokens, continued        off | mtp k=1,2,3
    code-edit  held-out code, then "# Edited version:" + its       off | ngram k=3,5
               first line (the output repeats the prompt)

Each is measured single-stream (4 prompts one after another) and as a batch of 8 at once
(`--batch-sizes`: others, e.g. to place --speculative-disable-by-batch-size). In
every round the configurations take turns on the same prompts (same seed), one server at a
time; a markdown table of per-stream ms/token (TPOT, mean over requests; median over rounds),
the speed-up over "off", the acceptance rate and the tokens per verification is printed and
appended to docs/benchmarks.md.

    python benchmarks/spec_decode.py --rounds 3
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CONFIGS = {
    "code": [
        ("off", []),
        ("mtp k=1", ["--speculative-algorithm", "mtp", "--speculative-num-steps", "1"]),
        ("mtp k=2", ["--speculative-algorithm", "mtp", "--speculative-num-steps", "2"]),
        ("mtp k=3", ["--speculative-algorithm", "mtp", "--speculative-num-steps", "3"]),
    ],
    "code-edit": [
        ("off", []),
        ("ngram k=3", ["--speculative-algorithm", "ngram", "--speculative-num-steps", "3"]),
        ("ngram k=5", ["--speculative-algorithm", "ngram", "--speculative-num-steps", "5"]),
    ],
}


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _serve(flags: list[str], log: Path):
    port = _port()
    cmd = [sys.executable, "-m", "mci", "serve", "--port", str(port), "--dtype", "bfloat16"]
    cmd += ["--speculative-disable-by-batch-size", "64", *flags]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=log.open("w"), stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    for _ in range(600):
        try:
            with urllib.request.urlopen(url + "/health", timeout=1):
                return proc, url
        except OSError:
            if proc.poll() is not None:
                raise RuntimeError(f"server exited: see {log}") from None
            time.sleep(0.2)
    proc.kill()
    raise RuntimeError("server did not start")


def _bench(url: str, dataset: str, num: int, seed: int, out: Path) -> dict:
    cmd = [sys.executable, "-m", "mci", "bench", "serve", "--base-url", url, "--dataset", dataset]
    cmd += ["--num-prompts", str(num), "--request-rate", "inf", "--input-len", "200"]
    cmd += ["--output-len", "128", "--ignore-eos", "--seed", str(seed), "--disable-tqdm"]
    cmd += ["--output-json", str(out)]
    subprocess.run(cmd, cwd=ROOT, check=True, capture_output=True)
    return json.loads(out.read_text())


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--no-docs", action="store_true", help="do not append to docs/benchmarks.md")
    ap.add_argument("--batch-sizes", default="1,8", help="requests at once, comma-separated")
    ap.add_argument("--workloads", default=",".join(CONFIGS), help="code, code-edit")
    args = ap.parse_args()
    # shape name -> (prompts at once, runs): about 4 requests per shape
    shapes = {
        ("single" if n == 1 else f"batch-{n}"): (n, max(1, 4 // n))
        for n in (int(x) for x in args.batch_sizes.split(","))
    }
    configs = {k: v for k, v in CONFIGS.items() if k in args.workloads.split(",")}
    tmp = Path(tempfile.mkdtemp(prefix="mci-spec-"))
    # (workload, shape, config) -> per round: (ms/token, acceptance, tokens per verify)
    results: dict[tuple[str, str, str], list[tuple]] = {}
    for rnd in range(args.rounds):
        for dataset, runs_of in configs.items():
            for name, flags in runs_of:
                proc, url = _serve(flags, tmp / f"serve-{dataset}-{name}.log")
                try:
                    _bench(url, dataset, 1, 999, tmp / "warm.json")  # warm-up
                    for shape, (num, runs) in shapes.items():
                        tpots, spec = [], []
                        for run in range(runs):
                            seed = args.seed + 100 * rnd + run
                            tag = f"{dataset}-{shape}-{name}-{rnd}-{run}".replace(" ", "")
                            summary = _bench(url, dataset, num, seed, tmp / f"{tag}.json")
                            tpots.append(summary["tpot_ms"]["mean"])
                            spec.append(summary.get("spec_decode"))
                        drafts = sum(s["num_drafts"] for s in spec if s) if any(spec) else 0
                        accepted = sum(s["num_accepted_tokens"] for s in spec if s) if drafts else 0
                        proposed = sum(s["num_draft_tokens"] for s in spec if s) if drafts else 0
                        entry = (
                            statistics.mean(tpots),
                            accepted / proposed if proposed else None,
                            1 + accepted / drafts if drafts else None,
                        )
                        results.setdefault((dataset, shape, name), []).append(entry)
                        print(f"round {rnd} {dataset} {shape} {name}: {entry}", flush=True)
                finally:
                    proc.terminate()
                    proc.wait(30)
    lines = [
        "| workload | shape | config | ms/token (median of rounds) | speed-up vs off "
        "| acceptance | tokens per verify |",
        "|---|---|---|---|---|---|---|",
    ]
    for dataset, runs_of in configs.items():
        for shape in shapes:
            base = statistics.median(e[0] for e in results[(dataset, shape, "off")])
            for name, _ in runs_of:
                rows = results[(dataset, shape, name)]
                ms = statistics.median(e[0] for e in rows)
                acc = [e[1] for e in rows if e[1] is not None]
                tpv = [e[2] for e in rows if e[2] is not None]
                lines.append(
                    f"| {dataset} | {shape} | {name} | {ms:.2f} "
                    f"({', '.join(f'{e[0]:.2f}' for e in rows)}) | {base / ms:.2f}x | "
                    + (f"{statistics.mean(acc):.1%}" if acc else "-")
                    + " | "
                    + (f"{statistics.mean(tpv):.2f}" if tpv else "-")
                    + " |"
                )
    table = "\n".join(lines)
    print(table)
    if not args.no_docs:
        stamp = dt.datetime.now().strftime("%Y%m%d-%H%M%S")
        command = "python benchmarks/spec_decode.py " + " ".join(sys.argv[1:])
        section = (
            f"\n## Speculative decoding run {stamp}\n\n"
            f"Bundled default model, bf16, greedy, 128 output tokens, {args.rounds} rounds; "
            f"whole command: `{command.strip()}`\n\n{table}\n"
        )
        with (ROOT / "docs" / "benchmarks.md").open("a") as f:
            f.write(section)
    return 0


if __name__ == "__main__":
    sys.exit(main())
