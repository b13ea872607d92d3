"""The engine's memory, part by part, bounded by its configuration: logged when it starts (so
`mci serve` states its expected peak), exported (`/internal/state`, `/metrics`), and what the
soak (scripts/chaos.py) holds the engine's RSS to.

* **weights**, as loaded, and the **KV pool** (slots x bytes per token, MTP scratch included):
  allocated once at start.
* **oneDNN kernels**. oneDNN JIT-compiles a kernel per matmul shape *and thread count* and
  keeps it (~0.55 MB each, measured: docs/reliability.md). The engine's matmuls run at
  bucketed row counts (layers/linear.py), so a step of up to `max_rows` rows meets at most
  `kernels_per_level` shapes; the thread governor uses at most `levels` thread counts
  (engine/cpu_threads.py). The cache's capacity is set to hold their product
  (`ONEDNN_PRIMITIVE_CACHE_CAPACITY`, in entries, unless the operator set it): oneDNN drops
  the least recently used entry beyond it, so this part never grows past `kernel_bytes`. The warm-up
  compiles every level's set at start, so the common shapes never land mid-traffic; those
  it leaves to first use are attention's expanded keys past a step's rows (long contexts),
  inside the same bound. A kernel's size is measured at warm-up (RSS over kernels compiled).
* **step transients**, freed when the step ends (and kept by malloc for the next one, see
  process_tuning.py): the logits of the rows a step samples (`logit_rows` x vocab float32,
  `SAMPLER_COPIES` of them alive in the sampler), prompt logprobs scored `SCORE_ROWS` rows at
  a time (runner/model_runner.py), and activations of up to `max_rows` rows (an estimate:
  `ACTIVATION_LIVE` tensors of the widest row alive at once, plus one prompt's expanded keys
  and values over the context).

What is not planned is counted as it is (Python objects, the radix tree's nodes, the
allocator's free chunks): `/internal/state`'s memory section shows each (process_memory.py).
"""

from __future__ import annotations

import logging
import os
from contextlib import contextmanager
from dataclasses import asdict, dataclass

from mci.model_config import ModelConfig
from mci.runner.sampler import SCORE_ROWS

log = logging.getLogger("mci")

KERNEL_BYTES_ESTIMATE = 600_000  # a oneDNN kernel (RSS) when the warm-up did not measure one
KERNEL_CACHE_ENV = "ONEDNN_PRIMITIVE_CACHE_CAPACITY"
# oneDNN's cache counts entries, and a matmul kernel takes two (its primitive and its JIT
# kernel; measured: 1,200 inner products needed a capacity of 2,400 to keep the first). The
# capacity is set to 3 entries a kernel (room to spare), so at most capacity / 2 are kept.
ENTRIES_PER_KERNEL = 2
ENTRIES_SET_PER_KERNEL = 3
SAMPLER_COPIES = 8  # float32 [rows, vocab] tensors alive at once in runner/sampler.py
ACTIVATION_LIVE = 4  # activations of the widest row alive at once, float32


@dataclass(frozen=True)
class MemoryPlan:
    """Bytes each part may take at most (see the module docstring)."""

    weight_bytes: int
    kv_pool_bytes: int
    kernel_capacity: int  # oneDNN kernels kept at most
    kernel_bytes_each: int  # measured at warm-up, else KERNEL_BYTES_ESTIMATE
    logits_bytes: int
    activation_bytes: int

    @property
    def kernel_bytes(self) -> int:
        return self.kernel_capacity * self.kernel_bytes_each

    @property
    def transient_bytes(self) -> int:
        return self.logits_bytes + self.activation_bytes

    @property
    def total_bytes(self) -> int:
        return self.weight_bytes + self.kv_pool_bytes + self.kernel_bytes + self.transient_bytes

    def as_dict(self) -> dict:
        return {
            **asdict(self),
            "kernel_bytes": self.kernel_bytes,
            "transient_bytes": self.transient_bytes,
            "total_bytes": self.total_bytes,
        }

    def log(self) -> None:
        mb = 1e6
        log.info(
            "memory plan: weights %.0f MB + KV pool %.0f MB + oneDNN kernels <= %.0f MB (%d x "
            "%.2f MB) + step transients <= %.0f MB = %.0f MB at most, plus the process's "
            "own (Python, torch: ~250 MB)",
            self.weight_bytes / mb,
            self.kv_pool_bytes / mb,
            self.kernel_bytes / mb,
            self.kernel_capacity,
            self.kernel_bytes_each / mb,
            self.transient_bytes / mb,
            self.total_bytes / mb,
        )


def step_transient_bytes(
    cfg: ModelConfig, max_rows: int, logit_rows: int, context_length: int
) -> tuple[int, int]:
    """(logits, activations) bytes a step of up to `max_rows` tokens, `logit_rows` of them
    sampled, may hold at once (see the module docstring)."""
    vocab_row = cfg.vocab_size * 4
    logits = logit_rows * vocab_row * SAMPLER_COPIES + SCORE_ROWS * vocab_row * 3
    widest = max(
        cfg.hidden_size,
        2 * cfg.intermediate_size,
        2 * cfg.moe_intermediate_size * (cfg.num_experts_per_tok + cfg.n_shared_experts),
        cfg.num_attention_heads * (cfg.qk_head_dim + cfg.qk_nope_head_dim + 2 * cfg.v_head_dim),
    )
    keys = context_length * cfg.num_attention_heads * (cfg.qk_nope_head_dim + cfg.v_head_dim)
    activations = max_rows * widest * 4 * ACTIVATION_LIVE + keys * 4
    return logits, activations


@contextmanager
def kernel_cache_capacity(kernels: int):
    """Size oneDNN's kernel cache for `kernels` kernels for the oneDNN work started inside
    (the engine's first: oneDNN reads the setting once per process, at its first kernel; in a
    process where oneDNN already ran, the capacity it read then stays). An operator's own
    setting wins. The variable is set only while inside, so processes started later (a test's
    servers, a router's replicas) size their own. Yields how many kernels it keeps at most."""
    ours = KERNEL_CACHE_ENV not in os.environ
    if ours:
        os.environ[KERNEL_CACHE_ENV] = str(max(1, kernels * ENTRIES_SET_PER_KERNEL))
    value = os.environ[KERNEL_CACHE_ENV]
    # oneDNN ignores a value that is not a number and keeps its default
    entries = int(value) if value.strip().isdigit() else 1024
    try:
        yield max(1, entries // ENTRIES_PER_KERNEL)
    finally:
        if ours:
            os.environ.pop(KERNEL_CACHE_ENV, None)
