#!/usr/bin/env bash
# Writes the benchmark model once: mci's `small` DeepSeek-V3-architecture checkpoint (108M params,
# random weights, bf16, HF format) into benchmarks/.peers/small-bf16, and its GGUF bf16
# conversion for llama.cpp into benchmarks/.peers/small-bf16.gguf; the same model made with
# --fp8 (e4m3, 128x128 block scales, DeepSeek-V3's format) into benchmarks/.peers/small-fp8,
# and the bf16 checkpoint converted to llama.cpp's q8_0 into benchmarks/.peers/small-q8_0.gguf;
# for the long workloads, `small` with a 32k context (YaRN, as DeepSeek-V3) and its GGUF.
# Idempotent.
#
#   bash benchmarks/prepare_checkpoint.sh
#   bash benchmarks/prepare_checkpoint.sh mci-only    # no GGUF files (no llama.cpp needed)
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
LONG=$PEERS/small-bf16-32k  # the same size stretched to 32k positions (YaRN) for `long`
LONG_GGUF=$PEERS/small-bf16-32k.gguf
LLAMA_CPP_DIR=$(ls -d "$PEERS"/llama-cpp-python-*/vendor/llama.cpp 2>/dev/null | tail -1 || true)

if [ ! -f "$CKPT/model.safetensors" ]; then
    rm -rf "$CKPT"
    $MCI make-checkpoint --size small --dtype bfloat16 --out "$CKPT"
fi

if [ ! -f "$FP8/model.safetensors" ]; then
    rm -rf "$FP8"
    $MCI make-checkpoint --size small --dtype bfloat16 --fp8 --out "$FP8"
fi

if [ ! -f "$LONG/model.safetensors" ]; then
    rm -rf "$LONG"
    $MCI make-checkpoint --size small --dtype bfloat16 --context 32768 --out "$LONG"
fi

# mci-only (make test-gpu): the checkpoints mci serves, no GGUF (no llama.cpp there)
if [ "${1:-}" = mci-only ]; then
    ls -l "$CKPT" "$FP8" "$LONG"
    exit 0
fi

# to_gguf CHECKPOINT OUT TYPE
to_gguf() {
    [ -f "$2" ] && return
    [ -n "$LLAMA_CPP_DIR" ] || { echo "run benchmarks/install_peers.sh llama first" >&2; exit 1; }
    # The converter reads the MoE router's scoring function from config.json and silently falls
    # back to softmax routing without "scoring_func": "sigmoid". Convert from a shadow directory
    # (links to the weights and tokenizer) whose config.json is guaranteed to carry it.
    local shadow=$1-for-gguf
    rm -rf "$shadow" && mkdir -p "$shadow"
    for f in "$1"/*; do
        [ "$(basename "$f")" = config.json ] || ln -s "$f" "$shadow/"
    done
    "$PEERS/llama-venv/bin/python" - "$1/config.json" "$shadow/config.json" <<'PY'
import json, sys
cfg = json.load(open(sys.argv[1]))
cfg["scoring_func"] = "sigmoid"
cfg["topk_method"] = "noaux_tc"
json.dump(cfg, open(sys.argv[2], "w"), indent=2)
PY
    LLAMA_CPP_DIR=$LLAMA_CPP_DIR "$PEERS/llama-venv/bin/python" "$HERE/convert_gguf.py" \
        "$shadow" --outtype "$3" --outfile "$2.tmp"
    mv "$2.tmp" "$2"
}
to_gguf "$CKPT" "$GGUF" bf16
to_gguf "$CKPT" "$Q8" q8_0
to_gguf "$LONG" "$LONG_GGUF" bf16
ls -l "$CKPT" "$FP8" "$LONG" "$GGUF" "$Q8" "$LONG_GGUF"
