"""`mci bench serve`: a serving benchmark for any OpenAI-compatible server.

Requests go to `/v1/completions` with token-id prompts (exact input lengths, no tokenizer
needed), streamed, with Poisson arrivals at `--request-rate` (`inf`: all at once). Per request
it records time to first token (TTFT), time per output token after the first (TPOT), the gaps
between streamed chunks (ITL) and end-to-end latency; it reports request and token throughput,
p50/p90/p99 of each latency, and goodput: requests per second meeting every given SLO.

The client is aiohttp, as vLLM's and SGLang's serving benchmarks use: it runs on the machine
beside the server it measures, so its own CPU is taken from the server. Measured on the
2-core machine with the same request loop on each library, alternating against one mci
server, 32 streams of 128 tokens: 0.15 s of client CPU a round against 0.38 s with httpx
(this module's client before), and mci served 4-8% more tok/s beside it.
"""

from __future__ import annotations

import asyncio
import json
import random
import statistics
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from tqdm import tqdm

from mci.errors import UserError

if TYPE_CHECKING:  # imported where used: every `mci` command builds this module's flags
    import aiohttp


@dataclass
class RequestResult:
    """One request's timings (seconds from its own send) and token counts."""

    ok: bool = False
    error: str = ""
    start: float = 0.0  # since the benchmark began
    ttft: float = 0.0
    e2e: float = 0.0
    output_tokens: int = 0
    prompt_tokens: int = 0
    chunk_gaps: list[float] = field(default_factory=list)
    token_times: list[float] = field(default_factory=list)  # absolute, for throughput plots

    @property
    def tpot(self) -> float:
        return (self.e2e - self.ttft) / (self.output_tokens - 1) if self.output_tokens > 1 else 0


DATASETS = ("random", "shared-prefix", "code", "code-edit")
EDIT_MARKER = "\n\n# Edited version:\n"  # between a code-edit prompt's block and its restart
CHARS_PER_TOKEN = 3  # code text, for sizing text prompts without the server's tokenizer


def make_prompts(
    dataset: str,
    num: int,
    input_len: int,
    prefix_len: int,
    vocab: int,
    seed: int,
    num_prefixes: int = 1,
) -> list[list[int]] | list[str]:
    """Token-id prompts (random, shared-prefix: `num_prefixes` families, each prompt in one
    drawn at random), or text prompts cut from the held-out Python
    modules of the bundled model's corpus: `code` continues a stretch of code; `code-edit`
    gives a stretch of code, then starts it again ("# Edited version:" and its first line),
    as an editing request does, so the output largely repeats the prompt."""
    rng = random.Random(seed)

    def ids(n: int) -> list[int]:
        return [rng.randrange(10, vocab) for _ in range(n)]

    if dataset == "random":
        return [ids(input_len) for _ in range(num)]
    if dataset == "shared-prefix":
        prefixes = [ids(prefix_len) for _ in range(num_prefixes)]
        if num_prefixes == 1:
            return [prefixes[0] + ids(input_len) for _ in range(num)]
        return [prefixes[rng.randrange(num_prefixes)] + ids(input_len) for _ in range(num)]
    if dataset in ("code", "code-edit"):
        return [_code_prompt(rng, input_len, dataset == "code-edit") for _ in range(num)]
    raise UserError(f"unknown dataset {dataset!r} ({', '.join(DATASETS)})")


def _code_prompt(rng: random.Random, input_len: int, edit: bool) -> str:
    """About `input_len` tokens of held-out code, starting and ending on a line boundary (a
    prompt ends before its last newline: see docs/default-model.md)."""
    from mci.tools.corpus import corpus_files

    held_out = corpus_files()[1]
    text = rng.choice(held_out).read_text()
    chars = input_len * CHARS_PER_TOKEN // (2 if edit else 1)
    start = text.rfind("\n", 0, rng.randrange(0, max(1, len(text) - chars))) + 1
    block = text[start : start + chars]
    block = block[: block.rfind("\n")] if "\n" in block else block
    if not edit:
        return block
    first_line = block.split("\n", 1)[0]
    return f"{block}{EDIT_MARKER}{first_line}"


