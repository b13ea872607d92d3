"""Starting a parallel run: follower rank processes, the rendezvous, per-rank loading (what
each rank then builds and runs is engine/builder.py's `follower_main`).

`mci serve --tp-size 2` starts everything on one machine: the engine process is rank 0 and
spawns ranks 1..W-1 itself. Across machines (`--nnodes`, `--node-rank`, `--dist-init-addr`, as
in SGLang) node 0 runs `mci serve` as usual and every other node runs the same command with its
`--node-rank`: it starts its ranks and serves nothing.

Failure is fast and loud: a rank that cannot load its shard fails every rank at the load
agreement (not at the first step); afterwards a rank that dies breaks its peers' next
collective at once (its sockets close), and a stuck one fails them after --dist-timeout.
Followers are daemon processes of rank 0, so rank 0 exiting takes them down; a follower whose
rank 0 died fails its next collective and exits.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
from collections.abc import Callable

import torch
import torch.distributed as dist

from mci.engine.config import EngineConfig
from mci.engine.sharded_model import ShardedModel
from mci.errors import UserError
from mci.loopback import free_loopback_port
from mci.model_config import ModelConfig
from mci.models.deepseek_v3 import DeepseekV3ForCausalLM
from mci.models.loader import load_model
from mci.parallel.config import ParallelConfig
from mci.parallel.context import ParallelContext, init_process_group

log = logging.getLogger("mci")
# a follower rank's life: (config, rank, init_addr, model_config) -> None (engine/builder.py)
FollowerMain = Callable[[EngineConfig, int, str, ModelConfig | None], None]


def _set_threads(par: ParallelConfig, device: str) -> None:
    """Ranks of a node share its cores: each gets its share (oversubscribing them makes every
    rank wait on the slowest)."""
    if device == "cpu":
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // par.ranks_per_node))


def join(config: EngineConfig, rank: int, init_addr: str) -> ParallelContext:
    """Join the run's process group as `rank` (every rank of every node calls it)."""
    par = config.parallel
    _set_threads(par, config.model.device)
    _start, serving = init_process_group(
        rank, par.world_size, init_addr, par.dist_timeout, config.model.device
    )
    return ParallelContext(
        rank,
        par.world_size,
        par.tp_size,
        par.ep_size,
        serving,
        par.enable_dp_attention,
        par.moe_dispatch,
    )


def load_agreed(
    config: EngineConfig, parallel: ParallelContext, model_config: ModelConfig | None = None
) -> DeepseekV3ForCausalLM:
    """Load this rank's shard; every rank learns whether all of them did (one all-reduce), so
    a bad shard fails the run here, with its reason on the rank that hit it."""
    placement = config.model
    model, error = None, None
    try:
        model = load_model(
            placement.model_path, placement.dtype, placement.device, parallel, model_config
        )
    except UserError as exc:
        error = exc
    failed = torch.tensor([0 if model is not None else 1])
    # on the start group (the default world): a slow rank's load is not a stuck rank
    dist.all_reduce(failed)
    if error is not None:
        raise error
    if int(failed):
        raise UserError(f"{int(failed)} rank(s) could not load their shard (see their log)")
    return model


def start_followers(
    config: EngineConfig, init_addr: str, main: FollowerMain, model_config: ModelConfig | None
) -> list[multiprocessing.Process]:
    """Spawn this node's follower ranks (every rank of the node but rank 0), each running
    `main(config, rank, init_addr, model_config)`."""
    par = config.parallel
    first = par.node_rank * par.ranks_per_node
    ranks = [r for r in range(first, first + par.ranks_per_node) if r != 0]
    context = multiprocessing.get_context("spawn")
    procs = []
    for rank in ranks:
        proc = context.Process(
            target=main,
            args=(config, rank, init_addr, model_config),
            name=f"mci-rank-{rank}",
            daemon=True,
        )
        proc.start()
        procs.append(proc)
    return procs


def load_sharded(
    config: EngineConfig, main: FollowerMain, model_config: ModelConfig | None = None
) -> tuple[ShardedModel | DeepseekV3ForCausalLM, ParallelContext, list[multiprocessing.Process]]:
    """Rank 0 (node 0): start this node's followers (`main`), join the run, load rank 0's
    shard. The model is a ShardedModel that drives the followers' shards, or under
    data-parallel attention rank 0's own model (a DataParallelCore drives the followers)."""
    par = config.parallel
    init_addr = par.dist_init_addr or f"127.0.0.1:{free_loopback_port()}"
    procs = start_followers(config, init_addr, main, model_config)
    try:
        parallel = join(config, 0, init_addr)
        model = load_agreed(config, parallel, model_config)
    except BaseException:
        for proc in procs:
            proc.kill()
        if dist.is_initialized():
            dist.destroy_process_group()
        raise
    log.info(
        "parallel run: %d ranks (tp %d, ep %d) over %d node(s)",
        par.world_size,
        par.tp_size,
        par.ep_size,
        par.nnodes,
    )
    if parallel.dp_attention:
        return model, parallel, procs
    return ShardedModel(model, parallel, par.dist_timeout), parallel, procs
