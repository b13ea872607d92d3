"""The bundled default model: trained, loadable in bf16 and FP8, and it writes Python."""

from __future__ import annotations

import re

import pytest
import torch

from mci.engine.config import DEFAULT_MODEL
from mci.layers.attention_metadata import AttentionMetadata, SequenceChunk
from mci.models.loader import load_model
from mci.runner.single_sequence import decode_single_sequence
from mci.tokenizer import TextTokenizer
from mci.tools.corpus import corpus_files

FP8_MODEL = DEFAULT_MODEL.parent / "default-model-fp8"


@pytest.fixture(scope="module")
def bf16():
    return load_model(DEFAULT_MODEL, "float32")


@pytest.fixture(scope="module")
def tokenizer():
    return TextTokenizer.load(DEFAULT_MODEL)


def test_both_checkpoints_load_with_mtp_and_fit_the_size_budget(bf16):
    fp8 = load_model(FP8_MODEL, "bfloat16")
    assert len(bf16.mtp) == 1 and len(fp8.mtp) == 1
    assert any(p.dtype == torch.float8_e4m3fn for p in fp8.parameters())
    total = sum(f.stat().st_size for d in (DEFAULT_MODEL, FP8_MODEL) for f in d.iterdir())
    assert total <= 40 * 2**20


def test_fp8_and_bf16_agree_on_held_out_text(bf16, tokenizer):
    """Trained weights are smooth enough that e4m3 blocks move logits by a few percent
    (measured 4-6% relative L2 on held-out code); bound: 10%, and top-1 agreement >= 85%."""
    fp8 = load_model(FP8_MODEL, "float32")
    _, held = corpus_files()
    ids = tokenizer.encode(held[0].read_text(encoding="utf-8"))[:400]
    meta = AttentionMetadata.build([SequenceChunk(torch.arange(len(ids)), len(ids))])
    a = bf16.logits(bf16(torch.tensor(ids), meta, bf16.allocate_kv_cache(len(ids))))
    b = fp8.logits(fp8(torch.tensor(ids), meta, fp8.allocate_kv_cache(len(ids))))
    assert ((a - b).norm() / a.norm()).item() < 0.10
    assert (a.argmax(-1) == b.argmax(-1)).float().mean().item() >= 0.85


# No trailing newline: BPE merges "\n" with the indentation after it (docs/default-model.md).
@pytest.mark.parametrize(
    "header", ["def add(a, b):", "def is_even(n):", "class Point:\n    def __init__(self, x, y):"]
)
def test_greedy_completion_is_python_shaped(bf16, tokenizer, header):
    out = decode_single_sequence(bf16, tokenizer.encode(header), 40)
    text = tokenizer.decode(out.token_ids)
    printable = sum(c.isascii() and (c.isprintable() or c in "\n\t") for c in text)
    assert printable / max(len(text), 1) > 0.97, text
    assert re.search(r"^ {4,}\S", text, re.MULTILINE), f"no indented line: {text!r}"
    words = set(re.findall(r"[A-Za-z_]+", text))
    assert words & {
        "return",
        "self",
        "if",
        "for",
        "in",
        "None",
        "not",
        "def",
        "raise",
        "is",
        "and",
        "or",
        "else",
    }, text
