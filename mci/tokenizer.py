"""Tokenizer and chat template of a checkpoint directory, encoding prompts as transformers does.

A text prompt becomes exactly `AutoTokenizer.from_pretrained(dir)(text)["input_ids"]` of
transformers 5 (checked against 5.24 in tests/test_tokenizer_fidelity.py). Which special tokens
frame it follows transformers' precedence:

1. tokenizer.json's `post_processor` alone decides. When a tokenizer.json exists, transformers
   drops `add_bos_token` and `add_eos_token` from tokenizer_config.json before building any class
   (`PreTrainedTokenizerBase._from_pretrained`, tokenization_utils_base.py:1818-1820), so those
   keys change nothing. (transformers 4's LlamaTokenizerFast rebuilt the post-processor from them;
   5 does not.)
2. A null post-processor adds nothing: `TokenizersBackend.__init__` then installs the template
   "$A" built from add_bos_token = add_eos_token = False (tokenization_utils_tokenizers.py:463-468,
   531-535, 636-660). A post-processor that is present is kept as written (same lines).
3. `tokenizer_class` cannot override this for the classes DeepSeek-style checkpoints name:
   PreTrainedTokenizerFast is an alias of TokenizersBackend (tokenization_utils_tokenizers.py:1588),
   unknown names fall back to it (tokenization_auto.py:982-984), LlamaTokenizer(Fast) loads as
   TokenizersBackend when tokenizer.json is ByteLevel (tokenization_auto.py:846-862) and otherwise
   keeps the file's post-processor too (`convert_to_native_format`, :151 and __init__ :466). Classes
   with a built-in template or pre-tokenizer (CodeLlama, BERT, T5, ...) are not emulated: mci warns
   and uses tokenizer.json as written.
4. Special tokens named in tokenizer_config.json (`*_token`, `additional_special_tokens` /
   `extra_special_tokens`, `added_tokens_decoder`) that tokenizer.json lacks are added to the
   vocabulary, in transformers' order (`TokenizersBackend.__init__`, :477-513), so their text
   encodes to one id. Truncation and padding stored in tokenizer.json are off, as in a plain call
   (`set_truncation_and_padding`, :938-966).

Chat prompts equal `apply_chat_template(messages, add_generation_prompt=True, tokenize=True)`: the
template is rendered with the special tokens as variables and the result encoded with
`add_special_tokens=False` (tokenization_utils_base.py:3176-3201), so the template alone writes
BOS. Templates run in jinja2's immutable sandbox with transformers' extensions (loopcontrols,
`tojson`, `raise_exception`, `strftime_now`): a checkpoint's template is data, not trusted code.
"""

from __future__ import annotations

import json
import logging
from datetime import datetime
from pathlib import Path

from jinja2.exceptions import TemplateError
from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import AddedToken, Tokenizer

from mci.errors import CheckpointError, UserError

log = logging.getLogger("mci")

# transformers 5's named special tokens (`SPECIAL_TOKENS_ATTRIBUTES`), in their order.
NAMED_SPECIAL_TOKENS = (
    "bos_token",
    "eos_token",
    "unk_token",
    "sep_token",
    "pad_token",
    "cls_token",
    "mask_token",
)
# tokenizer_class values transformers loads as TokenizersBackend, i.e. from tokenizer.json as is.
GENERIC_CLASSES = (
    "PreTrainedTokenizerFast",
    "TokenizersBackend",
    "PreTrainedTokenizer",
    "PythonBackend",
)
# A message's reasoning may come under any of these; templates read the first (transformers).
REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


def _token_text(value) -> str | None:
    """tokenizer_config stores special tokens as strings or as {"content": ...} objects."""
    if isinstance(value, dict):
        return value.get("content")
    return value if isinstance(value, str) else None


def _added_token(value, special: bool) -> AddedToken:
    """A config entry as transformers turns it into an AddedToken (a string is a special token)."""
    if isinstance(value, str):
        return AddedToken(value, special=True)
    fields = ("single_word", "lstrip", "rstrip", "normalized", "special")
    kwargs = {k: value[k] for k in fields if k in value}
    if special:  # a named special token is special whatever its entry says
        kwargs["special"] = True
    return AddedToken(value["content"], **kwargs)


