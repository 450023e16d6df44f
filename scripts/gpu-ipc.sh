#!/usr/bin/env bash
# Every layout on one GPU through the IPC backend: ranks as processes sharing GPU 0, each
# reading its peers' GPU memory through CUDA IPC. Run on the GPU machine after
# `scripts/build-gpu.sh --tests` here (the checkout with .gpu/ carried there).
#
# Usage (from the repository root):
#   scripts/gpu-ipc.sh OUT_DIR
#
#   ops     the IPC op tests (comm-tests ipc::): every op against the CPU backend at world 2 and
#           4, kernel waits and a dead rank, together; then world 8 alone;
#   parity  every layout of the composition tests against one rank on the same GPU in f32
#           (mtrain parity --vs "LAYOUT --device cuda --dtype f32 --comm ipc"), 5 steps of 2
#           sequences (pp 4: 4) of 32 tokens per dp rank at the CPU tests' loss tolerance (1e-5): one
#           PASS/FAIL line per layout with the largest relative loss and grad-norm differences,
#           in OUT/parity.txt;
#   bench   bench-comm all-reduce on GPU 0, IPC one-shot and two-shot (MTRAIN_IPC_ONE_SHOT_MAX)
#           against the staged path, world 2, 4 and 8, 1K to 1M: OUT/bench-MODE-N.txt each and
#           the time per op side by side in OUT/bench.txt;
#   train   GPT-2 124M in bf16, tp 2 x pp 2 on the one GPU, IPC_TRAIN_STEPS steps with the memory
#           report per rank: OUT/train.log, and each process's GPU memory every 15 s as the
#           driver counts it: OUT/train-gpu-memory.csv.
# Environment: IPC_PARTS (the parts to run, default "ops parity bench train"), IPC_TRAIN_STEPS
# (50), PARITY_STEPS (5), LIMIT (seconds per command, 240; train: TRAIN_LIMIT, 590), DEVICE
# (cuda; with cpu the parity part runs this checkout's target/release/mtrain, or $MTRAIN, on the
# CPU backend, which checks the script on a machine without a GPU; the other parts need cuda).
# With the defaults, ops + parity + bench fit in one 600 s call; train takes about 5 minutes
# more at 50 steps (5.8 s a step on one H200, docs/journal.md). Each command has its time
# limit, so one that hangs cannot take the rest with it; a failure is reported and the script
# goes on, exiting non-zero at the end.
set -uo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT"
OUT=${1:?usage: scripts/gpu-ipc.sh OUT_DIR}
PARTS=${IPC_PARTS:-ops parity bench train}
DEVICE=${DEVICE:-cuda}
PARITY_STEPS=${PARITY_STEPS:-5}
LIMIT=${LIMIT:-240}
TRAIN_LIMIT=${TRAIN_LIMIT:-590}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
if [ "$DEVICE" = cuda ]; then
  BIN=${MTRAIN_GPU_BIN:-/tmp/mtrain-gpu}
  mkdir -p "$BIN"
  # shellcheck disable=SC1091
  source scripts/gpu-env.sh
  for f in .gpu/mtrain.xz .gpu/comm-tests.xz; do
    [ -e "$f" ] && mtrain_unpack "$f" "$BIN/$(basename "$f" .xz)"
  done
  M=$BIN/mtrain
  COMM=(--comm ipc)
  { date -u +%FT%TZ; nvidia-smi --query-gpu=name,driver_version,memory.total,compute_mode \
      --format=csv,noheader; } | tee "$OUT/machine.txt"
else
  M=${MTRAIN:-$ROOT/target/release/mtrain}
  COMM=()
  { date -u +%FT%TZ; echo "DEVICE=$DEVICE: $(nproc) CPUs, load $(cut -d' ' -f1-3 /proc/loadavg)"; } \
    | tee "$OUT/machine.txt"
fi
status=0
has() { [[ " $PARTS " == *" $1 "* ]]; }
needs_cuda() {
  [ "$DEVICE" = cuda ] && return 0
  echo "== $1: skipped (DEVICE=$DEVICE; this part needs cuda)"
  return 1
}
# run NAME LIMIT COMMAND...: the command's output into OUT/NAME.log; 0 when it succeeded.
run() {
  local name=$1 limit=$2; shift 2
  local t0=$SECONDS
  echo "== $name: $*"
  timeout "$limit" "$@" > "$OUT/$name.log" 2>&1
  local rc=$?
  echo "$name rc=$rc $((SECONDS - t0)) s" >> "$OUT/times.txt"
  if [ $rc -ne 0 ]; then
    echo "FAILED (exit $rc$([ $rc -eq 124 ] && echo ", past ${limit} s")): see $OUT/$name.log"
    tail -4 "$OUT/$name.log"
    status=1
  fi
  return $rc
}
slug() { echo "$1" | tr -d ' -'; }

if has ops && needs_cuda ops; then
  if run ipc-tests "$LIMIT" "$BIN/comm-tests" ipc:: --test-threads=4 --skip world_8; then
    grep -E "^test |test result" "$OUT/ipc-tests.log"
  fi
  if run ipc-tests-world-8 "$LIMIT" "$BIN/comm-tests" \
      ipc::tests::ipc_ops_equal_the_cpu_backend_world_8 --exact --nocapture; then
    grep -E "every op equal|test result" "$OUT/ipc-tests-world-8.log"
  fi
fi

