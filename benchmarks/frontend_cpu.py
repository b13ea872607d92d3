"""Where a served single stream's time goes, in one run:

1. served: one greedy 32-in / 256-out stream through `mci serve`; wall ms per output token,
   and CPU ms per token of the front end, the engine process and this client (from /proc);
2. in-process: the same request through `mci.engine.Engine` (no HTTP, no pipe).

On the `small` checkpoint (benchmarks/.peers/small-bf16, made by prepare_checkpoint.sh):

    python benchmarks/frontend_cpu.py [--rounds 3]
"""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
import time

import httpx

CHECKPOINT = "benchmarks/.peers/small-bf16"
PROMPT = list(range(100, 132))
NEW_TOKENS = 256


def _cpu_s(pid: int) -> float:
    fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def served(rounds: int) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    url = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "mci", "serve", "--model-path", CHECKPOINT, "--port", str(port)]
    server = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        while True:
            try:
                if httpx.get(url + "/health").status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.3)
        engine = httpx.get(url + "/internal/state").json()["engine_pid"]
        body = {
            "prompt": PROMPT,
            "max_tokens": NEW_TOKENS,
            "ignore_eos": True,
            "temperature": 0,
            "stream": True,
        }
        for _ in range(rounds):
            before = [_cpu_s(pid) for pid in (server.pid, engine, os.getpid())]
            start = time.time()
            with httpx.stream("POST", url + "/v1/completions", json=body, timeout=300) as r:
                for _line in r.iter_lines():
                    pass
            wall = time.time() - start
            after = [_cpu_s(pid) for pid in (server.pid, engine, os.getpid())]
            front, eng, client = (1000 * (a - b) / NEW_TOKENS for a, b in zip(after, before))
            print(
                f"served: {1000 * wall / NEW_TOKENS:.1f} ms/token; CPU ms/token: front end "
                f"{front:.2f}, engine {eng:.2f}, client {client:.2f}"
            )
    finally:
        server.terminate()
        server.wait(60)


def in_process(rounds: int) -> None:
    from mci.cache.config import CacheConfig
    from mci.core.sampling_params import SamplingParams
    from mci.engine.config import EngineConfig, ModelPlacement
    from mci.engine.engine import Engine

    config = EngineConfig(model=ModelPlacement(model_path=CHECKPOINT), cache=CacheConfig())
    engine = Engine(config, background=True)
    params = SamplingParams(max_new_tokens=NEW_TOKENS, temperature=0, ignore_eos=True)
    try:
        for _ in range(rounds):
            start = time.time()
            engine.generate(PROMPT, params)
            print(f"in-process: {1000 * (time.time() - start) / NEW_TOKENS:.1f} ms/token")
    finally:
        engine.shutdown()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    rounds = ap.parse_args().rounds
    served(rounds)
    in_process(rounds)


if __name__ == "__main__":
    main()
