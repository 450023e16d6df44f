#!/usr/bin/env bash
# Builds scripts/bench/gemm_epilogue_check.cu (cuBLASLt's algorithms for the GEMM with the
# GELU-derivative epilogue, each timed) into .gpu/gemm-epilogue-check, with libcudart.so.13
# beside it. cuBLASLt itself is too large to carry: on the GPU machine the run takes PyTorch's.
#   scripts/gemm-epilogue-check.sh build
# then, on the GPU machine: scripts/gemm-epilogue-check.sh run IN OUT N REPS
#   (default 3072 768 8192 20: GPT-2 124M's c_proj backward at 8 x 1024)
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
PREFIX=${MTRAIN_CUDA_PREFIX:-$HOME/.cache/mtrain-cuda13}
case "${1:-}" in
build)
  mkdir -p "$ROOT/.gpu"
  tmp=$(mktemp -d)
  "$PREFIX/bin/nvcc" -O2 -std=c++17 -c "$ROOT/scripts/bench/gemm_epilogue_check.cu" -o "$tmp/check.o"
  g++ "$tmp/check.o" -o "$ROOT/.gpu/gemm-epilogue-check" -L"$PREFIX/lib" -lcublasLt -lcudart \
    -Wl,-rpath,'$ORIGIN'
  cp "$PREFIX/lib/libcudart.so.13" "$ROOT/.gpu/"
  rm -rf "$tmp"
  echo "built .gpu/gemm-epilogue-check (carry it and .gpu/libcudart.so.13)" ;;
run)
  shift
  site=$(python3 -c 'import os, torch; print(os.path.dirname(os.path.dirname(torch.__file__)))')
  lib=$(dirname "$(find "$site/nvidia" -name 'libcublasLt.so.13*' | head -1)")
  LD_LIBRARY_PATH="$lib:$ROOT/.gpu" "$ROOT/.gpu/gemm-epilogue-check" "$@" ;;
*) sed -n 2,7p "$0"; exit 2 ;;
esac
