"""Frozen engine configuration (cache, scheduler, model placement) and the CLI built from it.

Each field's help lives in its metadata; `add_config_args` turns the dataclasses into
argparse flags (`--field-name`, SGLang's names where the meaning is the same) so the CLI is
never written twice. Each component receives only its own section.
"""

from __future__ import annotations

import argparse
import dataclasses
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path

from mci.errors import UserError

DEFAULT_MODEL = Path(__file__).parent.parent / "assets" / "default-model"


def _opt(default, help: str, choices=None, aliases: tuple[str, ...] = ()):
    """A config field with its CLI help; `aliases` are other flags for it (peers' spellings)."""
    return field(default=default, metadata={"help": help, "choices": choices, "aliases": aliases})


@dataclass(frozen=True)
class ModelPlacement:
    """Which checkpoint, in which dtype, on which device."""

    model_path: Path = _opt(DEFAULT_MODEL, "checkpoint directory (default: the bundled model)")
    dtype: str = _opt(
        "auto",
        "activation dtype; auto = the checkpoint's",
        ["auto", "bfloat16", "float16", "float32"],
    )
    device: str = _opt("cpu", "torch device (cpu, cuda, cuda:1, ...)")
    deterministic: bool = _opt(
        False,
        "batch-invariant inference: each request's outputs and logprobs bit-identical whatever "
        "else is batched with it, its prefill chunking or its prefix cache hits (bf16 on the "
        "CPU); also spelled --enable-deterministic-inference",
        aliases=("--enable-deterministic-inference",),
    )
    skip_kernel_warmup: bool = _opt(
        False,
        "CPU: skip running every matmul shape once at startup (oneDNN compiles a kernel per "
        "shape, ~3 ms each; without the warm-up the first requests of each size pay it). "
        "MCI_SKIP_KERNEL_WARMUP=1 does the same (the test suite sets it)",
    )


@dataclass(frozen=True)
class CacheConfig:
    """Size of the latent KV pool and the prefix cache."""

    kv_cache_gb: float | None = _opt(None, "GiB of KV cache (default: a fraction of free memory)")
    mem_fraction_static: float = _opt(
        0.2, "fraction of free memory for the KV cache when --kv-cache-gb is not given"
    )
    max_total_tokens: int | None = _opt(None, "exact KV pool size in tokens (overrides the above)")
    disable_radix_cache: bool = _opt(False, "turn the radix prefix cache off")


@dataclass(frozen=True)
class SchedulerConfig:
    """Batching policy of the scheduler loop."""

    max_running_requests: int = _opt(256, "most requests decoding at once")
    max_prefill_tokens: int = _opt(8192, "most prompt tokens computed in one step")
    chunked_prefill_size: int = _opt(2048, "most tokens of one prompt per step; -1 disables")
    schedule_policy: str = _opt(
        "lpm", "admission order: lpm (longest cached prefix first) or fcfs", ["lpm", "fcfs"]
    )
    decode_reserve_tokens: int = _opt(16, "KV tokens kept free per running request at admission")
    enable_jump_forward: bool = _opt(
        False,
        "structured output: append the text a grammar forces (e.g. a fixed key) without a "
        "model step per token; computed in the next step like a prompt chunk",
    )

    def __post_init__(self):
        if self.max_running_requests < 1 or self.max_prefill_tokens < 1:
            raise UserError("--max-running-requests and --max-prefill-tokens must be >= 1")
        if self.chunked_prefill_size == 0 or self.chunked_prefill_size < -1:
            raise UserError("--chunked-prefill-size must be positive, or -1 to disable")

    @property
    def chunk_limit(self) -> int | None:
        return None if self.chunked_prefill_size == -1 else self.chunked_prefill_size


