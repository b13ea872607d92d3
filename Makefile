# Two entry points for a newcomer: `make run` and `make test`. Each creates .venv on first use.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
# The CPU build of torch: on a CPU-only machine plain `pip install torch` pulls a multi-GB CUDA build.
TORCH  ?= torch==2.13.0
PROMPT ?= def fibonacci(n):

.PHONY: run generate test test-slow test-ray test-gpu chaos test-lm-eval fuzz lint bench clean default-model

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH)"
	$(PY) -m pip install -q -e '.[test,bench]'
	touch $@

run: $(VENV)/.installed
	$(VENV)/bin/mci serve

generate: $(VENV)/.installed
	$(VENV)/bin/mci generate --prompt "$(PROMPT)" --max-new-tokens 32

test: $(VENV)/.installed
	$(PY) -m ruff check mci tests scripts benchmarks examples
	$(PY) -m pytest -q

# Contract fuzzing of the live server's OpenAPI schema, deeper than CI's seeded pass.
FUZZ_EXAMPLES ?= 300
FUZZ_SEED     ?= random
fuzz: $(VENV)/.installed
	FUZZ_EXAMPLES=$(FUZZ_EXAMPLES) FUZZ_SEED=$(FUZZ_SEED) $(PY) -m pytest -q -s tests/test_fuzz.py

# The chaos and soak suite (scripts/chaos.py) with its 10-minute mixed soak; CI runs a short
# version (tests/test_chaos.py). Results: chaos-results/chaos.json and chaos.png.
SOAK_SECONDS ?= 600
chaos: $(VENV)/.installed
	$(PY) scripts/chaos.py --soak-seconds $(SOAK_SECONDS) --out chaos-results

test-slow: $(VENV)/.installed
	$(PY) -m pytest -q -m slow

# `mci serve-ray` on a local Ray cluster (slow). Ray Serve lives in its own venv: it installs
# uvloop and httptools, which uvicorn would then pick up in .venv's servers and benchmarks.
RAY_VENV := .venv-ray
$(RAY_VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(RAY_VENV)
	$(RAY_VENV)/bin/python -m pip install -q --upgrade pip
	$(RAY_VENV)/bin/python -m pip install -q "$(TORCH)"
	$(RAY_VENV)/bin/python -m pip install -q -e '.[test,ray]'
	touch $@

test-ray: $(RAY_VENV)/.installed
	$(RAY_VENV)/bin/python -m pytest -q -m slow tests/test_ray_serve.py tests/test_workflow_ray.py

# The GPU checks in one command, on a machine with CUDA: the transformers-parity suites and
# FP8 exactness with mci and transformers on the GPU (MCI_TEST_DEVICE), then a served benchmark
# (`mci serve --device cuda`, batch and single). On this CPU-only machine it stops at once.
# On a GPU image whose python already holds torch with CUDA (and mci's dependencies), use that
# python instead of building .venv (whose torch is the CPU build): `make test-gpu PY=python3`.
GPU_DEVICE ?= cuda
GPU_SUITES := tests/test_parity_hf.py tests/test_engine_parity.py tests/test_fp8_kernels.py \
	tests/test_prompt_logprobs.py
# Every step runs on $(PY), also where a .venv exists beside it (the scripts' own default).
# A GPU run is short: a server not ready or a benchmark not done in 5 minutes is a failure.
GPU_PY = $(if $(findstring /,$(PY)),$(abspath $(PY)),$(PY))
test-gpu: $(if $(filter $(VENV)/%,$(PY)),$(VENV)/.installed)
	$(PY) -c 'import sys, torch; torch.cuda.is_available() or sys.exit(f"test-gpu: torch {torch.__version__} sees no CUDA device")'
	MCI_TEST_DEVICE=$(GPU_DEVICE) $(PY) -m pytest -q $(GPU_SUITES)
	MCI="env PYTHONPATH=$(CURDIR) $(GPU_PY) -m mci" bash benchmarks/prepare_checkpoint.sh mci-only
	$(PY) benchmarks/run.py --engines mci --workloads batch,single --mci-extra "--device $(GPU_DEVICE)" \
		--mci-python $(GPU_PY) --ready-timeout 300 --bench-timeout 300 --doc docs/benchmarks-gpu.md

# lm-evaluation-harness through `mci serve` vs transformers (slow; installs the extra on first use).
test-lm-eval: $(VENV)/.installed
	$(PY) -c 'import lm_eval' 2>/dev/null || $(PY) -m pip install -q -e '.[lm-eval]'
	$(PY) -m pytest -q -m slow tests/test_lm_eval.py

lint: $(VENV)/.installed
	$(PY) -m ruff check mci tests scripts benchmarks examples
	$(PY) -m ruff format --check mci tests scripts benchmarks examples

bench: $(VENV)/.installed
	$(PY) benchmarks/bench_decode.py
	$(PY) benchmarks/bench_offline.py

clean:
	rm -rf $(VENV) .pytest_cache

# The bundled default model: ~42 min of training on 2 CPU cores, 10 min of MTP distillation,
# then the held-out evaluation and model card (docs/default-model.md). Not run in CI.
default-model: $(VENV)/.installed
	$(PY) scripts/train_default_model.py --minutes 42
	$(PY) scripts/train_mtp.py --minutes 10
	$(PY) scripts/eval_default_model.py
