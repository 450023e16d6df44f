#!/usr/bin/env bash
# The pipeline schedules side by side on CPU, one core per rank: each schedule's step time and
# measured bubble next to the bubble its grid predicts from the same step's pass times, and each
# rank's activations at its peak next to the memory model's figure.
#
#   mtrain --pp 2 --microbatches M --schedule S --steps STEPS --mem-report
#          --set model.n_layer=N_LAYER --set model.n_embd=N_EMBD --set model.n_head=N_HEAD
#
# for S in SCHEDULES (default: 1f1b, interleaved:2, zb-h1, zb-v, and zb-v with the order built
# for the pass costs that round's zb-h1 run measured, `--pass-costs F,B,W`), ROUNDS rounds taken
# in turn. Every figure is the mean over the steps after the first WARMUP and over the rounds;
# a rank's bubble is its idle fraction of the step (defined in the pipeline executor's module
# doc), the predicted one the schedule simulated with that step's measured pass times, and the
# one on even stages the same with every stage at the mean of those times (predicted − even:
# what the uneven stages cost). The summary's last columns are the worse rank's bubble over
# 1F1B's, measured, predicted and on even stages.
#
# Each round starts on a quiet machine (scripts/quiet.sh: up to QUIET_WAIT s, default 120, for
# the one-minute load average to fall to LOAD_LIMIT, default 0.5 per core); a round that started
# above it is named and no ratio is printed. The load before and after every run is logged.
#
# Usage: scripts/bench-pipeline.sh   (env: ROUNDS=3 STEPS=10 WARMUP=2 MICRO=8 PP=2 N_LAYER=8
#                                     N_EMBD=512 N_HEAD=8 SCHEDULES="1f1b interleaved:2 zb-h1
#                                     zb-v zb-v-cost" QUIET_WAIT=120 LOAD_LIMIT=0.5·nproc --all
#                                     MTRAIN=binary)
# Results: printed; each run's directory and output under target/bench-pipeline/.
set -euo pipefail
cd "$(dirname "$0")/.."

ROUNDS=${ROUNDS:-3}
STEPS=${STEPS:-10}
WARMUP=${WARMUP:-2}
MICRO=${MICRO:-8}
PP=${PP:-2}
N_LAYER=${N_LAYER:-8}
N_EMBD=${N_EMBD:-512}
N_HEAD=${N_HEAD:-8}
SCHEDULES=${SCHEDULES:-"1f1b interleaved:2 zb-h1 zb-v zb-v-cost"}
OUT=target/bench-pipeline
mkdir -p "$OUT"

# shellcheck source=scripts/quiet.sh
. scripts/quiet.sh
bench_binary

# stage_costs RUN_DIR: "F,B,W" of one stage in ms, the mean over the stages and timed steps.
stage_costs() {
    python3 - "$1" "$WARMUP" <<'PY'
import json, sys
run, warmup = sys.argv[1], int(sys.argv[2])
f = b = w = n = 0
for line in open(f"{run}/steps.jsonl"):
    r = json.loads(line)
    if r["step"] < warmup:
        continue
    for c in r["report"]["pipeline"]["pass_costs"]:  # one entry a stage, seconds a micro-batch
        f += c["forward"]; b += c["input_grad"]; w += c["weight_grad"]; n += 1
print(",".join(f"{1e3 * x / n:.1f}" for x in (f, b, w)))
PY
}

echo "== $(date -u '+%F %H:%M UTC'), $(nproc) cores ($(cpu_line)), load average $(load) =="
echo "pp $PP, $MICRO micro-batches, $N_LAYER layers, n_embd $N_EMBD, $N_HEAD heads, one thread a rank; $ROUNDS rounds of $STEPS steps (the first $WARMUP not counted)"
for round in $(seq "$ROUNDS"); do
    COSTS=""
    for s in $SCHEDULES; do
        name="${s//:/}"
        case "$s" in
            interleaved:*) args=(--schedule interleaved --virtual-stages "${s#interleaved:}") ;;
            *) args=(--schedule "${s%-cost}") ;;
        esac
        if [[ "$s" == *-cost ]]; then
            [ -n "$COSTS" ] || { echo "$s needs zb-h1 earlier in SCHEDULES (its pass costs)" >&2; exit 2; }
            args+=(--pass-costs "$COSTS")
        fi
        run="$OUT/$name-$round"
        # A round waits for a quiet machine before its first run only (each run keeps every core
        # busy, so the load rises through a round).
        if [ "$s" = "${SCHEDULES%% *}" ]; then before_run "$name $round"; else before_run "$name $round" nowait; fi
        RAYON_NUM_THREADS=1 "$MTRAIN" --pp "$PP" --microbatches "$MICRO" "${args[@]}" --steps "$STEPS" \
            --log-every "$STEPS" --eval-every 0 --mem-report --run-dir "$run" --overwrite \
            --set model.n_layer="$N_LAYER" --set model.n_embd="$N_EMBD" --set model.n_head="$N_HEAD" \
            >"$OUT/$name-$round.log" 2>&1 || { tail -5 "$OUT/$name-$round.log" >&2; exit 1; }
        after_run "$name $round"
        if [ "$s" = zb-h1 ]; then COSTS=$(stage_costs "$run"); fi
        note=""
        if [[ "$s" == *-cost ]]; then note=" (the order built for F,B,W = $COSTS ms)"; fi
        echo "round $round: $name done$note (load $(load))"
    done
