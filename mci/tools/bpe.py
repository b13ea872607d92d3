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
# DeepSeek-V3's markup tokens for tool calls and (R1) reasoning; non-special, as DeepSeek's own
# tokenizer has them, so they stay in decoded text where the parsers find them.
TOOL_CALLS_BEGIN, TOOL_CALLS_END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
TOOL_CALL_BEGIN, TOOL_CALL_END, TOOL_SEP = (
    "<｜tool▁call▁begin｜>",
    "<｜tool▁call▁end｜>",
    "<｜tool▁sep｜>",
)
TOOL_OUTPUTS_BEGIN, TOOL_OUTPUTS_END = "<｜tool▁outputs▁begin｜>", "<｜tool▁outputs▁end｜>"
TOOL_OUTPUT_BEGIN, TOOL_OUTPUT_END = "<｜tool▁output▁begin｜>", "<｜tool▁output▁end｜>"
THINK_START, THINK_END = "<think>", "</think>"
DEEPSEEK_MARKUP_TOKENS = [
    TOOL_CALLS_BEGIN,
    TOOL_CALLS_END,
    TOOL_CALL_BEGIN,
    TOOL_CALL_END,
    TOOL_SEP,
    TOOL_OUTPUTS_BEGIN,
    TOOL_OUTPUTS_END,
    TOOL_OUTPUT_BEGIN,
    TOOL_OUTPUT_END,
    THINK_START,
    THINK_END,
]

# The bundled model's template. It has no tool markup tokens, so tools are listed as JSON and a
# call is the JSON envelope mci's `json` tool format reads (mci/server/tool_formats.py); a tool's
# result comes back as a user turn.
_ENVELOPE_CALLS = (
    "{% for call in message['tool_calls'] %}{% if not loop.first %}{{ '\\n' }}{% endif %}"
    "{{ '{\"name\": ' + (call['function']['name'] | tojson) + ', \"arguments\": ' "
    "+ call['function']['arguments'] + '}' }}"
    "{% endfor %}"
)
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% if tools %}"
    "{{ 'Tools: ' + (tools | tojson) + '\\nTo call a tool, reply with only "
    '{"name": <tool name>, "arguments": <its arguments>}.\\n\\n\' }}'
    "{% endif %}"
    "{% for message in messages %}"
    "{% if message['role'] == 'system' %}{{ message['content'] }}"
    "{% elif message['role'] == 'user' %}" + USER + "{{ message['content'] }}"
    "{% elif message['role'] == 'tool' %}" + USER + "{{ 'Tool result: ' + message['content'] }}"
    "{% elif message['role'] == 'assistant' %}"
    + ASSISTANT
    + "{{ message['content'] }}"
    + "{% if message['tool_calls'] %}"
    + _ENVELOPE_CALLS
    + "{% endif %}"
    + EOS
    + "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}" + ASSISTANT + "{% endif %}"
)

# A DeepSeek-V3-style template with its native tool markup (for checkpoints with
# DEEPSEEK_MARKUP_TOKENS): calls as DeepSeek-V3 writes them, results in its tool-output tokens.
DEEPSEEK_V3_TEMPLATE = (
    "{{ bos_token }}"
    "{% if tools %}"
    "{{ '## Tools\\nYou may call these functions:\\n' + (tools | tojson) + '\\n\\n' }}"
    "{% endif %}"
    "{% for message in messages %}"
    "{% if message['role'] == 'system' %}{{ message['content'] }}"
    "{% elif message['role'] == 'user' %}" + USER + "{{ message['content'] }}"
    "{% elif message['role'] == 'tool' %}"
    + TOOL_OUTPUTS_BEGIN
    + TOOL_OUTPUT_BEGIN
    + "{{ message['content'] }}"
    + TOOL_OUTPUT_END
    + TOOL_OUTPUTS_END
    + "{% elif message['role'] == 'assistant' %}"
    + ASSISTANT
    + "{{ message['content'] }}"
    + "{% if message['tool_calls'] %}"
    + TOOL_CALLS_BEGIN
    + "{% for call in message['tool_calls'] %}"
    + TOOL_CALL_BEGIN
    + "{{ call['type'] }}"
    + TOOL_SEP
    + "{{ call['function']['name'] + '\\n```json\\n' + call['function']['arguments'] + "
    "'\\n```' }}"
    + TOOL_CALL_END
    + "{% endfor %}"
    + TOOL_CALLS_END
    + "{% endif %}"
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


def train_bpe(vocab_size: int, texts: Iterator[str], markup: bool = False) -> Tokenizer:
    """Train a byte-level BPE of exactly `vocab_size` entries (special tokens included); with
    `markup`, DeepSeek-V3's tool and think tokens follow the four special tokens."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS + (DEEPSEEK_MARKUP_TOKENS if markup else []),
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
    """Write tokenizer.json (BOS-adding post-processor) and tokenizer_config.json (chat template:
    DeepSeek-V3's markup when the tokenizer has its tokens).

    The caller's tokenizer is left as it was: training encodes with it and places BOS itself.
    """
    written = Tokenizer.from_str(tok.to_str())
    written.post_processor = bos_post_processor(written)
    data = json.loads(written.to_str())
    for added in data["added_tokens"]:
        if added["content"] in DEEPSEEK_MARKUP_TOKENS:
            added["special"] = False
    (out_dir / "tokenizer.json").write_text(json.dumps(data, ensure_ascii=False))
    markup = tok.token_to_id(TOOL_CALLS_BEGIN) is not None
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS,
        "eos_token": EOS,
        # Ignored by transformers 5 (the post-processor decides) but read by older tools; they
        # must agree with the post-processor above.
        "add_bos_token": True,
        "add_eos_token": False,
        "model_max_length": max_length,
        "chat_template": DEEPSEEK_V3_TEMPLATE if markup else CHAT_TEMPLATE,
    }
    (out_dir / "tokenizer_config.json").write_text(json.dumps(config, indent=2, ensure_ascii=False))
