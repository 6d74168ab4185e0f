# Public commands (see README.md).  Everything runs from .venv, which `make setup` builds once
# (scripts/setup_env.sh; a no-op in well under a second when nothing changed).
VENV := .venv
PY := $(VENV)/bin/python

.PHONY: setup setup-vllm033 lint test demo fuzz

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

demo: setup
	$(VENV)/bin/vllm-hybrid-backends doctor
	$(PY) -m vllm_hybrid_backends.demo

# The replay harness's fuzzer at full strength: >= 10 000 random request streams through vLLM's
# scheduler, each checked by the state oracle (`make test` runs a few dozen).
fuzz: setup
	HYPOTHESIS_PROFILE=fuzz $(PY) -m pytest -q --timeout=0 tests/replay/test_fuzz.py
