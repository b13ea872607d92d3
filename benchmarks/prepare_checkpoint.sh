#!/usr/bin/env bash
# Writes the benchmark model once: mci's `small` DeepSeek-V3-architecture checkpoint (108M params,
# random weights, bf16, HF format) into benchmarks/.peers/small-bf16, and its GGUF bf16
# conversion for llama.cpp into benchmarks/.peers/small-bf16.gguf; the same model made with
# --fp8 (e4m3, 128x128 block scales, DeepSeek-V3's format) into benchmarks/.peers/small-fp8,
# and the bf16 checkpoint converted to llama.cpp's q8_0 into benchmarks/.peers/small-q8_0.gguf.
# Idempotent.
#
#   bash benchmarks/prepare_checkpoint.sh
#   MCI="env PYTHONPATH=/tmp/mci-bench /work/main/.venv/bin/python -m mci" bash benchmarks/prepare_checkpoint.sh
#
# MCI: the command that runs mci's CLI (default: `python -m mci` of this checkout, with the
# project's venv when there is one). Needs benchmarks/install_peers.sh llama first.
set -euo pipefail
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
ROOT=$(dirname "$HERE")
PEERS=$HERE/.peers
if [ -z "${MCI:-}" ]; then
    py=python3; [ -x "$ROOT/.venv/bin/python" ] && py=$ROOT/.venv/bin/python
    MCI="env PYTHONPATH=$ROOT $py -m mci"
fi
CKPT=$PEERS/small-bf16
GGUF=$PEERS/small-bf16.gguf
FP8=$PEERS/small-fp8
Q8=$PEERS/small-q8_0.gguf
LLAMA_CPP_DIR=$(ls -d "$PEERS"/llama-cpp-python-*/vendor/llama.cpp 2>/dev/null | tail -1)

if [ ! -f "$CKPT/model.safetensors" ]; then
    rm -rf "$CKPT"
    $MCI make-checkpoint --size small --dtype bfloat16 --out "$CKPT"
fi

if [ ! -f "$FP8/model.safetensors" ]; then
    rm -rf "$FP8"
    $MCI make-checkpoint --size small --dtype bfloat16 --fp8 --out "$FP8"
fi

if [ ! -f "$GGUF" ] || [ ! -f "$Q8" ]; then
    [ -n "$LLAMA_CPP_DIR" ] || { echo "run benchmarks/install_peers.sh llama first" >&2; exit 1; }
    # The converter reads the MoE router's scoring function from config.json and silently falls
    # back to softmax routing without "scoring_func": "sigmoid". Convert from a shadow directory
    # (links to the weights and tokenizer) whose config.json is guaranteed to carry it.
    SHADOW=$PEERS/small-bf16-for-gguf
    rm -rf "$SHADOW" && mkdir -p "$SHADOW"
    for f in "$CKPT"/*; do
        [ "$(basename "$f")" = config.json ] || ln -s "$f" "$SHADOW/"
    done
    "$PEERS/llama-venv/bin/python" - "$CKPT/config.json" "$SHADOW/config.json" <<'PY'
import json, sys
cfg = json.load(open(sys.argv[1]))
cfg["scoring_func"] = "sigmoid"
cfg["topk_method"] = "noaux_tc"
json.dump(cfg, open(sys.argv[2], "w"), indent=2)
PY
    for out in "$GGUF:bf16" "$Q8:q8_0"; do
        file=${out%:*}
        [ -f "$file" ] && continue
        LLAMA_CPP_DIR=$LLAMA_CPP_DIR "$PEERS/llama-venv/bin/python" "$HERE/convert_gguf.py" \
            "$SHADOW" --outtype "${out#*:}" --outfile "$file.tmp"
        mv "$file.tmp" "$file"
    done
fi
ls -l "$CKPT" "$FP8" "$GGUF" "$Q8"
