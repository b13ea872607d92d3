#!/usr/bin/env python3
"""Side-by-side serving benchmark: mci against vLLM (CPU build) and llama.cpp (llama-server).

For each workload and round, the engines take turns (mci, vllm, llama.cpp, then mci again in the
next round): each engine's OpenAI-compatible server is started on a loopback port, polled until
ready, warmed up with one short request, measured with `mci bench serve` (the same fresh random
seed for every engine within a round, so all engines get the same prompts and arrival times), and
stopped. Only one engine runs at a time. Results go to benchmarks/results/<timestamp>.json (and the
raw per-run JSON and server logs to benchmarks/results/<timestamp>/); a markdown table is printed
and appended to docs/benchmarks.md.

Set up first: benchmarks/install_peers.sh and benchmarks/prepare_checkpoint.sh. Example:

    python benchmarks/run.py                                   # all engines, all workloads, 1 round
    python benchmarks/run.py --engines mci,llama.cpp --workloads batch,single --rounds 3
    python benchmarks/run.py --mci-src /tmp/mci-bench         # mci from a snapshot worktree

Stdlib only; any Python 3.9+ runs it.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import random
import shlex
import signal
import socket
import statistics
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
PEERS = HERE / ".peers"
CKPT = PEERS / "small-bf16"
GGUF = PEERS / "small-bf16.gguf"
FP8_CKPT = PEERS / "small-fp8"  # the same model made with --fp8 (e4m3, 128x128 block scales)
# the same size stretched to 32k positions with YaRN (as DeepSeek-V3 stretches 4k to 160k)
LONG_CKPT = PEERS / "small-bf16-32k"
LONG_GGUF = PEERS / "small-bf16-32k.gguf"
Q8_GGUF = PEERS / "small-q8_0.gguf"  # the bf16 checkpoint converted with --outtype q8_0
VLLM_PY = PEERS / "vllm-venv" / "bin" / "python"
LLAMA_SERVER = PEERS / "llama.cpp-build" / "bin" / "llama-server"
VOCAB = 8000  # random prompt ids below this: inside the model's 8192, special ids (< 10) excluded
SERVED_NAME = "small-bf16"

# name -> (bench serve args, metrics to report: (label, json path, unit, higher_is_better))
WORKLOADS: dict[str, tuple[list[str], list[tuple[str, tuple[str, ...], str, bool]]]] = {
    "batch": (
        [
            "--dataset",
            "random",
            "--num-prompts",
            "32",
            "--request-rate",
            "inf",
            "--input-len",
            "128",
            "--output-len",
            "128",
        ],
        [("output tok/s", ("output_token_throughput",), "tok/s", True)],
    ),
    "online": (
        [
            "--dataset",
            "random",
            "--num-prompts",
            "64",
            "--request-rate",
            "4",
            "--input-len",
            "256",
            "--output-len",
            "64",
        ],
        [
            ("TTFT p50", ("ttft_ms", "p50"), "ms", False),
            ("TTFT p99", ("ttft_ms", "p99"), "ms", False),
            ("TPOT p50", ("tpot_ms", "p50"), "ms", False),
        ],
    ),
    "prefix": (
        [
            "--dataset",
            "shared-prefix",
            "--num-prompts",
            "32",
            "--request-rate",
            "inf",
            "--prefix-len",
            "1024",
            "--input-len",
            "32",
            "--output-len",
            "32",
        ],
        [("TTFT p50", ("ttft_ms", "p50"), "ms", False)],
    ),
    "single": (
        [
            "--dataset",
            "random",
            "--num-prompts",
            "1",
            "--request-rate",
            "inf",
            "--input-len",
            "32",
            "--output-len",
            "256",
        ],
        [("TPOT", ("tpot_ms", "p50"), "ms/tok", False)],
    ),
    # long contexts: one request decoding after an 8k / a 16k prompt (its TTFT is the prefill)
    **{
        f"long-{k}k": (
            [
                "--dataset",
                "random",
                "--num-prompts",
                "1",
                "--request-rate",
                "inf",
                "--input-len",
                str(k * 1024),
                "--output-len",
                "128",
            ],
            [
                ("TTFT", ("ttft_ms", "p50"), "ms", False),
                ("TPOT", ("tpot_ms", "p50"), "ms/tok", False),
            ],
        )
        for k in (8, 16)
    },
    "many": (
        [
            "--dataset",
            "random",
            "--num-prompts",
            "256",
            "--request-rate",
            "inf",
            "--input-len",
            "256",
            "--output-len",
            "256",
        ],
        [
            ("output tok/s", ("output_token_throughput",), "tok/s", True),
            ("TPOT p99", ("tpot_ms", "p99"), "ms", False),
        ],
    ),
}
# `--workloads long` names both long ones
WORKLOAD_GROUPS = {"long": ("long-8k", "long-16k")}
# the long and many workloads take minutes per engine here: asked for by name
DEFAULT_WORKLOADS = ("batch", "online", "prefix", "single")
WORKLOAD_TEXT = {
    "batch": "32 requests at once, 128 in / 128 out",
    "online": "64 requests, Poisson 4 req/s, 256 in / 64 out",
    "prefix": "32 at once, 1,024 shared + 32 unique in / 32 out",
    "single": "1 request, 32 in / 256 out",
    "long-8k": "1 request, 8,192 in / 128 out, on the 32k-context checkpoint",
    "long-16k": "1 request, 16,384 in / 128 out, on the 32k-context checkpoint",
    "many": "256 requests at once, 256 in / 256 out",
}


class Serving:
    """What a workload needs of every engine's server: the checkpoint (`long`: the 32k-context
    one), room for each sequence, and how many sequences at once (llama-server splits its
    context evenly over that many slots)."""

    def __init__(self, long: bool, context: int, sequences: int):
        self.long, self.context, self.sequences = long, context, sequences

    def key(self) -> tuple:
        return (self.long, self.context, self.sequences)


# Longest default request: 1,024 + 32 in + 32 out (prefix): 2,048 per sequence for every engine,
# and 32 llama.cpp slots of 1,280 for 32 concurrent requests.
DEFAULT_SERVING = Serving(long=False, context=2048, sequences=32)
SERVING = {
    "long-8k": Serving(long=True, context=16384 + 512, sequences=1),
    "long-16k": Serving(long=True, context=16384 + 512, sequences=1),
    "many": Serving(long=False, context=2048, sequences=256),
}
LLAMA_CTX_PER_SLOT = {32: 1280, 256: 640}  # what the longest request of each needs, rounded up
ENGINES = (
    "mci",
    "vllm",
    "llama.cpp",
    "mci-deterministic",
    "mci-fp8",
    "llama.cpp-q8_0",
    "mci-base",
    "mci-fp8-base",
)
# mci-deterministic: mci with --deterministic; mci-fp8: mci on the FP8 checkpoint;
# llama.cpp-q8_0: llama.cpp on the model converted to q8_0 (8.5 bits per weight);
# mci-base / mci-fp8-base: mci and mci-fp8 from --base-src (an A/B within one run)
DEFAULT_ENGINES = ("mci", "vllm", "llama.cpp")


def log(msg: str) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def busy_cpus(seconds: float = 2.0) -> float:
    """How many CPUs' worth of time the whole machine used over `seconds` (/proc/stat)."""

    def sample() -> tuple[int, int]:
        with open("/proc/stat") as f:
            v = [int(x) for x in f.readline().split()[1:]]
        idle = v[3] + v[4]
        return sum(v) - idle, sum(v)

    try:
        b0, t0 = sample()
        time.sleep(seconds)
        b1, t1 = sample()
    except OSError:
        return 0.0
    return (b1 - b0) / max(1, t1 - t0) * (os.cpu_count() or 1)


