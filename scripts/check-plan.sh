#!/usr/bin/env bash
# `mtrain plan`'s predicted step against the measured median step on CPU (issue #54), for four
# layouts of the built-in tiny GPT (and configs/moe-tiny.toml for the experts):
#
#   --tp 2 --pp 2 --microbatches 2     (one-rank micro-batch 8)
#   --dp 4 --fsdp                      (16)
#   --pp 4 --microbatches 4            (4)
#   --dp 2 --ep 2, moe-tiny            (16)
#
# For each: a one-rank run of the layout's micro-batch on the threads a rank of the layout gets
# (RAYON_NUM_THREADS = cores / ranks, at least 1) with --profile-phases gives the medians of the
# forward and the backward; `mtrain plan` predicts the layout's step from them
# (--forward-ms, --backward-ms), the α-β table AB and the node's cores (--cores-per-node);
# for a layout with tp, three one-rank runs with --profile-ops give --tp-whole: the median of
# their LayerNorm, residual and embedding rows' share of the passes' op time (what a tp rank
# runs whole; the optimizer's and the gradient norm's rows are not passes); for a layout with
# ep, a one-rank run with --profile-ops gives --copy-gb-s: the copy bandwidth it measured (its
# ops.json's roofs), what the ep ranks' permutations of the token rows run at; then the layout
# runs. Medians are over the steps after SKIP. FIT=1 first refits the α-β
# table on this machine (`bench-comm --fit`, every op the layouts issue, at 2 and 4 ranks) into
# target/check-plan/alpha-beta.toml and uses it.
#
# Each run starts on a quiet machine (scripts/quiet.sh: up to QUIET_WAIT s, default 120, for the
# one-minute load average to fall to LOAD_LIMIT, default 0.5 per core); if any started above it,
# the table is printed with the busy runs named and no verdict.
#
# A shared machine's speed drifts by tens of percent over minutes, and a one-rank run and the
# layout's run a minute apart can land on either side of a drift. So each layout runs ROUNDS
# pairs, a one-rank run (its passes) and right after it the layout, each pair giving one
# ratio; the verdict is on the median of a layout's ratios (every pair's is printed).
#
# Usage: scripts/check-plan.sh   (env: STEPS=40 SKIP=5 AB=configs/alpha-beta/cpu-loopback.toml
#                                 FIT=0 LAYOUTS="tp2pp2 dp4fsdp pp4 dp2ep2" ROUNDS=3
#                                 QUIET_WAIT=120 LOAD_LIMIT=0.5·nproc --all MTRAIN=binary)
# Results: printed, and target/check-plan/summary.tsv; each run's directory under target/check-plan/.
set -euo pipefail
cd "$(dirname "$0")/.."

STEPS=${STEPS:-40}
SKIP=${SKIP:-5}
AB=${AB:-configs/alpha-beta/cpu-loopback.toml}
FIT=${FIT:-0}
LAYOUTS=${LAYOUTS:-"tp2pp2 dp4fsdp pp4 dp2ep2"}
ROUNDS=${ROUNDS:-3}
OUT=target/check-plan
mkdir -p "$OUT"

# shellcheck source=scripts/quiet.sh
. scripts/quiet.sh
bench_binary
CORES=$(nproc)

# layout NAME: sets FLAGS (the layout), CONFIG (config flags), MB (one-rank micro-batch), RANKS.
layout() {
    CONFIG=()
    case "$1" in
    tp2pp2) FLAGS=(--tp 2 --pp 2 --microbatches 2) MB=8 RANKS=4 ;;
    dp4fsdp) FLAGS=(--dp 4 --fsdp) MB=16 RANKS=4 ;;
    pp4) FLAGS=(--pp 4 --microbatches 4) MB=4 RANKS=4 ;;
    dp2ep2) FLAGS=(--dp 2 --ep 2) CONFIG=(--config configs/moe-tiny.toml) MB=16 RANKS=2 ;;
    *) echo "unknown layout $1 (one of tp2pp2 dp4fsdp pp4 dp2ep2)" >&2; exit 2 ;;
    esac
}

# median RUN_DIR KEY: the median of metrics.jsonl's KEY (a dotted path) over the steps after SKIP.
median() {
    python3 - "$1" "$2" "$SKIP" <<'PY'
import json, statistics, sys
run, key, skip = sys.argv[1], sys.argv[2], int(sys.argv[3])
vals = []
for line in open(f"{run}/metrics.jsonl"):
    v = json.loads(line)
    if v.get("step", 0) <= skip:
        continue
    for k in key.split("."):
        v = v.get(k) if isinstance(v, dict) else None
    if isinstance(v, (int, float)):
        vals.append(v)
if not vals:
    sys.exit(f"{run}/metrics.jsonl: no {key} after step {skip}")
print(f"{statistics.median(vals):.3f}")
PY
}

# tp_whole RUN_DIR: the share of the passes' op time in RUN_DIR/ops.json that tp leaves whole.
tp_whole() {
    python3 - "$1/ops.json" <<'PY'
import json, sys
rows = json.load(open(sys.argv[1]))["rows"]
step = ("adamw", "sq_sum", "grad accumulate")  # the optimizer and the gradient norm
whole = ("layer_norm", "residual", "embedding")
passes = [r for r in rows if not r["name"].startswith(step)]
part = sum(r["seconds"] for r in passes if r["name"].startswith(whole))
print(f"{part / sum(r['seconds'] for r in passes):.3f}")
PY
}

# copy_gb_s RUN_DIR: the copy bandwidth (bytes read and written per second) RUN_DIR/ops.json
# measured, in GB/s.
copy_gb_s() {
    python3 - "$1/ops.json" <<'PY'
import json, sys
print(f"{json.load(open(sys.argv[1]))['roofs']['measured']['bytes_per_s'] / 1e9:.3f}")
PY
}

