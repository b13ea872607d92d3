"""Assembly: load a model and tokenizer, size the KV pool, and build the engine's parts.

The only place that knows how the parts fit together; everything else receives them built.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from mci.cache.kv_manager import KVCacheManager
from mci.cache.radix_cache import RadixCache
from mci.cache.sizing import kv_pool_tokens
from mci.cache.slot_pool import SlotPool
from mci.cpu_allocator import keep_freed_memory
from mci.engine_config import EngineConfig
from mci.engine_core import EngineCore
from mci.errors import UserError
from mci.models.deepseek_v3 import DeepseekV3ForCausalLM
from mci.models.loader import load_model
from mci.request_front import RequestFront
from mci.runner.model_runner import ModelRunner
from mci.scheduler.output_processor import OutputProcessor
from mci.scheduler.scheduler import Scheduler
from mci.tokenizer import TextTokenizer

log = logging.getLogger("mci")


@dataclass(frozen=True)
class EngineParts:
    """A built engine: the model and tokenizer, the core that steps them, and the front that
    turns prompts into its requests."""

    model: DeepseekV3ForCausalLM
    tokenizer: TextTokenizer
    core: EngineCore
    front: RequestFront


def assemble(
    config: EngineConfig,
    model: DeepseekV3ForCausalLM | None = None,
    tokenizer: TextTokenizer | None = None,
) -> EngineParts:
    """Load what is not passed in (tests share one loaded model between engines), then build."""
    placement = config.model
    model = model or load_model(placement.model_path, placement.dtype, placement.device)
    tokenizer = tokenizer or TextTokenizer.load(placement.model_path)
    log.info(
        "model %s: %s, %.1f MB of weights",
        placement.model_path,
        model.dtype,
        model.weight_bytes() / 1e6,
    )
    cfg = model.cfg
    front = RequestFront(tokenizer, cfg.vocab_size, cfg.max_position_embeddings)
    return EngineParts(model, tokenizer, build_engine_core(config, model, tokenizer), front)


def build_engine_core(
    config: EngineConfig, model: DeepseekV3ForCausalLM, tokenizer: TextTokenizer
) -> EngineCore:
    """Size the KV pool and assemble pool, radix cache, runner and scheduler for `model`.

    The pool holds the main layers' latents only: nothing runs the MTP modules yet, so their
    rows would be memory no token uses.
    """
    cfg = model.cfg
    eos_ids = tuple(cfg.eos_token_ids)
    with_mtp = False  # nothing runs the MTP modules yet
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
    scheduler = Scheduler(
        config.scheduler, KVCacheManager(pool, radix), OutputProcessor(tokenizer, eos_ids)
    )
    kv_cache = model.allocate_kv_cache(num_slots, device, with_mtp)
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
    return EngineCore(scheduler, ModelRunner(model, kv_cache, eos_ids), config.check_integrity)
