#!/usr/bin/env bash
# Builds scripts/bench/gemm_epilogue_check.cu (cuBLASLt's algorithms for the GEMM with the
# GELU-derivative epilogue, each timed) into .gpu/gemm-epilogue-check, and
# scripts/bench/gemm_algos.cu (any of linear.rs's calls, the algorithms split over K too) into
# .gpu/gemm-algos, with libcudart.so.13 beside them. cuBLASLt itself is too large to carry: on
# the GPU machine the run takes PyTorch's.
#   scripts/gemm-epilogue-check.sh build
# then, on the GPU machine: scripts/gemm-epilogue-check.sh run IN OUT N REPS
#   (default 3072 768 8192 20: GPT-2 124M's c_proj backward at 8 x 1024)
# or: scripts/gemm-epilogue-check.sh algos KIND M N K REPS   (KIND: bias residual dgelu bgradb)
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
  "$PREFIX/bin/nvcc" -O2 -std=c++17 -c "$ROOT/scripts/bench/gemm_algos.cu" -o "$tmp/algos.o"
  g++ "$tmp/algos.o" -o "$ROOT/.gpu/gemm-algos" -L"$PREFIX/lib" -lcublasLt -lcudart -Wl,-rpath,'$ORIGIN'
  cp "$PREFIX/lib/libcudart.so.13" "$ROOT/.gpu/"
  rm -rf "$tmp"
  echo "built .gpu/gemm-epilogue-check and .gpu/gemm-algos (carry them and .gpu/libcudart.so.13)" ;;
run|algos)
  exe=$ROOT/.gpu/gemm-epilogue-check
  [ "$1" = algos ] && exe=$ROOT/.gpu/gemm-algos
  shift
  site=$(python3 -c 'import os, torch; print(os.path.dirname(os.path.dirname(torch.__file__)))')
  lib=$(dirname "$(find "$site/nvidia" -name 'libcublasLt.so.13*' | head -1)")
  LD_LIBRARY_PATH="$lib:$ROOT/.gpu" "$exe" "$@" ;;
*) sed -n 2,10p "$0"; exit 2 ;;
esac
