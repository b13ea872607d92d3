"""Run llama.cpp's `convert_hf_to_gguf.py` (vendored in the llama-cpp-python sdist) on an mci
checkpoint.

Usage: LLAMA_CPP_DIR=.../vendor/llama.cpp llama-venv/bin/python convert_gguf.py <convert args...>

One change to the converter, made at run time (the vendored file is not edited): mci's checkpoints
carry a small byte-level BPE tokenizer whose pre-tokenizer hash is in no upstream table, so the
converter would stop with "BPE pre-tokenizer was not recognized". For an unknown hash we write
the generic pre-tokenizer "default" instead. The benchmark sends token-id prompts, so the
pre-tokenizer only affects how llama.cpp renders output text, never the computation.
"""

import logging
import os
import runpy
import sys

llama_dir = os.environ["LLAMA_CPP_DIR"]
sys.path.insert(0, llama_dir)
sys.path.insert(0, os.path.join(llama_dir, "gguf-py"))

from conversion import base  # noqa: E402

_orig = base.TextModel.get_vocab_base_pre


def _get_vocab_base_pre(self, tokenizer) -> str:
    try:
        return _orig(self, tokenizer)
    except NotImplementedError:
        logging.getLogger("convert_gguf").warning(
            "unrecognized BPE pre-tokenizer: writing tokenizer.ggml.pre = 'default'"
        )
        return "default"


base.TextModel.get_vocab_base_pre = _get_vocab_base_pre
sys.argv = [os.path.join(llama_dir, "convert_hf_to_gguf.py"), *sys.argv[1:]]
runpy.run_path(sys.argv[0], run_name="__main__")