def _special_token_map(config: dict) -> dict[str, str | dict]:
    """Named and model-specific special tokens of tokenizer_config.json, None values dropped.

    transformers 5 treats every `*_token` string like bos_token/eos_token/...: a special token
    and a chat-template variable. The order is theirs (it decides the ids of tokens new to the
    vocabulary): the named ones, then `*_token` objects, then strings, then an
    `extra_special_tokens` dict (`_from_pretrained` and `PreTrainedTokenizerBase.__init__`).
    """
    others = [k for k in config if k.endswith("_token") and k not in NAMED_SPECIAL_TOKENS]
    keys = list(NAMED_SPECIAL_TOKENS)
    keys += [k for k in others if isinstance(config[k], dict)]
    keys += [k for k in others if isinstance(config[k], str)]
    tokens = {k: config[k] for k in keys if _token_text(config.get(k)) is not None}
    extra = config.get("extra_special_tokens")
    if isinstance(extra, dict):
        tokens.update({k: v for k, v in extra.items() if _token_text(v) is not None})
    return tokens


def _extra_special_tokens(config: dict) -> list:
    """The unnamed special tokens (`additional_special_tokens` is their transformers 4 name)."""
    for key in ("extra_special_tokens", "additional_special_tokens"):
        if isinstance(config.get(key), list) and config[key]:
            return [v for v in config[key] if _token_text(v) is not None]
    return []


def _missing_special_tokens(tok: Tokenizer, config: dict) -> list[AddedToken]:
    """Config special tokens that tokenizer.json lacks, in the order transformers adds them."""
    have = {t.content for t in tok.get_added_tokens_decoder().values()}
    named = _special_token_map(config)
    named_texts = {_token_text(v) for v in named.values()}
    decoder = config.get("added_tokens_decoder") or {}
    candidates = [decoder[k] for k in sorted(decoder, key=int)]
    candidates += list(named.values()) + _extra_special_tokens(config)
    missing: list[AddedToken] = []
    for value in candidates:
        token = _added_token(value, _token_text(value) in named_texts)
        if token.content not in have:
            have.add(token.content)
            missing.append(token)
    return missing


