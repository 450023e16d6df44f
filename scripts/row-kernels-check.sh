#!/usr/bin/env bash
# Builds scripts/bench/row_kernels_check.cu (the LayerNorm and cross-entropy kernels of
# kernels.cu, outside the binary) into .gpu/NAME (default row-kernels-check), with
# libcudart.so.13 beside it. KERNELS_CU names another kernels.cu to build against (an older
# commit's, for an A/B in one call):
#   scripts/row-kernels-check.sh build [KERNELS_CU] [NAME] [NVCC_ARGS...]
# then, on the GPU machine: .gpu/NAME N C V REPS   (default 8192 768 0 50)
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
PREFIX=${MTRAIN_CUDA_PREFIX:-$HOME/.cache/mtrain-cuda13}
[ "${1:-}" = build ] || { sed -n 2,7p "$0"; exit 2; }
KCU=$(realpath "${2:-$ROOT/crates/kernels/src/kernels.cu}")
NAME=${3:-row-kernels-check}
shift $(( $# < 3 ? $# : 3 ))
mkdir -p "$ROOT/.gpu"
tmp=$(mktemp -d)
"$PREFIX/bin/nvcc" -gencode arch=compute_90,code=sm_90 -O3 -std=c++17 -DKERNELS_CU="\"$KCU\"" "$@" \
  -c "$ROOT/scripts/bench/row_kernels_check.cu" -o "$tmp/check.o"
g++ "$tmp/check.o" -o "$ROOT/.gpu/$NAME" -L"$PREFIX/lib" -lcudart -Wl,-rpath,'$ORIGIN'
cp "$PREFIX/lib/libcudart.so.13" "$ROOT/.gpu/"
rm -rf "$tmp"
echo "built .gpu/$NAME (carry it and .gpu/libcudart.so.13)"
