"""The replay harness: vLLM's real scheduler and KV-cache manager driven by a trace, with a
fake hybrid model whose Mamba states are fingerprints checked at every read.

Entry points: ``vllm-hybrid-backends replay`` (:mod:`.cli`), :func:`.harness.run_replay` (one
run), :func:`.report.compare_policies` (policies side by side). See ``docs/replay.md``.
Nothing here imports vLLM at import time.
"""
