"""Building an engine: load the model and tokenizer (in this process, or over this node's ranks),
size the KV pool, then build the pool, radix cache, runner, scheduler, speculator, grammar
cache and request front, and the core that steps them.

The only place that knows how the parts fit together; everything else receives them built.
Every rank of a parallel run starts here too: rank 0 through `build_engine`, the others
through `follower_main` (a data-parallel rank builds its own core with `build_engine_core`).
"""

from __future__ import annotations

import logging
import multiprocessing
import sys
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from mci.cache.kv_manager import KVCacheManager
from mci.cache.radix_cache import RadixCache
from mci.cache.sizing import kv_pool_tokens
from mci.cache.slot_pool import SlotPool
from mci.cache.tiers import open_tiers
from mci.disaggregation.handoff import open_handoff
from mci.engine.config import EngineConfig
from mci.engine.core import EngineCore
from mci.engine.cpu_threads import ThreadGovernor, thread_levels
from mci.engine.dp_attention import DataParallelCore, follow_rounds
from mci.engine.memory_plan import (
    KERNEL_BYTES_ESTIMATE,
    MemoryPlan,
    kernel_cache_capacity,
    step_transient_bytes,
)
from mci.engine.ranks import join, load_agreed, load_sharded, start_followers
from mci.engine.request_front import RequestFront
from mci.engine.sharded_model import ShardedModel, follow
from mci.errors import UserError
from mci.grammar.cache import xgrammar_cache
from mci.model_config import ModelConfig
from mci.models.deepseek_v3 import DeepseekV3ForCausalLM
from mci.models.loader import load_model
from mci.process_memory import FreeMemoryBound, rss_bytes
from mci.process_tuning import keep_freed_memory
from mci.runner.model_runner import ModelRunner
from mci.runner.sampler import SCORE_ROWS
from mci.scheduler.output_processor import OutputProcessor
from mci.scheduler.scheduler import Scheduler
from mci.speculative.mtp import MTPDrafter
from mci.speculative.ngram import NgramDrafter
from mci.speculative.speculator import Speculator
from mci.tokenizer import TextTokenizer

log = logging.getLogger("mci")


@dataclass(frozen=True)
class EngineParts:
    """A built engine: the model and tokenizer, the core that steps them, and the front that
    checks prompts for it; in a parallel run, the model is rank 0's handle on all ranks and
    `followers` this node's other rank processes."""

    model: DeepseekV3ForCausalLM | ShardedModel
    tokenizer: TextTokenizer
    core: EngineCore | DataParallelCore
    front: RequestFront
    followers: tuple[multiprocessing.Process, ...] = ()

    def close(self) -> None:
        """Release the other ranks of a parallel run (nothing to do for one process); after a
        failure, kill this node's (a stuck one would never leave on its own)."""
        if isinstance(self.core, EngineCore):
            self.core.close()
        driver = self.core if isinstance(self.core, DataParallelCore) else self.model
        if not isinstance(driver, (ShardedModel, DataParallelCore)):
            return
        broken = driver.broken
        try:
            driver.close()
        except RuntimeError as exc:  # a rank already gone: nothing to release
            log.warning("closing the parallel run: %s", exc)
        for proc in self.followers:
            proc.join(timeout=0 if broken else 10)
            if proc.is_alive():
                proc.kill()
                proc.join(timeout=5)


def build_engine(
    config: EngineConfig,
    model: DeepseekV3ForCausalLM | None = None,
    tokenizer: TextTokenizer | None = None,
    model_config: ModelConfig | None = None,
) -> EngineParts:
    """Load what is not passed in (tests share one loaded model between engines), then build.
    `model_config`: the checkpoint's config.json, when the caller has parsed it already."""
    placement = config.model
    followers, parallel = [], None
    if model is None and config.parallel.world_size > 1:
        model, parallel, followers = load_sharded(config, follower_main, model_config)
    model = model or load_model(
        placement.model_path, placement.dtype, placement.device, cfg=model_config
    )
    tokenizer = tokenizer or TextTokenizer.load(placement.model_path)
    log.info(
        "model %s: %s, %.1f MB of weights",
        placement.model_path,
        model.dtype,
        model.weight_bytes() / 1e6,
    )
    try:
        core = build_engine_core(config, model, tokenizer)
    except BaseException:
        _abandon_run(followers)
        raise
    front = core.front
    if parallel is not None and parallel.dp_attention:
        core = DataParallelCore(core, model, parallel, config.parallel.dist_timeout)
    return EngineParts(model, tokenizer, core, front, tuple(followers))


def _abandon_run(followers: list[multiprocessing.Process]) -> None:
    """A parallel run that failed while its engine was being built: stop its ranks."""
    for proc in followers:
        proc.kill()
        proc.join(timeout=5)
    if followers and dist.is_initialized():
        dist.destroy_process_group()