async def _sse_data(response: aiohttp.ClientResponse):
    """The `data:` payloads of a server-sent event stream, up to `[DONE]`, from the body's
    pieces as they arrive (a piece may end anywhere in a line, or in a character; CRLF line
    ends are taken; bytes that are not UTF-8 are replaced, as a text decoder would)."""
    pending = b""
    async for piece in response.content.iter_any():
        pending += piece
        *lines, pending = pending.split(b"\n")
        for raw in lines:
            line = raw.decode(errors="replace").rstrip("\r")
            if not line.startswith("data:"):
                continue
            data = line[5:].strip()
            if data == "[DONE]":
                return
            yield data


async def _one(
    client: aiohttp.ClientSession, url: str, headers: dict, body: dict, t0: float
) -> RequestResult:
    import aiohttp

    res = RequestResult(start=time.perf_counter() - t0)
    sent = time.perf_counter()
    last = None
    try:
        async with client.post(url, json=body, headers=headers) as r:
            if r.status != 200:
                res.error = f"HTTP {r.status}: {(await r.read())[:200]!r}"
                return res
            async for data in _sse_data(r):
                chunk = json.loads(data)
                if "error" in chunk:
                    res.error = str(chunk["error"])
                    return res
                now = time.perf_counter()
                if chunk.get("usage"):
                    res.output_tokens = chunk["usage"]["completion_tokens"]
                    res.prompt_tokens = chunk["usage"]["prompt_tokens"]
                if chunk.get("choices") and chunk["choices"][0].get("text"):
                    if last is None:
                        res.ttft = now - sent
                    else:
                        res.chunk_gaps.append(now - last)
                    res.token_times.append(now - t0)
                    last = now
        res.e2e = time.perf_counter() - sent
        res.ok = res.output_tokens > 0
        if not res.ok:
            res.error = "no tokens"
    except aiohttp.ClientError as exc:
        res.error = f"{type(exc).__name__}: {exc}"
    return res


async def run_benchmark(
    base_url: str,
    model: str | None,
    prompts: list[list[int]],
    output_len: int,
    request_rate: float,
    seed: int,
    ignore_eos: bool,
    api_key: str | None,
    progress: bool = True,
) -> tuple[list, float]:
    import aiohttp

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    session = aiohttp.ClientSession(
        timeout=aiohttp.ClientTimeout(total=None),
        connector=aiohttp.TCPConnector(limit=0),  # a connection per request in flight
    )
    async with session as client:
        if model is None:
            async with client.get(base_url + "/v1/models", headers=headers) as r:
                r.raise_for_status()
                model = (await r.json())["data"][0]["id"]
        spec_before = await _spec_counters(client, base_url, headers)
        rng = random.Random(seed + 1)
        bar = tqdm(total=len(prompts), desc="requests", disable=not progress)
        t0 = time.perf_counter()
        tasks = []

        async def tracked(body):
            res = await _one(client, base_url + "/v1/completions", headers, body, t0)
            bar.update(1)
            return res

        for prompt in prompts:
            body = {
                "model": model,
                "prompt": prompt,
                "max_tokens": output_len,
                "stream": True,
                "temperature": 0,
                "stream_options": {"include_usage": True},
            }
            if ignore_eos:
                body["ignore_eos"] = True
            tasks.append(asyncio.create_task(tracked(body)))
            if request_rate != float("inf"):
                await asyncio.sleep(rng.expovariate(request_rate))
        results = await asyncio.gather(*tasks)
        duration = time.perf_counter() - t0
        bar.close()
        spec_after = await _spec_counters(client, base_url, headers)
    return results, duration, _spec_summary(spec_before, spec_after)


SPEC_COUNTERS = ("num_drafts", "num_draft_tokens", "num_accepted_tokens")


async def _spec_counters(client, base_url: str, headers: dict) -> dict[str, float] | None:
    """The server's speculative decoding counters (`mci:` or `vllm:spec_decode_*` on
    /metrics), or None where it exports none."""
    import aiohttp

    try:
        async with client.get(base_url + "/metrics", headers=headers) as r:
            if r.status != 200:
                return None
            text = await r.text()
    except aiohttp.ClientError:
        return None
    found = {}
    for line in text.splitlines():
        for name in SPEC_COUNTERS:
            for prefix in ("mci:", "vllm:"):
                if line.startswith(f"{prefix}spec_decode_{name}_total "):
                    found[name] = float(line.split()[-1])
    return found if len(found) == len(SPEC_COUNTERS) else None


