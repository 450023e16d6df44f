#!/usr/bin/env bash
# Build the CUDA-enabled mtrain binary and prepare it to be copied to a GPU machine.
#
# Usage: scripts/build-gpu.sh [--tests]
#   Builds `mtrain` with `--features cuda` in release mode into a separate target directory
#   (target-cuda/, so the CPU build in target/ is never invalidated), strips it and writes it to
#   .gpu/mtrain.xz. With --tests it also packs the test binaries of the GPU code: the NCCL
#   backend's (.gpu/comm-tests.xz) and the memory probe's (.gpu/trainer-tests.xz).
#   Stripped, a CUDA binary is about 55 MB, mostly the PTX of candle's kernels, which xz packs
#   to about 8 MB: small enough to copy with a checkout. scripts/gpu-test.sh unpacks them.
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
[ -d .git ] && { grep -qx '.gpu/' .git/info/exclude 2>/dev/null || echo '.gpu/' >> .git/info/exclude; }

pack() { # $1 = built executable, $2 = name in .gpu/
  strip -o ".gpu/$2" "$1"
  xz -T0 -6 -f ".gpu/$2"
  echo "packed .gpu/$2.xz ($(du -h ".gpu/$2.xz" | cut -f1))"
}

# The path of the test executable cargo built for a crate's library.
lib_tests() { # $1 = package
  nice -n 19 cargo test --release -p "$1" --features cuda --lib --no-run --message-format=json \
    | python3 -c 'import json, sys
for line in sys.stdin:
    m = json.loads(line)
    if m.get("reason") == "compiler-artifact" and m.get("executable") and m["target"]["kind"] == ["lib"]:
        print(m["executable"])' | tail -1
}

nice -n 19 cargo build --release -p mtrain-trainer --features cuda --bin mtrain
pack "$CARGO_TARGET_DIR/release/mtrain" mtrain
if [ "${1:-}" = "--tests" ]; then
  pack "$(lib_tests mtrain-comm)" comm-tests
  pack "$(lib_tests mtrain-trainer)" trainer-tests
fi
echo "copy the checkout with .gpu/ to the GPU machine; there: scripts/gpu-test.sh"