def build_engine_core(
    config: EngineConfig, model: DeepseekV3ForCausalLM, tokenizer: TextTokenizer
) -> EngineCore:
    """Size the KV pool and assemble pool, radix cache, runner and scheduler for `model`.

    The pool holds the main layers' latents, and the MTP module's when it drafts
    (`--speculative-algorithm mtp`); otherwise nothing runs the module and its row would be
    memory no token uses.
    """
    cfg = model.cfg
    eos_ids = tuple(cfg.eos_token_ids)
    spec = config.speculative
    with_mtp = spec.speculative_algorithm == "mtp"
    if with_mtp and not len(model.mtp):
        raise UserError(
            "--speculative-algorithm mtp: the checkpoint has no MTP module "
            "(num_nextn_predict_layers is 0 or its weights are missing); use ngram"
        )
    per_token = cfg.kv_bytes_per_token(model.dtype.itemsize, include_mtp=with_mtp)
    cap = config.scheduler.max_running_requests * cfg.max_position_embeddings
    device = model.lm_head.weight.device  # where the model is, whatever the config said
    num_slots = kv_pool_tokens(config.cache, per_token, device, cap)
    pool = SlotPool(num_slots)
    radix = None if config.cache.disable_radix_cache else RadixCache(pool)
    log.info(
        "%d tokens of KV (%.1f MB), radix cache %s",
        num_slots,
        num_slots * per_token / 1e6,
        "off" if radix is None else "on",
    )
    # MTP latents need a matched prefix's last position computed again (see mci/speculative/mtp.py)
    kv = KVCacheManager(pool, radix, match_margin=1 if with_mtp else 0)
    outputs = OutputProcessor(tokenizer, eos_ids, config.scheduler.enable_jump_forward)
    # several decode steps a call run where a decode step runs whole on the CPU kernels: bf16,
    # one rank, no drafts to verify, and not batch-invariant (its routers run in torch; the
    # model is made so, or not, below as --deterministic says)
    steps_ahead = (
        device.type == "cpu"
        and model.dtype == torch.bfloat16
        and model.parallel.world_size == 1
        and not spec.enabled
        and not config.model.deterministic
    )
    decode_steps = config.scheduler.num_scheduler_steps if steps_ahead else 1
    scheduler = Scheduler(config.scheduler, kv, outputs, decode_steps)
    # Chained MTP drafts write latents of unverified positions: to scratch slots after the
    # pool's, a row of num_steps per request that can share a step (see mci/speculative/mtp.py).
    scratch_cols = spec.num_steps if with_mtp else 0
    num_scratch = config.scheduler.max_running_requests * scratch_cols
    kv_cache = model.allocate_kv_cache(num_slots + num_scratch, device, with_mtp)
    threads = compute_threads(config, device, model.parallel.world_size)
    levels = thread_levels(threads.max_threads) if threads else (torch.get_num_threads(),)
    # a step's tokens: a full prefill budget beside a decode token of every running request
    max_rows = config.scheduler.max_prefill_tokens + config.scheduler.max_running_requests
    kernel_capacity = 0
    if device.type == "cpu":
        shapes = model.kernel_shapes(max(max_rows, cfg.max_position_embeddings))
        with kernel_cache_capacity(shapes * len(levels)) as kernel_capacity:
            log.info("prepared %d linear layers for the CPU", model.pack_for_cpu())
        log.info("malloc keeps freed memory: %s", keep_freed_memory())
    if config.model.deterministic or model.batch_invariant:  # a shared model may have it on
        try:
            model.set_batch_invariant(config.model.deterministic)
        except ValueError as exc:
            raise UserError(f"--deterministic: {exc}") from None
        log.info(
            "deterministic (batch-invariant) inference %s", "on" if model.batch_invariant else "off"
        )
    # logits: every running request's sampled rows (its drafts too), or a slice of scored
    # prompt rows (runner/sampler.py)
    logit_rows = config.scheduler.max_running_requests * (1 + (spec.num_steps or 0))
    logit_rows = max(logit_rows, SCORE_ROWS)
    kernel_bytes = KERNEL_BYTES_ESTIMATE
    if device.type == "cpu" and not config.model.skip_kernel_warmup:
        kernel_bytes = warm_up(model, max_rows, logit_rows, levels) or kernel_bytes
    logits, activations = step_transient_bytes(
        cfg, max_rows, logit_rows, cfg.max_position_embeddings
    )
    if config.cache.enable_hierarchical_cache:
        if model.parallel.world_size > 1:
            raise UserError(
                "--enable-hierarchical-cache runs in one process for now (each rank's pool "
                "would need the same loads)"
            )
        kv.attach_tiers(
            open_tiers(config.cache, config.model.model_path, kv_cache, model.batch_invariant)
        )
    plan = MemoryPlan(
        model.weight_bytes(),
        (num_slots + num_scratch) * per_token,
        kernel_capacity,
        kernel_bytes,
        logits,
        activations,
    )
    plan.log()
    # on the CPU, free heap kept for reuse: up to two steps' transients (process_memory.py)
    free_memory = FreeMemoryBound(2 * plan.transient_bytes) if device.type == "cpu" else None
    speculator = None
    if spec.enabled:
        if with_mtp:
            scratch = torch.arange(num_slots, num_slots + num_scratch, device=device)
            scratch = scratch.view(config.scheduler.max_running_requests, scratch_cols)
            drafter = MTPDrafter(model, kv_cache, scratch)
        else:
            drafter = NgramDrafter(
                spec.speculative_ngram_min_window, spec.speculative_ngram_max_window
            )
        speculator = Speculator(spec, drafter)
        log.info(
            "speculative decoding: %s, %d draft tokens", spec.speculative_algorithm, spec.num_steps
        )
    if config.disaggregation.enabled:
        scheduler.handoff = open_handoff(
            config.disaggregation, kv_cache, config.model.model_path, model.batch_invariant
        )
    runner = ModelRunner(model, kv_cache, eos_ids, speculator)
    grammar = xgrammar_cache(tokenizer, cfg.vocab_size, eos_ids)
    front = RequestFront(tokenizer, cfg.vocab_size, cfg.max_position_embeddings, grammar)
    return EngineCore(
        scheduler, runner, front, config.check_integrity, grammar, threads, plan, free_memory
    )


