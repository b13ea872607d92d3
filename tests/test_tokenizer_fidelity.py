"""Prompts are tokenised exactly as transformers' AutoTokenizer does (issue 8).

Each case writes a small tokenizer directory in one shape (post-processor adding BOS, nothing, or
BOS+EOS; `add_bos_token` true/false/absent; a null BOS; DeepSeek-V3 and Llama-3 style configs) and
compares mci's ids with `AutoTokenizer(dir)(text)` and `apply_chat_template(..., tokenize=True)`.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from conftest import hf_greedy, load_hf_reference
from server_helpers import LiveServer
from tokenizers import AddedToken, Tokenizer, processors

from mci.cache.config import CacheConfig
from mci.cli import DEFAULT_MODEL
from mci.core.sampling_params import SamplingParams
from mci.engine.config import EngineConfig, ModelPlacement
from mci.engine.engine import Engine
from mci.tokenizer import TextTokenizer
from mci.tools.bpe import ASSISTANT, BOS, CHAT_TEMPLATE, EOS, USER, train_bpe

transformers = pytest.importorskip("transformers")
transformers.logging.set_verbosity_error()

LLAMA3_BOS, LLAMA3_EOS = "<|begin_of_text|>", "<|end_of_text|>"
LLAMA3_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|start_header_id|>{{ m['role'] }}<|end_header_id|>"
    "\n\n{{ m['content'] | trim }}<|eot_id|>{% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
)
PLAIN_TEMPLATE = "{% for m in messages %}[{{ m['role'] }}]{{ m['content'] }}\n{% endfor %}"

# Code, prose, unicode, emoji, whitespace runs, special-token text inside text, near-empty, long.
STRINGS = [
    "",
    " ",
    "  ",
    "\n",
    "\t",
    "\r\n",
    "a",
    "hello",
    "Hello, world!",
    "def f(x):\n    return x * 2\n",
    "import os\nimport sys\n\n\nclass A:\n\tpass\n",
    "    leading spaces",
    "trailing spaces    ",
    "many     inner      spaces",
    "\n\n\n\nnewlines only before",
    "tabs\t\tand\t\t\ttabs",
    "mixed \t \n \r\n whitespace",
    "naïve café résumé",
    "日本語のテキスト",
    "中文：你好，世界！",
    "Ελληνικά και русский",
    "emoji 🙂🎉👍🏽 and flags 🇫🇷",
    "family 👨‍👩‍👧‍👦 zwj",
    "combining e\u0301 and a\u030a",
    "zero\u200bwidth\ufeffspace",
    "math ∑ ∫ √ ≠ ≤ ∞",
    "quotes “curly” ‘single’ «guillemets»",
    f"{BOS}",
    f"{EOS}",
    f"{USER}What is 2+2?{ASSISTANT}",
    f"text {BOS} in the middle {EOS} end",
    "<｜User｜> spaced <｜Assistant｜>",
    "<｜begin▁of▁sentence｜",
    "<|begin_of_text|>llama text<|eot_id|>",
    "<s> </s> <unk> <pad>",
    "<<SYS>> [INST] [/INST]",
    "0123456789 3.14159 -42 1e-9",
    "a" * 300,
    "ab " * 200,
    "\u00a0non-breaking\u00a0spaces",
    "null\x00byte and \x07bell",
    "back\\slash and /slash",
    "{'json': [1, 2, {\"k\": null}]}",
    "```python\nprint('hi')\n```",
    "https://example.com/path?q=1&r=2#frag",
    "email@example.com",
    "UPPER lower MiXeD",
    "punctuation!!! ??? ...",
    "end with newline\n",
    " lone emoji 🙂",
    "🙂",
    "é",
    "\n\t \n",
    "x" + "🙂" * 40,
    "The quick brown fox jumps over the lazy dog. " * 30,
    "".join(chr(c) for c in range(0x20, 0x7F)),
]

CHATS = [
    [{"role": "user", "content": "Hi"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello 🙂"}],
    [
        {"role": "user", "content": f"say {USER} and {BOS} literally"},
        {"role": "assistant", "content": "ok\n\n  done"},
        {"role": "user", "content": "  spaces  \t\n"},
    ],
    [{"role": "user", "content": "日本語 <|begin_of_text|> <s>"}],
]


def _with_specials(base: Tokenizer, specials: list[str]) -> Tokenizer:
    tok = Tokenizer.from_str(base.to_str())
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in specials])
    return tok


def _template(bos: str | None, eos: str | None, add_eos: bool = False):
    """TemplateProcessing adding BOS (and EOS) as transformers' update_post_processor writes it."""
    single = f"{bos}:0 $A:0" + (f" {eos}:0" if add_eos else "")
    pair = single + f" {bos}:1 $B:1" + (f" {eos}:1" if add_eos else "")
    return single, pair


