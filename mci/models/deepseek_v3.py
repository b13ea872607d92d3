"""DeepSeek-V3 for causal LM: MLA attention, dense then DeepSeekMoE feed-forward, MTP heads.

Module names mirror the checkpoint's tensor names (see `mci.models.layout`), except that routed
experts are stacked per projection (`mlp.experts.gate_proj.weight[e]`) and the MTP modules,
stored as `model.layers.{num_hidden_layers + k}`, live at `mtp.{k}`.

The forward pass works on a flat batch of new tokens ([T]) from any number of sequences; the
attention metadata says where each sits in the latent KV cache (`mci.layers.attention_metadata`).
"""

from __future__ import annotations

import torch
from torch import nn

from mci.kernels import cpu_kernels
from mci.kernels.cpu_decoder import DecoderSpans, StepEnds, blas_sgemm
from mci.layers.attention import (
    ATTENTION_KEY_MULTIPLE,
    CASCADE_MIN_PREFIX,
    EVERY_ROW,
    IN_PLACE_QUERY_ROWS,
    MultiHeadLatentAttention,
    choose_absorbed,
    decode_group,
)
from mci.layers.attention_metadata import AttentionLayout, AttentionMetadata
from mci.layers.embedding import VocabEmbedding, VocabHead
from mci.layers.linear import Linear, bf16_matmuls_supported, bucket_sizes
from mci.layers.moe import MoE, RoutedExperts, TopKRouter
from mci.layers.norm import RMSNorm
from mci.layers.rotary import RotaryEmbedding
from mci.model_config import ModelConfig
from mci.models.decoder_layer import DecoderLayer
from mci.models.mtp import MTPLayer
from mci.parallel.context import ParallelContext


class DeepseekV3Backbone(nn.Module):
    """Embeddings, decoder layers and the final norm (named `model` like the checkpoint)."""

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, parallel: ParallelContext):
        super().__init__()
        self.embed_tokens = VocabEmbedding(cfg.vocab_size, cfg.hidden_size, dtype, parallel)
        self.layers = nn.ModuleList(
            DecoderLayer(cfg, cfg.is_moe_layer(i), dtype, parallel)
            for i in range(cfg.num_hidden_layers)
        )
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)


