"""Rank 0 drives, the other ranks follow: every model call the engine makes runs on all ranks.

The engine (scheduler, sampler, outputs) lives on rank 0 only. It holds a `ShardedModel`, which
it calls exactly as it would call a whole model; each call of a method in `CALLS` is first
broadcast to the other ranks (`follow`), so all ranks run the same call on their shards with
the same arguments and the collectives inside line up. Every rank keeps its own latent KV cache
(replicated under tensor parallelism): rank 0 sends a marker in its place.

Invariant: between calls, every rank has run the same sequence of calls; every KV cache write
happens inside one (a forward, or `copy_cache_slot`).
"""

from __future__ import annotations

import logging
import time

import torch
import torch.distributed as dist

from mci.errors import EngineBroken
from mci.models.deepseek_v3 import DeepseekV3ForCausalLM
from mci.parallel.context import ParallelContext

log = logging.getLogger("mci")

CALLS = frozenset(
    {
        "forward",
        "logits",
        "mtp_hidden",
        "mtp_logits",
        "allocate_kv_cache",
        "pack_for_cpu",
        "warm_up_cpu_kernels",
        "set_batch_invariant",
        "copy_cache_slot",
        "keepalive",
    }
)
KV_CACHE = "<this rank's kv cache>"
CLOSE = "close"


class ShardedModel:
    """Rank 0's handle on a model split across the run's ranks; attributes other than the
    calls (cfg, dtype, mtp, batch_invariant, ...) are rank 0's shard's."""

    def __init__(self, model: DeepseekV3ForCausalLM, parallel: ParallelContext, timeout_s: float):
        self._model = model
        self._keepalive_s = timeout_s / 3
        self._parallel = parallel
        self._kv_cache: torch.Tensor | None = None
        self._closed = False
        self.broken = False  # a call failed: the other ranks may be dead, stuck or waiting
        self._last_call = time.monotonic()

    def keepalive(self) -> None:
        """Called while the engine idles: the other ranks wait for the next call inside a
        collective, which fails after --dist-timeout; a call every third of it keeps them."""
        if time.monotonic() - self._last_call > self._keepalive_s:
            self._call("keepalive")

    def __getattr__(self, name: str):
        if name in CALLS:
            return lambda *args: self._call(name, *args)
        return getattr(self._model, name)

    def __call__(self, *args):
        return self._call("forward", *args)

    def decode_logits(self, *args) -> None:
        """Never fused across ranks: the runner then calls `forward` and `logits`, which every
        rank runs (a rank deciding alone to fuse would skip the others' cache writes)."""
        return None

    def _call(self, name: str, *args):
        """Any failure here is fatal (EngineBroken): once rank 0 has broadcast a call, a
        rank that fails inside it leaves the others waiting in a collective, and the ranks
        can never line up again."""
        if self._closed:
            raise EngineBroken("the parallel run is closed")
        wire = tuple(KV_CACHE if a is self._kv_cache and a is not None else a for a in args)
        try:
            dist.broadcast_object_list([(name, wire)], src=0, group=self._parallel.group)
            result = getattr(self._model, name)(*args)
        except Exception as exc:
            self._closed = self.broken = True  # nothing more can be sent to the other ranks
            reason = str(exc).strip().splitlines()[0] if str(exc).strip() else repr(exc)
            raise EngineBroken(f"parallel run failed in {name}: {reason}") from exc
        if name == "allocate_kv_cache":
            self._kv_cache = result
        self._last_call = time.monotonic()
        return result

    def close(self) -> None:
        """Release the other ranks (they return from `follow`; nothing to send when the run is
        already broken) and leave the process group, so this process can start another run."""
        try:
            if not self._closed:
                self._closed = True
                dist.broadcast_object_list([(CLOSE, ())], src=0, group=self._parallel.group)
        finally:
            if dist.is_initialized():
                dist.destroy_process_group()


def follow(model: DeepseekV3ForCausalLM, parallel: ParallelContext) -> None:
    """A follower rank's life after loading: run each call rank 0 broadcasts, until it closes
    the run (or a collective fails: rank 0 is gone, or a peer timed out)."""
    kv_cache = None
    while True:
        box = [None]
        dist.broadcast_object_list(box, src=0, group=parallel.group)
        name, args = box[0]
        if name == CLOSE:
            return
        if name not in CALLS:
            raise RuntimeError(f"rank 0 asked for an unknown call {name!r}")
        args = tuple(kv_cache if isinstance(a, str) and a == KV_CACHE else a for a in args)
        result = getattr(model, name)(*args)
        if name == "allocate_kv_cache":
            kv_cache = result
