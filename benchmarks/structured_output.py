#!/usr/bin/env python3
"""Structured output cost, offline on the `small` checkpoint (bf16, random weights): decode
tokens/s with a nested JSON Schema vs unconstrained on the same prompts, and jump-forward on vs
off for a schema with long fixed keys. Each pair alternates within a round; medians printed.

    python benchmarks/structured_output.py --rounds 3

Needs the checkpoint of benchmarks/prepare_checkpoint.sh (benchmarks/.peers/small-bf16).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

from mci.core.sampling_params import SamplingParams
from mci.engine.config import EngineConfig, ModelPlacement
from mci.engine.engine import Engine
from mci.grammar.constraint import Constraint
from mci.scheduler.config import SchedulerConfig

CKPT = Path(__file__).resolve().parent / ".peers" / "small-bf16"
NESTED = {
    "type": "object",
    "properties": {
        "id": {"type": "integer", "minimum": 0, "maximum": 100000},
        "name": {"type": "string", "maxLength": 16},
        "active": {"type": "boolean"},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 8}, "maxItems": 4},
        "address": {
            "type": "object",
            "properties": {
                "street": {"type": "string", "maxLength": 20},
                "city": {"type": "string", "maxLength": 12},
                "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
            },
            "required": ["street", "city", "zip"],
        },
        "orders": {
            "type": "array",
            "maxItems": 3,
            "items": {
                "type": "object",
                "properties": {
                    "sku": {"type": "string", "maxLength": 8},
                    "qty": {"type": "integer", "minimum": 1, "maximum": 9},
                },
                "required": ["sku", "qty"],
            },
        },
    },
    "required": ["id", "name", "active", "address", "orders"],
}
LONG_KEYS = {
    "type": "object",
    "properties": {
        "customer_identifier_string": {"type": "string", "maxLength": 6},
        "total_order_amount_in_cents": {"type": "integer", "minimum": 0, "maximum": 999},
        "shipping_method_preference": {"enum": ["standard_ground", "express_overnight"]},
        "customer_loyalty_program_member": {"type": "boolean"},
    },
    "required": [
        "customer_identifier_string",
        "total_order_amount_in_cents",
        "shipping_method_preference",
        "customer_loyalty_program_member",
    ],
}


def run(engine: Engine, prompts, params) -> tuple[float, int, float]:
    """(seconds, output tokens, tokens per second)."""
    t = time.perf_counter()
    results = engine.generate(prompts, params)
    dt = time.perf_counter() - t
    tokens = sum(len(r.outputs[0].output_token_ids) for r in results)
    return dt, tokens, tokens / dt


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--requests", type=int, default=8)
    args = ap.parse_args()
    prompts = [f"Record {i}: " for i in range(args.requests)]
    nested = Constraint("json_schema", json.dumps(NESTED))
    long_keys = Constraint("json_schema", json.dumps(LONG_KEYS))

    def params(constraint, max_new_tokens=128, **kw):
        return SamplingParams(
            max_new_tokens=max_new_tokens, temperature=1.0, seed=1, constraint=constraint, **kw
        )

    engines = {
        jump: Engine(
            EngineConfig(
                model=ModelPlacement(model_path=CKPT, dtype="bfloat16"),
                scheduler=SchedulerConfig(enable_jump_forward=jump),
            ),
            background=False,
        )
        for jump in (False, True)
    }
    plain = engines[False]
    for engine in engines.values():  # warm-up: kernels, and the grammars compiled once
        engine.generate(prompts[:2], params(nested, 8))
        engine.generate(prompts[:2], params(long_keys, 8))
    rows: dict[str, list] = {}
    for _ in range(args.rounds):
        for name, engine, p in (
            ("unconstrained", plain, params(None, ignore_eos=True)),
            ("nested schema", plain, params(nested)),
            ("long keys, jump-forward off", engines[False], params(long_keys)),
            ("long keys, jump-forward on", engines[True], params(long_keys)),
        ):
            rows.setdefault(name, []).append(run(engine, prompts, p))
    print(f"{args.requests} requests at once, small checkpoint, bf16, temperature 1")
    print("| case | seconds | output tokens | tokens/s |")
    print("|---|---|---|---|")
    for name, runs in rows.items():
        secs = statistics.median(r[0] for r in runs)
        toks = statistics.median(r[1] for r in runs)
        tps = statistics.median(r[2] for r in runs)
        print(f"| {name} | {secs:.2f} | {toks:.0f} | {tps:.0f} |")
    for engine in engines.values():
        engine.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