class DeepseekV3ForCausalLM(nn.Module):
    """The full model. `forward` returns final-norm hidden states; `logits` applies lm_head.

    KV cache layout: one tensor [rows, num_slots, kv_lora_rank + qk_rope_head_dim]; layer i of
    the main model uses row i, MTP module k uses row num_hidden_layers + k (when allocated).
    """

    def __init__(
        self,
        cfg: ModelConfig,
        dtype: torch.dtype,
        with_mtp: bool = True,
        parallel: ParallelContext | None = None,
    ):
        """`parallel`: this rank's part of a tensor/expert-parallel run (mci/parallel/);
        None: the whole model in one process."""
        super().__init__()
        self.cfg = cfg
        self.dtype = dtype
        self.parallel = parallel = parallel or ParallelContext.single()
        self.model = DeepseekV3Backbone(cfg, dtype, parallel)
        self.lm_head = VocabHead(cfg.hidden_size, cfg.vocab_size, dtype, parallel)  # never FP8
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.rotary = RotaryEmbedding(cfg.rope, cfg.qk_rope_head_dim)
        num_mtp = cfg.num_mtp_layers if with_mtp else 0
        self.mtp = nn.ModuleList(MTPLayer(cfg, dtype, parallel) for _ in range(num_mtp))
        self.batch_invariant = False  # see `set_batch_invariant`
        self.skinny_kernels = True  # `pack_for_cpu`'s choice, kept by `set_batch_invariant`
        self.cpu_kernels: cpu_kernels.CpuKernels | None = None  # mci/kernels/, where they run
        # rows -> the decoder layers' kernel spans, or None (`_decode_on_kernels`); emptied
        # whenever the kernels or the batch-invariant mode change which path a layer takes
        self._kernel_spans: dict[int, DecoderSpans | None] = {}
        self._layout: AttentionLayout | None = None  # `attention_layout`, once worked out

    @property
    def num_cache_layers(self) -> int:
        """Latent rows per token with the MTP modules' rows (see `allocate_kv_cache`)."""
        return self.cfg.num_hidden_layers + len(self.mtp)

    def pack_for_cpu(self, skinny_kernels: bool = True) -> int:
        """Pack every unquantised linear weight for oneDNN (see layers/linear.py) before
        serving on the CPU, and with `skinny_kernels` use mci/kernels/ where they run (matmuls
        of a few rows, decode attention, RMSNorm); returns how many layers were packed.
        Idempotent."""
        self.skinny_kernels = skinny_kernels
        self._kernel_spans.clear()
        self._layout = None
        packed = sum(
            m.pack_for_cpu(skinny_kernels) for m in self.modules() if isinstance(m, Linear)
        )
        kernels = cpu_kernels.load() if skinny_kernels and packed else None
        self.cpu_kernels = kernels
        for module in self.modules():
            if isinstance(module, RMSNorm):
                module.use_kernels(kernels)
            if isinstance(module, RoutedExperts) and module.gate_up_proj.matvec is not None:
                module.pack_for_cpu(kernels)
        for module in self.modules():  # once every weight is packed
            if isinstance(module, MoE):
                module.pack_shared_for_cpu(kernels)
        return packed

    def warm_up_cpu_kernels(self, max_rows: int, max_logit_rows: int) -> int:
        """Call every oneDNN matmul shape a step of up to `max_rows` tokens (and up to
        `max_logit_rows` rows of logits) can meet once: oneDNN JIT-compiles a kernel per shape
        (1-9 ms each; see layers/linear.py), which otherwise lands on the first requests of
        each size (measured: a fresh server's first shared-prefix burst took 1.8x as long as
        its third). Packed linears at every bucketed row count oneDNN takes (one layer per
        weight shape: kernels are keyed by shape, not weights), the absorbed attention's
        per-head matmuls at the same counts, and the grouped experts' batched matmuls at
        every capacity. Returns the number of calls."""
        calls = self.lm_head.warm_up(max_logit_rows)
        seen = {(self.lm_head.out_features, self.lm_head.in_features)}
        for module in self.modules():
            if isinstance(module, Linear) and module._packed is not None:
                key = (module.out_features, module.in_features)
                if key not in seen:
                    seen.add(key)
                    calls += module.warm_up(max_rows)
        for module in self.modules():
            if isinstance(module, MultiHeadLatentAttention):
                calls += module.warm_up(max_rows)
                break
        for module in self.modules():
            if isinstance(module, RoutedExperts):
                calls += module.warm_up()
                break
        return calls

    def kernel_shapes(self, max_rows: int) -> int:
        """At most how many oneDNN kernels matmuls of up to `max_rows` rows (a step's tokens,
        or the keys attention expands over a context) compile at one thread count: every
        bucketed row count for each linear weight shape, the absorbed attention's two per-head
        matmuls and the grouped experts' two, plus a weight reorder per shape."""
        shapes = {(m.out_features, m.in_features) for m in self.modules() if isinstance(m, Linear)}
        rows = max(max_rows, RoutedExperts.GROUPED_MAX_ROWS)
        return len(bucket_sizes(rows)) * (len(shapes) + 4) + len(shapes)

    def set_batch_invariant(self, enabled: bool) -> None:
        """With `enabled`, compute every token's logits bit-identically whatever else shares
        its step, the chunk its prompt came in, or whether its prefix was cached
        (`--deterministic`):

        * every matmul runs exactly `linear.BATCH_INVARIANT_ROWS` rows per call (see `fixed_rows` in
          layers/linear.py): the linears, the routers (through oneDNN's float32 matmul: aten's
          picks another kernel for one row than for several), the absorbed attention's
          batched matmuls; the routed experts always loop (the grouped batched matmul is
          another kernel than the looped one);
        * attention always takes the absorbed path (the expanded one rounds differently): with
          the CPU kernels every query row attends alone through the decode kernel (one order
          of sums per row, whatever the step; `attention_layout`), else through SDPA over
          keys padded to a multiple of `ATTENTION_KEY_MULTIPLE` (SDPA's CPU kernel sums a key
          tail shorter than its vector width in another order; on an AMD CPU it was seen to
          round a row differently with the chunk's query count even so);
        * everything else is already row-wise: norms, rope, the residual stream, the
          sampler.

        bf16 on the CPU only: that is where each claim above is measured and tested. The mode
        belongs to the model: engines sharing one model object share it."""
        if enabled and (self.dtype != torch.bfloat16 or self.lm_head.weight.device.type != "cpu"):
            raise ValueError("batch-invariant inference is implemented for bfloat16 on the CPU")
        if enabled and not bf16_matmuls_supported():
            raise ValueError(
                "batch-invariant inference needs a CPU oneDNN runs bf16 matmuls on "
                "(AVX-512 BW/VL/DQ or AVX-NE-CONVERT); this one has neither"
            )
        if enabled:
            self.pack_for_cpu(self.skinny_kernels)
        for module in self.modules():
            if isinstance(module, (Linear, TopKRouter, RoutedExperts, MultiHeadLatentAttention)):
                module.set_batch_invariant(enabled)
        self.batch_invariant = enabled
        self._kernel_spans.clear()
        self._layout = None

    @property
    def attention_layout(self) -> AttentionLayout:
        """How a step's attention is grouped (see `AttentionMetadata`): for batch invariance,
        every row alone in the decode group (or keys padded, without the kernels); with the
        CPU kernels, sequences of a few new tokens (a speculative
        verification's k + 1) attend in the decode group, read in place; on the CPU, a shared
        cached prefix attends once (cascade attention). Worked out once (every step asks), again
        after `pack_for_cpu` or `set_batch_invariant`, which change it."""
        if self._layout is None:
            self._layout = self._attention_layout()
        return self._layout

    def _attention_layout(self) -> AttentionLayout:
        in_place = self.cpu_kernels is not None and self.dtype == torch.bfloat16
        if self.batch_invariant:  # every row alone in the decode kernel, else padded SDPA
            attention = self.model.layers[0].self_attn
            if in_place and attention.kv_b_proj.matvec is not None:  # the kernels run it
                return AttentionLayout(row_query_max=EVERY_ROW)
            return AttentionLayout(key_multiple=ATTENTION_KEY_MULTIPLE)
        cpu = self.lm_head.weight.device.type == "cpu"  # the cascade's flash kernel is the CPU's
        return AttentionLayout(
            row_query_max=IN_PLACE_QUERY_ROWS if in_place else 1,
            cascade_min_prefix=CASCADE_MIN_PREFIX if cpu else 0,
        )

    def weight_bytes(self) -> int:
        return sum(p.numel() * p.element_size() for p in self.parameters())

    def allocate_kv_cache(
        self, num_slots: int, device: torch.device | str = "cpu", with_mtp: bool = True
    ) -> torch.Tensor:
        """Zeroed latent cache for `num_slots` tokens: [rows, num_slots, latent_dim], one row
        per main layer and, with `with_mtp`, one per MTP module (an engine that never runs them
        leaves theirs out)."""
        rows = self.num_cache_layers if with_mtp else self.cfg.num_hidden_layers
        shape = (rows, num_slots, self.cfg.kv_latent_dim)
        return torch.zeros(shape, dtype=self.dtype, device=device)

    def idle_forward(self) -> None:
        """A step with no tokens under data-parallel attention: every MoE layer takes part in
        its token exchange, as a rank with tokens does (mci/parallel/dispatch.py)."""
        for layer in self.model.layers:
            if isinstance(layer.mlp, MoE):
                layer.mlp.idle()

    def keepalive(self) -> None:
        """Nothing for one process (a parallel run's handle pings its other ranks)."""

    def copy_cache_slot(self, kv_cache: torch.Tensor, row: int, dst: int, src: int) -> None:
        """Copy slot `src`'s latent to slot `dst` in cache row `row` (the engine's only cache
        write outside a forward: a model method, so a parallel run replicates it on every
        rank)."""
        kv_cache[row, dst] = kv_cache[row, src]

    def rope_for(self, meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin [T, rope/2] for the step's positions, computed once and shared by all layers.

        Kept in float32 whatever the model dtype: rotating in float32 and rounding once is
        measurably closer to the fp32 reference than bf16 tables, and the tensors are tiny."""
        return self.rotary.cos_sin(meta.positions, meta.max_position)

    def resolve_path(self, meta: AttentionMetadata, attention_path: str) -> tuple[bool, ...]:
        """Whether each attention group of the step takes the absorbed path: by cost under
        "auto", or forced ("absorbed" / "expanded", for tests). Decided once per step."""
        if attention_path == "auto" and self.batch_invariant:
            return (True,) * len(meta.groups)  # one path, whatever the step
        if attention_path == "auto":
            return tuple(choose_absorbed(self.cfg, group) for group in meta.groups)
        if attention_path not in ("absorbed", "expanded"):
            raise ValueError(
                f"attention_path must be auto|absorbed|expanded, got {attention_path!r}"
            )
        return (attention_path == "absorbed",) * len(meta.groups)

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,
        meta: AttentionMetadata,
        kv_cache: torch.Tensor,
        attention_path: str = "auto",
    ) -> torch.Tensor:
        """input_ids: [T] -> final-norm hidden states [T, hidden]; writes T latents per layer."""
        return self.hidden_states(input_ids, meta, kv_cache, attention_path)

    def hidden_states(self, input_ids, meta, kv_cache, attention_path: str = "auto"):
        """`forward` without inference mode, so autograd can follow it (training)."""
        absorbed = self.resolve_path(meta, attention_path)
        spans = self._decode_on_kernels(input_ids.shape[0], meta, absorbed, kv_cache)
        if spans is not None and spans.runs_whole():  # embedding to final norm in one C call
            return self._whole_step(spans, input_ids, meta, kv_cache)
        rope = self.rope_for(meta)
        x = self.model.embed_tokens(input_ids).float()  # the residual stream is float32
        if spans is not None:  # every layer's kernel calls, bound once; x is updated in place
            group = meta.groups[0]
            x = spans(x, *rope, kv_cache, meta.write_slots, group.kv_slots, group.lengths)
        else:
            for i, layer in enumerate(self.model.layers):
                x = layer(x, meta, rope, kv_cache[i], absorbed)
        return self.model.norm(x)  # in the model dtype, for lm_head and the MTP modules

    def _decode_on_kernels(self, rows: int, meta, absorbed, kv_cache) -> DecoderSpans | None:
        """The decoder layers in a few kernel calls (cpu_decoder.py) for a step of `rows` rows
        when every layer runs wholly on the CPU kernels in it (made once per row count), else
        None."""
        if (
            self.cpu_kernels is None
            or kv_cache.dtype != torch.bfloat16
            or not kv_cache.is_contiguous()
            or not torch.is_inference_mode_enabled()
            or decode_group(meta, absorbed, rows) is None
            or meta.groups[0].kv_slots.stride(1) != 1
        ):
            return None
        if rows not in self._kernel_spans:
            layers = [layer.decode_on_kernels(rows) for layer in self.model.layers]
            spans = None
            if None not in layers:
                spans = DecoderSpans(self.cpu_kernels, layers, rows, self._step_ends(rows))
            self._kernel_spans[rows] = spans
        return self._kernel_spans[rows]

    def _step_ends(self, rows: int) -> StepEnds | None:
        """What the decoder spans need to run a whole step of `rows` rows in C (the
        embedding, the final norm, BLAS's sgemm for the routers, and the LM head where its
        `logits` would run on the kernels too), or None where some part is not as they read
        it."""
        embed, norm, sgemm = self.model.embed_tokens, self.model.norm, blas_sgemm()
        if (
            sgemm is None
            or embed.parallel.tp_size != 1
            or embed.weight.dtype != torch.bfloat16
            or not embed.weight.is_contiguous()
            or norm.kernels is None
            or self.rotary.cos_table.dtype != torch.float32
        ):
            return None
        head = self.lm_head  # as its forward takes the kernels: bf16, at this row count
        on_kernels = head.kernel is not None and not head.kernel.fp8 and head.skinny(rows)
        whole = on_kernels and head.parallel.tp_size == 1
        ends = (embed.weight.detach(), norm.weight.detach(), norm.eps, sgemm)
        return StepEnds(*ends, head.kernel if whole else None)

    def decode_logits(
        self, input_ids: torch.Tensor, meta: AttentionMetadata, kv_cache: torch.Tensor
    ) -> torch.Tensor | None:
        """`logits(forward(...))` of a step whose every row samples, in one kernel call where
        the whole step runs on the kernels (the decoder spans with the LM head bound; in
        inference mode, which the caller enters: no decorator on this per-step path); None
        (nothing run) elsewhere: the caller runs `forward`, then `logits`. Writes the step's
        latents as `forward` does."""
        spans = self._spans_with_head(input_ids.shape[0], meta, kv_cache)
        if spans is None:
            return None
        _, logits = self._whole_step(spans, input_ids, meta, kv_cache, logits=True)
        return logits

    def _spans_with_head(self, rows: int, meta, kv_cache) -> DecoderSpans | None:
        """The decoder spans of a step of `rows` rows where it runs whole on the kernels,
        the LM head with it (`decode_logits`, `decode_greedy`); else None."""
        absorbed = self.resolve_path(meta, "auto")
        spans = self._decode_on_kernels(rows, meta, absorbed, kv_cache)
        if spans is None or not spans.runs_whole() or spans.ends.head is None:
            return None
        return spans

    def decode_greedy(
        self,
        input_ids: torch.Tensor,
        meta: AttentionMetadata,
        kv_cache: torch.Tensor,
        slots_ahead: torch.Tensor,
        steps: int,
        stop_ids: tuple[int, ...] = (),
        wake_fd: int | None = None,
        budget_s: float = 0.0,
    ) -> torch.Tensor | None:
        """Up to `steps` decode steps from this one (`decode_logits`' step), in one kernel call
        where that step runs whole on the kernels, each row's next input its greedy token
        (`DecoderSpans.greedy_steps`: it ends early after a step that drew one of `stop_ids`,
        once `wake_fd` is readable, or past `budget_s`). `slots_ahead` [rows, >= context +
        steps - 1]: each row's context slots, then those of its next positions. -> int64
        [steps run, rows], the tokens `sample` draws at temperature 0 from as many
        `decode_logits` steps, the same latents written; None (nothing run) elsewhere."""
        spans = self._spans_with_head(input_ids.shape[0], meta, kv_cache)
        if spans is None:
            return None
        group = meta.groups[0]
        tables = self.rotary.tables(meta.max_position + steps - 1)
        return spans.greedy_steps(
            input_ids, meta.positions, *tables, kv_cache, meta.write_slots, slots_ahead,
            group.lengths, steps, stop_ids, wake_fd, budget_s,
        )  # fmt: skip

    def _whole_step(self, spans: DecoderSpans, input_ids, meta, kv_cache, logits=False):
        """`spans.step` on the step's ids, positions, rope tables and decode group's slots."""
        group, tables = meta.groups[0], self.rotary.tables(meta.max_position)
        slots = (meta.write_slots, group.kv_slots, group.lengths)
        return spans.step(input_ids, meta.positions, *tables, kv_cache, *slots, logits=logits)

    @torch.inference_mode()
    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden: [N, hidden] -> float32 logits [N, vocab]."""
        return self.lm_head.logits(hidden)

    @torch.inference_mode()
    def mtp_forward(
        self,
        k: int,
        next_ids: torch.Tensor,
        hidden: torch.Tensor,
        meta: AttentionMetadata,
        kv_cache: torch.Tensor,
        attention_path: str = "auto",
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Run MTP module k: hidden of position i plus token i+1 -> (hidden', logits for i+2).

        next_ids: [T], hidden: [T, hidden] (final-norm states of the previous depth, as vLLM and
        SGLang feed them); `meta` has the same positions as the hidden states.
        """
        out = self.mtp_hidden(k, next_ids, hidden, meta, kv_cache, attention_path)
        return out.to(self.dtype), self.mtp_logits(k, out)

    @torch.inference_mode()
    def mtp_hidden(
        self,
        k: int,
        next_ids: torch.Tensor,
        hidden: torch.Tensor,
        meta: AttentionMetadata,
        kv_cache: torch.Tensor,
        attention_path: str = "auto",
    ) -> torch.Tensor:
        """`mtp_forward` without the logits: the block's output, float32 [T, hidden] (a drafter
        needs logits for a few rows only); writes the module's latent cache row."""
        if not 0 <= k < len(self.mtp):
            raise ValueError(f"MTP module {k} is not loaded (this model has {len(self.mtp)})")
        absorbed = self.resolve_path(meta, attention_path)
        layer = self.mtp[k]
        cache_row = kv_cache[self.cfg.num_hidden_layers + k]
        return layer(next_ids, hidden, meta, self.rope_for(meta), cache_row, absorbed)

    @torch.inference_mode()
    def mtp_logits(self, k: int, hidden: torch.Tensor) -> torch.Tensor:
        """MTP module k's logits (float32 [N, vocab]) for rows of `mtp_hidden`'s output."""
        return self.mtp[k].logits(hidden)