def _spec_summary(before: dict | None, after: dict | None) -> dict | None:
    """Acceptance over the run: accepted / draft tokens, and tokens per verification."""
    if before is None or after is None:
        return None
    d = {k: after[k] - before[k] for k in SPEC_COUNTERS}
    if not d["num_drafts"]:
        return {**d, "acceptance_rate": None, "mean_accepted_length": None}
    return {
        **d,
        "acceptance_rate": d["num_accepted_tokens"] / d["num_draft_tokens"],
        "mean_accepted_length": 1 + d["num_accepted_tokens"] / d["num_drafts"],
    }


def _percentiles(values: list[float]) -> dict:
    if not values:
        return {"mean": 0, "p50": 0, "p90": 0, "p99": 0}
    s = sorted(values)

    def pct(p: float) -> float:
        return s[min(len(s) - 1, int(round(p / 100 * (len(s) - 1))))]

    return {"mean": statistics.mean(s), "p50": pct(50), "p90": pct(90), "p99": pct(99)}


def summarize(
    results: list[RequestResult],
    duration: float,
    slo_ttft_ms: float | None,
    slo_tpot_ms: float | None,
) -> dict:
    ok = [r for r in results if r.ok]
    out_tokens = sum(r.output_tokens for r in ok)
    in_tokens = sum(r.prompt_tokens for r in ok)
    good = [
        r
        for r in ok
        if (slo_ttft_ms is None or r.ttft * 1000 <= slo_ttft_ms)
        and (slo_tpot_ms is None or r.tpot * 1000 <= slo_tpot_ms)
    ]
    ms = 1000.0
    summary = {
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "duration_s": duration,
        "request_throughput": len(ok) / duration,
        "output_token_throughput": out_tokens / duration,
        "total_token_throughput": (in_tokens + out_tokens) / duration,
        "input_tokens": in_tokens,
        "output_tokens": out_tokens,
        "ttft_ms": {k: v * ms for k, v in _percentiles([r.ttft for r in ok]).items()},
        "tpot_ms": {
            k: v * ms for k, v in _percentiles([r.tpot for r in ok if r.output_tokens > 1]).items()
        },
        "itl_ms": {
            k: v * ms for k, v in _percentiles([g for r in ok for g in r.chunk_gaps]).items()
        },
        "e2e_ms": {k: v * ms for k, v in _percentiles([r.e2e for r in ok]).items()},
        "goodput": len(good) / duration,
        "errors": sorted({r.error for r in results if not r.ok})[:5],
    }
    return summary


def format_table(summary: dict) -> str:
    lines = [
        f"{'completed / failed':34s} {summary['completed']} / {summary['failed']}",
        f"{'duration (s)':34s} {summary['duration_s']:.2f}",
        f"{'request throughput (req/s)':34s} {summary['request_throughput']:.2f}",
        f"{'output token throughput (tok/s)':34s} {summary['output_token_throughput']:.1f}",
        f"{'total token throughput (tok/s)':34s} {summary['total_token_throughput']:.1f}",
        f"{'goodput (req/s)':34s} {summary['goodput']:.2f}",
        f"{'':22s}{'mean':>10s}{'p50':>10s}{'p90':>10s}{'p99':>10s}",
    ]
    for key, label in (
        ("ttft_ms", "TTFT (ms)"),
        ("tpot_ms", "TPOT (ms)"),
        ("itl_ms", "ITL (ms)"),
        ("e2e_ms", "E2E latency (ms)"),
    ):
        v = summary[key]
        lines.append(
            f"{label:22s}{v['mean']:10.1f}{v['p50']:10.1f}{v['p90']:10.1f}{v['p99']:10.1f}"
        )
    spec = summary.get("spec_decode")
    if spec and spec["acceptance_rate"] is not None:
        lines.append(
            f"{'spec decode acceptance':34s} {spec['acceptance_rate']:.1%} "
            f"({spec['num_accepted_tokens']:.0f} / {spec['num_draft_tokens']:.0f} draft tokens)"
        )
        lines.append(f"{'spec decode tokens per verify':34s} {spec['mean_accepted_length']:.2f}")
    for err in summary["errors"]:
        lines.append(f"error: {err}")
    return "\n".join(lines)


