"""Sampling parameters of one request, validated once at creation (frozen afterwards)."""

from __future__ import annotations

from dataclasses import dataclass

from mci.errors import InvalidParameter
from mci.grammar.constraint import Constraint

MAX_N = 128  # samples per prompt; more is a mistake, not a workload


@dataclass(frozen=True)
class SamplingParams:
    """What to generate and how; names follow vLLM/SGLang.

    temperature 0 is greedy. Penalties: `repetition_penalty` (HF/vLLM style, over prompt and
    output tokens; 1 = off), `frequency_penalty` and `presence_penalty` (OpenAI style, over
    output tokens; 0 = off). `seed` makes sampling reproducible whatever else is batched.
    `logit_bias` adds a bias in [-100, 100] to a token's logit before anything else (OpenAI).
    `prompt_logprobs` (vLLM's name) scores every prompt token after the first with its
    logprob and that many top alternatives, computed in the prefill forward; with
    `max_new_tokens = 0` the request only scores its prompt.
    """

    max_new_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    min_new_tokens: int = 0
    n: int = 1
    logprobs: int | None = None  # number of top alternatives to return with each token
    prompt_logprobs: int | None = None  # the same for each prompt token (None = off)
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias) pairs
    skip_special_tokens: bool = True
    speculative: bool = True  # False: never draft for this request (speculation opt-out)
    constraint: Constraint | None = None  # what the output must match (structured output)
    # the constraint applies after this token is generated (a reasoning model's `</think>`)
    constraint_start_token_id: int | None = None
    # token healing (mci/grammar/healing.py): the prompt text backed off, which the output
    # starts with (its constraint says so) and which is not reported
    healed_text: str = ""

    def __post_init__(self):
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        # a dict or (id, bias) pairs -> hashable pairs, one per token id
        object.__setattr__(self, "logit_bias", tuple(dict(self.logit_bias).items()))
        checks = [  # (holds, parameter, message)
            (self.max_new_tokens >= 0, "max_new_tokens", "must be >= 0"),
            (self.temperature >= 0, "temperature", "must be >= 0"),
            (0 < self.top_p <= 1, "top_p", "must be in (0, 1]"),
            (0 <= self.top_k < 2**31, "top_k", "must be in [0, 2^31) (0 disables it)"),
            (0 <= self.min_p <= 1, "min_p", "must be in [0, 1]"),
            (self.repetition_penalty > 0, "repetition_penalty", "must be > 0"),
            (-2 <= self.frequency_penalty <= 2, "frequency_penalty", "must be in [-2, 2]"),
            (-2 <= self.presence_penalty <= 2, "presence_penalty", "must be in [-2, 2]"),
            (self.min_new_tokens >= 0, "min_new_tokens", "must be >= 0"),
            (1 <= self.n <= MAX_N, "n", f"must be in [1, {MAX_N}]"),
            (self.seed is None or 0 <= self.seed < 2**63, "seed", "must be in [0, 2^63)"),
            (
                all(
                    isinstance(t, int) and not isinstance(t, bool) and t >= 0
                    for t in self.stop_token_ids
                ),
                "stop_token_ids",
                "must be non-negative integers",
            ),
            (self.logprobs is None or 0 <= self.logprobs <= 20, "logprobs", "must be in [0, 20]"),
            (
                self.prompt_logprobs is None or 0 <= self.prompt_logprobs <= 20,
                "prompt_logprobs",
                "must be in [0, 20]",
            ),
            (
                all(
                    isinstance(t, int) and not isinstance(t, bool) and t >= 0
                    for t, _ in self.logit_bias
                ),
                "logit_bias",
                "keys must be non-negative token ids",
            ),
            (
                all(-100 <= b <= 100 for _, b in self.logit_bias),
                "logit_bias",
                "values must be in [-100, 100]",
            ),
            (all(isinstance(s, str) and s for s in self.stop), "stop", "must be non-empty strings"),
            (
                not self.healed_text or self.constraint is not None,
                "healed_text",
                "needs its healing constraint",
            ),
            (
                self.constraint_start_token_id is None or self.constraint is not None,
                "constraint_start_token_id",
                "needs a constraint",
            ),
        ]
        for ok, param, message in checks:
            if not ok:
                raise InvalidParameter.named(param, "{param} " + message)

    def check_vocab(self, vocab_size: int) -> None:
        """Token ids named here must exist in the model: checked before a request is accepted,
        since an out-of-range id would fail the whole batch's step."""
        if any(t >= vocab_size for t in self.stop_token_ids):
            raise InvalidParameter.named(
                "stop_token_ids", f"{{param}} must be in [0, {vocab_size})"
            )
        start = self.constraint_start_token_id
        if start is not None and not 0 <= start < vocab_size:
            raise InvalidParameter.named(
                "constraint_start_token_id", f"{{param}} must be in [0, {vocab_size})"
            )
        if any(t >= vocab_size for t, _ in self.logit_bias):
            raise InvalidParameter.named(
                "logit_bias", f"{{param}} token ids must be in [0, {vocab_size})"
            )

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def has_penalties(self) -> bool:
        return (
            self.repetition_penalty != 1.0
            or self.frequency_penalty != 0.0
            or self.presence_penalty != 0.0
        )
