#!/usr/bin/env bash
# The two-GPU checks and measurements, on a machine with 2+ GPUs, after `scripts/build-gpu.sh --tests`
# here (the checkout with .gpu/ carried there).
#
# Usage (on the GPU machine, from the repository root):
#   scripts/gpu-multi.sh [OUT_DIR]
#
#   1. the NCCL backend's tests (every collective across the GPUs, stream ordering);
#   2. all-reduce bus bandwidth, mtrain bench-comm next to torch.distributed (same sizes, same run);
#   3. tp = 2 and pp = 2 against one GPU over 10 steps (mtrain parity, tiny model, f32);
#   4. DDP: GPT-2 124M in bf16 on 1 and 2 GPUs (tokens/s, comm and exposed comm per step), and
#      PyTorch DDP on 1 and 2 GPUs for the same batch.
# Each command has a time limit, so one that hangs cannot take the rest with it.
set -uo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT"
OUT=${1:-.gpu/out-multi}
BIN=${MTRAIN_GPU_BIN:-/tmp/mtrain-gpu}
mkdir -p "$OUT" "$BIN"
# shellcheck disable=SC1091
source scripts/gpu-env.sh
export TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
for f in mtrain comm-tests; do
  mtrain_unpack ".gpu/$f.xz" "$BIN/$f"
done
M=$BIN/mtrain
SIZES=(-b 16M -e 1G -f 4)
{ date -u +%FT%TZ; nvidia-smi --query-gpu=name,driver_version --format=csv,noheader; } | tee "$OUT/machine.txt"

echo "== NCCL backend tests"
# --include-ignored: the multi-GPU test, ignored by default, runs here.
timeout 180 "$BIN/comm-tests" nccl:: --test-threads=1 --include-ignored > "$OUT/comm-tests.log" 2>&1
grep -E "^test |test result" "$OUT/comm-tests.log"
echo "== all-reduce: mtrain"
timeout 120 "$M" --nproc-per-node 2 bench-comm "${SIZES[@]}" --op all-reduce --device cuda > "$OUT/bench-comm.log" 2>&1
grep -E "^\[rank 0\] +[0-9]" "$OUT/bench-comm.log"
echo "== all-reduce: torch.distributed"
timeout 120 python3 -m torch.distributed.run --nproc_per_node=2 scripts/bench/torch_comm_ref.py \
  --op all-reduce "${SIZES[@]}" > "$OUT/torch-comm.log" 2>&1
grep -E "^ +[0-9]" "$OUT/torch-comm.log"
for vs in "--tp 2" "--pp 2"; do
  echo "== parity $vs"
  timeout 150 "$M" parity --config configs/tiny.toml --vs "$vs" --set device=cuda --steps 10 \
    > "$OUT/parity-${vs// /}.log" 2>&1
  tail -2 "$OUT/parity-${vs// /}.log"
done
echo "== DDP, GPT-2 124M bf16, 16 x 1024 per GPU"
for dp in 1 2; do
  timeout 150 "$M" --dp $dp --config configs/gpt2-124m.toml --device cuda --dtype bf16 --steps 8 \
    --eval-every 0 --ckpt-every 0 --batch-size 16 --grad-accum 1 --log-every 1 \
    --run-dir "$OUT/ddp$dp" > "$OUT/ddp$dp.log" 2>&1
  grep -E "step=7" "$OUT/ddp$dp.log" | tail -2
done
T=scripts/bench/torch_gpt_ref.py
timeout 120 python3 $T --batch 16 --steps 15 --warmup 5 2>&1 | grep '^{'
timeout 150 python3 -m torch.distributed.run --nproc_per_node=2 $T --mode ddp --batch 16 --steps 15 \
  --warmup 5 2>&1 | grep '^{'
