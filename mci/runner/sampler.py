"""Batched sampling: one call per step for every request that needs a token.

Order of operations per row: logit_bias, penalties (repetition over prompt+output,
frequency/presence over output), min-token EOS masking, the grammar's token mask (structured
output), temperature, top-k, min-p, top-p, then a draw. Rows are vectorised; the only
per-request Python is drawing each request's noise from its own random stream, seeded per
(request seed, output position), which makes seeded sampling independent of whatever else
shares the batch (exponential-race sampling: argmax(p / E), E ~ Exp(1), picks i with
probability p_i).

A row may sample a position past the request's known tokens (`SampleRow.assumed`): speculative
verification samples every drafted position in the same call, each as if the drafts before it
had been accepted (penalties, min_tokens and the random stream all see them); a row is used
only if they were.

Logprobs are of the model's raw distribution (before logit_bias, penalties and temperature), as vLLM
and OpenAI report them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from mci.core.batch import ScheduledItem, TokenLogprob
from mci.core.request import Request

SCORE_ROWS = 256  # prompt logprobs: rows of logits computed and scored at a time


@dataclass(frozen=True)
class SampleRow:
    """Sample the next token of `request` as if `assumed` had been appended to it."""

    request: Request
    assumed: tuple[int, ...] = ()

    @property
    def output_position(self) -> int:
        return len(self.request.output_ids) + len(self.assumed)

    def output_ids(self) -> list[int]:
        return self.request.output_ids + list(self.assumed)


@dataclass(frozen=True)
class Draws:
    """One token per row, and its logprobs where the request asked for them."""

    token_ids: list[int]
    logprobs: list[TokenLogprob | None]


def token_logprobs(
    logprobs: torch.Tensor, token_ids: torch.Tensor, num_top: int
) -> list[TokenLogprob]:
    """(logprob of token_ids[i], its `num_top` best alternatives) for each row of `logprobs`
    [N, vocab] (already log-softmaxed); the one shape for output and prompt logprobs."""
    chosen = logprobs.gather(1, token_ids[:, None]).squeeze(1).tolist()
    if not num_top:
        return [(lp, []) for lp in chosen]
    values, ids = logprobs.topk(num_top, dim=-1)
    alts = [list(zip(i, v)) for i, v in zip(ids.tolist(), values.tolist())]
    return list(zip(chosen, alts))


def _apply_logit_bias(logits: torch.Tensor, reqs: list[Request]) -> None:
    for i, r in enumerate(reqs):
        if r.params.logit_bias:
            logits[i].index_add_(0, r.bias_ids, r.bias_values.to(logits.dtype))


def _apply_penalties(logits: torch.Tensor, penalised: list[int], rows: list[SampleRow]) -> None:
    vocab = logits.shape[-1]
    for i in penalised:
        p = rows[i].request.params
        row = logits[i]
        if p.repetition_penalty != 1.0:
            seen = torch.zeros(vocab, dtype=torch.bool)
            seen[torch.tensor(rows[i].request.token_ids + list(rows[i].assumed))] = True
            penalised_row = torch.where(
                row > 0, row / p.repetition_penalty, row * p.repetition_penalty
            )
            row.copy_(torch.where(seen, penalised_row, row))
        output_ids = rows[i].output_ids()
        if (p.frequency_penalty or p.presence_penalty) and output_ids:
            counts = torch.bincount(torch.tensor(output_ids), minlength=vocab).float()
            row -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).float()


def _mask_stop_tokens_before_min(logits, rows: list[SampleRow], eos_ids: tuple[int, ...]) -> None:
    for i, row in enumerate(rows):
        p = row.request.params
        if row.output_position < p.min_new_tokens:
            banned = list(p.stop_token_ids) + ([] if p.ignore_eos else list(eos_ids))
            if banned:
                logits[i, banned] = float("-inf")


def _apply_grammars(logits: torch.Tensor, rows: list[SampleRow]) -> None:
    """Mask each constrained row to the tokens its grammar allows after the request's output
    plus the row's assumed drafts. A request's rows come in order of growing `assumed`
    (verification); the matcher accepts each draft on the way and rolls them all back after,
    so it ends where it began. A row after a draft the grammar forbids is left unmasked: it is
    never used (the target's token at that draft's row cannot be the forbidden draft); so is
    a row after a draft that completed the grammar (the request ends there)."""
    constrained = [i for i, r in enumerate(rows) if r.request.grammar is not None]
    if not constrained:
        return
    backend = rows[constrained[0]].request.grammar.backend
    bitmask = backend.new_bitmask(len(rows))
    masked = []
    i = 0
    while i < len(constrained):
        req = rows[constrained[i]].request
        matcher = req.grammar.matcher
        accepted, valid = 0, True
        while i < len(constrained) and rows[constrained[i]].request is req:
            row = constrained[i]
            assumed = rows[row].assumed
            while valid and accepted < len(assumed):
                valid = matcher.accept(assumed[accepted])
                accepted += valid
            # past a draft that ended the grammar (its stop token) the request is over too
            if valid and not matcher.is_terminated() and matcher.fill_mask(bitmask, row):
                masked.append(row)
            i += 1
        matcher.rollback(accepted)
    backend.apply_bitmask(logits, bitmask, masked)


def _argmax(logits: torch.Tensor) -> torch.Tensor:
    """Each row's first maximum (its first NaN where it has one), as `torch.argmax` picks;
    through numpy on the CPU, whose argmax takes ~2 us on a row of 8,192 where torch's takes
    ~9 (warm; more between the weight-streaming kernels)."""
    if logits.device.type == "cpu" and logits.dtype == torch.float32 and logits.dim() == 2:
        return torch.from_numpy(logits.numpy().argmax(-1).astype(np.int64, copy=False))
    return logits.argmax(dim=-1)


def _processed(row: SampleRow) -> bool:
    """Whether a row's logits may change before the draw (logit_bias, penalties, stop tokens
    masked before min_tokens, a grammar): a step of plain rows skips the copy and the passes
    (each a few microseconds between the weight-streaming kernels, which leave caches cold)."""
    return not row.request.logits_as_they_come(row.output_position)


def sample(
    logits: torch.Tensor, rows: list[SampleRow | Request], eos_ids: tuple[int, ...]
) -> Draws:
    """logits: [N, vocab] float32, row i for rows[i] (a request: its next token) -> one token
    per row."""
    n = logits.shape[0]
    rows = [r if isinstance(r, SampleRow) else SampleRow(r) for r in rows]
    reqs = [r.request for r in rows]
    want_lp = [r.params.logprobs is not None for r in reqs]
    raw_lp = torch.log_softmax(logits, dim=-1) if any(want_lp) else None
    if any(_processed(row) for row in rows):  # the caller's logits stay as they are
        logits = logits.clone()
        _apply_logit_bias(logits, reqs)
        penalised = [i for i, r in enumerate(reqs) if r.params.has_penalties]
        if penalised:
            _apply_penalties(logits, penalised, rows)
        _mask_stop_tokens_before_min(logits, rows, eos_ids)
        _apply_grammars(logits, rows)

    tokens = _argmax(logits)
    # greedy rows decided in Python: a single greedy stream's step spends three torch ops less
    # (each ~5-15 us between the weight-streaming kernels, whose passes leave caches cold)
    if not all(r.params.greedy for r in reqs):
        temps = torch.tensor([r.params.temperature for r in reqs], dtype=logits.dtype)
        greedy = temps == 0
        scaled = logits / torch.where(greedy, 1.0, temps)[:, None]
        top_k = torch.tensor([r.params.top_k for r in reqs])
        if bool((top_k > 0).any()):
            k = torch.where(top_k > 0, top_k, logits.shape[-1]).clamp(max=logits.shape[-1])
            kth = scaled.sort(dim=-1, descending=True).values.gather(1, (k - 1)[:, None])
            scaled = scaled.masked_fill(scaled < kth, float("-inf"))
        probs = scaled.softmax(dim=-1)
        min_p = torch.tensor([r.params.min_p for r in reqs], dtype=probs.dtype)
        if bool((min_p > 0).any()):
            probs = probs.masked_fill(
                probs < min_p[:, None] * probs.max(-1, keepdim=True).values, 0
            )
        top_p = torch.tensor([r.params.top_p for r in reqs], dtype=probs.dtype)
        if bool((top_p < 1).any()):
            sorted_p, order = probs.sort(dim=-1, descending=True)
            drop = (sorted_p.cumsum(-1) - sorted_p) >= top_p[:, None]
            probs = torch.zeros_like(probs).scatter_(-1, order, sorted_p.masked_fill(drop, 0))
        noise = torch.empty_like(probs)
        for i in range(n):
            if not greedy[i]:
                generator = reqs[i].generator_for_output(rows[i].output_position)
                noise[i].exponential_(generator=generator)
        drawn = (probs / noise).argmax(dim=-1)
        tokens = torch.where(greedy, tokens, drawn)

    token_list = tokens.tolist()
    logprobs: list = [None] * n
    if raw_lp is not None:
        for i, r in enumerate(reqs):
            if want_lp[i]:
                row = raw_lp[i : i + 1]
                logprobs[i] = token_logprobs(row, tokens[i : i + 1], r.params.logprobs)[0]
    return Draws(token_list, logprobs)


def score_prompts(
    logits_of: Callable[[slice], torch.Tensor], items: list[ScheduledItem]
) -> list[list[TokenLogprob]]:
    """Prompt logprobs of each scoring item. `logits_of(part)`: float32 logits of a slice of
    the scored rows (every item's `scored_positions` back to back; position j's row scores
    prompt token j + 1), asked for `SCORE_ROWS` rows at most, so a long prompt's scores never
    hold its whole [prompt, vocab] at once."""
    scores, row = [], 0
    for item in items:
        positions, req = item.scored_positions, item.request
        targets = torch.tensor(req.prompt_ids[positions.start + 1 : positions.stop + 1])
        scored: list[TokenLogprob] = []
        for start in range(0, len(positions), SCORE_ROWS):
            stop = min(start + SCORE_ROWS, len(positions))
            lp = torch.log_softmax(logits_of(slice(row + start, row + stop)), dim=-1)
            scored += token_logprobs(lp, targets[start:stop], req.params.prompt_logprobs)
        row += len(positions)
        scores.append(scored)
    return scores