done
echo "== $(date -u '+%F %H:%M UTC'), load average $(load) =="

python3 - "$OUT" "$ROUNDS" "$WARMUP" "$PP" ${#BUSY[@]} $SCHEDULES <<'PY'
import json, statistics, sys
out, rounds, warmup, pp, busy = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
mean = statistics.mean
rows = {}
for s in sys.argv[6:]:
    name = s.replace(":", "")
    per_rank = {r: {"step": [], "bubble": [], "pred": [], "even": [], "act": [], "analytic": []} for r in range(pp)}
    for k in range(1, rounds + 1):
        run = f"{out}/{name}-{k}"
        for line in open(f"{run}/steps.jsonl"):
            r = json.loads(line)
            if r["step"] < warmup:
                continue
            p, d = r["report"]["pipeline"], per_rank[r["rank"]]
            d["step"].append(p["step_ms"]); d["bubble"].append(p["bubble"])
            d["pred"].append(p["predicted_bubble"]); d["even"].append(p["balanced_bubble"])
        for line in open(f"{run}/memory.jsonl"):
            m = json.loads(line)
            if m["step"] < warmup:
                continue
            # The heap's growth over the forward passes the schedule holds at its peak, and the
            # memory model's figure for it.
            per_rank[m["rank"]]["act"].append(m["increments"]["forward"])
            per_rank[m["rank"]]["analytic"].append(m["predicted"]["forward"])
    rows[s] = {r: {k: mean(v) for k, v in d.items()} for r, d in per_rank.items()}
base = max(rows["1f1b"][r]["bubble"] for r in range(pp)) if "1f1b" in rows else None
base_pred = max(rows["1f1b"][r]["pred"] for r in range(pp)) if "1f1b" in rows else None
base_even = max(rows["1f1b"][r]["even"] for r in range(pp)) if "1f1b" in rows else None
print("| schedule | step ms, rank " + " / ".join(map(str, range(pp))) +
      " | bubble measured / predicted / on even stages, each rank "
      "| worse rank / 1F1B's, measured (predicted; on even stages) "
      "| activations at the peak / analytic (MiB), each rank |")
print("|---|---|---|---|---|")
for s, ranks in rows.items():
    step = " / ".join(f"{ranks[r]['step']:.1f}" for r in range(pp))
    bub = " ; ".join(f"{ranks[r]['bubble']:.3f} / {ranks[r]['pred']:.3f} / {ranks[r]['even']:.3f}"
                     for r in range(pp))
    worst, worst_pred, worst_even = (max(ranks[r][k] for r in range(pp)) for k in ("bubble", "pred", "even"))
    ratio = ("—" if base is None or busy else
             f"{worst / base:.2f}x ({worst_pred / base_pred:.2f}x; {worst_even / base_even:.2f}x)")
    act = " ; ".join(f"{ranks[r]['act'] / 2**20:.2f} / {ranks[r]['analytic'] / 2**20:.2f} "
                     f"({ranks[r]['act'] / ranks[r]['analytic']:.2f}x)" for r in range(pp))
    print(f"| {s} | {step} | {bub} | {ratio} | {act} |")
PY
if [ ${#BUSY[@]} -gt 0 ]; then
    echo "busy machine: these runs started above the load limit $LOAD_LIMIT, so no ratio is reported:"
    printf '  %s\n' "${BUSY[@]}"
fi
echo "load before and after each run: $OUT/load.log"
