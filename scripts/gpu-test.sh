#!/usr/bin/env bash
# The GPU checks, run on a GPU machine with the binaries scripts/build-gpu.sh packed into .gpu/.
#
# Usage (on the GPU machine, from the repository root):
#   scripts/gpu-test.sh [OUT_DIR]        # OUT_DIR collects the logs (default: .gpu/out)
#
#   1. the NCCL backend's tests (comm-tests): every collective of a group of one against its
#      closed form, stream ordering of async ops, and, with 2+ GPUs, every collective across all
#      the machine's GPUs, one thread per GPU (uneven splits included);
#      Then the IPC backend's tests (every op against the CPU backend, world 2 and 4, ranks as
#      processes sharing GPU 0; a dead rank named within the timeout), and world 8 alone;
#   2. the CUDA memory probe's test (trainer-tests);
#   3. with MTRAIN_GPU_TRAIN=1: GPT-2 124M on one GPU with the memory report for
#      MTRAIN_GPU_STEPS steps (default 20); with MTRAIN_GPU_DTYPE (e.g. bf16) once more in
#      that compute dtype.
set -uo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT"
OUT=${1:-.gpu/out}
BIN=${MTRAIN_GPU_BIN:-/tmp/mtrain-gpu}
mkdir -p "$OUT" "$BIN"
# shellcheck disable=SC1091
source scripts/gpu-env.sh
status=0

for f in .gpu/*.xz; do
  [ -e "$f" ] || continue
  mtrain_unpack "$f" "$BIN/$(basename "$f" .xz)"
done

{ date -u +%FT%TZ; nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader; } \
  | tee "$OUT/machine.txt"

if [ -x "$BIN/comm-tests" ]; then
  echo "== NCCL backend tests"
  # The multi-GPU test is ignored by default; with 2+ GPUs it runs too.
  multi=()
  [ "$(nvidia-smi -L | grep -c '^GPU ')" -ge 2 ] && multi=(--include-ignored)
  "$BIN/comm-tests" nccl:: --test-threads=1 ${multi[@]+"${multi[@]}"} 2>&1 | tee "$OUT/comm-tests.log"
  [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
  echo "== IPC backend tests (ranks as processes on GPU 0)"
  "$BIN/comm-tests" ipc:: --test-threads=4 --skip world_8 2>&1 | tee "$OUT/ipc-tests.log"
  [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
  "$BIN/comm-tests" ipc::tests::ipc_ops_equal_the_cpu_backend_world_8 --exact --nocapture 2>&1 \
    | tee "$OUT/ipc-tests-world-8.log"
  [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
fi
if [ -x "$BIN/trainer-tests" ]; then
  echo "== CUDA memory probe test"
  "$BIN/trainer-tests" gpu_memory:: --test-threads=1 2>&1 | tee "$OUT/trainer-tests.log"
  [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
fi
if [ -x "$BIN/mtrain" ] && [ "${MTRAIN_GPU_TRAIN:-0}" = 1 ]; then
  steps=${MTRAIN_GPU_STEPS:-20}
  echo "== GPT-2 124M on one GPU, $steps steps, memory report"
  "$BIN/mtrain" --config configs/gpt2-124m.toml --device cuda --mem-report --steps "$steps" \
    2>&1 | tee "$OUT/train-gpt2-124m.log"
  [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
  if [ -n "${MTRAIN_GPU_DTYPE:-}" ]; then
    echo "== GPT-2 124M on one GPU, $steps steps, --dtype $MTRAIN_GPU_DTYPE, memory report"
    "$BIN/mtrain" --config configs/gpt2-124m.toml --device cuda --mem-report --steps "$steps" \
      --dtype "$MTRAIN_GPU_DTYPE" 2>&1 | tee "$OUT/train-gpt2-124m-$MTRAIN_GPU_DTYPE.log"
    [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
  fi
fi
exit $status
