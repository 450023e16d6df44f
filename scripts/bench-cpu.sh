#!/usr/bin/env bash
# mtrain on CPU next to PyTorch on CPU, measured in one run so both see the same machine and load.
#
#   1. Training, the tiny preset (4 layers, width 64, 4 heads, byte vocabulary, batch 16 x 64, f32,
#      AdamW with weight decay 0.1 and gradient clipping at 1.0): mtrain's default CPU job against
#      scripts/bench/torch_gpt_ref.py with the same shapes and optimizer, ROUNDS rounds taken in
#      turn (mtrain, PyTorch, mtrain, ...). Each run's figure, on both sides, is the median over its
#      steps after the first WARMUP of each step's tokens/s, with the share of those steps within
#      ±10% of the median step time; the printed figure is the median over the rounds.
#   2. All-reduce, f32, 1 MiB to 256 MiB (x4 per size) at 2 and 4 ranks on loopback: `mtrain
#      bench-comm --in-place` against torch.distributed with gloo (scripts/bench/torch_comm_ref.py
#      under torchrun; `dist.all_reduce` reduces in place too), again in turn; the printed busbw
#      is the median over the rounds.
# Then the ratios mtrain / PyTorch, with the load average at the start and the end.
#
# A busy machine measures the neighbour, so before every run the script waits (up to QUIET_WAIT
# seconds, default 120) for the one-minute load average to fall to LOAD_LIMIT (default 0.5 per
# core), records it before and after the run, and prints no ratio when any run started above the
# limit: the figures are still printed, marked as taken on a busy machine.
#
# N_EMBD=W trains the tiny preset at width W on both sides (`--set model.n_embd=W`, `--n-embd W`).
# DP=N trains data-parallel on N processes, the global batch still 16 x 64: `mtrain --dp N
# --batch-size 16/N` against PyTorch DDP over gloo under torchrun (`--mode ddp`, 16/N per
# rank), each process THREADS threads (default for DP: one per process); the figure is the
# job's tokens/s (all ranks).
#
# PARTS picks what runs ("train", "comm", or both, the default). COMPARE=PATH adds another
# mtrain binary (the one before a change, say) to every all-reduce round, run in turn with the
# others, and prints its busbw and the ratio of the two binaries next to gloo's; COMPARE_ARGS
# are its bench-comm flags (default: the same as mtrain's, COMM_ARGS, default --in-place), so
# COMPARE=target/release/mtrain COMPARE_ARGS=" " sets in place against out of place.
#
# PyTorch (the CPU wheel) is installed into a throwaway virtual environment that is removed at
# the end; set VENV=DIR to keep one and reuse it across runs.
#
# Usage: scripts/bench-cpu.sh   (env: ROUNDS=3 STEPS=60 WARMUP=10 THREADS=$(nproc) NPROCS="2 4"
#                                ITERS=10 MAXBYTES=256M VENV= PARTS="train comm" COMPARE=
#                                COMM_ARGS=--in-place COMPARE_ARGS=$COMM_ARGS QUIET_WAIT=120
#                                LOAD_LIMIT=0.5·nproc --all N_EMBD= DP=1)
# Results: printed; each run's raw output is kept in target/bench-cpu/.
set -euo pipefail
cd "$(dirname "$0")/.."

ROUNDS=${ROUNDS:-3}
STEPS=${STEPS:-60}
WARMUP=${WARMUP:-10}
DP=${DP:-1}
THREADS=${THREADS:-$(( $(nproc) / DP > 0 ? $(nproc) / DP : 1 ))}
N_EMBD=${N_EMBD:-}
BATCH=$((16 / DP))
MTRAIN_SHAPE=(--batch-size "$BATCH" ${N_EMBD:+--set model.n_embd=$N_EMBD})
if [ "$DP" -gt 1 ]; then MTRAIN_SHAPE+=(--dp "$DP"); fi
TORCH_SHAPE=(--batch "$BATCH" ${N_EMBD:+--n-embd $N_EMBD})
if [ "$DP" -gt 1 ]; then TORCH_SHAPE+=(--mode ddp); fi
NPROCS=${NPROCS:-"2 4"}
ITERS=${ITERS:-10}
MAXBYTES=${MAXBYTES:-256M}
PARTS=${PARTS:-"train comm"}
COMPARE=${COMPARE:-}
COMM_ARGS=${COMM_ARGS:---in-place}
COMPARE_ARGS=${COMPARE_ARGS:-$COMM_ARGS}
part() { [[ " $PARTS " == *" $1 "* ]]; }
if ! part train && ! part comm; then
    echo "PARTS='$PARTS' names neither 'train' nor 'comm'" >&2
    exit 2