if has parity; then
  # The layouts of the composition tests (crates/trainer/tests/composition.rs and
  # crates/parallel/tests/composition.rs), and pp 4, whose middle stages send and receive twice
  # as often as its ends: config, sequences per dp rank (a multiple of the micro-batches, pp by
  # default), layout flags.
  LAYOUTS=(
    "tiny.toml|2|--dp 2"
    "tiny.toml|2|--dp 2 --fsdp"
    "tiny.toml|2|--pp 2 --dp 2 --fsdp"
    "tiny.toml|2|--tp 2 --dp 2 --sequence-parallel"
    "tiny.toml|2|--tp 2 --dp 2 --sequence-parallel --zero-stage 2"
    "tiny.toml|2|--pp 2 --dp 2 --schedule 1f1b"
    "tiny.toml|4|--pp 4 --schedule 1f1b"
    "tiny.toml|2|--pp 2 --tp 2 --sequence-parallel --schedule interleaved --virtual-stages 2"
    "moe-tiny.toml|2|--dp 2 --ep 2"
    "tiny.toml|2|--tp 2 --pp 2 --dp 2"
    "tiny.toml|2|--tp 4 --pp 2"
  )
  : > "$OUT/parity.txt"
  for entry in "${LAYOUTS[@]}"; do
    IFS='|' read -r cfg batch layout <<< "$entry"
    vs="$layout --device $DEVICE --dtype f32${COMM[*]:+ ${COMM[*]}}"
    name=parity-$(slug "$layout")
    t0=$SECONDS
    run "$name" "$LIMIT" "$M" parity --config "configs/$cfg" --vs "$vs" --steps "$PARITY_STEPS" \
      --batch-size "$batch" --seq-len 32 --tol 1e-5 --out "$OUT/$name"
    figure=$(grep -o "max relative difference vs .*" "$OUT/$name.log" | sed 's/.*`: //')
    if grep -q "^parity OK" "$OUT/$name.log"; then verdict=PASS; else verdict=FAIL; fi
    [ -n "$figure" ] || figure="no comparison: $(grep -m1 -E "^error" "$OUT/$name.log")"
    printf '%s  %-78s %s (%d s)\n' "$verdict" "$vs [$cfg]" "$figure" $((SECONDS - t0)) \
      | tee -a "$OUT/parity.txt"
  done
fi

if has bench && needs_cuda bench; then
  SIZES=(-b 1K -e 1M -f 2 -n 20 -w 5)
  for n in 2 4 8; do
    for mode in one-shot two-shot staged; do
      case $mode in
        # Two ranks always run one-shot (protocol::choose_all_reduce): no two-shot row.
        two-shot) [ $n -eq 2 ] && continue; env=(MTRAIN_IPC_ONE_SHOT_MAX=0); comm=ipc ;;
        one-shot) env=(MTRAIN_IPC_ONE_SHOT_MAX=1073741824); comm=ipc ;;
        staged) env=(); comm=staged ;;
      esac
      if run "bench-$mode-$n" "$LIMIT" env "${env[@]}" "$M" --nproc-per-node $n bench-comm \
          --device cuda --comm $comm --op all-reduce "${SIZES[@]}"; then
        grep -E "^ +[0-9]" "$OUT/bench-$mode-$n.log" > "$OUT/bench-$mode-$n.txt"
      fi
    done
  done
  # Time (us) per op by size, one column per run; #wrong summed over the rows.
  python3 - "$OUT" > "$OUT/bench.txt" <<'EOF'
import os, sys
out = sys.argv[1]
cols, rows, wrong = [], {}, {}
for n in (2, 4, 8):
    for mode in ("one-shot", "two-shot", "staged"):
        path = os.path.join(out, f"bench-{mode}-{n}.txt")
        if not os.path.exists(path):
            continue
        col = f"{mode} {n}"
        cols.append(col)
        for line in open(path):
            f = line.split()
            rows.setdefault(int(f[0]), {})[col] = f[3]
            wrong[col] = wrong.get(col, 0) + int(f[6])
print("| size (B) | " + " | ".join(cols) + " |")
print("| --- " * (len(cols) + 1) + "|")
for size in sorted(rows):
    print(f"| {size} | " + " | ".join(rows[size].get(c, "-") for c in cols) + " |")
print("| #wrong | " + " | ".join(str(wrong[c]) for c in cols) + " |")
EOF
  cat "$OUT/bench.txt"
fi

if has train && needs_cuda train; then
  steps=${IPC_TRAIN_STEPS:-50}
  # Each process's GPU memory as the driver counts it (its context included) every 15 s, beside
  # the memory report's figures: what the launcher's per-rank allowance (gpu_fit.rs) stands for.
  nvidia-smi --query-compute-apps=pid,used_memory --format=csv,noheader -l 15 \
    > "$OUT/train-gpu-memory.csv" 2>&1 &
  sampler=$!
  if run train "$TRAIN_LIMIT" "$M" --device cuda --dtype bf16 --tp 2 --pp 2 \
      --config configs/gpt2-124m.toml --steps "$steps" --mem-report --run-dir "$OUT/train-run" --overwrite; then
    grep -E "ranks on|step=|memory:" "$OUT/train.log" | tail -12
  fi
  kill "$sampler" 2>/dev/null
  tail -4 "$OUT/train-gpu-memory.csv"
fi
cat "$OUT/times.txt" 2>/dev/null
exit $status
