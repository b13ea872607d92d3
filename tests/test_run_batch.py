"""`mci run-batch` on an OpenAI Batch API file; response bodies validate as openai types."""

from __future__ import annotations

import json
import subprocess
import sys

from openai.types import Completion
from openai.types.chat import ChatCompletion

LINES = [
    {
        "custom_id": "c1",
        "method": "POST",
        "url": "/v1/completions",
        "body": {
            "model": "m",
            "prompt": "def f(x):",
            "max_tokens": 6,
            "temperature": 0,
            "logprobs": 2,
            "echo": True,
        },
    },
    {
        "custom_id": "c2",
        "method": "POST",
        "url": "/v1/completions",
        "body": {"model": "m", "prompt": [[5, 6, 7], [8, 9]], "max_tokens": 3, "n": 2, "seed": 3},
    },
    {
        "custom_id": "chat",
        "method": "POST",
        "url": "/v1/chat/completions",
        "body": {
            "model": "m",
            "messages": [
                {"role": "system", "content": "be brief"},
                {"role": "user", "content": "hello"},
            ],
            "max_completion_tokens": 5,
            "logprobs": True,
            "top_logprobs": 2,
        },
    },
    {
        "custom_id": "bad-temp",
        "method": "POST",
        "url": "/v1/completions",
        "body": {"prompt": "x", "temperature": "hot"},
    },
    {"custom_id": "bad-url", "method": "POST", "url": "/v1/embeddings", "body": {}},
]


def test_run_batch_end_to_end(tmp_path, checkpoint):
    src, dst = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_text("\n".join(json.dumps(x) for x in LINES) + "\nnot json\n")
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "mci",
            "run-batch",
            "-i",
            str(src),
            "-o",
            str(dst),
            "--model-path",
            str(checkpoint()),
            "--max-total-tokens",
            "2048",
            "--served-model-name",
            "m",
            "--skip-kernel-warmup",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    rows = [json.loads(line) for line in dst.read_text().splitlines()]
    assert [r["custom_id"] for r in rows] == ["c1", "c2", "chat", "bad-temp", "bad-url", "line-6"]
    by_id = {r["custom_id"]: r for r in rows}

    # The SDK's Completion type says token_logprobs holds floats, but with echo the first is
    # null, as OpenAI and vLLM send it (the SDK's client parses leniently), so read it raw.
    c1 = by_id["c1"]["response"]["body"]
    choice, usage = c1["choices"][0], c1["usage"]
    assert choice["text"].startswith("def f(x):")  # echo
    lp = choice["logprobs"]
    assert len(lp["tokens"]) == usage["prompt_tokens"] + 6 and lp["token_logprobs"][0] is None
    assert all(v is not None for v in lp["token_logprobs"][1:])
    assert usage["completion_tokens"] == 6

    c2 = Completion.model_validate(by_id["c2"]["response"]["body"])
    assert [c.index for c in c2.choices] == [0, 1, 2, 3] and c2.usage.prompt_tokens == 5

    chat = ChatCompletion.model_validate(by_id["chat"]["response"]["body"])
    assert chat.choices[0].message.role == "assistant"
    assert len(chat.choices[0].logprobs.content[0].top_logprobs) == 2

    for bad in ("bad-temp", "bad-url", "line-6"):
        assert by_id[bad]["response"]["status_code"] == 400 and by_id[bad]["error"]["message"]
    assert "temperature" in by_id["bad-temp"]["error"]["message"]


def test_run_batch_missing_input_is_one_line_error(tmp_path):
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "mci",
            "run-batch",
            "-i",
            str(tmp_path / "x"),
            "-o",
            str(tmp_path / "y"),
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2 and len(result.stderr.strip().splitlines()) == 1
