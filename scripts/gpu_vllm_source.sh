#!/usr/bin/env bash
# Copy the part of the installed vLLM that `gpu_check --interior --vllm-source OUT` loads (vLLM's
# FLA and Mamba2 SSD kernel modules and the few files they import; vllm_hybrid_backends/vllm_source.py
# says which) into OUT, plus einops, for a GPU machine without vLLM. Only .py files; prints the size.
#
#   bash scripts/gpu_vllm_source.sh .devrun/vllm-src          # PYTHON=... picks the interpreter
set -euo pipefail
out=${1:?usage: $0 OUT  (e.g. .devrun/vllm-src, git-ignored)}
py=${PYTHON:-$(if [ -x .venv/bin/python ]; then echo .venv/bin/python; else echo python3; fi)}
read -r vllm einops < <("$py" - <<'PY'
import importlib.util
def where(name):
    spec = importlib.util.find_spec(name)  # the package's directory, without importing it
    return spec.submodule_search_locations[0] if spec and spec.submodule_search_locations else "-"
print(where("vllm"), where("einops"))
PY
)
if [ "$vllm" = - ]; then
    echo "gpu_vllm_source: vLLM is not installed for $py (PYTHON=... picks another)" >&2
    exit 1
fi
# never the installed packages themselves (OUT their site-packages): those would be deleted
for pkg in "$vllm" "$einops"; do
    [ "$pkg" != - ] && [ -d "$out/$(basename "$pkg")" ] || continue
    if [ "$(cd "$out/$(basename "$pkg")" && pwd -P)" = "$(cd "$pkg" && pwd -P)" ]; then
        echo "gpu_vllm_source: $out/$(basename "$pkg") is the installed $(basename "$pkg") itself; pick another OUT" >&2
        exit 1
    fi
done
rm -rf "$out/vllm" "$out/einops"
mkdir -p "$out"
copy() {  # copy FILE... (relative to vLLM's package directory)
    for f in "$@"; do
        mkdir -p "$out/vllm/$(dirname "$f")"
        cp "$vllm/$f" "$out/vllm/$f"
    done
}
copy _version.py envs.py utils/math_utils.py utils/gpu_sync_debug.py \
    v1/attention/backends/mamba_attn.py
# FLA's license, where the tree has it (a wheel's unpacked Python sources may not)
if [ -f "$vllm/third_party/flash_linear_attention/LICENSE" ]; then
    copy third_party/flash_linear_attention/LICENSE
fi
(cd "$vllm" && find third_party/flash_linear_attention/ops model_executor/layers/mamba/ops \
    -maxdepth 1 -name '*.py') | while read -r f; do copy "$f"; done
if [ "$einops" != - ]; then
    mkdir -p "$out/einops"
    (cd "$einops" && find . -name '*.py' -not -path '*/__pycache__/*') | while read -r f; do
        mkdir -p "$out/einops/$(dirname "$f")"
        cp "$einops/$f" "$out/einops/$f"
    done
else
    echo "gpu_vllm_source: einops is not installed for $py; the target needs its own" >&2
fi
version=$(sed -n "s/^__version__ = version = '\(.*\)'/\1/p" "$out/vllm/_version.py")
echo "$out: vLLM $version kernel sources from $vllm$( [ "$einops" != - ] && echo ", einops"), $(du -sh "$out" | cut -f1)"
