"""Tokenizer loading, BOS handling and chat templates from both places checkpoints keep them."""

from __future__ import annotations

import json
import shutil

import pytest

from mci.errors import CheckpointError, UserError
from mci.tokenizer import TextTokenizer
from mci.tools.bpe import ASSISTANT, BOS, USER

MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]


def test_roundtrip_and_bos(checkpoint):
    tok = TextTokenizer.load(checkpoint())
    text = "def f(x):\n    return x * 2  # ünïcødé ✓\n"
    ids = tok.encode(text)
    assert ids[0] == tok.bos_id == 0 and tok.eos_id == 1
    assert tok.decode(ids) == text
    assert tok.encode(text, add_bos=False) == ids[1:]


def test_chat_template_from_tokenizer_config(checkpoint):
    tok = TextTokenizer.load(checkpoint())
    prompt = tok.apply_chat_template(MESSAGES)
    assert prompt == f"{BOS}Be brief.{USER}Hi{ASSISTANT}"
    ids = tok.encode_chat(MESSAGES)
    assert ids.count(tok.bos_id) == 1 and ids[0] == tok.bos_id


def test_chat_template_jinja_file_wins(checkpoint, tmp_path):
    path = shutil.copytree(checkpoint(), tmp_path / "c")
    cfg = json.loads((path / "tokenizer_config.json").read_text())
    del cfg["chat_template"]
    (path / "tokenizer_config.json").write_text(json.dumps(cfg))
    (path / "chat_template.jinja").write_text(
        "{% for m in messages %}[{{ m['role'] }}]{{ m['content'] }}{% endfor %}"
    )
    assert TextTokenizer.load(path).apply_chat_template(MESSAGES) == "[system]Be brief.[user]Hi"


def test_template_errors_are_user_errors(checkpoint, tmp_path):
    path = shutil.copytree(checkpoint(), tmp_path / "c")
    (path / "chat_template.jinja").write_text("{{ raise_exception('roles must alternate') }}")
    with pytest.raises(UserError, match="roles must alternate"):
        TextTokenizer.load(path).apply_chat_template(MESSAGES)
    (path / "chat_template.jinja").write_text("{{ ''.__class__.__mro__[1].__subclasses__() }}")
    with pytest.raises(UserError):  # the sandbox refuses attribute escapes
        TextTokenizer.load(path).apply_chat_template(MESSAGES)


def test_missing_tokenizer(tmp_path):
    with pytest.raises(CheckpointError, match="no tokenizer.json"):
        TextTokenizer.load(tmp_path)
