#!/usr/bin/env python3
"""`mci generate` against `mci serve` on the same model and prompt, alternating, in one run.

Each round runs `mci generate` (a fresh process: its own "[mci] ... decode N tokens X tok/s"
line is the figure) and then sends the same greedy request to one running `mci serve`, twice:
non-streamed (end-to-end tokens/s, HTTP and prefill included) and streamed (decode tokens/s
from the first to the last token, what `mci generate` reports). Prints a JSON summary.

    python benchmarks/generate_cli.py [--model-path DIR] [--max-new-tokens 128] [--rounds 3]
"""

from __future__ import annotations

import argparse
import json
import re
import socket
import statistics
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROMPT = "def fibonacci(n):"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _post(url: str, body: dict, timeout: float = 120):
    req = urllib.request.Request(
        url, json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    return urllib.request.urlopen(req, timeout=timeout)


def generate_cli(python: str, model: list[str], n: int) -> dict:
    cmd = [python, "-m", "mci", "generate", "--prompt", PROMPT, "--max-new-tokens", str(n)]
    out = subprocess.run(
        cmd + model + ["--ignore-eos"], capture_output=True, text=True, cwd=ROOT, check=True
    )
    line = next(x for x in out.stderr.splitlines() if x.startswith("[mci]"))
    decode = re.search(r"decode (\d+) tokens ([\d.]+) tok/s", line)
    return {"text": out.stdout, "tokens": int(decode[1]), "decode_tok_s": float(decode[2])}


def served(url: str, n: int) -> dict:
    body = {"prompt": PROMPT, "max_tokens": n, "temperature": 0, "ignore_eos": True}
    start = time.perf_counter()
    with _post(url + "/v1/completions", body) as r:
        whole = json.loads(r.read())
    e2e_s = time.perf_counter() - start
    times = []
    with _post(url + "/v1/completions", {**body, "stream": True}) as r:
        for raw in r:
            line = raw.decode().strip()
            if line.startswith("data: {") and json.loads(line[6:])["choices"][0]["text"]:
                times.append(time.perf_counter())
    tokens = whole["usage"]["completion_tokens"]
    return {
        "text": PROMPT + whole["choices"][0]["text"] + "\n",
        "tokens": tokens,
        "e2e_tok_s": tokens / e2e_s,
        "decode_tok_s": (len(times) - 1) / (times[-1] - times[0]),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model-path", default=None, help="default: the bundled model")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--python", default=sys.executable)
    args = ap.parse_args()
    model = ["--model-path", args.model_path] if args.model_path else []
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    server = subprocess.Popen(
        [args.python, "-m", "mci", "serve", "--port", str(port), *model],
        cwd=ROOT,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        for _ in range(600):
            try:
                with urllib.request.urlopen(url + "/health", timeout=1) as r:
                    if r.status == 200:
                        break
            except OSError:
                time.sleep(0.2)
        served(url, 8)  # warm-up
        cli, srv = [], []
        for _ in range(args.rounds):
            cli.append(generate_cli(args.python, model, args.max_new_tokens))
            srv.append(served(url, args.max_new_tokens))
    finally:
        server.terminate()
        server.wait(60)
    summary = {
        "max_new_tokens": args.max_new_tokens,
        "generate_decode_tok_s": [round(r["decode_tok_s"], 1) for r in cli],
        "served_decode_tok_s": [round(r["decode_tok_s"], 1) for r in srv],
        "served_e2e_tok_s": [round(r["e2e_tok_s"], 1) for r in srv],
        "generate_over_served_decode": round(
            statistics.median(r["decode_tok_s"] for r in cli)
            / statistics.median(r["decode_tok_s"] for r in srv),
            2,
        ),
        "same_greedy_text": all(c["text"] == s["text"] for c, s in zip(cli, srv)),
    }
    print(json.dumps(summary, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
