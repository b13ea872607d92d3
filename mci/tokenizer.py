"""Tokenizer and chat template of a checkpoint directory.

Reads `tokenizer.json` (Hugging Face `tokenizers` format) and the chat template from
`tokenizer_config.json` (`chat_template`) or a separate `chat_template.jinja`. Templates run in
jinja2's immutable sandbox: a checkpoint's template is data, not trusted code.
"""

from __future__ import annotations

import json
from pathlib import Path

from jinja2.exceptions import TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer

from mci.errors import CheckpointError, UserError


def _token_text(value) -> str | None:
    """tokenizer_config stores special tokens as strings or as {"content": ...} objects."""
    if isinstance(value, dict):
        return value.get("content")
    return value


class TextTokenizer:
    """Text <-> token ids for one model, plus chat-template rendering."""

    def __init__(self, tokenizer: Tokenizer, config: dict, chat_template: str | None):
        self._tok = tokenizer
        self.bos_token = _token_text(config.get("bos_token"))
        self.eos_token = _token_text(config.get("eos_token"))
        self.bos_id = tokenizer.token_to_id(self.bos_token) if self.bos_token else None
        self.eos_id = tokenizer.token_to_id(self.eos_token) if self.eos_token else None
        self.add_bos = bool(config.get("add_bos_token", self.bos_id is not None))
        self.chat_template = chat_template
        self._template = None
        if chat_template:
            env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
            env.globals["raise_exception"] = _raise_template_error
            self._template = env.from_string(chat_template)

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size()

    @classmethod
    def load(cls, path: str | Path) -> TextTokenizer:
        path = Path(path)
        file = path / "tokenizer.json"
        if not file.exists():
            raise CheckpointError(f"no tokenizer.json in {path}")
        try:
            tok = Tokenizer.from_file(str(file))
        except Exception as exc:  # tokenizers raises a bare Exception for malformed files
            raise CheckpointError(f"cannot read {file}: {exc}") from None
        config = {}
        config_file = path / "tokenizer_config.json"
        if config_file.exists():
            try:
                config = json.loads(config_file.read_text())
            except json.JSONDecodeError as exc:
                raise CheckpointError(f"{config_file} is not valid JSON: {exc}") from None
        template = config.get("chat_template")
        jinja_file = path / "chat_template.jinja"
        if jinja_file.exists():
            template = jinja_file.read_text()
        if isinstance(template, list):  # [{"name": "default", "template": ...}, ...]
            named = {t.get("name"): t.get("template") for t in template}
            template = named.get("default") or next(iter(named.values()), None)
        return cls(tok, config, template)

    def encode(self, text: str, add_bos: bool | None = None) -> list[int]:
        """Token ids of `text`, with the BOS token first when the model expects one."""
        ids = self._tok.encode(text, add_special_tokens=False).ids
        if (self.add_bos if add_bos is None else add_bos) and self.bos_id is not None:
            ids = [self.bos_id] + ids
        return ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(ids, skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        """Render chat messages to the prompt text (the template adds BOS itself)."""
        if self._template is None:
            raise UserError("this model has no chat template")
        try:
            return self._template.render(
                messages=messages,
                add_generation_prompt=add_generation_prompt,
                bos_token=self.bos_token or "",
                eos_token=self.eos_token or "",
            )
        except TemplateError as exc:
            raise UserError(f"chat template failed: {exc}") from None

    def encode_chat(self, messages: list[dict], add_generation_prompt: bool = True) -> list[int]:
        return self.encode(self.apply_chat_template(messages, add_generation_prompt), add_bos=False)


def _raise_template_error(message: str):
    raise TemplateError(message)
