"""`GrammarBackend` on xgrammar (PyPI `xgrammar`): token masks from a pushdown automaton compiled
once per constraint for the model's tokenizer, on the CPU."""

from __future__ import annotations

import json
import re

import torch
import xgrammar as xg

from mci.errors import InvalidParameter
from mci.grammar.constraint import Constraint, ebnf_string
from mci.grammar.utf8_classes import exclude_surrogates
from mci.tokenizer import TextTokenizer

BOUNDED_CHAR = r"[^\"\\\r\n]"  # as xgrammar prints it
BOUNDED_CHAR_JSON = r"[^\0-\x1f\"\\]"
# The API field each constraint kind came from, for a 400's `param`
PARAM_OF_KIND = {
    "json": "response_format",
    "json_schema": "response_format",
    "regex": "regex",
    "ebnf": "ebnf",
    "choice": "choice",
    "tagged_json": "tools",
}


def _grammar_text(constraint: Constraint) -> str:
    """The constraint as an xgrammar EBNF grammar, printed so its classes can be rewritten."""
    kind, spec = constraint.kind, constraint.spec
    if kind == "json":
        return str(xg.Grammar.builtin_json_grammar())
    if kind == "json_schema":
        return _json_schema_text(spec)
    if kind == "tagged_json":
        framed = [
            xg.Grammar.concat(
                _literal(begin),
                xg.Grammar.from_ebnf(_json_schema_text(json.dumps(schema))),
                _literal(end),
            )
            for begin, schema, end in constraint.options
        ]
        if not framed:
            raise ValueError("tagged_json needs at least one alternative")
        return str(framed[0] if len(framed) == 1 else xg.Grammar.union(*framed))
    if kind == "regex":
        return str(xg.Grammar.from_regex(spec))
    if kind == "ebnf":
        return str(xg.Grammar.from_ebnf(spec))
    options = constraint.options
    if not options or not all(isinstance(o, str) and o for o in options):
        raise ValueError("choice must be a non-empty list of non-empty strings")
    return "root ::= " + " | ".join(ebnf_string(o) for o in options)


def _json_schema_text(schema: str) -> str:
    grammar = str(xg.Grammar.from_json_schema(schema, any_whitespace=False))
    # xgrammar 0.2.9 writes length-bounded strings (maxLength, minLength) as repeats of
    # [^"\\\r\n], which admits raw control characters: not JSON. Exclude them as its unbounded
    # string rule does (escapes stay out: valid).
    return grammar.replace(BOUNDED_CHAR, BOUNDED_CHAR_JSON)


def _literal(text: str) -> xg.Grammar:
    return xg.Grammar.from_ebnf(f"root ::= {ebnf_string(text)}")


class XGrammarMatcher:
    def __init__(self, matcher: xg.GrammarMatcher):
        self._m = matcher

    def fill_mask(self, bitmask: torch.Tensor, row: int) -> bool:
        return self._m.fill_next_token_bitmask(bitmask, row)

    def accept(self, token: int) -> bool:
        return self._m.accept_token(token)

    def rollback(self, num_tokens: int) -> None:
        if num_tokens:
            self._m.rollback(num_tokens)

    def is_terminated(self) -> bool:
        return self._m.is_terminated()

    def is_completed(self) -> bool:
        return self._m.is_completed()

    def find_jump_forward_string(self) -> str:
        return self._m.find_jump_forward_string()


class XGrammarBackend:
    """One per tokenizer and model vocabulary; `compile` is thread-safe (xgrammar's compiler)."""

    def __init__(self, tokenizer: TextTokenizer, vocab_size: int, stop_ids: tuple[int, ...]):
        backend = tokenizer.backend
        vocab = [""] * vocab_size
        for token, idx in backend.get_vocab(with_added_tokens=True).items():
            if idx < vocab_size:
                vocab[idx] = token
        # A special token vanishes from the decoded text (skip_special_tokens), so the text
        # would not be what the grammar matched: give it no text, which xgrammar never allows.
        # Stop tokens are allowed where the grammar may end, by id.
        for idx, added in backend.get_added_tokens_decoder().items():
            if added.special and idx < vocab_size:
                vocab[idx] = ""
        # vocab type (byte-level BPE, SentencePiece byte fallback, raw) and prefix-space rule,
        # read from tokenizer.json as xgrammar's own from_huggingface does
        meta = xg.TokenizerInfo._detect_metadata_from_hf(backend.to_str())
        info = xg.TokenizerInfo(
            vocab,
            meta["vocab_type"],
            vocab_size=vocab_size,
            stop_token_ids=list(stop_ids),
            add_prefix_space=meta["add_prefix_space"],
        )
        self.vocab_size = vocab_size
        self._compiler = xg.GrammarCompiler(info, max_threads=1)

    def compile(self, constraint: Constraint) -> xg.CompiledGrammar:
        kind = constraint.kind
        try:
            return self._compiler.compile_grammar(exclude_surrogates(_grammar_text(constraint)))
        except (RuntimeError, ValueError, TypeError) as exc:
            message = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            message = re.sub(r"^\[[^\]]*\]\s*\S+:\d+:\s*", "", message)  # "[time] file:line:"
            raise InvalidParameter(
                f"invalid {kind.replace('_', ' ')} constraint: {message}", PARAM_OF_KIND[kind]
            ) from None

    def matcher(self, compiled: xg.CompiledGrammar) -> XGrammarMatcher:
        return XGrammarMatcher(xg.GrammarMatcher(compiled))  # rollback is unbounded in 0.2

    def new_bitmask(self, rows: int) -> torch.Tensor:
        return xg.allocate_token_bitmask(rows, self.vocab_size)

    def fill_all_but(self, bitmask: torch.Tensor, row: int, tokens: tuple[int, ...]) -> None:
        bitmask[row].fill_(-1)  # 32 tokens per int32, bit set = allowed
        for token in tokens:
            bit = token % 32
            word = -(2**31) if bit == 31 else 1 << bit  # the bit as a signed int32
            bitmask[row, token // 32] &= ~word

    def apply_bitmask(self, logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> None:
        xg.apply_token_bitmask_inplace(
            logits, bitmask, vocab_size=self.vocab_size, indices=rows, backend="torch_native"
        )