MTP_ALIASES = ("nextn", "eagle")  # SGLang's names for DeepSeek's MTP draft
# Per algorithm, measured with benchmarks/spec_decode.py on the bundled model (docs/speculative.md):
# the fastest draft length single-stream, and the largest batch (sampling requests in a step)
# where drafting still paid off. An MTP draft costs a module forward per depth; an n-gram
# draft costs only its verification (and a request whose text never repeats drafts nothing).
SPECULATION_DEFAULT_STEPS = {"mtp": 2, "ngram": 5}
SPECULATION_MAX_BATCH = {"mtp": 4, "ngram": 4}


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding: draft tokens cheaply, verify them all in one target forward.

    Chains only (one draft per position, SGLang's EAGLE with topk 1): each step a request
    verifies up to `speculative_num_steps` drafts, so `--speculative-num-draft-tokens`, which
    SGLang also takes, must be that plus one.
    """

    speculative_algorithm: str | None = _opt(
        None,
        "draft with the checkpoint's MTP module (mtp; SGLang's NEXTN/EAGLE are accepted) or "
        "by prompt lookup (ngram, any model); off when not given",
        ["mtp", "ngram", *MTP_ALIASES],
    )
    speculative_num_steps: int | None = _opt(
        None, "draft tokens per request per step, k (default: mtp 2, ngram 5; measured)"
    )
    speculative_num_draft_tokens: int | None = _opt(
        None, "tokens verified per request per step: num_steps + 1 (SGLang's flag)"
    )
    speculative_ngram_max_window: int = _opt(
        3, "ngram: longest suffix looked up in the request's earlier tokens"
    )
    speculative_ngram_min_window: int = _opt(1, "ngram: shortest suffix looked up")
    speculative_disable_by_batch_size: int | None = _opt(
        None,
        "no drafting in a step with more sampling requests than this, where verifying costs "
        "more than it saves (default: measured per algorithm, docs/speculative.md)",
    )

    def __post_init__(self):
        algo = self.speculative_algorithm
        if algo is not None:
            algo = algo.lower()
            object.__setattr__(
                self, "speculative_algorithm", "mtp" if algo in MTP_ALIASES else algo
            )
        if self.speculative_algorithm not in (None, "mtp", "ngram"):
            raise UserError(f"--speculative-algorithm must be mtp or ngram, got {algo!r}")
        steps = self.speculative_num_steps
        if steps is None:
            steps = SPECULATION_DEFAULT_STEPS.get(self.speculative_algorithm, 1)
            object.__setattr__(self, "speculative_num_steps", steps)
        if not 1 <= steps <= 16:
            raise UserError("--speculative-num-steps must be in [1, 16]")
        draft_tokens = self.speculative_num_draft_tokens
        if draft_tokens is not None and draft_tokens != steps + 1:
            raise UserError(
                "--speculative-num-draft-tokens must be --speculative-num-steps + 1 "
                f"({steps + 1}): drafts are chains, not trees"
            )
        if not 1 <= self.speculative_ngram_min_window <= self.speculative_ngram_max_window:
            raise UserError(
                "--speculative-ngram-min-window must be in [1, --speculative-ngram-max-window]"
            )
        limit = self.speculative_disable_by_batch_size
        if limit is not None and limit < 1:
            raise UserError("--speculative-disable-by-batch-size must be >= 1")

    @property
    def enabled(self) -> bool:
        return self.speculative_algorithm is not None

    @property
    def num_steps(self) -> int:
        """Drafts per request per step; 0 when speculation is off."""
        return self.speculative_num_steps if self.enabled else 0

    @property
    def max_drafting_batch(self) -> int:
        """Most sampling requests in a step that still drafts: the flag, or the measured
        break-even of the algorithm on this project's CPU benchmark (docs/speculative.md)."""
        if self.speculative_disable_by_batch_size is not None:
            return self.speculative_disable_by_batch_size
        return SPECULATION_MAX_BATCH.get(self.speculative_algorithm, 0)


@dataclass(frozen=True)
class ParallelConfig:
    """How the model is split over processes (mci/parallel/): SGLang's flag names."""

    tp_size: int = _opt(1, "tensor-parallel ranks (heads, MLPs, vocabulary)", aliases=("--tp",))
    ep_size: int = _opt(
        1, "expert-parallel ranks (routed experts split by expert)", aliases=("--ep",)
    )
    enable_dp_attention: bool = _opt(
        False,
        "data-parallel attention: each rank runs its own requests (own KV cache) through whole "
        "attention and dense layers; routed experts split over the ranks (needs --ep-size N)",
    )
    moe_dispatch: str = _opt(
        "all_to_all",
        "with --enable-dp-attention, how tokens reach their experts' ranks",
        ["all_to_all", "all_gather"],
    )
    nnodes: int = _opt(1, "machines the ranks span")
    node_rank: int = _opt(0, "this machine's index; node 0 serves, the others only compute")
    dist_init_addr: str | None = _opt(
        None, "host:port of node 0's rendezvous (default: a free local port; one node only)"
    )
    dist_timeout: float = _opt(
        30.0, "seconds a collective may wait for a peer before the run fails (dead/stuck rank)"
    )

    def __post_init__(self):
        world = self.world_size
        for name, size in (("--tp-size", self.tp_size), ("--ep-size", self.ep_size)):
            if size < 1 or size not in (1, world):
                raise UserError(
                    f"{name} must be 1 or the number of ranks ({world}): tp and ep share them"
                )
        if self.nnodes < 1 or world % self.nnodes:
            raise UserError(f"--nnodes {self.nnodes} does not divide the {world} ranks")
        if not 0 <= self.node_rank < self.nnodes:
            raise UserError(f"--node-rank must be in [0, {self.nnodes})")
        if self.nnodes > 1 and not self.dist_init_addr:
            raise UserError("--nnodes > 1 needs --dist-init-addr HOST:PORT (node 0's)")
        if self.dist_timeout <= 0:
            raise UserError("--dist-timeout must be > 0")
        if self.enable_dp_attention and (self.tp_size != 1 or self.ep_size < 2):
            raise UserError(
                "--enable-dp-attention needs --ep-size N (N >= 2) and --tp-size 1: attention "
                "is data-parallel, the routed experts are split by expert"
            )

    @property
    def world_size(self) -> int:
        return max(self.tp_size, self.ep_size)

    @property
    def ranks_per_node(self) -> int:
        return self.world_size // self.nnodes


@dataclass(frozen=True)
class ServerConfig:
    """The HTTP front end of `mci serve`."""

    host: str = _opt("127.0.0.1", "address to bind (loopback by default)")
    port: int = _opt(30000, "port to listen on")
    served_model_name: str | None = _opt(None, "model name in the API (default: the directory)")
    api_key: str | None = _opt(None, "require 'Authorization: Bearer KEY' on the API")
    context_length: int | None = _opt(None, "max prompt + output tokens (default: the model's)")
    max_queued_requests: int = _opt(256, "requests waiting beyond the running batch before 429")
    request_timeout: float | None = _opt(None, "seconds before a request is aborted")
    drain_timeout: float = _opt(30.0, "seconds to let requests finish after SIGTERM")
    max_request_bytes: int = _opt(4 * 2**20, "largest request body accepted (413 beyond)")
    health_generate_timeout: float = _opt(20.0, "seconds /health_generate waits for a token")
    dp_size: int = _opt(
        1,
        "data-parallel replicas: start N servers on the next N ports behind the cache-aware "
        "router on --port (mci router)",
    )
    max_engine_restarts: int = _opt(
        5, "restarts of a crashed engine within 10 minutes before it stays down (0: none)"
    )
    watchdog_timeout: float | None = _opt(
        None,
        "seconds the engine may go without progress before it is declared hung, killed and "
        "restarted (default: 30, or 10x the longest step it has taken if more)",
    )
    max_queue_time: float | None = _opt(
        120.0,
        "seconds a request may wait to be scheduled before it is refused with 503 and "
        "Retry-After (0: no bound)",
    )
    reasoning_parser: str | None = _opt(
        None,
        "chat: report the text before </think> as reasoning_content (DeepSeek-R1 style)",
        ["deepseek-r1"],
    )
    token_healing: bool = _opt(
        False,
        "completions and /generate: back off a prompt's last token(s) and let the model "
        "regenerate them (requests override with token_healing)",
    )
    tool_call_parser: str | None = _opt(
        None,
        "chat: the format tool calls are written in (default: deepseekv3 when the tokenizer "
        "has its markup tokens, else a JSON envelope)",
        ["deepseekv3", "json"],
    )


@dataclass(frozen=True)
class RouterConfig:
    """`mci router` (mci/router/): replicas behind one OpenAI endpoint."""

    host: str = _opt("127.0.0.1", "address to bind (loopback by default)")
    port: int = _opt(30000, "port to listen on")
    policy: str = _opt(
        "cache_aware",
        "which replica takes a request",
        ["cache_aware", "round_robin", "least_load"],
    )
    cache_threshold: float = _opt(
        0.5, "cache_aware: the share of a prompt a replica must hold to take it by cache"
    )
    balance_abs_threshold: int = _opt(
        32, "cache_aware: balance by load when the busiest has this many more requests ..."
    )
    balance_rel_threshold: float = _opt(1.5, "... and this many times the idlest's")
    health_check_interval: float = _opt(1.0, "seconds between health checks of each replica")
    max_retries: int = _opt(3, "other replicas tried when one fails before the first byte")
    breaker_failures: int = _opt(3, "consecutive failures that eject a replica")
    breaker_cooldown: float = _opt(10.0, "seconds an ejected replica waits for a health check")
    disable_stream_resume: bool = _opt(
        False,
        "fail a stream whose replica dies mid-stream instead of continuing it on another "
        "replica (continuing is exact for greedy and seeded streams with n = 1)",
    )


@dataclass(frozen=True)
class RayServeConfig:
    """`mci serve-ray` (mci/ray_serve/): replicas as a Ray Serve deployment with autoscaling."""

    ray_address: str | None = _opt(
        None, "Ray cluster to join, e.g. auto or HOST:6379 (default: start a local one)"
    )
    min_replicas: int = _opt(1, "autoscaling: fewest replicas")
    max_replicas: int = _opt(4, "autoscaling: most replicas")
    target_ongoing_requests: float = _opt(
        16.0, "autoscaling: requests in flight per replica that the replica count aims at"
    )
    upscale_delay_s: float = _opt(30.0, "autoscaling: seconds of demand before adding replicas")
    downscale_delay_s: float = _opt(
        600.0, "autoscaling: seconds of low demand before removing replicas"
    )
    max_ongoing_requests: int = _opt(
        256, "requests one replica takes at once (Ray Serve queues the rest)"
    )
    cpus_per_replica: float = _opt(
        1.0, "CPUs Ray reserves per replica (also its OpenMP threads, at least 1)"
    )
    request_router: str = _opt(
        "cache_aware",
        "which replica takes a request: mci's cache-aware policy, or Ray Serve's default",
        ["cache_aware", "power_of_two"],
    )

    def __post_init__(self):
        if not 0 <= self.min_replicas <= self.max_replicas or self.max_replicas < 1:
            raise UserError("need 0 <= --min-replicas <= --max-replicas and --max-replicas >= 1")
        for name, value in (
            ("--target-ongoing-requests", self.target_ongoing_requests),
            ("--max-ongoing-requests", self.max_ongoing_requests),
            ("--cpus-per-replica", self.cpus_per_replica),
        ):
            if value <= 0:
                raise UserError(f"{name} must be > 0")
        if self.upscale_delay_s < 0 or self.downscale_delay_s < 0:
            raise UserError("--upscale-delay-s and --downscale-delay-s must be >= 0")


@dataclass(frozen=True)
class EngineConfig:
    """Everything the in-process Engine needs."""

    model: ModelPlacement = field(default_factory=ModelPlacement)
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    speculative: SpeculativeConfig = field(default_factory=SpeculativeConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    check_integrity: bool = False  # verify slot accounting every step (tests)

    def __post_init__(self):
        if self.speculative.enabled and self.parallel.enable_dp_attention:
            raise UserError(
                "--speculative-algorithm with --enable-dp-attention is not supported: drafts "
                "would add forwards on some ranks only, and the ranks step together"
            )


SECTIONS = {
    "model": ModelPlacement,
    "cache": CacheConfig,
    "scheduler": SchedulerConfig,
    "speculative": SpeculativeConfig,
    "parallel": ParallelConfig,
}
ALL_SECTIONS = {
    **SECTIONS,
    "server": ServerConfig,
    "router": RouterConfig,
    "ray": RayServeConfig,
}


def _arg_type(tp):
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        tp = next(a for a in typing.get_args(tp) if a is not type(None))
    return tp


def add_config_args(parser: argparse.ArgumentParser, sections=tuple(SECTIONS)) -> None:
    """Add one flag per field of the named sections."""
    for cls in (ALL_SECTIONS[name] for name in sections):
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            flags = ["--" + f.name.replace("_", "-"), *f.metadata.get("aliases", ())]
            tp = _arg_type(hints[f.name])
            help_text, choices = f.metadata["help"], f.metadata.get("choices")
            if tp is bool:
                parser.add_argument(*flags, dest=f.name, action="store_true", help=help_text)
            else:
                parser.add_argument(
                    *flags,
                    dest=f.name,
                    type=tp,
                    default=f.default,
                    choices=choices,
                    help=f"{help_text} (default: {f.default})",
                )


def server_config_from_args(args: argparse.Namespace) -> ServerConfig:
    fields = dataclasses.fields(ServerConfig)
    return ServerConfig(**{f.name: getattr(args, f.name) for f in fields})


def config_from_args(args: argparse.Namespace, **extra) -> EngineConfig:
    """Build the frozen EngineConfig from parsed flags."""
    sections = {
        name: cls(**{f.name: getattr(args, f.name) for f in dataclasses.fields(cls)})
        for name, cls in SECTIONS.items()
    }
    return EngineConfig(**sections, **extra)
