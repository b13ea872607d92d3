"""Assembly: load a model and tokenizer, size the KV pool, and build the engine's parts.

The only place that knows how the parts fit together; everything else receives them built.
"""

from __future__ import annotations

import logging
import multiprocessing
from dataclasses import dataclass

import torch.distributed as dist

from mci.engine.builder import build_engine_core
from mci.engine.config import EngineConfig
from mci.engine.core import EngineCore
from mci.engine.dp_attention import DataParallelCore
from mci.engine.ranks import load_sharded
from mci.engine.request_front import RequestFront
from mci.engine.sharded_model import ShardedModel
from mci.models.deepseek_v3 import DeepseekV3ForCausalLM
from mci.models.loader import load_model
from mci.tokenizer import TextTokenizer

log = logging.getLogger("mci")


@dataclass(frozen=True)
class EngineParts:
    """A built engine: the model and tokenizer, the core that steps them, and the front that
    turns prompts into its requests; in a parallel run, the model is rank 0's handle on all
    ranks and `followers` this node's other rank processes."""

    model: DeepseekV3ForCausalLM | ShardedModel
    tokenizer: TextTokenizer
    core: EngineCore | DataParallelCore
    front: RequestFront
    followers: tuple[multiprocessing.Process, ...] = ()

    def close(self) -> None:
        """Release the other ranks of a parallel run (nothing to do for one process); after a
        failure, kill this node's (a stuck one would never leave on its own)."""
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


def assemble(
    config: EngineConfig,
    model: DeepseekV3ForCausalLM | None = None,
    tokenizer: TextTokenizer | None = None,
) -> EngineParts:
    """Load what is not passed in (tests share one loaded model between engines), then build."""
    placement = config.model
    followers, parallel = [], None
    if model is None and config.parallel.world_size > 1:
        model, parallel, followers = load_sharded(config)
    model = model or load_model(placement.model_path, placement.dtype, placement.device)
    tokenizer = tokenizer or TextTokenizer.load(placement.model_path)
    log.info(
        "model %s: %s, %.1f MB of weights",
        placement.model_path,
        model.dtype,
        model.weight_bytes() / 1e6,
    )
    cfg = model.cfg
    try:
        core = build_engine_core(config, model, tokenizer)
    except BaseException:
        _abandon_run(followers)
        raise
    if parallel is not None and parallel.dp_attention:
        core = DataParallelCore(core, model, parallel, config.parallel.dist_timeout)
    front = RequestFront(tokenizer, cfg.vocab_size, cfg.max_position_embeddings, core.grammar)
    return EngineParts(model, tokenizer, core, front, tuple(followers))


def _abandon_run(followers: list[multiprocessing.Process]) -> None:
    """A parallel run that failed while its engine was being built: stop its ranks."""
    for proc in followers:
        proc.kill()
        proc.join(timeout=5)
    if followers and dist.is_initialized():
        dist.destroy_process_group()
