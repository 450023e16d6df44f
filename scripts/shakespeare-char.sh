#!/usr/bin/env bash
# nanoGPT's shakespeare_char recipe through the `mtrain` binary next to the PyTorch reference
# (scripts/bench/torch_nanogpt_ref.py), on the same prepared characters, in one call.
#
# Usage:
#   scripts/build-gpu.sh                    # here: the CUDA binary, packed as .gpu/mtrain.xz
#   scripts/shakespeare-char.sh [OUT_DIR]   # on the GPU machine, from the repository root
#   MTRAIN=target/release/mtrain DEVICE=cpu SHAPE=tiny scripts/shakespeare-char.sh /tmp/sc   # a check on CPU
#
# Steps:
#   1. mtrain prepare --chars on scripts/bench/tinyshakespeare.txt: 65 characters, 90/10 split;
#   2. mtrain --config configs/shakespeare-char.toml (6 layers, 6 heads, 384 wide, block 256, dropout 0.2, batch 64,
#      lr 1e-3 cosine to 1e-4 over 5000 steps, warmup 100, beta2 0.99, weight decay 0.1, clip 1.0,
#      evaluation every 250 steps on 200 batches of each split) into OUT/mtrain;
#   3. the PyTorch reference with the same recipe and the same data into OUT/torch (and, with
#      TORCH_EXTRA_DROPOUT=p, a second reference run with dropout p into OUT/torch-dropout);
#   4. `mtrain plot` of the run directories (loss.svg beside each metrics.jsonl, and the runs on
#      one chart in OUT/mtrain/compare.svg), 500 characters
#      sampled from mtrain's model (OUT/sample.txt; its checkpoint is then removed unless
#      KEEP_CHECKPOINTS=1), and OUT/summary.json: every evaluation of every run, best validation
#      loss and its step, wall time.
# Environment: DEVICE (cuda), DTYPE (bf16 on cuda, f32 on cpu), DROPOUT (the recipe's 0.2: model.dropout of both runs),
#   STEPS (the recipe's 5000), SHAPE=tiny (2 layers, 2 heads, 64 wide, block 64, batch 8, evaluation
#   every 10 steps on 4 batches: the CPU check), EVAL_EVERY and EVAL_ITERS (the shape's unless set),
#   TORCH_THREADS (the reference's CPU threads), MTRAIN (a binary; default: .gpu/mtrain.xz unpacked).
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT"
OUT=$(mkdir -p "${1:-.gpu/shakespeare-char}" && cd "${1:-.gpu/shakespeare-char}" && pwd)
DEVICE=${DEVICE:-cuda}
DROPOUT=${DROPOUT:-0.2}
if [ "$DEVICE" = cuda ]; then DTYPE=${DTYPE:-bf16}; else DTYPE=${DTYPE:-f32}; fi
TORCH_DTYPE=$([ "$DTYPE" = bf16 ] && echo bf16 || echo fp32)

if [ "$DEVICE" = cuda ]; then
  # shellcheck disable=SC1091
  source scripts/gpu-env.sh
  { date -u +%FT%TZ; nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader; } \
    | tee "$OUT/machine.txt"
fi
if [ -z "${MTRAIN:-}" ]; then
  MTRAIN=/tmp/mtrain-shakespeare/mtrain
  mkdir -p "$(dirname "$MTRAIN")"
  # shellcheck disable=SC1091
  declare -F mtrain_unpack >/dev/null || source scripts/gpu-env.sh
  mtrain_unpack .gpu/mtrain.xz "$MTRAIN"
fi

# The recipe's numbers, one list for both programs: mtrain's [train] keys and the reference's flags.
if [ "${SHAPE:-full}" = tiny ]; then
  L=2 H=2 C=64 T=64 B=8 LOG_EVERY=5
  EVAL_EVERY=${EVAL_EVERY:-10} EVAL_ITERS=${EVAL_ITERS:-4} STEPS=${STEPS:-20}
