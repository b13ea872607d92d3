"""Speculative decoding's settings: the drafter, how many tokens it drafts, when it stays off."""

from __future__ import annotations

from dataclasses import dataclass

from mci.config_fields import option
from mci.errors import UserError

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

    speculative_algorithm: str | None = option(
        None,
        "draft with the checkpoint's MTP module (mtp; SGLang's NEXTN/EAGLE are accepted) or "
        "by prompt lookup (ngram, any model); off when not given",
        ["mtp", "ngram", *MTP_ALIASES],
    )
    speculative_num_steps: int | None = option(
        None, "draft tokens per request per step, k (default: mtp 2, ngram 5; measured)"
    )
    speculative_num_draft_tokens: int | None = option(
        None, "tokens verified per request per step: num_steps + 1 (SGLang's flag)"
    )
    speculative_ngram_max_window: int = option(
        3, "ngram: longest suffix looked up in the request's earlier tokens"
    )
    speculative_ngram_min_window: int = option(1, "ngram: shortest suffix looked up")
    speculative_disable_by_batch_size: int | None = option(
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