def _merge_special_tokens_map(config: dict, file: Path) -> dict:
    """Legacy special_tokens_map.json: read only without `added_tokens_decoder`, and it wins."""
    if "added_tokens_decoder" in config or not file.exists():
        return config
    try:
        legacy = json.loads(file.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise CheckpointError(f"{file} is not valid JSON: {exc}") from None
    merged = dict(config)
    for key, value in legacy.items():
        if key in ("extra_special_tokens", "additional_special_tokens") and isinstance(value, list):
            extra = _extra_special_tokens(merged)
            texts = {_token_text(v) for v in extra}
            merged["extra_special_tokens"] = extra + [
                v for v in value if _token_text(v) not in texts
            ]
        else:
            merged[key] = value
    return merged


class TextTokenizer:
    """Text <-> token ids for one model, plus chat-template rendering."""

    def __init__(self, tokenizer: Tokenizer, config: dict, chat_template: str | None):
        self._tok = tokenizer
        self._tok.no_truncation()
        self._tok.no_padding()
        self._tok.encode_special_tokens = bool(config.get("split_special_tokens", False))
        missing = _missing_special_tokens(tokenizer, config)
        if missing:
            self._tok.add_tokens(missing)
        self.special_tokens = {k: _token_text(v) for k, v in _special_token_map(config).items()}
        self.bos_token = self.special_tokens.get("bos_token")
        self.eos_token = self.special_tokens.get("eos_token")
        self.bos_id = tokenizer.token_to_id(self.bos_token) if self.bos_token else None
        self.eos_id = tokenizer.token_to_id(self.eos_token) if self.eos_token else None
        self.chat_template = chat_template
        self._template = None
        if chat_template:
            env = ImmutableSandboxedEnvironment(
                trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols]
            )
            env.filters["tojson"] = _tojson
            env.globals["raise_exception"] = _raise_template_error
            env.globals["strftime_now"] = _strftime_now
            self._template = env.from_string(chat_template)

    @property
    def backend(self):
        """The underlying `tokenizers.Tokenizer` (its vocabulary and JSON, for grammar masks)."""
        return self._tok

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
            text = file.read_text(encoding="utf-8")
            tok = Tokenizer.from_str(text)
        except Exception as exc:  # tokenizers raises a bare Exception for malformed files
            raise CheckpointError(f"cannot read {file}: {exc}") from None
        config = {}
        config_file = path / "tokenizer_config.json"
        if config_file.exists():
            try:
                config = json.loads(config_file.read_text(encoding="utf-8"))
            except (json.JSONDecodeError, UnicodeDecodeError) as exc:
                raise CheckpointError(f"{config_file} is not valid JSON: {exc}") from None
        config = _merge_special_tokens_map(config, path / "special_tokens_map.json")
        _warn_if_class_rebuilds(config.get("tokenizer_class"), text)
        template = config.get("chat_template")
        jinja_file = path / "chat_template.jinja"
        if jinja_file.exists():
            template = jinja_file.read_text(encoding="utf-8")
        if isinstance(template, list):  # [{"name": "default", "template": ...}, ...]
            named = {t.get("name"): t.get("template") for t in template}
            template = named.get("default") or next(iter(named.values()), None)
        return cls(tok, config, template)

    def encode(
        self, text: str, add_special_tokens: bool = True, add_bos: bool | None = None
    ) -> list[int]:
        """Token ids of `text`, framed by tokenizer.json's post-processor as transformers does.

        `add_bos` overrides that: True gives BOS + the bare ids, False the bare ids (no special
        tokens at all), for callers that frame sequences themselves (training, evaluation).
        """
        if not text.isascii():  # a lone surrogate would fail deep inside the tokenizer
            try:
                text.encode("utf-8")
            except UnicodeEncodeError:
                raise UserError("text must be valid Unicode (it has a lone surrogate)") from None
        if add_bos is None:
            return self._tok.encode(text, add_special_tokens=add_special_tokens).ids
        ids = self._tok.encode(text, add_special_tokens=False).ids
        return [self.bos_id] + ids if add_bos and self.bos_id is not None else ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(ids, skip_special_tokens=skip_special_tokens)

    def apply_chat_template(
        self,
        messages: list[dict],
        add_generation_prompt: bool = True,
        tools: list[dict] | None = None,
    ) -> str:
        """Render chat messages (and tool definitions, for templates that show them) to the
        prompt text (the template writes BOS itself)."""
        if self._template is None:
            raise UserError("this model has no chat template")
        try:
            return self._template.render(
                messages=[_template_message(m) for m in messages],
                tools=tools,
                documents=None,
                add_generation_prompt=add_generation_prompt,
                **self.special_tokens,
            )
        except TemplateError as exc:
            raise UserError(f"chat template failed: {exc}") from None

    def encode_chat(
        self,
        messages: list[dict],
        add_generation_prompt: bool = True,
        tools: list[dict] | None = None,
    ) -> list[int]:
        """Ids of the rendered chat; no post-processor, as in transformers' apply_chat_template."""
        prompt = self.apply_chat_template(messages, add_generation_prompt, tools)
        return self.encode(prompt, add_special_tokens=False)


def _template_message(message: dict) -> dict:
    """A message as transformers passes it: None values dropped, reasoning aliased."""
    message = {k: v for k, v in message.items() if v is not None}
    reasoning = next((message[k] for k in REASONING_FIELDS if k in message), None)
    if reasoning is not None:
        message = {"thinking": reasoning, **message, "reasoning_content": reasoning}
    return message


def _warn_if_class_rebuilds(tokenizer_class: str | None, tokenizer_json: str) -> None:
    """Warn when transformers would build `tokenizer_class` from more than tokenizer.json."""
    if tokenizer_class is None or tokenizer_class in GENERIC_CLASSES:
        return
    if tokenizer_class.removesuffix("Fast") == "LlamaTokenizer":
        if '"ByteLevel"' in tokenizer_json:  # transformers' own test (from_pretrained)
            return
    log.warning(
        "tokenizer_class %s: mci encodes with tokenizer.json as written; transformers' class may "
        "rebuild the pre-tokenizer or post-processor, so ids can differ",
        tokenizer_class,
    )


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
    # transformers' filter: unlike jinja's own, it does not HTML-escape
    return json.dumps(
        x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(format: str) -> str:
    return datetime.now().strftime(format)


def _raise_template_error(message: str):
    raise TemplateError(message)