else
  L=6 H=6 C=384 T=256 B=64 LOG_EVERY=10
  EVAL_EVERY=${EVAL_EVERY:-250} EVAL_ITERS=${EVAL_ITERS:-200} STEPS=${STEPS:-5000}
fi

DATA="$OUT/data"
"$MTRAIN" prepare --chars --text scripts/bench/tinyshakespeare.txt --out "$DATA" | tee "$OUT/prepare.log"

echo "== mtrain: $L layers, $H heads, $C wide, block $T, batch $B, $STEPS steps, dropout $DROPOUT, $DEVICE $DTYPE"
t0=$(date +%s.%N)
"$MTRAIN" --config configs/shakespeare-char.toml --data "$DATA" --run-dir "$OUT/mtrain" --overwrite \
  --device "$DEVICE" --dtype "$DTYPE" --steps "$STEPS" --batch-size "$B" --seq-len "$T" \
  --eval-every "$EVAL_EVERY" --eval-iters "$EVAL_ITERS" --log-every "$LOG_EVERY" \
  --set model.n_layer="$L" --set model.n_head="$H" --set model.n_embd="$C" --set model.block_size="$T" \
  --set model.dropout="$DROPOUT" 2>&1 | tee "$OUT/mtrain.log"
t1=$(date +%s.%N)
echo "{\"impl\": \"mtrain\", \"wall_s\": $(python3 -c "print($t1 - $t0)")}" > "$OUT/mtrain/wall.json"

reference() { # $1 = run directory name, $2 = dropout
  echo "== torch: same recipe, dropout $2"
  python3 scripts/bench/torch_nanogpt_ref.py --data "$DATA" --out "$OUT/$1" --run "$1" --device "$DEVICE" \
    --dtype "$TORCH_DTYPE" --steps "$STEPS" --batch "$B" --seq "$T" --layers "$L" --heads "$H" --width "$C" \
    --dropout "$2" --eval-every "$EVAL_EVERY" --eval-iters "$EVAL_ITERS" --log-every "$LOG_EVERY" \
    ${TORCH_THREADS:+--threads "$TORCH_THREADS"} 2>&1 | tee "$OUT/$1.log"
}
reference torch "$DROPOUT"
[ -n "${TORCH_EXTRA_DROPOUT:-}" ] && reference torch-dropout "$TORCH_EXTRA_DROPOUT"

# Each run's loss.svg, and both (all three) runs on one chart: OUT/mtrain/compare.svg.
"$MTRAIN" plot "$OUT/mtrain" "$OUT/torch" ${TORCH_EXTRA_DROPOUT:+"$OUT/torch-dropout"}
"$MTRAIN" sample --checkpoint "$OUT/mtrain" --device "$DEVICE" --prompt "ROMEO:" --max-new-tokens 500 \
  | tee "$OUT/sample.txt"
# The final checkpoint (weights and AdamW moments, 130 MB at the full shape) stays only when asked.
[ "${KEEP_CHECKPOINTS:-0}" = 1 ] || rm -rf "$OUT"/mtrain/step-*

python3 - "$OUT" <<'PY' | tee "$OUT/summary.json"
import json, os, sys
out = sys.argv[1]
rows = {}
for run in ("mtrain", "torch", "torch-dropout"):
    path = os.path.join(out, run, "metrics.jsonl")
    if not os.path.exists(path):
        continue
    evals = [(m["step"] + 1, m.get("train_eval_loss"), m["val_loss"])
             for m in map(json.loads, open(path)) if "val_loss" in m]
    best = min(evals, key=lambda e: e[2])
    wall = json.load(open(os.path.join(out, run, "wall.json" if run == "mtrain" else "summary.json")))["wall_s"]
    rows[run] = {"best_val": best[2], "best_val_step": best[0], "wall_s": round(wall, 1),
                 "evals": [{"step": s, "train": t, "val": v} for s, t, v in evals]}
if "mtrain" in rows and "torch" in rows:
    rows["best_val_mtrain_minus_torch"] = rows["mtrain"]["best_val"] - rows["torch"]["best_val"]
print(json.dumps(rows, indent=1))
PY
