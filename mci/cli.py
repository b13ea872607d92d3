"""The `mci` command line: `serve`, `serve-ray`, `router`, `workflow run|serve|deploy`,
`generate`, `run-batch`, `bench serve`, `plan`, `make-checkpoint`.

Each command's flags come from the config sections it takes (`config_fields.add_flags`), so
no flag is written twice. User mistakes (bad flags, missing or broken checkpoints) print one
line, `mci: error: ...`, and exit with code 2; no traceback. Flag names follow SGLang/vLLM
where the meaning is the same.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import sys
import threading
import time
from pathlib import Path

from mci.config_fields import add_flags, from_args
from mci.engine.config import (
    DEFAULT_MODEL,
    add_engine_flags,
    check_device,
    engine_config_from_args,
)
from mci.errors import UserError
from mci.ray_serve.config import RayServeConfig
from mci.router.config import RouterConfig
from mci.server.config import ServerConfig
from mci.workflow.config import WorkflowConfig

__all__ = ["DEFAULT_MODEL", "main"]

EXIT_USAGE = 2


class OneLineParser(argparse.ArgumentParser):
    """argparse, but a usage error is a single line (exit code 2), like every other user error."""

    def error(self, message: str):  # noqa: D401 - argparse API
        raise UserError(f"{self.prog}: {message}")


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value


def _non_negative_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"expected a non-negative number, got {text!r}")
    return value


GENERATE_SECTIONS = ("model", "speculative")  # the engine flags `mci generate` takes


def _cmd_generate(args: argparse.Namespace) -> int:
    """One prompt through the engine the server runs (`Engine`, driven on this thread), sized
    for it: one running request, a prefill budget and a KV pool of what the prompt needs."""
    from mci.cache.config import CacheConfig
    from mci.core.sampling_params import SamplingParams
    from mci.engine.engine import Engine
    from mci.engine.request_front import RequestFront
    from mci.errors import InvalidParameter
    from mci.model_config import load_config
    from mci.scheduler.config import SchedulerConfig
    from mci.tokenizer import TextTokenizer

    logging.getLogger("mci").setLevel(logging.WARNING)  # the engine's start-up log is a server's
    config = engine_config_from_args(args, GENERATE_SECTIONS)
    path = Path(config.model.model_path)
    if not path.is_dir():
        raise UserError(f"model directory {path} does not exist")
    start = time.perf_counter()
    model_config = load_config(path)
    tokenizer = TextTokenizer.load(path)
    if args.chat:
        prompt_ids = tokenizer.encode_chat([{"role": "user", "content": args.prompt}])
    else:
        prompt_ids = tokenizer.encode(args.prompt)
    params = SamplingParams(
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        seed=args.seed,
        ignore_eos=args.ignore_eos,
    )
    # checked before the engine is sized for it (a too-long request must not size the pool)
    front = RequestFront(tokenizer, model_config.vocab_size, model_config.max_position_embeddings)
    try:
        if args.token_healing:
            prompt_ids, params = front.heal(prompt_ids, params)
        front.check(prompt_ids, params)
    except InvalidParameter as exc:
        raise exc.renamed({"max_new_tokens": "--max-new-tokens"}) from None
    # room for the prompt, its output, the drafts of a step and the admission reserve
    scheduler = SchedulerConfig(max_running_requests=1, max_prefill_tokens=len(prompt_ids) or 1)
    need = len(prompt_ids) + args.max_new_tokens + config.speculative.num_steps
    cache = CacheConfig(max_total_tokens=need + scheduler.decode_reserve_tokens + 1)
    config = dataclasses.replace(config, scheduler=scheduler, cache=cache)
    engine = Engine(config, tokenizer=tokenizer, background=False, model_config=model_config)
    try:
        load_s = time.perf_counter() - start
        command = engine.command("generate", prompt_ids, params)
        token_times: list[float] = []
        final: list = []
        done = threading.Condition()

        def sink(out) -> None:
            if out.new_token_ids:
                token_times.append(time.perf_counter())
            if out.finished:
                final.append(out)

        submitted = time.perf_counter()
        engine.submit(command, sink)
        with done:
            engine.run_until(lambda: bool(final), done)
    finally:
        engine.shutdown()
    out = final[0]
    if out.error:
        raise UserError(out.error)
    print(args.prompt + out.text, flush=True)
    prefill_s = token_times[0] - submitted if token_times else 0.0
    decode_s = token_times[-1] - token_times[0] if token_times else 0.0
    num_tokens = len(out.output_token_ids)
    print(
        f"[mci] load {load_s:.2f}s | prefill {len(command.prompt_ids)} tokens "
        f"{len(command.prompt_ids) / max(prefill_s, 1e-9):.1f} tok/s | decode {num_tokens} "
        f"tokens {max(num_tokens - 1, 0) / max(decode_s, 1e-9):.1f} tok/s | finish "
        f"{out.finish_reason}",
        file=sys.stderr,
    )
    return 0


def _cmd_plan(args: argparse.Namespace) -> int:
    from mci.model_config import load_config
    from mci.plan import format_plan, make_plan, parse_gpus

    source = args.config or args.model_path
    if source is None:
        raise UserError("mci plan needs --config FILE or --model-path DIR")
    cfg = load_config(source)
    hw = parse_gpus(args.gpus)
    plan = make_plan(cfg, hw, args.mem_fraction_static, include_mtp=not args.no_mtp)
    print(format_plan(plan, hw, args.mem_fraction_static))
    return 0


def _cmd_make_checkpoint(args: argparse.Namespace) -> int:
    from mci.tools.make_checkpoint import PRESETS, long_context, make_checkpoint, preset_config

    if args.size not in PRESETS:
        raise UserError(f"unknown size {args.size!r} (choose {', '.join(PRESETS)})")
    shard = int(args.shard_size_mb * 2**20) if args.shard_size_mb else None
    cfg = preset_config(args.size)
    if args.context is not None:
        cfg = long_context(cfg, args.context)
    out = make_checkpoint(
        args.out,
        cfg,
        seed=args.seed,
        dtype=args.dtype,
        fp8=args.fp8,
        include_mtp=not args.no_mtp,
        shard_max_bytes=shard,
        config_dialect=args.config_dialect,
    )
    print(f"wrote {args.size} checkpoint (seed {args.seed}{', fp8' if args.fp8 else ''}) to {out}")
    return 0


def _cmd_serve(args: argparse.Namespace) -> int:
    from mci.server.launch import serve

    server_config = from_args(ServerConfig, args)
    if server_config.dp_size > 1:
        from mci.replicas.launch import serve_data_parallel

        return serve_data_parallel(engine_config_from_args(args), server_config)
    return serve(engine_config_from_args(args), server_config)


def _cmd_serve_ray(args: argparse.Namespace) -> int:
    from mci.ray_serve.launch import serve_ray

    return serve_ray(
        engine_config_from_args(args),
        from_args(ServerConfig, args),
        from_args(RayServeConfig, args),
    )


def _cmd_router(args: argparse.Namespace) -> int:
    from mci.router.launch import run_router

    return run_router(from_args(RouterConfig, args), args.worker_urls, args.prefill, args.decode)


def _cmd_workflow(args: argparse.Namespace) -> int:
    from mci.workflow import launch

    config = from_args(WorkflowConfig, args)
    if args.workflow_command == "run":
        return launch.run_once(args.target, args.input, config)
    if args.workflow_command == "serve":
        return launch.serve(args.target, config)
    from mci.workflow.ray_app import deploy

    return deploy(args.target, config)


def _cmd_bench_serve(args: argparse.Namespace) -> int:
    from mci.bench.serve import main as bench_main

    return bench_main(args)


def _cmd_bench_floors(args: argparse.Namespace) -> int:
    from mci.bench.floors import Shape, main

    try:
        shapes = [Shape.parse(text) for text in args.shape]
    except ValueError as e:
        raise UserError(str(e)) from None
    if not (args.model_path / "config.json").is_file():
        raise UserError(f"{args.model_path} has no config.json")
    check_device(args.device)
    return main(args.model_path, shapes, args.json, args.device)


def _cmd_run_batch(args: argparse.Namespace) -> int:
    from mci.engine.engine import Engine
    from mci.server.batch_api import run_batch

    if not args.input_file.is_file():
        raise UserError(f"input file {args.input_file} does not exist")
    engine = Engine(engine_config_from_args(args), background=False)
    try:
        name = args.served_model_name or Path(args.model_path).name
        counts = run_batch(engine, args.input_file, args.output_file, name)
    finally:
        engine.shutdown()
    print(
        f"{counts['ok']} succeeded, {counts['failed']} failed -> {args.output_file}",
        file=sys.stderr,
    )
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(prog="mci", description="mission-critical inference for DeepSeek-V3")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=OneLineParser)

    g = sub.add_parser("generate", help="generate text offline from one prompt")
    add_engine_flags(g, GENERATE_SECTIONS)
    g.add_argument("--prompt", required=True)
    g.add_argument("--max-new-tokens", type=_positive_int, default=64)
    g.add_argument("--temperature", type=_non_negative_float, default=0.0, help="0 = greedy")
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--chat", action="store_true", help="wrap the prompt in the chat template")
    g.add_argument("--ignore-eos", action="store_true")
    g.add_argument(
        "--token-healing",
        action="store_true",
        help="back off the prompt's last token(s) and let the model regenerate them",
    )
    g.set_defaults(func=_cmd_generate)

    p = sub.add_parser("plan", help="memory plan: weights, KV cache and fit on given GPUs")
    p.add_argument("--config", type=Path, help="a config.json file")
    p.add_argument("--model-path", type=Path, help="a checkpoint directory (reads its config.json)")
    p.add_argument("--gpus", default="8xH200", help="e.g. 8xH200, 8xH100, 16xH100, 8x141GB")
    p.add_argument(
        "--mem-fraction-static",
        type=float,
        default=0.9,
        help="fraction of each GPU for weights + KV cache (SGLang's name)",
    )
    p.add_argument("--no-mtp", action="store_true", help="leave the MTP layer's weights out")
    p.set_defaults(func=_cmd_plan)

    s = sub.add_parser("serve", help="OpenAI-compatible HTTP server")
    add_engine_flags(s)
    add_flags(s, ServerConfig)
    s.set_defaults(func=_cmd_serve)

    sr = sub.add_parser(
        "serve-ray", help="mci serve replicas as an autoscaled Ray Serve deployment"
    )
    add_engine_flags(sr)
    add_flags(sr, ServerConfig, RayServeConfig)
    sr.set_defaults(func=_cmd_serve_ray)

    r = sub.add_parser("router", help="one OpenAI endpoint over mci serve replicas")
    r.add_argument(
        "--worker-urls", nargs="+", default=[], help="the replicas, e.g. http://127.0.0.1:30001"
    )
    r.add_argument(
        "--prefill", nargs="+", default=[], help="--pd-disaggregation: the prefill workers"
    )
    r.add_argument(
        "--decode", nargs="+", default=[], help="--pd-disaggregation: the decode workers"
    )
    add_flags(r, RouterConfig)
    r.set_defaults(func=_cmd_router)

    w = sub.add_parser("workflow", help="compound workflows: typed steps calling models")
    w_sub = w.add_subparsers(dest="workflow_command", required=True, parser_class=OneLineParser)
    for name, help_ in (
        ("run", "run a workflow once in this process and print its output as JSON"),
        ("serve", "serve a workflow over HTTP in one process (POST /run)"),
        ("deploy", "deploy a workflow on Ray Serve: a deployment per step, one HTTP ingress"),
    ):
        wc = w_sub.add_parser(name, help=help_)
        wc.add_argument("target", metavar="FILE:ENTRY", help="a workflow file and its entry step")
        if name == "run":
            wc.add_argument("--input", required=True, help="the entry step's input, as JSON")
        add_flags(wc, WorkflowConfig)
        wc.set_defaults(func=_cmd_workflow)

    bench = sub.add_parser("bench", help="benchmarks")
    bench_sub = bench.add_subparsers(
        dest="bench_command", required=True, parser_class=OneLineParser
    )
    bs = bench_sub.add_parser("serve", help="serving benchmark against an OpenAI-compatible server")
    from mci.bench.serve import add_arguments

    add_arguments(bs)
    bs.set_defaults(func=_cmd_bench_serve)
    bf = bench_sub.add_parser(
        "floors", help="a workload's physical floors on this machine (bytes and FLOPs per step)"
    )
    bf.add_argument("--model-path", type=Path, required=True, help="checkpoint directory")
    bf.add_argument(
        "--shape",
        action="append",
        required=True,
        metavar="NAME=CONCURRENCY,INPUT,OUTPUT",
        help="a workload: that many requests at once, each INPUT tokens in and OUTPUT out",
    )
    bf.add_argument("--json", action="store_true", help="print JSON")
    bf.add_argument(
        "--device", default="cpu", help="measure this torch device (cpu, cuda): the engine's"
    )
    bf.set_defaults(func=_cmd_bench_floors)

    b = sub.add_parser("run-batch", help="offline inference over an OpenAI Batch API file")
    b.add_argument("-i", "--input-file", type=Path, required=True, help="requests JSONL")
    b.add_argument("-o", "--output-file", type=Path, required=True, help="results JSONL")
    b.add_argument("--served-model-name", default=None, help="model name in responses")
    add_engine_flags(b)
    b.set_defaults(func=_cmd_run_batch)

    m = sub.add_parser("make-checkpoint", help="write a seeded random DeepSeek-V3 checkpoint")
    m.add_argument("--size", default="tiny", help="tiny (~2M params) or small (~108M)")
    m.add_argument("--out", type=Path, required=True)
    m.add_argument("--seed", type=int, default=0)
    m.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    m.add_argument("--fp8", action="store_true", help="FP8 e4m3 with 128x128 block scales")
    m.add_argument("--no-mtp", action="store_true", help="omit the MTP layer's weights")
    m.add_argument(
        "--context",
        type=_positive_int,
        default=None,
        help="context length; past the size's own, YaRN rope as DeepSeek-V3 (e.g. 32768)",
    )
    m.add_argument(
        "--shard-size-mb", type=float, default=None, help="shard into files of this size"
    )
    m.add_argument(
        "--config-dialect",
        default="4",
        choices=["4", "5"],
        help="config.json style of transformers 4.x or 5.x",
    )
    m.set_defaults(func=_cmd_make_checkpoint)
    return parser


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="mci: %(message)s", stream=sys.stderr)
    for noisy in ("httpx", "httpcore", "matplotlib"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    try:
        args = build_parser().parse_args(argv)
        return args.func(args)
    except UserError as exc:
        print(f"mci: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        return 130