def plot(results: list[RequestResult], duration: float, path: Path) -> None:
    """PNG: TTFT, TPOT and E2E distributions, and output tokens/s over time."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise UserError("--plot needs matplotlib (pip install matplotlib)") from None
    ok = [r for r in results if r.ok]
    fig, axes = plt.subplots(2, 2, figsize=(11, 7))
    for ax, values, title in (
        (axes[0][0], [r.ttft * 1000 for r in ok], "TTFT (ms)"),
        (axes[0][1], [r.tpot * 1000 for r in ok], "TPOT (ms)"),
        (axes[1][0], [r.e2e * 1000 for r in ok], "E2E latency (ms)"),
    ):
        ax.hist(values, bins=30, color="#3b7dd8")
        ax.set_title(title)
        ax.set_ylabel("requests")
    seconds = int(duration) + 1
    per_second = [0] * seconds
    for r in ok:
        for t in r.token_times:
            per_second[min(int(t), seconds - 1)] += 1
    axes[1][1].plot(range(seconds), per_second, color="#d85b3b")
    axes[1][1].set_title("streamed chunks per second")
    axes[1][1].set_xlabel("time (s)")
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main(args) -> int:
    import aiohttp

    if min(args.num_prompts, args.input_len, args.output_len, args.num_prefixes) < 1:
        raise UserError("--num-prompts, --input-len, --output-len, --num-prefixes must be >= 1")
    rate = float(args.request_rate)
    if not rate > 0:
        raise UserError("--request-rate must be > 0 (or inf)")
    prompts = make_prompts(
        args.dataset,
        args.num_prompts,
        args.input_len,
        args.prefix_len,
        args.vocab_size,
        args.seed,
        args.num_prefixes,
    )
    try:
        results, duration, spec = asyncio.run(
            run_benchmark(
                args.base_url.rstrip("/"),
                args.model,
                prompts,
                args.output_len,
                rate,
                args.seed,
                args.ignore_eos,
                args.api_key,
                progress=not args.disable_tqdm,
            )
        )
    except aiohttp.ClientError as exc:
        raise UserError(f"cannot reach {args.base_url}: {exc}") from None
    summary = summarize(results, duration, args.slo_ttft_ms, args.slo_tpot_ms)
    summary["spec_decode"] = spec
    summary["config"] = {k: v for k, v in vars(args).items() if k != "func"}
    print(format_table(summary))
    if args.output_json:
        Path(args.output_json).write_text(
            json.dumps(
                {**summary, "requests": [asdict(r) | {"tpot": r.tpot} for r in results]},
                indent=2,
                default=str,
            )
        )
    if args.plot:
        plot(results, duration, Path(args.plot))
    return 0 if summary["completed"] else 1


def add_arguments(p) -> None:
    p.add_argument("--base-url", default="http://127.0.0.1:30000")
    p.add_argument("--model", default=None, help="default: the server's first model")
    p.add_argument("--api-key", default=None)
    p.add_argument("--dataset", default="random", choices=list(DATASETS))
    p.add_argument("--num-prompts", type=int, default=32)
    p.add_argument("--request-rate", default="inf", help="requests/s (Poisson), or inf")
    p.add_argument(
        "--input-len",
        type=int,
        default=128,
        help="unique prompt tokens per request (code datasets: about that many)",
    )
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--prefix-len", type=int, default=1024, help="shared-prefix: shared tokens")
    p.add_argument(
        "--num-prefixes", type=int, default=1, help="shared-prefix: prompt families (prefixes)"
    )
    p.add_argument("--vocab-size", type=int, default=1000, help="random ids drawn below this")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--ignore-eos", action="store_true")
    p.add_argument("--slo-ttft-ms", type=float, default=None)
    p.add_argument("--slo-tpot-ms", type=float, default=None)
    p.add_argument("--output-json", default=None)
    p.add_argument("--plot", default=None, help="write a PNG of latencies and throughput")
    p.add_argument("--disable-tqdm", action="store_true")