fi
if [ -n "$COMPARE" ] && [ ! -x "$COMPARE" ]; then
    echo "COMPARE='$COMPARE' is not an executable mtrain binary" >&2
    exit 2
fi
OUT=target/bench-cpu
mkdir -p "$OUT"

if [ -z "${VENV:-}" ]; then
    VENV=$(mktemp -d)/venv
    trap 'rm -rf "$(dirname "$VENV")"' EXIT
fi
if [ ! -x "$VENV/bin/python" ]; then
    echo "installing PyTorch (CPU) into $VENV ..." >&2
    python3 -m venv "$VENV"
    # The CPU-only wheel where its index is reachable; otherwise PyPI's (it runs on CPU too).
    "$VENV/bin/pip" install -q torch --index-url https://download.pytorch.org/whl/cpu \
        || "$VENV/bin/pip" install -q torch
fi
PY="$VENV/bin/python"

cargo build --release --workspace --bin mtrain
MTRAIN=target/release/mtrain
# shellcheck source=scripts/quiet.sh
. scripts/quiet.sh
CPU_LINE=$(cpu_line)
echo "== $(date -u '+%F %H:%M UTC'), $(nproc) cores ($CPU_LINE), load average $(load); torch $("$PY" -c 'import torch; print(torch.__version__)') =="

# --- training -----------------------------------------------------------------------------------
# A run's figure, the same statistic on both sides: the median over its timed steps of tokens
# per second of the step, and beside it the share of those steps within ±10% of the median step
# time (how steady the machine and the program were). mtrain's steps after the first WARMUP come
# from metrics.jsonl; PyTorch's from its per-step times (step_ms_each; it runs WARMUP steps
# untimed first) and the job's tokens per step.
# run_figure mtrain METRICS_JSONL | run_figure torch RESULT_JSON
run_figure() {
    "$PY" - "$1" "$2" "$WARMUP" <<'PY'
import json, statistics, sys
side, path, warmup = sys.argv[1], sys.argv[2], int(sys.argv[3])
if side == "mtrain":  # (tokens per step, step ms) of each step after the warm-up
    rows = [json.loads(l) for l in open(path) if l.strip()]
    steps = [(r["tokens_per_s"] * r["step_ms"] / 1e3, r["step_ms"]) for r in rows
             if "tokens_per_s" in r and r.get("step", 0) > warmup]
else:  # PyTorch ran its warm-up untimed; every step takes the job's batch of tokens
    r = json.load(open(path))
    tokens = r["batch"] * r["seq"] * r["grad_accum"] * r["world"]
    steps = [(tokens, ms) for ms in r["step_ms_each"]]
ms = [m for _, m in steps]
med = statistics.median(ms)
steady = sum(abs(m - med) <= 0.1 * med for m in ms) / len(ms)
print(round(statistics.median(t / m * 1e3 for t, m in steps)), f"{100 * steady:.0f}%")
PY
}
median() { "$PY" -c 'import statistics, sys; print(round(statistics.median(float(x) for x in sys.argv[1:]), 3))' "$@"; }

TRAIN_LINE="training: not run (PARTS='$PARTS')"
MT=(); PT=(); MS=(); PS=()
for round in $(part train && seq "$ROUNDS"); do
    RUN="$OUT/train-run"
    before_run "train mtrain $round"
    RAYON_NUM_THREADS=$THREADS "$MTRAIN" --steps "$STEPS" --eval-every 0 --log-every 1 --run-dir "$RUN" --overwrite \
        "${MTRAIN_SHAPE[@]}" >"$OUT/train-mtrain-$round.log" 2>&1
    after_run "train mtrain $round"
    read -r tok steady < <(run_figure mtrain "$RUN/metrics.jsonl")
    MT+=("$tok"); MS+=("$steady")
    before_run "train torch $round"
    TORCH=("$PY")
    if [ "$DP" -gt 1 ]; then
        TORCH=("$VENV/bin/torchrun" --nproc_per_node "$DP" --master_port "$("$PY" -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')")
    fi
    OMP_NUM_THREADS=$THREADS "${TORCH[@]}" scripts/bench/torch_gpt_ref.py --device cpu --threads "$THREADS" --preset tiny --vocab 256 \
        --seq 64 --dtype fp32 --steps $((STEPS - WARMUP)) --warmup "$WARMUP" \
        --weight-decay 0.1 --grad-clip 1.0 "${TORCH_SHAPE[@]}" >"$OUT/train-torch-$round.json" 2>"$OUT/train-torch-$round.log"
    after_run "train torch $round"
    read -r tok steady < <(run_figure torch "$OUT/train-torch-$round.json")
    PT+=("$tok"); PS+=("$steady")
    echo "round $round: mtrain ${MT[-1]} tok/s (${MS[-1]} of steps within ±10%), PyTorch ${PT[-1]} tok/s (${PS[-1]}) (load $(load))"