def warm_up(model: DeepseekV3ForCausalLM, max_rows: int, logit_rows: int, levels) -> int:
    """Compile oneDNN's kernels for every shape a step can meet at every thread count the
    governor may use (a set per count: engine/memory_plan.py), ending at the largest count;
    returns the resident bytes a kernel took (0 if not measured: an upper bound, since what
    the warm-up's own activations left in malloc's free lists counts too)."""
    start, before = time.monotonic(), rss_bytes()
    calls = 0
    for level in reversed(levels):
        torch.set_num_threads(level)
        calls += model.warm_up_cpu_kernels(max_rows, logit_rows)
    after = rss_bytes()
    log.info(
        "warmed up %d CPU matmul shapes at %s threads in %.1f s",
        calls,
        "/".join(map(str, levels)),
        time.monotonic() - start,
    )
    if not before or not after or not calls:
        return 0
    return max(0, after - before) // calls


def compute_threads(
    config: EngineConfig, device: torch.device, world_size: int
) -> ThreadGovernor | None:
    """--cpu-threads: a fixed count is set here; auto gets a governor (mci/engine/
    cpu_threads.py) on one process on the CPU. A parallel run keeps the count each rank was
    given (mci/engine/ranks.py): its ranks are each other's neighbours, and step together.
    So does --deterministic: oneDNN and aten may split a sum differently with another count
    (measured equal here, not promised), and bit-identical outputs may not hang on load.
    Engines in one process share one thread count: each governor lowers it from what it
    found."""
    if device.type != "cpu":
        return None
    if config.model.cpu_threads != "auto":
        torch.set_num_threads(int(config.model.cpu_threads))
        return None
    if world_size > 1 or config.model.deterministic:
        return None
    log.info("compute threads: %d, fewer while other work takes CPUs", torch.get_num_threads())
    return ThreadGovernor(torch.get_num_threads(), torch.set_num_threads)


def follower_main(
    config: EngineConfig, rank: int, init_addr: str, model_config: ModelConfig | None
) -> None:
    """A follower rank's process: join the run, load its shard, then follow rank 0 (its own
    core under data-parallel attention, else rank 0's model calls) until the run ends."""
    logging.basicConfig(
        level=logging.INFO, format=f"mci[rank {rank}]: %(message)s", stream=sys.stderr
    )
    try:
        parallel = join(config, rank, init_addr)
        model = load_agreed(config, parallel, model_config)
        if parallel.dp_attention:  # its own scheduler and KV cache, stepped by rank 0
            tokenizer = TextTokenizer.load(config.model.model_path)
            follow_rounds(build_engine_core(config, model, tokenizer), model, parallel)
        else:
            follow(model, parallel)
        dist.destroy_process_group()
    except UserError as exc:
        log.error("%s", exc)
        sys.exit(2)
    except Exception as exc:  # noqa: BLE001 - a failed collective: a peer is gone or stuck
        log.error("rank %d stopping: %s", rank, str(exc).splitlines()[0] if str(exc) else exc)
        sys.exit(1)


def run_follower_node(config: EngineConfig) -> int:
    """`mci serve --node-rank K` (K > 0): this node's ranks, until the run ends."""
    procs = start_followers(config, config.parallel.dist_init_addr, follower_main, None)
    for proc in procs:
        proc.join()
    return max((proc.exitcode or 0) for proc in procs) if procs else 0
