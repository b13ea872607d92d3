"""`mci run-batch`: offline inference over an OpenAI Batch API input file.

Input: JSONL, one request per line: {"custom_id", "method": "POST", "url":
"/v1/completions" | "/v1/chat/completions", "body": {...}} — the format vLLM and SGLang also
accept. Output: JSONL in input order, each {"id", "custom_id", "response": {"status_code",
"request_id", "body"}, "error"}; a bad line gets status 400 and an error, and never stops the
others. Every request is queued at once so the engine batches them continuously.
"""

from __future__ import annotations

import json
import threading
from dataclasses import dataclass, field
from pathlib import Path

from tqdm import tqdm

from mci.core.outputs import RequestOutput
from mci.core.request_ids import prompt_request_id
from mci.engine.engine import Engine
from mci.errors import UserError
from mci.server import requests, responses
from mci.server.openai_types import ChatCompletionRequest, CompletionRequest

URLS = ("/v1/completions", "/v1/chat/completions")


@dataclass
class _Job:
    custom_id: str
    url: str = ""
    body: dict = field(default_factory=dict)
    request: object = None  # the parsed CompletionRequest / ChatCompletionRequest
    params: object = None  # its SamplingParams
    prompts: list = field(default_factory=list)  # [(prompt, prompt ids)]
    sample_ids: list[list[str]] = field(default_factory=list)
    error: str | None = None


def _parse_line(line: str, number: int) -> _Job:
    try:
        item = json.loads(line)
    except json.JSONDecodeError as exc:
        return _Job(custom_id=f"line-{number}", error=f"line {number} is not JSON: {exc}")
    if not isinstance(item, dict):
        return _Job(custom_id=f"line-{number}", error=f"line {number} is not a JSON object")
    job = _Job(
        custom_id=str(item.get("custom_id", f"line-{number}")),
        url=item.get("url", ""),
        body=item.get("body"),
    )
    if job.url not in URLS:
        job.error = f"unsupported url {job.url!r} (supported: {', '.join(URLS)})"
    elif not isinstance(job.body, dict):
        job.error = "'body' must be a JSON object"
    return job


def run_batch(engine: Engine, input_path: Path, output_path: Path, model_name: str) -> dict:
    """Run every request of `input_path`; write results; returns counts."""
    lines = [ln for ln in input_path.read_text().splitlines() if ln.strip()]
    jobs = [_parse_line(ln, i + 1) for i, ln in enumerate(lines)]
    finals: dict[str, RequestOutput] = {}
    lock = threading.Condition()
    progress = tqdm(total=0, desc="requests", unit="req", disable=None)

    def sink(out: RequestOutput) -> None:
        if out.finished:
            with lock:
                finals[out.request_id] = out
                progress.update(1)
                lock.notify_all()

    wanted = []
    for i, job in enumerate(jobs):
        if job.error:
            continue
        try:
            if job.url.endswith("chat/completions"):
                job.request = requests.parse(ChatCompletionRequest, job.body)
                job.params = requests.chat_params(job.request)
                texts = [requests.chat_prompt_ids(engine.tokenizer, job.request)]
                names = requests.CHAT_NAMES
            else:
                job.request = requests.parse(CompletionRequest, job.body)
                job.params = requests.completion_params(job.request)
                texts = requests.completion_prompts(job.request)
                names = requests.COMPLETION_NAMES
            if job.request.stream:
                raise UserError("'stream' is not supported in a batch")
            with requests.reported_as(names):  # every prompt is checked before any is queued
                commands = [
                    engine.command(prompt_request_id(f"batch-{i}", k), p, job.params)
                    for k, p in enumerate(texts)
                ]
            job.prompts = [(p, c.prompt_ids) for p, c in zip(texts, commands, strict=True)]
            job.sample_ids = [engine.submit(command, sink) for command in commands]
        except UserError as exc:
            job.error = str(exc)
        wanted += [r for rids in job.sample_ids for r in rids]
    progress.total = len(wanted)
    progress.refresh()
    with lock:
        engine.run_until(lambda: all(r in finals for r in wanted), lock)
    progress.close()

    counts = {"ok": 0, "failed": 0}
    with output_path.open("w") as f:
        for i, job in enumerate(jobs):
            record = {
                "id": f"batch_req_{i}",
                "custom_id": job.custom_id,
                "response": None,
                "error": None,
            }
            outs = [[finals[r] for r in rids] for rids in job.sample_ids]
            failed = [o.error for group in outs for o in group if o.error]
            if job.error or failed:
                message = job.error or failed[0]
                record["response"] = {
                    "status_code": 400 if job.error else 500,
                    "request_id": f"batch_req_{i}",
                    "body": {"error": {"message": message, "type": "invalid_request_error"}},
                }
                record["error"] = {
                    "code": "invalid_request" if job.error else "internal_error",
                    "message": message,
                }
                counts["failed"] += 1
            else:
                if job.url.endswith("chat/completions"):
                    body = responses.chat_response(
                        model_name, engine.tokenizer, len(job.prompts[0][1]), outs[0]
                    )
                else:
                    body = responses.completion_response(
                        model_name,
                        engine.tokenizer,
                        job.prompts,
                        outs,
                        job.params,
                        echo=bool(job.request.echo),
                    )
                record["response"] = {
                    "status_code": 200,
                    "request_id": f"batch_req_{i}",
                    "body": body,
                }
                counts["ok"] += 1
            f.write(json.dumps(record) + "\n")
    return counts
