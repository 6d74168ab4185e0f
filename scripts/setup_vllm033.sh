#!/usr/bin/env bash
# Optional (`make setup-vllm033`): vLLM 0.33.0's sources, without any dependency, in a separate
# directory, so scheduler-level tests can put them first on sys.path and check the plugin's
# pure-Python logic against 0.33 while everything else (torch, transformers...) comes from .venv.
#
#   .venv-vllm033/site/vllm/...    the Python modules and data of the vllm==0.33.0 wheel
#                                  (scripts/unpack_sources.py: ~60 MB; its CUDA extensions and
#                                  vendored headers, ~750 MB, are left out and the wheel deleted)
#   .venv-vllm033/.stamp           the installed version; a matching stamp makes a rerun a no-op
#
# Use:  PYTHONPATH=.venv-vllm033/site .venv/bin/python -c 'import vllm; print(vllm.__version__)'
# (or insert the path at sys.path[0] in a subprocess).  FORCE=1 reinstalls.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
DEST="${VLLM033_DIR:-$ROOT/.venv-vllm033}"
SITE="$DEST/site"
VERSION="0.33.0"
STAMP="$DEST/.stamp"
PY="$ROOT/.venv/bin/python"
[[ -x "$PY" ]] || PY="python3"

if [[ "${FORCE:-0}" != "1" && -f "$STAMP" && "$(cat "$STAMP")" == "$VERSION" && -d "$SITE/vllm" ]]; then
    echo "setup_vllm033: vllm $VERSION already in $SITE"
    exit 0
fi

start=$SECONDS
log() { echo "setup_vllm033 [$((SECONDS - start))s]: $*"; }

mkdir -p "$DEST"
rm -f "$STAMP"
wheels="$DEST/.download"  # kept when the download fails: a rerun resumes its .part file
mkdir -p "$wheels"
trap 'rm -rf "$SITE.new"' EXIT

log "downloading vllm==$VERSION (the wheel only; resumes a dropped transfer)"
if ! wheel="$("$PY" "$ROOT/scripts/fetch_wheel.py" "vllm==$VERSION" "$wheels" | tail -1)"; then
    echo "setup_vllm033: could not download vllm==$VERSION (fetch_wheel's reason above)" >&2
    exit 1
fi
log "got $(basename "$wheel") ($(du -h "$wheel" | cut -f1))"

log "unpacking its Python modules into $SITE"
rm -rf "$SITE.new"
"$PY" "$ROOT/scripts/unpack_sources.py" "$wheel" "$SITE.new"
rm -rf "$wheels" "$SITE" "$DEST"/.download-*  # (.download-* : earlier versions of this script)
mv "$SITE.new" "$SITE"

got="$(cd / && "$PY" - "$SITE" <<'PYEOF'
import importlib.metadata as md
import sys
print(next(md.distributions(path=[sys.argv[1]], name="vllm")).version)
PYEOF
)"
[[ "$got" == "$VERSION" ]] || { echo "setup_vllm033: installed version is '$got'" >&2; exit 1; }
echo "$VERSION" > "$STAMP"
log "done: vllm $got in $SITE ($(du -sh "$SITE" | cut -f1)); use PYTHONPATH=$SITE"
