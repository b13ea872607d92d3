"""Byte-level BPE tokenizers trained on the Python standard library, with a chat template.

Every machine with Python has the standard library's source, so it is the corpus: no download.
Special tokens follow DeepSeek-V3's spelling and come first, so `<｜begin▁of▁sentence｜>` is id 0
and `<｜end▁of▁sentence｜>` id 1, matching the checkpoint's `bos_token_id`/`eos_token_id`.

Models trained here see BOS first in every sequence, so the written tokenizer.json says so in its
post-processor: transformers 5 takes BOS from there alone and ignores `add_bos_token`.
"""

from __future__ import annotations

import json
import sysconfig
from collections.abc import Iterator
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

BOS, EOS = "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>"
USER, ASSISTANT = "<｜User｜>", "<｜Assistant｜>"
SPECIAL_TOKENS = [BOS, EOS, USER, ASSISTANT]

# DeepSeek-V3's template, reduced to system/user/assistant turns.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{% if message['role'] == 'system' %}{{ message['content'] }}"
    "{% elif message['role'] == 'user' %}" + USER + "{{ message['content'] }}"
    "{% elif message['role'] == 'assistant' %}"
    + ASSISTANT
    + "{{ message['content'] }}"
    + EOS
    + "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}" + ASSISTANT + "{% endif %}"
)


def stdlib_files() -> list[Path]:
    """The standard library's top-level `.py` files, sorted (a stable corpus per Python version)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    return sorted(p for p in root.glob("*.py") if p.is_file())


def stdlib_corpus(max_bytes: int) -> Iterator[str]:
    """Yield stdlib source texts until about `max_bytes` have been produced."""
    total = 0
    for file in stdlib_files():
        text = file.read_text(encoding="utf-8", errors="replace")
        yield text
        total += len(text)
        if total >= max_bytes:
            return


def train_bpe(vocab_size: int, texts: Iterator[str]) -> Tokenizer:
    """Train a byte-level BPE of exactly `vocab_size` entries (special tokens included)."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    return tok


def bos_post_processor(tok: Tokenizer) -> processors.TemplateProcessing:
    """BOS before every sequence: the template transformers' `update_post_processor` writes."""
    return processors.TemplateProcessing(
        single=f"{BOS}:0 $A:0",
        pair=f"{BOS}:0 $A:0 {BOS}:1 $B:1",
        special_tokens=[(BOS, tok.token_to_id(BOS))],
    )


def write_tokenizer(out_dir: Path, tok: Tokenizer, max_length: int) -> None:
    """Write tokenizer.json (BOS-adding post-processor) and tokenizer_config.json (chat template).

    The caller's tokenizer is left as it was: training encodes with it and places BOS itself.
    """
    written = Tokenizer.from_str(tok.to_str())
    written.post_processor = bos_post_processor(written)
    written.save(str(out_dir / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS,
        "eos_token": EOS,
        # Ignored by transformers 5 (the post-processor decides) but read by older tools; they
        # must agree with the post-processor above.
        "add_bos_token": True,
        "add_eos_token": False,
        "model_max_length": max_length,
        "chat_template": CHAT_TEMPLATE,
    }
    (out_dir / "tokenizer_config.json").write_text(json.dumps(config, indent=2, ensure_ascii=False))