def _write_case(root: Path, base: Tokenizer, name: str, case: dict) -> Path:
    out = root / name
    out.mkdir()
    tok = _with_specials(base, case.get("specials", []))
    bos, eos = case.get("pp_bos", BOS), case.get("pp_eos", EOS)
    if case["pp"] in ("bos", "bos_eos"):
        single, pair = _template(bos, eos, add_eos=case["pp"] == "bos_eos")
        ids = [(bos, tok.token_to_id(bos))]
        if case["pp"] == "bos_eos":
            ids.append((eos, tok.token_to_id(eos)))
        tok.post_processor = processors.TemplateProcessing(
            single=single, pair=pair, special_tokens=ids
        )
    elif case["pp"] == "bytelevel+bos":  # Llama 3's shape: Sequence[ByteLevel, TemplateProcessing]
        single, pair = _template(bos, eos)
        tok.post_processor = processors.Sequence(
            [
                processors.ByteLevel(trim_offsets=False),
                processors.TemplateProcessing(
                    single=single, pair=pair, special_tokens=[(bos, tok.token_to_id(bos))]
                ),
            ]
        )
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps(case["config"], ensure_ascii=False))
    for file, content in case.get("files", {}).items():
        (out / file).write_text(json.dumps(content, ensure_ascii=False))
    if "model_type" in case:
        (out / "config.json").write_text(json.dumps({"model_type": case["model_type"]}))
    return out


def _config(cls="PreTrainedTokenizerFast", template=CHAT_TEMPLATE, **extra) -> dict:
    config = {"bos_token": BOS, "eos_token": EOS, "chat_template": template, **extra}
    if cls is not None:
        config["tokenizer_class"] = cls
    return config


CASES = {
    "pp_bos": {"pp": "bos", "config": _config()},
    "pp_none_add_bos_true": {"pp": "none", "config": _config(add_bos_token=True)},
    "pp_none_add_bos_false": {"pp": "none", "config": _config(add_bos_token=False)},
    "pp_none_add_bos_absent": {"pp": "none", "config": _config()},
    "pp_bos_add_bos_false": {"pp": "bos", "config": _config(add_bos_token=False)},
    "pp_bos_eos": {
        "pp": "bos_eos",
        "config": _config(add_bos_token=True, add_eos_token=True),
    },
    "pp_none_add_eos_true": {"pp": "none", "config": _config(add_eos_token=True)},
    "bos_null_pp_none": {
        "pp": "none",
        "config": _config(bos_token=None, template=PLAIN_TEMPLATE, add_bos_token=True),
    },
    "bos_null_pp_bos": {
        "pp": "bos",
        "config": _config(bos_token=None, template=PLAIN_TEMPLATE),
    },
    "no_tokenizer_class": {"pp": "bos", "config": _config(cls=None)},
    "deepseek_v3": {
        "pp": "bos",
        "model_type": "deepseek_v3",
        "config": _config(cls="LlamaTokenizerFast", add_bos_token=True, add_eos_token=False),
    },
    "deepseek_v3_pp_none": {
        "pp": "none",
        "model_type": "deepseek_v3",
        "config": _config(cls="LlamaTokenizerFast", add_bos_token=True, add_eos_token=False),
    },
    "llama3": {
        "pp": "bytelevel+bos",
        "pp_bos": LLAMA3_BOS,
        "specials": [
            LLAMA3_BOS,
            LLAMA3_EOS,
            "<|start_header_id|>",
            "<|end_header_id|>",
            "<|eot_id|>",
        ],
        "config": {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "bos_token": LLAMA3_BOS,
            "eos_token": LLAMA3_EOS,
            "chat_template": LLAMA3_TEMPLATE,
        },
    },
    "config_tokens_missing_from_json": {
        "pp": "bos",
        "config": _config(pad_token="<pad>", additional_special_tokens=["<|tool|>"]),
    },
    "split_special_tokens": {"pp": "bos", "config": _config(split_special_tokens=True)},
    "legacy_special_tokens_map": {
        "pp": "bos",
        "config": _config(),
        "files": {"special_tokens_map.json": {"pad_token": "<pad>", "unk_token": "<unk>"}},
    },
}


@pytest.fixture(scope="module")
def base_tokenizer() -> Tokenizer:
    """A small byte-level BPE with DeepSeek's special tokens (a few hundred ms to train)."""
    text = "\n".join(STRINGS) + Path(__file__).read_text(encoding="utf-8")
    return train_bpe(600, iter([text] * 3))


@pytest.fixture(scope="module")
def case_dirs(base_tokenizer, tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tokenizers")
    return {name: _write_case(root, base_tokenizer, name, case) for name, case in CASES.items()}


def _hf(path: Path):
    return transformers.AutoTokenizer.from_pretrained(str(path))


def _hf_chat(hf, messages) -> list[int]:
    return hf.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=True, return_dict=False
    )


def test_strings_are_varied_enough():
    assert len(STRINGS) >= 50 and len(set(STRINGS)) == len(STRINGS)


@pytest.mark.parametrize("name", list(CASES))
def test_text_ids_equal_transformers(case_dirs, name):
    ours, hf = TextTokenizer.load(case_dirs[name]), _hf(case_dirs[name])
    for text in STRINGS:
        assert ours.encode(text) == hf(text)["input_ids"], (name, text)


