#!/usr/bin/env bash
# Builds scripts/bench/flash_hopper_check.cu (the Hopper attention kernels against the wide ones,
# outside the binary) into .gpu/flash-hopper-check, with libcudart.so.13 beside it (the GPU
# machines have the driver, not the toolkit). Extra arguments go to nvcc: -DHEAD_DIM=128 for
# the other head size, -DHP_FWD_WGS=3 -DHP_FWD_BLOCKS=1 ... (the six HP_*_WGS and HP_*_BLOCKS
# of the two-pass kernels and HP_FWD_N together) to try other shapes.
#   scripts/flash-hopper-check.sh build [NVCC_ARGS...]
# then, on the GPU machine: .gpu/flash-hopper-check BH T REPS   (default 48 4096 20)
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
PREFIX=${MTRAIN_CUDA_PREFIX:-$HOME/.cache/mtrain-cuda13}
[ "${1:-}" = build ] || { sed -n 2,7p "$0"; exit 2; }
shift
mkdir -p "$ROOT/.gpu"
tmp=$(mktemp -d)
"$PREFIX/bin/nvcc" -gencode arch=compute_90a,code=sm_90a -O3 -std=c++17 "$@" \
  -c "$ROOT/scripts/bench/flash_hopper_check.cu" -o "$tmp/check.o"
g++ "$tmp/check.o" -o "$ROOT/.gpu/flash-hopper-check" -L"$PREFIX/lib" -lcudart -Wl,-rpath,'$ORIGIN'
cp "$PREFIX/lib/libcudart.so.13" "$ROOT/.gpu/"
rm -rf "$tmp"
echo "built .gpu/flash-hopper-check (carry it and .gpu/libcudart.so.13)"
