#!/usr/bin/env bash
# Whether this machine's cores run the same work at the same speed: the premise of a pipeline
# whose stages are measured one core each (scripts/bench-pipeline.sh). Two single-rank runs of
# the same model, one thread each, start together, each pinned to its own core:
#
#   MTRAIN_PIN_THREADS=0 RAYON_NUM_THREADS=1 taskset -c CORE mtrain --steps STEPS --eval-every 0
#       --set model.n_layer=N_LAYER --set model.n_embd=N_EMBD --set model.n_head=N_HEAD
#
# Both runs take the same batches and do the same arithmetic, so step k costs the same on both;
# the ratio of their step-k times is the two cores' speed ratio over that step. Printed: each
# run's median step, then over the steps after the first WARMUP the median and the 90th
# percentile of |ratio − 1| and the share of steps within 1% (a pipeline of two even stages on
# these cores is uneven by about that much: on two stages 3% uneven, ZB-V's grid is 0.28x of
# 1F1B's bubble where even stages give 0.20x; the pipeline executor's module doc, the bubble on
# even stages).
#
# Usage: scripts/core-balance.sh   (env: CORES="0 1" STEPS=60 WARMUP=5 N_LAYER=8 N_EMBD=256
#                                   N_HEAD=8 QUIET_WAIT=120 LOAD_LIMIT=0.5·nproc --all MTRAIN=binary)
# Results: printed; each run's directory under target/core-balance/.
set -euo pipefail
cd "$(dirname "$0")/.."

CORES=${CORES:-"0 1"}
STEPS=${STEPS:-60}
WARMUP=${WARMUP:-5}
N_LAYER=${N_LAYER:-8}
N_EMBD=${N_EMBD:-256}
N_HEAD=${N_HEAD:-8}
OUT=target/core-balance
mkdir -p "$OUT"

# shellcheck source=scripts/quiet.sh
. scripts/quiet.sh
bench_binary

echo "== $(date -u '+%F %H:%M UTC'), $(nproc) cores ($(cpu_line)), load average $(load) =="
echo "cores $CORES at once, one thread each; $STEPS steps, $N_LAYER layers, n_embd $N_EMBD, $N_HEAD heads"
before_run "cores $CORES"
pids=()
for c in $CORES; do
    MTRAIN_PIN_THREADS=0 RAYON_NUM_THREADS=1 taskset -c "$c" "$MTRAIN" --steps "$STEPS" \
        --log-every 1 --eval-every 0 --run-dir "$OUT/core$c" --overwrite \
        --set model.n_layer="$N_LAYER" --set model.n_embd="$N_EMBD" --set model.n_head="$N_HEAD" \
        >"$OUT/core$c.log" 2>&1 &
    pids+=($!)
done
for p in "${pids[@]}"; do wait "$p" || { echo "a run failed: $OUT/*.log" >&2; exit 1; }; done
after_run "cores $CORES"

python3 - "$OUT" "$WARMUP" $CORES <<'PY'
import json, statistics, sys
out, warmup, cores = sys.argv[1], int(sys.argv[2]), sys.argv[3:]
steps = {}
for c in cores:
    rows = [json.loads(line) for line in open(f"{out}/core{c}/metrics.jsonl")]
    steps[c] = {r["step"]: r["step_ms"] for r in rows if "step_ms" in r}
    print(f"core {c}: median step {statistics.median(steps[c].values()):.1f} ms")
a, b = cores[0], cores[1]
ks = sorted(k for k in steps[a] if k in steps[b] and k >= warmup)
dev = sorted(abs(steps[a][k] / steps[b][k] - 1) for k in ks)
print(f"core {a} / core {b}, step by step over {len(ks)} steps: median |ratio - 1| "
      f"{100 * statistics.median(dev):.1f}%, 90th percentile {100 * dev[int(0.9 * (len(dev) - 1))]:.1f}%, "
      f"within 1%: {100 * sum(d <= 0.01 for d in dev) / len(dev):.0f}% of steps")
PY
if [ ${#BUSY[@]} -gt 0 ]; then
    echo "busy machine: started above the load limit $LOAD_LIMIT: ${BUSY[*]}"
fi
