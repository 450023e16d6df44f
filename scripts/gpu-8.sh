#!/usr/bin/env bash
# Every layout on one 8-GPU node, with parity against one GPU and collective bandwidth next to
# torch.distributed, after `scripts/build-gpu.sh --tests` here (the checkout with .gpu/ carried).
#
# Usage (on the GPU machine, from the repository root):
#   scripts/gpu-8.sh [OUT_DIR]
#
#   1. training, STEPS steps each, bf16 with the memory report (tokens/s, MFU, peak per rank in the
#      logs): tp4 x pp2, dp8, dp8 FSDP, tp8, tp2 x pp2 x dp2 on DENSE, and dp8 with ep4 on MOE;
#   2. parity of PARITY_STEPS steps of each layout against one GPU (mtrain parity, f32, short
#      sequences so the one-GPU reference holds the whole global batch);
#   3. bench-comm over NPROC GPUs for all-reduce, all-gather, reduce-scatter, all-to-all, and
#      torch.distributed for the same ops and sizes (SKIP_TORCH=1 leaves it out).
# Environment: DEVICE (cuda), DENSE (configs/gpt2-350m.toml), MOE (configs/moe-tiny.toml),
# STEPS (20), GRAD_ACCUM (4, micro-steps per training step), PARITY_STEPS (10), PARITY_SEQ (256), PARITY_BATCH (2, sequences per dp rank: a
# multiple of the pipeline's 2 micro-batches), NPROC (8), SIZES ("-b 1M -e 1G -f 4"),
# LIMIT (seconds per command, 300). Each command has that time limit, so one that hangs cannot
# take the rest with it; a failure is reported and the script goes on.
set -uo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT"
OUT=${1:-.gpu/out-8}
DEVICE=${DEVICE:-cuda}
DENSE=${DENSE:-configs/gpt2-350m.toml}
MOE=${MOE:-configs/moe-tiny.toml}
STEPS=${STEPS:-20}
GRAD_ACCUM=${GRAD_ACCUM:-4}
PARITY_STEPS=${PARITY_STEPS:-10}
PARITY_SEQ=${PARITY_SEQ:-256}
PARITY_BATCH=${PARITY_BATCH:-2}
NPROC=${NPROC:-8}
read -r -a SIZES <<< "${SIZES:--b 1M -e 1G -f 4}"
LIMIT=${LIMIT:-300}
mkdir -p "$OUT"
if [ "$DEVICE" = cuda ]; then
  BIN=${MTRAIN_GPU_BIN:-/tmp/mtrain-gpu}
  mkdir -p "$BIN"
  # shellcheck disable=SC1091
  source scripts/gpu-env.sh
  export TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
  mtrain_unpack .gpu/mtrain.xz "$BIN/mtrain"
  M=$BIN/mtrain
  DTYPE=(--dtype bf16)
  { date -u +%FT%TZ; nvidia-smi --query-gpu=name,driver_version --format=csv,noheader; } | tee "$OUT/machine.txt"
else
  M=${MTRAIN:-target/release/mtrain}
  DTYPE=()
fi
status=0
run() {  # name, command...
  local name=$1; shift
  echo "== $name: $*"
  if timeout "$LIMIT" "$@" > "$OUT/$name.log" 2>&1; then
    grep -E "step=$((STEPS - 1)) |parity OK|peak|Avg bus" "$OUT/$name.log" | tail -4
  else
    echo "FAILED ($?): see $OUT/$name.log"; tail -5 "$OUT/$name.log"; status=1
  fi
}

DENSE_LAYOUTS=("--tp 4 --pp 2" "--dp 8" "--dp 8 --fsdp" "--tp 8" "--tp 2 --pp 2 --dp 2")
MOE_LAYOUT="--dp 8 --ep 4"
slug() { echo "$1" | tr -d ' -'; }

for L in "${DENSE_LAYOUTS[@]}"; do
  # shellcheck disable=SC2086
  run "train-$(slug "$L")" "$M" $L --config "$DENSE" --device "$DEVICE" "${DTYPE[@]}" --steps "$STEPS" \
    --grad-accum "$GRAD_ACCUM" --mem-report --log-every 5 --eval-every 0 --ckpt-every 0 --run-dir "$OUT/run-$(slug "$L")"
done
# shellcheck disable=SC2086
run "train-$(slug "$MOE_LAYOUT")" "$M" $MOE_LAYOUT --config "$MOE" --device "$DEVICE" --steps "$STEPS" \
  --mem-report --log-every 5 --eval-every 0 --ckpt-every 0 --run-dir "$OUT/run-$(slug "$MOE_LAYOUT")"

for L in "${DENSE_LAYOUTS[@]}"; do
  run "parity-$(slug "$L")" "$M" parity --config "$DENSE" --vs "$L" --set "device=$DEVICE" \
    --steps "$PARITY_STEPS" --seq-len "$PARITY_SEQ" --batch-size "$PARITY_BATCH" --out "$OUT/parity-$(slug "$L")"
done
run "parity-$(slug "$MOE_LAYOUT")" "$M" parity --config "$MOE" --vs "$MOE_LAYOUT" --set "device=$DEVICE" \
  --steps "$PARITY_STEPS" --out "$OUT/parity-$(slug "$MOE_LAYOUT")"

for op in all-reduce all-gather reduce-scatter all-to-all; do
  run "bench-comm-$op" "$M" --nproc-per-node "$NPROC" bench-comm "${SIZES[@]}" --op "$op" --device "$DEVICE"
  if [ "${SKIP_TORCH:-0}" != 1 ]; then
    backend=nccl; [ "$DEVICE" = cuda ] || backend=gloo
    run "torch-comm-$op" python3 -m torch.distributed.run --nproc_per_node="$NPROC" \
      scripts/bench/torch_comm_ref.py --backend "$backend" --op "$op" "${SIZES[@]}"
  fi
done
exit $status
