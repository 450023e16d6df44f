#!/usr/bin/env bash
# The GPU checks, run on a GPU machine with the binaries scripts/build-gpu.sh put in .gpu/.
#
# Usage (on the GPU machine, from the repository root):
#   scripts/gpu-test.sh [OUT_DIR]        # OUT_DIR collects the logs (default: .gpu/out)
#
#   1. the NCCL backend's tests (.gpu/comm-tests): every collective of a group of one against its
#      closed form, stream ordering of async ops, and, with 2+ GPUs, every collective across
#      all the machine's GPUs (uneven splits included);
#   2. with .gpu/mtrain: the training run of GPT-2 124M on one GPU with the memory report
#      (MTRAIN_GPU_STEPS steps, default 20), when the trainer accepts `--device cuda`.
set -uo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT"
OUT=${1:-.gpu/out}
mkdir -p "$OUT"
# shellcheck disable=SC1091
source scripts/gpu-env.sh
status=0

{ date -u +%FT%TZ; nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader; } \
  | tee "$OUT/machine.txt"

if [ -x .gpu/comm-tests ]; then
  echo "== NCCL backend tests"
  .gpu/comm-tests nccl:: --test-threads=1 2>&1 | tee "$OUT/comm-tests.log" || status=1
fi

if [ -x .gpu/mtrain ]; then
  steps=${MTRAIN_GPU_STEPS:-20}
  echo "== GPT-2 124M on one GPU, $steps steps, memory report"
  .gpu/mtrain --config configs/gpt2-124m.toml --device cuda --mem-report --steps "$steps" \
    2>&1 | tee "$OUT/train-gpt2-124m.log" || status=1
fi
exit $status