@pytest.mark.parametrize("name", list(CASES))
def test_chat_ids_equal_transformers(case_dirs, name):
    ours, hf = TextTokenizer.load(case_dirs[name]), _hf(case_dirs[name])
    for messages in CHATS:
        ids = ours.encode_chat(messages)
        assert ids == _hf_chat(hf, messages), (name, messages)
        if ours.bos_id is not None and not CASES[name]["config"].get("split_special_tokens"):
            assert ids[0] == ours.bos_id and ids[1] != ours.bos_id, "one BOS first, not two"


def test_post_processor_decides_bos(case_dirs):
    """The shapes behind issue 8: add_bos_token alone adds nothing, the post-processor does."""
    first = {n: TextTokenizer.load(case_dirs[n]).encode("hi")[0] for n in CASES}
    bos = TextTokenizer.load(case_dirs["pp_bos"]).bos_id
    assert first["pp_none_add_bos_true"] != bos and first["deepseek_v3_pp_none"] != bos
    assert first["pp_bos_add_bos_false"] == bos and first["bos_null_pp_bos"] == bos
    assert TextTokenizer.load(case_dirs["pp_bos_eos"]).encode("hi")[-1] == 1


def test_explicit_bos_override(case_dirs):
    tok = TextTokenizer.load(case_dirs["pp_bos_eos"])
    bare = tok.encode("hi", add_special_tokens=False)
    assert tok.encode("hi", add_bos=True) == [tok.bos_id] + bare
    assert tok.encode("hi", add_bos=False) == bare
    assert tok.encode("hi") == [tok.bos_id] + bare + [tok.eos_id]


@pytest.mark.parametrize("model", [DEFAULT_MODEL, Path(f"{DEFAULT_MODEL}-fp8")])
def test_default_model_matches_transformers_and_starts_with_bos(model):
    ours, hf = TextTokenizer.load(model), _hf(model)
    for text in STRINGS:
        ids = ours.encode(text)
        assert ids == hf(text)["input_ids"], text
        assert ids[0] == ours.bos_id == 0, "the model was trained with BOS first"
    for messages in CHATS:
        ids = ours.encode_chat(messages)
        assert ids == _hf_chat(hf, messages) and ids[0] == 0 and ids[1] != 0


def test_written_tokenizer_adds_bos(checkpoint):
    """make-checkpoint writes the post-processor, so mci and transformers both add BOS."""
    path = checkpoint()
    ids = TextTokenizer.load(path).encode("def main():")
    assert ids[0] == 0 and ids == _hf(path)("def main():")["input_ids"]


def test_greedy_text_equals_transformers_without_bos(checkpoint, tmp_path):
    """End to end on a checkpoint whose post-processor adds nothing: `mci generate`, the Engine,
    `/v1/completions` and transformers' generate all see the same prompt ids and produce the
    same greedy text."""
    path = Path(shutil.copytree(checkpoint(), tmp_path / "ckpt"))
    tok_file = path / "tokenizer.json"
    data = json.loads(tok_file.read_text(encoding="utf-8"))
    data["post_processor"] = None
    tok_file.write_text(json.dumps(data, ensure_ascii=False), encoding="utf-8")
    prompt, n = "def fibonacci(n):\n    ", 12

    hf_tok = _hf(path)
    prompt_ids = hf_tok(prompt)["input_ids"]
    assert prompt_ids[0] != hf_tok.bos_token_id
    hf_ids = hf_greedy(load_hf_reference(path), prompt_ids, n)
    hf_text = hf_tok.decode(hf_ids, skip_special_tokens=True)

    engine = Engine(
        EngineConfig(
            model=ModelPlacement(model_path=path, dtype="float32", skip_kernel_warmup=True),
            cache=CacheConfig(max_total_tokens=2048),
        )
    )
    try:
        params = SamplingParams(max_new_tokens=n, temperature=0, ignore_eos=True)
        result = engine.generate(prompt, params)[0]
    finally:
        engine.shutdown()
    assert result.prompt_token_ids == prompt_ids
    assert result.outputs[0].output_token_ids == hf_ids
    assert result.outputs[0].text == hf_text

    cli = subprocess.run(
        [sys.executable, "-m", "mci", "generate", "--model-path", str(path), "--dtype", "float32"]
        + ["--prompt", prompt, "--max-new-tokens", str(n), "--ignore-eos"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert cli.returncode == 0, cli.stderr
    assert cli.stdout == prompt + hf_text + "\n"

    # and through the server: the text prompt is tokenised as transformers does
    with LiveServer(path, "--max-total-tokens", "2048") as server:
        body = httpx.post(
            server.url + "/v1/completions",
            json={"prompt": prompt, "max_tokens": n, "temperature": 0, "ignore_eos": True},
            timeout=60,
        ).json()
    assert body["choices"][0]["text"] == hf_text
    assert body["usage"]["prompt_tokens"] == len(prompt_ids)