def http_json(url: str, body: dict | None = None, timeout: float = 10) -> dict:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read())


def version_of(cmd: list[str]) -> str:
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd="/")
        return (out.stdout + out.stderr).strip()
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"unknown ({exc})"


def git_commit(src: Path) -> str:
    out = subprocess.run(
        ["git", "-C", str(src), "rev-parse", "HEAD"], capture_output=True, text=True
    )
    dirty = subprocess.run(
        ["git", "-C", str(src), "status", "--porcelain", "--untracked-files=no"],
        capture_output=True,
        text=True,
    ).stdout.strip()
    return out.stdout.strip() + (" (with uncommitted changes)" if dirty else "")


class CpuQuota:
    """A cgroup with a CPU quota of `cpus` (cgroup v2 cpu.max, else v1's cpu controller) that
    the servers run in (`wrap`): the shape of a container CPU limit."""

    PERIOD_US = 100_000

    def __init__(self, cpus: float):
        quota = round(cpus * self.PERIOD_US)
        v2 = Path("/sys/fs/cgroup/cgroup.controllers")
        name = f"mci-bench-{os.getpid()}"
        if v2.exists():
            self.path = Path("/sys/fs/cgroup") / name
            self.path.mkdir()
            (self.path / "cpu.max").write_text(f"{quota} {self.PERIOD_US}")
        else:
            self.path = Path("/sys/fs/cgroup/cpu") / name
            self.path.mkdir()
            (self.path / "cpu.cfs_period_us").write_text(str(self.PERIOD_US))
            (self.path / "cpu.cfs_quota_us").write_text(str(quota))

    def wrap(self, cmd: list[str]) -> list[str]:
        """cmd, started inside the cgroup (its children stay in it)."""
        return ["sh", "-c", 'echo $$ > "$0" && exec "$@"', str(self.path / "cgroup.procs"), *cmd]

    def remove(self) -> None:
        try:
            self.path.rmdir()
        except OSError as exc:
            log(f"could not remove {self.path}: {exc}")