# predicted_ms TEXT: the `predicted step:` of plan's output, in ms.
predicted_ms() {
    python3 -c '
import re, sys
m = re.search(r"predicted step: ([0-9.]+) (ns|µs|ms|s)\b", sys.stdin.read())
if not m:
    sys.exit("no predicted step in plan output")
scale = {"ns": 1e-6, "µs": 1e-3, "ms": 1.0, "s": 1e3}[m.group(2)]
print(f"{float(m.group(1)) * scale:.3f}")'
}

if [ "$FIT" = 1 ]; then
    cp "$AB" "$OUT/alpha-beta.toml"
    AB=$OUT/alpha-beta.toml
    for ranks in 2 4; do
        for op in all-reduce all-gather reduce-scatter all-to-all send-recv; do
            before_run "fit $op $ranks"
            "$MTRAIN" --nproc-per-node "$ranks" bench-comm -b 4K -e 16M -f 2 --op "$op" \
                --device cpu --fit "$AB" >"$OUT/fit-$op-$ranks.log" 2>&1
            after_run "fit $op $ranks"
        done
    done
fi

printf 'layout\tround\tone-rank forward ms\tbackward ms\ttp whole\tpredicted ms\tmeasured median ms\tpredicted/measured\n' >"$OUT/summary.tsv"
for name in $LAYOUTS; do
    layout "$name"
    threads=$((CORES / RANKS > 0 ? CORES / RANKS : 1))
    common=(--steps "$STEPS" --log-every 1 --eval-every 1000000 --overwrite)
    whole=0
    if [[ " ${FLAGS[*]} " == *" --tp "* ]]; then
        shares=()
        for i in 1 2 3; do # a profile times 3 steps: the median of three runs' shares
            before_run "$name one rank, ops $i"
            RAYON_NUM_THREADS=$threads "$MTRAIN" "${CONFIG[@]}" --batch-size "$MB" --steps 12 \
                --log-every 1 --eval-every 1000000 --overwrite --profile-ops \
                --run-dir "$OUT/$name-ops$i" >"$OUT/$name-ops$i.log" 2>&1
            after_run "$name one rank, ops $i"
            shares+=("$(tp_whole "$OUT/$name-ops$i")")
        done
        whole=$(printf '%s\n' "${shares[@]}" | sort -g | sed -n 2p)
    fi
    copy=()
    if [[ " ${FLAGS[*]} " == *" --ep "* ]]; then
        before_run "$name one rank, copy"
        RAYON_NUM_THREADS=$threads "$MTRAIN" "${CONFIG[@]}" --batch-size "$MB" --steps 4 \
            --log-every 1 --eval-every 1000000 --overwrite --profile-ops \
            --run-dir "$OUT/$name-copy" >"$OUT/$name-copy.log" 2>&1
        after_run "$name one rank, copy"
        copy=(--copy-gb-s "$(copy_gb_s "$OUT/$name-copy")")
    fi
    for round in $(seq "$ROUNDS"); do
        run=$name-$round
        before_run "$run one rank"
        RAYON_NUM_THREADS=$threads "$MTRAIN" "${CONFIG[@]}" --batch-size "$MB" "${common[@]}" \
            --profile-phases --run-dir "$OUT/$run-one" >"$OUT/$run-one.log" 2>&1
        after_run "$run one rank"
        fwd=$(median "$OUT/$run-one" phase_ms.forward)
        bwd=$(median "$OUT/$run-one" phase_ms.backward)
        plan=("$MTRAIN" plan "${CONFIG[@]}" "${FLAGS[@]}" --gpus "$RANKS" --gpus-per-node "$RANKS"
            --cores-per-node "$CORES" --intra "$AB" --forward-ms "$fwd" --backward-ms "$bwd"
            --tp-whole "$whole" "${copy[@]}")
        "${plan[@]}" >"$OUT/$run-plan.txt"
        pred=$(predicted_ms <"$OUT/$run-plan.txt")
        before_run "$run" nowait # right after its one-rank run: the pair sees one machine
        "$MTRAIN" "${CONFIG[@]}" "${FLAGS[@]}" "${common[@]}" --run-dir "$OUT/$run" >"$OUT/$run.log" 2>&1
        after_run "$run"
        meas=$(median "$OUT/$run" step_ms)
        ratio=$(python3 -c "print(f'{$pred / $meas:.2f}')")
        printf '%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\n' "$name" "$round" "$fwd" "$bwd" "$whole" "$pred" "$meas" "$ratio" >>"$OUT/summary.tsv"
        echo "$name, round $round: predicted $pred ms, measured $meas ms: $ratio   (${plan[*]})"
    done
done

echo "$(date -u '+%Y-%m-%d %H:%M UTC'), $(cpu_line), $CORES cores, α-β $AB"
column -t -s $'\t' "$OUT/summary.tsv"
if [ ${#BUSY[@]} -gt 0 ]; then
    echo "runs started above load $LOAD_LIMIT (timings are the neighbours' too; no verdict): ${BUSY[*]}"
    exit 0
fi
python3 - "$OUT/summary.tsv" <<'PY'
import csv, statistics, sys
rows = list(csv.DictReader(open(sys.argv[1]), delimiter="\t"))
ratios = {}
for r in rows:
    ratios.setdefault(r["layout"], []).append(float(r["predicted/measured"]))
med = {k: statistics.median(v) for k, v in ratios.items()}
print("median predicted/measured: " + ", ".join(f"{k} {v:.2f}" for k, v in med.items()))
bad = [k for k, v in med.items() if abs(v - 1) > 0.15]
print("every layout within ±15%" if not bad else f"outside ±15%: {', '.join(bad)}")
PY