done
if part train; then
    MTM=$(median "${MT[@]}"); PTM=$(median "${PT[@]}")
    SHAPE="tiny preset${N_EMBD:+, n_embd $N_EMBD}"
    if [ "$DP" -gt 1 ]; then SHAPE+=", dp $DP"; fi
    TRAIN_LINE="training, $SHAPE, $THREADS threads: mtrain $MTM tok/s, PyTorch $PTM tok/s, ratio $("$PY" -c "print(f'{$MTM / $PTM:.2f}')")"
    if [ "${#BUSY[@]}" -gt 0 ]; then
        TRAIN_LINE="training, $SHAPE, $THREADS threads: mtrain $MTM tok/s, PyTorch $PTM tok/s, ratio not reported (busy machine)"
    fi
    echo "$TRAIN_LINE"
fi

# --- all-reduce ---------------------------------------------------------------------------------
bench_comm() { # BINARY NAME RANKS ROUND ARGS
    before_run "comm $2 $3 ranks $4"
    # shellcheck disable=SC2086 # ARGS are words
    "$1" --nproc-per-node "$3" bench-comm -b 1M -e "$MAXBYTES" -f 4 --op all-reduce \
        -n "$ITERS" -w 2 $5 --json "$OUT/comm-$2-$3-$4.json" >/dev/null 2>"$OUT/comm-$2-$3-$4.log"
    after_run "comm $2 $3 ranks $4"
}
COMM_NPROCS=$(part comm && echo "$NPROCS" || true)
for n in $COMM_NPROCS; do
    for round in $(seq "$ROUNDS"); do
        bench_comm "$MTRAIN" mtrain "$n" "$round" "$COMM_ARGS"
        if [ -n "$COMPARE" ]; then bench_comm "$COMPARE" compare "$n" "$round" "$COMPARE_ARGS"; fi
        before_run "comm gloo $n ranks $round"
        "$VENV/bin/torchrun" --nproc_per_node "$n" --master_port "$("$PY" -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')" \
            scripts/bench/torch_comm_ref.py --backend gloo --op all-reduce -b 1M -e "$MAXBYTES" -f 4 \
            --iters "$ITERS" --warmup 2 >"$OUT/comm-gloo-$n-$round.txt" 2>"$OUT/comm-gloo-$n-$round.log"
        after_run "comm gloo $n ranks $round"
        echo "all-reduce $n ranks, round $round done (load $(load))"
    done
done

echo
echo "== $(date -u '+%F %H:%M UTC'), load average $(load) =="
echo "$TRAIN_LINE"
if [ "${#BUSY[@]}" -gt 0 ]; then
    echo "busy machine: these runs started above the load limit $LOAD_LIMIT (after waiting ${QUIET_WAIT} s), so no ratio is reported:"
    printf '  %s\n' "${BUSY[@]}"
fi
echo "load before and after each run: $OUT/load.log"
"$PY" - "$OUT" "$ROUNDS" "${COMPARE:+compare}" "${#BUSY[@]}" $COMM_NPROCS <<'PY'
import json, statistics, sys
out, rounds, compare, busy, nprocs = sys.argv[1], int(sys.argv[2]), sys.argv[3], int(sys.argv[4]) > 0, sys.argv[5:]
ratio = lambda a, b: "-" if busy else f"{a / b:.2f}"  # no ratio from a busy machine
for n in nprocs:
    mt, cmp, gl = {}, {}, {}
    for r in range(1, rounds + 1):
        for name, into in [("mtrain", mt)] + ([("compare", cmp)] if compare else []):
            for row in json.load(open(f"{out}/comm-{name}-{n}-{r}.json"))["rows"]:
                into.setdefault(row["bytes"], []).append(row["busbw_gbps"])
        for line in open(f"{out}/comm-gloo-{n}-{r}.txt"):
            if line.startswith("#") or not line.strip():
                continue
            b, _count, _us, _alg, bus = line.split()
            gl.setdefault(int(b), []).append(float(bus))
    print(f"all-reduce busbw (GB/s, median of {rounds}), {n} ranks:")
    extra = f" {'compare':>8} {'mt/cmp':>6} {'cmp/gloo':>8}" if compare else ""
    print(f"  {'MiB':>5} {'mtrain':>8} {'gloo':>8} {'ratio':>6}{extra}")
    for b in sorted(mt):
        m, g = statistics.median(mt[b]), statistics.median(gl.get(b, [float("nan")]))
        line = f"  {b / 2**20:>5.0f} {m:>8.3f} {g:>8.3f} {ratio(m, g):>6}"
        if compare:
            c = statistics.median(cmp[b])
            line += f" {c:>8.3f} {ratio(m, c):>6} {ratio(c, g):>8}"
        print(line)
PY
