"""Building an engine core for a loaded model: size the KV pool, then the pool, radix cache,
runner, scheduler, speculator and grammar cache (mci.engine_assembly loads what it needs first;
a data-parallel rank builds its own core here too)."""

from __future__ import annotations

import logging
import os
import time

import torch

from mci.cache.kv_manager import KVCacheManager
from mci.cache.radix_cache import RadixCache
from mci.cache.sizing import kv_pool_tokens
from mci.cache.slot_pool import SlotPool
from mci.cpu_allocator import keep_freed_memory
from mci.engine.config import EngineConfig
from mci.engine.core import EngineCore
from mci.errors import UserError
from mci.grammar.cache import xgrammar_cache
from mci.models.deepseek_v3 import DeepseekV3ForCausalLM
from mci.runner.model_runner import ModelRunner
from mci.scheduler.output_processor import OutputProcessor
from mci.scheduler.scheduler import Scheduler
from mci.speculative.mtp import MTPDrafter
from mci.speculative.ngram import NgramDrafter
from mci.speculative.speculator import Speculator
from mci.tokenizer import TextTokenizer

log = logging.getLogger("mci")


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
    scheduler = Scheduler(config.scheduler, kv, outputs)
    # Chained MTP drafts write latents of unverified positions: to scratch slots after the
    # pool's, a row of num_steps per request that can share a step (see mci/speculative/mtp.py).
    scratch_cols = spec.num_steps if with_mtp else 0
    num_scratch = config.scheduler.max_running_requests * scratch_cols
    kv_cache = model.allocate_kv_cache(num_slots + num_scratch, device, with_mtp)
    if device.type == "cpu":
        log.info("packed %d linear layers for oneDNN", model.pack_for_cpu())
        log.info("malloc keeps freed memory: %s", keep_freed_memory())
    if config.model.deterministic or model.batch_invariant:  # a shared model may have it on
        try:
            model.set_batch_invariant(config.model.deterministic)
        except ValueError as exc:
            raise UserError(f"--deterministic: {exc}") from None
        log.info(
            "deterministic (batch-invariant) inference %s", "on" if model.batch_invariant else "off"
        )
    if device.type == "cpu" and not (
        config.model.skip_kernel_warmup or os.environ.get("MCI_SKIP_KERNEL_WARMUP") == "1"
    ):
        start = time.monotonic()
        # a step's tokens: a full prefill budget beside a decode token of every running request
        max_rows = config.scheduler.max_prefill_tokens + config.scheduler.max_running_requests
        # logits: every running request's sampled rows (its drafts too); prompt logprobs of
        # longer prompts compile their shapes on first use
        logit_rows = config.scheduler.max_running_requests * (1 + (spec.num_steps or 0))
        calls = model.warm_up_cpu_kernels(max_rows, logit_rows)
        log.info("warmed up %d CPU matmul shapes in %.1f s", calls, time.monotonic() - start)
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
    runner = ModelRunner(model, kv_cache, eos_ids, speculator)
    grammar = xgrammar_cache(tokenizer, cfg.vocab_size, eos_ids)
    return EngineCore(scheduler, runner, config.check_integrity, grammar)
