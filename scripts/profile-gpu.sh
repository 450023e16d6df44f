#!/usr/bin/env bash
# Per-kernel device time of one GPT-2 124M training step (bf16, batch 16 x 1024), mtrain and
# PyTorch eager side by side, from Nsight Compute's `gpu__time_duration` of every kernel.
#
# Usage, on the GPU machine from the repository root, after `scripts/bench-gpu.sh build` here:
#   scripts/profile-gpu.sh [OUT_DIR]
#
# ncu runs each kernel alone (serialised), so the sum is device time without overlap or host
# gaps; `bench_gpu --steps 1 --warmup 0` is one full step (forward, backward, AdamW). The summary
# groups kernels by name and prints the largest first, with counts and the share of the step.
set -uo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT"
OUT=${1:-.gpu/profile}
BIN=/tmp/mtrain-bench
mkdir -p "$OUT" "$BIN"
# shellcheck disable=SC1091
source scripts/gpu-env.sh
mtrain_unpack .gpu/bench_gpu.xz "$BIN/bench_gpu"
NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
M=gpu__time_duration.sum
"$NCU" --clock-control none --metrics $M --csv --page raw --log-file "$OUT/mtrain.csv" \
  "$BIN/bench_gpu" --batch 16 --steps 1 --warmup 0 > "$OUT/mtrain.out" 2>&1
"$NCU" --clock-control none --metrics $M --csv --page raw --log-file "$OUT/torch.csv" \
  python3 scripts/bench/torch_gpt_ref.py --batch 16 --steps 1 --warmup 0 > "$OUT/torch.out" 2>&1
python3 - "$OUT/mtrain.csv" "$OUT/torch.csv" <<'PY'
import csv, sys, collections
for path in sys.argv[1:]:
    rows = list(csv.reader(open(path)))
    head = next(i for i, r in enumerate(rows) if "Kernel Name" in r)
    cols = rows[head]
    k, v = cols.index("Kernel Name"), cols.index("gpu__time_duration.sum")
    agg = collections.defaultdict(lambda: [0, 0.0])
    for r in rows[head + 2:]:
        if len(r) <= max(k, v):
            continue
        try:
            ns = float(r[v].replace(",", ""))
        except ValueError:
            continue
        name = r[k].split("(")[0][:90]
        agg[name][0] += 1
        agg[name][1] += ns / 1e6
    total = sum(t for _, t in agg.values())
    n = sum(c for c, _ in agg.values())
    print(f"== {path}: {n} kernels, {total:.2f} ms of device time")
    for name, (c, t) in sorted(agg.items(), key=lambda x: -x[1][1])[:40]:
        print(f"{t:9.3f} ms {100 * t / total:5.1f}% {c:6d}x  {name}")
PY
