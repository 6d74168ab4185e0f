#!/usr/bin/env bash
# Real vllm-ascend releases beside the vLLM each pairs with, as sources only (no NPU needed):
#   .venv-matrix/src/vllm-0.23.0 + vllm_ascend-0.23.0, vllm-0.26.0 + vllm_ascend-0.26.0rc1,
#   .venv-matrix/extra: gguf and scipy (pure imports vLLM 0.23 / vllm-ascend need; no deps pulled).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
ROOT=.venv-matrix
mkdir -p "$ROOT/wheels" "$ROOT/src"
for spec in vllm==0.23.0 vllm==0.26.0 vllm-ascend==0.23.0 vllm-ascend==0.26.0rc1; do
  name=${spec%%==*}; version=${spec##*==}; dest="$ROOT/src/${name//-/_}-$version"
  [ "$name" = vllm ] && dest="$ROOT/src/vllm-$version"
  [ -d "$dest" ] && continue
  "$PY" -m pip download -q --no-deps -d "$ROOT/wheels" "$spec"
  wheel=$(ls "$ROOT"/wheels/"${name//-/_}"-"$version"*.whl | head -1)
  mkdir -p "$dest" && unzip -q -o "$wheel" -d "$dest" -x '*.so'
done
[ -d "$ROOT/extra/scipy" ] || "$PY" -m pip install -q --no-deps --target "$ROOT/extra" gguf scipy
