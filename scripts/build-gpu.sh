#!/usr/bin/env bash
# Build the CUDA-enabled mtrain binary and prepare it to be copied to a GPU machine.
#
# Usage: scripts/build-gpu.sh [--tests]
#   Builds `mtrain` with `--features cuda` in release mode into a separate target directory
#   (target-cuda/, so the CPU build in target/ is never invalidated), strips it, and copies it
#   to .gpu/mtrain. With --tests it also builds the comm crate's test binary (the NCCL
#   self-tests) and copies it to .gpu/comm-tests.
#   The toolchain comes from scripts/cuda-setup.sh (an existing CUDA_HOME, or CUDA 13.0 wheels).
#   Environment: CUDA_COMPUTE_CAP (default 90), MTRAIN_CUDA_PREFIX (toolchain cache).
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT"
PREFIX=${MTRAIN_CUDA_PREFIX:-$HOME/.cache/mtrain-cuda13}
[ -f "$PREFIX/env.sh" ] || scripts/cuda-setup.sh "$PREFIX"
# shellcheck disable=SC1091
source "$PREFIX/env.sh"
export CARGO_TARGET_DIR=${CARGO_TARGET_DIR:-$ROOT/target-cuda}
mkdir -p .gpu
grep -qx '.gpu/' .git/info/exclude 2>/dev/null || echo '.gpu/' >> .git/info/exclude

nice -n 19 cargo build --release -p mtrain-trainer --features cuda --bin mtrain
strip -o .gpu/mtrain "$CARGO_TARGET_DIR/release/mtrain"
echo "built .gpu/mtrain ($(du -h .gpu/mtrain | cut -f1))"

if [ "${1:-}" = "--tests" ]; then
  exe=$(nice -n 19 cargo test --release -p mtrain-comm --features cuda --lib --no-run \
        --message-format=json 2>/dev/null \
        | python3 -c 'import json,sys
for l in sys.stdin:
    m = json.loads(l)
    if m.get("reason") == "compiler-artifact" and m.get("executable") and m["target"]["kind"] == ["lib"]:
        print(m["executable"])' | tail -1)
  strip -o .gpu/comm-tests "$exe"
  echo "built .gpu/comm-tests ($(du -h .gpu/comm-tests | cut -f1))"
fi
echo "carry .gpu to the GPU machine; there: source scripts/gpu-env.sh && scripts/gpu-test.sh"
