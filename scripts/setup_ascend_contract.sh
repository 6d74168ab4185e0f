#!/usr/bin/env bash
# Real vllm-ascend releases beside the vLLM each pairs with, as sources only (no NPU needed):
#   .venv-matrix/src/vllm-0.23.0 + vllm_ascend-0.23.0, vllm-0.26.0 + vllm_ascend-0.26.0rc1,
#   .venv-matrix/extra: gguf and scipy (pure imports vLLM 0.23 / vllm-ascend need; no deps pulled).
# Only each wheel's Python and data are unpacked (scripts/unpack_sources.py); the wheels are deleted.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
ROOT=.venv-matrix
mkdir -p "$ROOT/src"
for spec in vllm==0.23.0 vllm==0.26.0 vllm-ascend==0.23.0 vllm-ascend==0.26.0rc1; do
  name=${spec%%==*}; version=${spec##*==}; dest="$ROOT/src/${name//-/_}-$version"
  [ "$name" = vllm ] && dest="$ROOT/src/vllm-$version"
  [ -d "$dest" ] && continue
  mkdir -p "$ROOT/wheels"
  wheel=$("$PY" scripts/fetch_wheel.py "$spec" "$ROOT/wheels" | tail -1)  # resumes a dropped transfer
  rm -rf "$dest.new"
  "$PY" scripts/unpack_sources.py "$wheel" "$dest.new"
  mv "$dest.new" "$dest"
  rm -f "$wheel"  # the unpacked Python is all that is used; the wheels were 600 MB
done
rm -rf "$ROOT/wheels"  # also what earlier versions of this script left there
[ -d "$ROOT/extra/scipy" ] || "$PY" -m pip install -q --no-cache-dir --no-deps --target "$ROOT/extra" gguf scipy