def start_neighbour(kind: str) -> subprocess.Popen | None:
    """Another process taking CPU beside the engine: `busy-loop`, a Python busy loop pinned
    to the last CPU (a co-located service at full load)."""
    if kind == "none":
        return None
    cpu = max(os.sched_getaffinity(0))
    return subprocess.Popen(
        ["taskset", "-c", str(cpu), sys.executable, "-c", "while True: pass"],
        stdin=subprocess.DEVNULL,
        start_new_session=True,
    )


def stop_neighbour(proc: subprocess.Popen | None) -> None:
    if proc is not None:
        proc.kill()
        proc.wait()


class Server:
    """One engine's server in its own process group, so that stopping it ends all its children."""

    def __init__(self, name: str, cmd: list[str], env: dict, port: int, log_path: Path):
        self.name, self.cmd, self.port, self.log_path = name, cmd, port, log_path
        self.base = f"http://127.0.0.1:{port}"
        self.log_file = open(log_path, "w")
        self.log_file.write("$ " + shlex.join(cmd) + "\n")
        self.log_file.flush()
        # cwd=/: `python -m` puts the cwd first on sys.path; running from the repo root would make
        # an mci given through PYTHONPATH lose to the checkout's own mci/.
        self.proc = subprocess.Popen(
            cmd,
            env=env,
            stdout=self.log_file,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            cwd="/",
            start_new_session=True,
        )

    def wait_ready(self, timeout: float) -> float:
        t0 = time.monotonic()
        while time.monotonic() - t0 < timeout:
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"{self.name} exited with {self.proc.returncode} while starting;"
                    f" see {self.log_path}"
                )
            try:
                models = http_json(self.base + "/v1/models", timeout=5)
                if models.get("data"):
                    return time.monotonic() - t0
            except (urllib.error.URLError, OSError, ValueError):
                pass
            time.sleep(1)
        raise RuntimeError(f"{self.name} not ready after {timeout:.0f}s; see {self.log_path}")

    def warm_up(self) -> None:
        body = {
            "model": SERVED_NAME,
            "prompt": list(range(100, 132)),
            "max_tokens": 16,
            "temperature": 0,
        }
        out = http_json(self.base + "/v1/completions", body, timeout=600)
        if not out.get("choices"):
            raise RuntimeError(f"{self.name}: warm-up request returned {out}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            for sig, wait in ((signal.SIGTERM, 40), (signal.SIGKILL, 10)):
                try:
                    os.killpg(self.proc.pid, sig)
                except ProcessLookupError:
                    break
                try:
                    self.proc.wait(wait)
                    break
                except subprocess.TimeoutExpired:
                    continue
        # the group's other members (workers that outlived their parent)
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.log_file.close()


def model_file(name: str, serving: Serving) -> Path:
    """The checkpoint (or GGUF) `name` serves for a workload (ValueError where none is made)."""
    fp8, q8 = name.startswith("mci-fp8"), name == "llama.cpp-q8_0"
    if serving.long and (fp8 or q8):
        raise ValueError(f"{name}: no 32k-context checkpoint is made in its format")
    if name.startswith("llama.cpp"):
        return Q8_GGUF if q8 else LONG_GGUF if serving.long else GGUF
    return FP8_CKPT if fp8 else LONG_CKPT if serving.long else CKPT


def engine_cmd(name: str, port: int, args, serving: Serving) -> tuple[list[str], dict]:
    env = dict(os.environ)
    env.pop("PYTHONPATH", None)
    if name.startswith("mci"):
        cmd = shlex.split(args.base_cmd if name.endswith("-base") else args.mci_cmd) + [
            "--model-path",
            str(model_file(name, serving)),
            "--port",
            str(port),
            "--served-model-name",
            SERVED_NAME,
            "--context-length",
            str(serving.context),
            "--kv-cache-gb",
            f"{args.kv_cache_gb:g}",
        ]
        cmd += ["--deterministic"] if name == "mci-deterministic" else []
        return cmd + shlex.split(args.mci_extra), env
    if name == "vllm":
        env.update(VLLM_MLA_DISABLE="1", VLLM_CPU_KVCACHE_SPACE=str(round(args.kv_cache_gb)))
        cmd = [
            str(VLLM_PY),
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--model",
            str(model_file(name, serving)),
            "--served-model-name",
            SERVED_NAME,
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--dtype",
            "bfloat16",
            "--max-model-len",
            str(serving.context),
            "--hf-overrides",
            '{"topk_method": "noaux_tc", "scoring_func": "sigmoid"}',
        ]
        if serving.sequences > DEFAULT_SERVING.sequences:
            cmd += ["--max-num-seqs", str(serving.sequences)]
        return cmd + shlex.split(args.vllm_extra), env
    if name in ("llama.cpp", "llama.cpp-q8_0"):
        cmd = [
            str(LLAMA_SERVER),
            "-m",
            str(model_file(name, serving)),
            "--alias",
            SERVED_NAME,
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "-c",
            str(serving.sequences * LLAMA_CTX_PER_SLOT.get(serving.sequences, serving.context)),
            "-np",
            str(serving.sequences),
            "-t",
            str(os.cpu_count()),
            "--no-webui",
            # its jinja parser rejects the checkpoint's tool-call chat template and exits; the
            # benchmark only uses /v1/completions, which needs no template
            "--no-jinja",
        ]
        return cmd + shlex.split(args.llama_extra), env
    raise ValueError(name)


def server_commands(engines: list[str], workloads: list[str], args) -> dict[str, str]:
    """Each engine's server command (port as PORT), once per distinct serving setup: keyed by
    the engine alone for the default one, else by the engine and its workloads."""
    by_serving: dict[tuple, list[str]] = {}
    for wl in workloads:
        by_serving.setdefault(SERVING.get(wl, DEFAULT_SERVING).key(), []).append(wl)
    out = {}
    for e in engines:
        for key, wls in by_serving.items():
            try:
                cmd = shlex.join(engine_cmd(e, 0, args, SERVING.get(wls[0], DEFAULT_SERVING))[0])
            except ValueError as exc:
                cmd = f"not run: {exc}"
            label = e if key == DEFAULT_SERVING.key() else f"{e} ({', '.join(wls)})"
            prefix = "VLLM_MLA_DISABLE=1 VLLM_CPU_KVCACHE_SPACE=" + str(round(args.kv_cache_gb))
            cmd = cmd.replace("--port 0", "--port PORT").replace("port 0", "port PORT")
            out[label] = f"{prefix} {cmd}" if e == "vllm" else cmd
    return out


def bench_arg(wl: str, flag: str) -> int:
    bench_args = WORKLOADS[wl][0]
    return int(bench_args[bench_args.index(flag) + 1])


def mci_device(mci_extra: str) -> str:
    """The device mci serves on in this run (its --device in --mci-extra; cpu without one):
    the floors are that device's."""
    extra = shlex.split(mci_extra)
    for i, arg in enumerate(extra):
        if arg == "--device" and i + 1 < len(extra):
            return extra[i + 1]
        if arg.startswith("--device="):
            return arg.split("=", 1)[1]
    return "cpu"


def gpu_names(device: str) -> str:
    """', GPU: <name>' for a run on CUDA (from nvidia-smi), else ''."""
    if not device.startswith("cuda"):
        return ""
    try:
        names = subprocess.run(
            ["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=30,
        ).stdout.split("\n")
    except (OSError, subprocess.SubprocessError):
        return ", GPU: unknown (no nvidia-smi)"
    names = [n.strip() for n in names if n.strip()]
    return ", GPU: " + ("; ".join(names) or "unknown (nvidia-smi named none)")


def workload_floors(workloads: list[str], args) -> dict:
    """`mci bench floors` for the workloads whose requests all arrive at once on random
    prompts (batch, single, long, many): the machine's measured bandwidth and matmul rate, and
    each workload's TTFT / TPOT floors and output tok/s ceiling ({} where it cannot run)."""
    shapes = {}
    for wl in workloads:
        bench_args = WORKLOADS[wl][0]
        if bench_args[bench_args.index("--dataset") + 1] != "random":
            continue
        if bench_args[bench_args.index("--request-rate") + 1] != "inf":
            continue
        shape = [bench_arg(wl, f) for f in ("--num-prompts", "--input-len", "--output-len")]
        ckpt = LONG_CKPT if SERVING.get(wl, DEFAULT_SERVING).long else CKPT
        shapes.setdefault(ckpt, []).append(f"{wl}={','.join(map(str, shape))}")
    out: dict = {"machine": None, "floors": {}}
    for ckpt, specs in shapes.items():
        cmd = shlex.split(args.bench_cmd.replace(" bench serve", " bench floors"))
        cmd += ["--model-path", str(ckpt), "--json", "--device", args.mci_device]
        cmd += [x for spec in specs for x in ("--shape", spec)]
        proc = subprocess.run(cmd, capture_output=True, text=True, cwd="/", timeout=600)
        if proc.returncode:
            log(f"floors not measured: {(proc.stdout + proc.stderr)[-400:]}")
            continue
        got = json.loads(proc.stdout)
        out["machine"] = got["machine"]
        out["floors"].update(got["floors"])
    return out


# a metric's floor in `mci bench floors`' output, by the metric's JSON path
FLOOR_KEYS = {"output_token_throughput": "output_tok_s", "tpot_ms": "tpot_ms", "ttft_ms": "ttft_ms"}


def dig(d: dict, path: tuple[str, ...]) -> float:
    for key in path:
        d = d[key]
    return float(d)


def peer_versions(engines: list[str], args) -> dict:
    v = {"mci": f"commit {git_commit(Path(args.mci_src))} ({args.mci_src})"}
    if "mci-deterministic" in engines:
        v["mci-deterministic"] = v["mci"] + ", with --deterministic"
    if "mci-fp8" in engines:
        v["mci-fp8"] = v["mci"] + f", on {FP8_CKPT.name}"
    if args.base_src:
        base = f"commit {git_commit(Path(args.base_src))} ({args.base_src})"
        v.update({"mci-base": base, "mci-fp8-base": base + f", on {FP8_CKPT.name}"})
    if "vllm" in engines:
        v["vllm"] = version_of(
            [
                str(VLLM_PY),
                "-c",
                "import vllm, torch; print(f'vllm-cpu {vllm.__version__}, "
                "torch {torch.__version__}')",
            ]
        )
    for name in ("llama.cpp", "llama.cpp-q8_0"):
        if name not in engines:
            continue
        sdist = sorted(PEERS.glob("llama-cpp-python-*"))
        ver = version_of([str(LLAMA_SERVER), "--version"]).splitlines()
        v[name] = (
            f"llama-server {' '.join(line for line in ver if 'version' in line)}"
            f", from the llama.cpp vendored in {sdist[-1].name if sdist else '?'}"
            f", on {(Q8_GGUF if name.endswith('q8_0') else GGUF).name}"
        )
    return v


def ratio_pairs(engines: list[str]) -> list[tuple[str, str]]:
    """The (a, b) columns a / b of the table: mci against every peer; with mci-fp8, FP8
    against mci's bf16 and against llama.cpp's q8_0."""
    pairs = []
    if "mci" in engines:
        pairs += [("mci", e) for e in engines if not e.startswith("mci")]
    if "mci-fp8" in engines:
        pairs += [("mci-fp8", e) for e in ("mci", "llama.cpp-q8_0") if e in engines]
    pairs += [
        (e, e + "-base") for e in ("mci", "mci-fp8") if e in engines and e + "-base" in engines
    ]
    return pairs


def render(summary: dict) -> str:
    engines = summary["engines"]
    ratios = ratio_pairs(engines)
    floors = summary.get("floors", {}).get("floors", {})
    head = ["workload", "metric", *engines] + [f"{a}/{b}" for a, b in ratios]
    head += ["machine floor"] if floors else []
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for wl in summary["workloads"]:
        for label, _path, unit, higher in WORKLOADS[wl][1]:
            row = [f"{wl}", f"{label} ({unit}, {'higher' if higher else 'lower'} is better)"]
            vals = {}
            for e in engines:
                got = summary["results"].get(wl, {}).get(e, {}).get(label)
                if got is None:
                    row.append("n/a")
                    continue
                vals[e] = got["median"]
                runs = got["runs"]
                cell = f"{got['median']:.1f}"
                if len(runs) > 1:
                    cell += " (" + ", ".join(f"{x:.1f}" for x in runs) + ")"
                failed = summary["results"][wl][e].get("failed", 0)
                if failed:
                    cell += f" [{failed} failed]"
                row.append(cell)
            for a, b in ratios:
                row.append(f"{vals[a] / vals[b]:.2f}" if a in vals and vals.get(b) else "n/a")
            if floors:
                floor = floors.get(wl, {}).get(FLOOR_KEYS[_path[0]])
                row.append("n/a" if floor is None else f"{floor:.{1 if floor >= 10 else 2}f}")
            lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines)


def markdown_section(summary: dict) -> str:
    out = [f"## Run {summary['timestamp']}", ""]
    out.append(
        f"Machine: {summary['machine']}. Rounds: {summary['rounds']}; seeds per workload: "
        + "; ".join(f"{wl} {s}" for wl, s in summary["seeds"].items())
        + "."
    )
    out.append(
        "Cells are the median over rounds (every round's value in brackets when more than "
        "one); ratios are mci ÷ peer, so above 1 is better for mci on tok/s and below 1 is "
        "better for mci on ms."
    )
    machine = summary.get("floors", {}).get("machine")
    if machine:
        out.append(
            "Machine floor: `mci bench floors` (mci/bench/floors.py): the bytes each step must "
            "read and the FLOPs it must do over the measured memory bandwidth and matmul rates of "
            f"the device mci serves on ({summary.get('mci_device', 'cpu')}): "
            f"{machine['bandwidth_gbs']:.1f} GB/s and the faster of its bf16 "
            f"{machine['bf16_gflops']:.0f} and fp32 {machine['fp32_gflops']:.0f} GFLOP/s;"
            " a floor for ms, a ceiling for tok/s; n/a where arrivals or shared prefixes set "
            "the pace."
        )
    if summary.get("neighbour", "none") != "none":
        out.append(f"Beside each engine: a {summary['neighbour']} (--neighbour).")
    if summary.get("cpu_quota"):
        quota = summary["cpu_quota"]
        out.append(f"Each engine's server ran under a {quota:g}-CPU quota (--cpu-quota).")
    out += ["", render(summary), "", "Versions:", ""]
    out += [f"- {e}: {v}" for e, v in summary["versions"].items()]
    out += ["", "Server commands (port varies per run):", ""]
    for e, c in summary["commands"].items():
        out.append(f"- {e}: `{c}`")
    out += [
        "",
        f"Benchmark client: `{summary['bench_cmd']} --base-url http://127.0.0.1:PORT "
        "--seed SEED --ignore-eos --vocab-size "
        f"{VOCAB} --disable-tqdm --output-json FILE` plus each workload's arguments:",
        "",
    ]
    for wl in summary["workloads"]:
        out.append(f"- {wl} ({WORKLOAD_TEXT[wl]}): `{' '.join(WORKLOADS[wl][0])}`")
    if summary.get("problems"):
        out += ["", "Problems in this run:", ""] + [f"- {p}" for p in summary["problems"]]
    out += ["", f"Whole command: `{summary['argv']}`", ""]
    return "\n".join(out)


def main() -> int:
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    ap.add_argument(
        "--engines",
        default=",".join(DEFAULT_ENGINES),
        help=f"comma-separated, in turn order, of {', '.join(ENGINES)}",
    )
    ap.add_argument(
        "--workloads",
        default=",".join(DEFAULT_WORKLOADS),
        help=f"comma-separated, of {', '.join([*WORKLOADS, *WORKLOAD_GROUPS])}",
    )
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument(
        "--seed",
        type=int,
        default=None,
        help="seeds the per-round bench seeds (default: a random one, recorded)",
    )
    ap.add_argument(
        "--mci-src",
        default=str(ROOT),
        help="mci source tree (a checkout or `git worktree`): goes on PYTHONPATH of "
        "the default --mci-cmd/--bench-cmd, and its commit is recorded",
    )
    ap.add_argument(
        "--mci-python",
        default=str(ROOT / ".venv" / "bin" / "python")
        if (ROOT / ".venv" / "bin" / "python").exists()
        else sys.executable,
    )
    ap.add_argument(
        "--mci-cmd",
        default=None,
        help="command that starts mci's server, before --model-path/--port "
        "(default: env PYTHONPATH=<mci-src> <mci-python> -m mci serve)",
    )
    ap.add_argument(
        "--bench-cmd",
        default=None,
        help="the benchmark client (default: env PYTHONPATH=<mci-src> <mci-python> "
        "-m mci bench serve)",
    )
    ap.add_argument(
        "--kv-cache-gb",
        type=int,
        default=4,
        help="GiB of KV cache for mci (--kv-cache-gb) and vLLM (VLLM_CPU_KVCACHE_SPACE)",
    )
    ap.add_argument(
        "--base-src",
        help="an mci checkout (a worktree of an older commit) for the mci-base and "
        "mci-fp8-base engines: before and after side by side in one run",
    )
    ap.add_argument(
        "--neighbour",
        choices=["none", "busy-loop"],
        default="none",
        help="busy-loop: a Python busy loop pinned to the last CPU runs beside each engine",
    )
    ap.add_argument(
        "--cpu-quota",
        type=float,
        help="run each engine's server in a cgroup with this CPU quota, in CPUs (e.g. 1.5)",
    )
    ap.add_argument("--mci-extra", default="", help="more mci server arguments")
    ap.add_argument("--vllm-extra", default="", help="more vLLM server arguments")
    ap.add_argument("--llama-extra", default="", help="more llama-server arguments")
    ap.add_argument("--ready-timeout", type=float, default=600)
    ap.add_argument("--bench-timeout", type=float, default=1200)
    ap.add_argument("--results", default=str(HERE / "results"))
    ap.add_argument(
        "--doc",
        default=str(ROOT / "docs" / "benchmarks.md"),
        help="markdown file the table is appended to ('' for none)",
    )
    args = ap.parse_args()
    args.mci_device = mci_device(args.mci_extra)

    base_mci = f"env PYTHONPATH={shlex.quote(args.mci_src)} {shlex.quote(args.mci_python)} -m mci"
    args.mci_cmd = args.mci_cmd or base_mci + " serve"
    args.base_cmd = (
        f"env PYTHONPATH={shlex.quote(args.base_src)} {shlex.quote(args.mci_python)} -m mci serve"
        if args.base_src
        else None
    )
    args.bench_cmd = args.bench_cmd or base_mci + " bench serve"
    engines = [e.strip() for e in args.engines.split(",") if e.strip()]
    workloads = [
        x
        for w in args.workloads.split(",")
        if w.strip()
        for x in WORKLOAD_GROUPS.get(w.strip(), (w.strip(),))
    ]
    for e in engines:
        if e not in ENGINES:
            ap.error(f"unknown engine {e!r} ({', '.join(ENGINES)})")
        if e.endswith("-base") and not args.base_src:
            ap.error(f"{e} needs --base-src")
    for w in workloads:
        if w not in WORKLOADS:
            ap.error(f"unknown workload {w!r} ({', '.join(WORKLOADS)})")
    need = {
        "mci": [CKPT / "config.json"],
        "mci-deterministic": [CKPT / "config.json"],
        "vllm": [VLLM_PY, CKPT / "config.json"],
        "llama.cpp": [LLAMA_SERVER, GGUF],
        "mci-fp8": [FP8_CKPT / "config.json"],
        "mci-base": [CKPT / "config.json"],
        "mci-fp8-base": [FP8_CKPT / "config.json"],
        "llama.cpp-q8_0": [LLAMA_SERVER, Q8_GGUF],
    }
    if any(SERVING.get(w, DEFAULT_SERVING).long for w in workloads):
        need = {e: [LONG_CKPT / "config.json" if p == CKPT / "config.json" else LONG_GGUF
                    if p == GGUF else p for p in files] for e, files in need.items()}  # fmt: skip
    missing = sorted({str(p) for e in engines for p in need[e] if not p.exists()})
    if missing:
        sys.exit(
            "missing (run benchmarks/install_peers.sh and benchmarks/prepare_checkpoint.sh): "
            + ", ".join(missing)
        )

    stamp = dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    out_dir = Path(args.results) / stamp
    out_dir.mkdir(parents=True)
    seed = args.seed if args.seed is not None else random.SystemRandom().randrange(2**31)
    rng = random.Random(seed)
    seeds = {wl: [rng.randrange(2**31) for _ in range(args.rounds)] for wl in workloads}
    log(f"results -> {out_dir}; master seed {seed}")

    summary = {
        "timestamp": stamp,
        "argv": shlex.join([sys.executable, *sys.argv]),
        "machine": f"{os.cpu_count()} CPUs, {os.uname().machine}, "
        f"{os.sysconf('SC_PAGE_SIZE') * os.sysconf('SC_PHYS_PAGES') / 2**30:.0f} GiB"
        + gpu_names(args.mci_device),
        "engines": engines,
        "workloads": workloads,
        "rounds": args.rounds,
        "mci_device": args.mci_device,
        "master_seed": seed,
        "seeds": seeds,
        "versions": peer_versions(engines, args),
        "commands": server_commands(engines, workloads, args),
        "floors": workload_floors(workloads, args),
        "env": {
            "vllm": {
                "VLLM_MLA_DISABLE": "1",
                "VLLM_CPU_KVCACHE_SPACE": str(round(args.kv_cache_gb)),
            }
        },
        "bench_cmd": args.bench_cmd,
        "neighbour": args.neighbour,
        "cpu_quota": args.cpu_quota,
        "runs": [],
        "results": {},
        "problems": [],
    }
    for e, v in summary["versions"].items():
        log(f"{e}: {v}")

    current: list[Server] = []
    quota = CpuQuota(args.cpu_quota) if args.cpu_quota else None

    class Interrupted(Exception):
        pass

    def on_signal(signum, _frame):
        raise Interrupted(signal.Signals(signum).name)

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)

    try:
        for wl in workloads:
            for r in range(args.rounds):
                s = seeds[wl][r]
                for e in engines:
                    tag = f"{wl}-r{r}-{e}"
                    port = free_port()
                    run = {
                        "workload": wl,
                        "round": r,
                        "engine": e,
                        "seed": s,
                        "port": port,
                        "busy_cpus_before": busy_cpus(),
                    }
                    if run["busy_cpus_before"] > 0.3:
                        note = (
                            f"{tag}: {run['busy_cpus_before']:.1f} CPUs busy just before the "
                            "server started: another process was using the CPUs"
                        )
                        summary["problems"].append(note)
                        log(note)
                    try:
                        cmd, env = engine_cmd(e, port, args, SERVING.get(wl, DEFAULT_SERVING))
                    except ValueError as exc:
                        summary["problems"].append(f"{tag}: not run: {exc}")
                        log(f"{tag}: not run: {exc}")
                        continue
                    log(f"{tag}: starting {e} on port {port}")
                    neighbour = start_neighbour(args.neighbour)
                    if quota is not None:
                        cmd = quota.wrap(cmd)
                    server = Server(e, cmd, env, port, out_dir / f"{tag}.log")
                    current.append(server)
                    try:
                        run["startup_s"] = server.wait_ready(args.ready_timeout)
                        t = time.monotonic()
                        server.warm_up()
                        run["warmup_s"] = time.monotonic() - t
                        log(
                            f"{tag}: ready in {run['startup_s']:.0f}s, warm-up "
                            f"{run['warmup_s']:.1f}s; benchmarking"
                        )
                        json_path = out_dir / f"{tag}.json"
                        bench = shlex.split(args.bench_cmd) + [
                            "--base-url",
                            server.base,
                            "--seed",
                            str(s),
                            "--ignore-eos",
                            "--vocab-size",
                            str(VOCAB),
                            "--disable-tqdm",
                            "--output-json",
                            str(json_path),
                            *WORKLOADS[wl][0],
                        ]
                        t = time.monotonic()
                        proc = subprocess.run(
                            bench,
                            capture_output=True,
                            text=True,
                            cwd="/",
                            timeout=args.bench_timeout,
                            env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"},
                        )
                        run["bench_wall_s"] = time.monotonic() - t
                        (out_dir / f"{tag}.bench.txt").write_text(
                            "$ " + shlex.join(bench) + "\n" + proc.stdout + proc.stderr
                        )
                        if not json_path.exists():
                            raise RuntimeError(
                                f"bench exited {proc.returncode}: "
                                f"{(proc.stdout + proc.stderr)[-800:]}"
                            )
                        res = json.loads(json_path.read_text())
                        res.pop("requests", None)
                        run["summary"] = res
                        run["metrics"] = {
                            label: dig(res, path) for label, path, _u, _h in WORKLOADS[wl][1]
                        }
                        log(
                            f"{tag}: {res['completed']} ok / {res['failed']} failed; "
                            + ", ".join(f"{k} {v:.1f}" for k, v in run["metrics"].items())
                        )
                        if res["failed"]:
                            summary["problems"].append(
                                f"{tag}: {res['failed']} requests failed: {res['errors']}"
                            )
                    except Interrupted:
                        raise
                    except Exception as exc:  # record, go on with the next engine
                        run["error"] = f"{type(exc).__name__}: {exc}"
                        summary["problems"].append(f"{tag}: {run['error']}")
                        log(f"{tag}: FAILED {run['error']}")
                    finally:
                        server.stop()
                        current.remove(server)
                        stop_neighbour(neighbour)
                    summary["runs"].append(run)
    except Interrupted as exc:
        # stop here, but still write what was measured
        summary["problems"].append(f"interrupted by {exc} after {len(summary['runs'])} runs")
        log(f"interrupted by {exc}: writing the runs finished so far")
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        for s in current:
            s.stop()
        if quota is not None:
            quota.remove()

    for wl in workloads:
        for e in engines:
            runs = [
                x
                for x in summary["runs"]
                if x["workload"] == wl and x["engine"] == e and "metrics" in x
            ]
            if not runs:
                continue
            cell = summary["results"].setdefault(wl, {}).setdefault(e, {})
            cell["failed"] = sum(x["summary"]["failed"] for x in runs)
            for label, _p, _u, _h in WORKLOADS[wl][1]:
                vals = [x["metrics"][label] for x in runs]
                cell[label] = {"median": statistics.median(vals), "runs": vals}

    path = Path(args.results) / f"{stamp}.json"
    path.write_text(json.dumps(summary, indent=2))
    section = markdown_section(summary)
    print(section)
    if args.doc:
        with open(args.doc, "a") as f:
            f.write("\n" + section)
        log(f"appended to {args.doc}")
    log(f"wrote {path}")
    return 1 if summary["problems"] and not summary["results"] else 0


if __name__ == "__main__":
    sys.exit(main())
