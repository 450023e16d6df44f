#!/usr/bin/env bash
# Single-GPU training speed: mtrain (fused kernels, hand-written backward) next to PyTorch, one run.
#
# Usage:
#   scripts/bench-gpu.sh build            # here: builds and packs .gpu/bench_gpu.xz,
#                                         # .gpu/kernels-tests.xz and .gpu/model-tests.xz
#   scripts/bench-gpu.sh run [OUT_DIR]    # on the GPU machine, from the repository root
#   scripts/bench-gpu.sh train [OUT_DIR]  # the mtrain binary next to PyTorch (see train())
#   scripts/bench-gpu.sh loss [OUT_DIR]   # the binary's loss, --backward tapes vs autograd
#
# `run` does, on one card:
#   1. the fused kernels' tests against plain candle (kernels-tests), the tapes' tests against
#      autograd (model-tests explicit::), and the pieces of one block timed alone (bench_gpu
#      --ops: attention, LayerNorm, GELU fused and plain; the block fused and taped; matmuls);
#   2. GPT-2 124M, bf16, AdamW: mtrain fused (batch 16 x 1024) with a per-segment profile;
#   3. PyTorch (scripts/bench/torch_gpt_ref.py): eager + SDPA flash, eager + materialised
#      attention, torch.compile; all batch 16 x 1024;
#   4. loss curves, BENCH_LOSS_STEPS steps (default 200) of batch 4 x 256 on
#      scripts/bench/tinyshakespeare.txt (bytes as token ids), lr 3e-4 after 20 warmup steps:
#      fused vs the fused kernels under autograd (the bf16 rounding-order noise floor);
#   and prints every JSON line and the ratio of mtrain fused to each PyTorch variant.
# Environment: BENCH_STEPS (timed steps, default 10), BENCH_TORCH_COMPILE=0 to skip torch.compile.
set -uo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT"

build() {
  PREFIX=${MTRAIN_CUDA_PREFIX:-$HOME/.cache/mtrain-cuda13}
  [ -f "$PREFIX/env.sh" ] || scripts/cuda-setup.sh "$PREFIX"
  # shellcheck disable=SC1091
  source "$PREFIX/env.sh"
  export CARGO_TARGET_DIR=${CARGO_TARGET_DIR:-$ROOT/target-cuda}
  mkdir -p .gpu
  grep -qx '.gpu/' .git/info/exclude 2>/dev/null || echo '.gpu/' >> .git/info/exclude
  set -e
  nice -n 19 cargo build --release -p mtrain-model --features cuda --example bench_gpu
  strip -o .gpu/bench_gpu "$CARGO_TARGET_DIR/release/examples/bench_gpu"
  # Both crates' library tests in one cargo call, so candle is built with one feature set.
  nice -n 19 cargo test --release -p mtrain-kernels -p mtrain-model --features mtrain-model/cuda \
    --lib --no-run --message-format=json | python3 -c 'import json, sys
names = {"mtrain_kernels": ".gpu/kernels-tests", "mtrain_model": ".gpu/model-tests"}
for line in sys.stdin:
    m = json.loads(line)
    if m.get("reason") == "compiler-artifact" and m.get("executable") and m["target"]["kind"] == ["lib"]:
        print(m["executable"], names[m["target"]["name"]])' | while read -r exe name; do
    strip -o "$name" "$exe"
  done
  xz -T0 -6 -f .gpu/bench_gpu .gpu/kernels-tests .gpu/model-tests
  ls -l .gpu/
}

run() {
  OUT=${1:-.gpu/out}
  BIN=/tmp/mtrain-bench
  mkdir -p "$OUT" "$BIN"
  # shellcheck disable=SC1091
  source scripts/gpu-env.sh
  for f in .gpu/bench_gpu.xz .gpu/kernels-tests.xz .gpu/model-tests.xz; do
    mtrain_unpack "$f" "$BIN/$(basename "$f" .xz)"
  done
  { date -u +%FT%TZ; nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader; } \
    | tee "$OUT/machine.txt"
  steps=${BENCH_STEPS:-10}
  R="$OUT/results.jsonl"
  : > "$R"
  echo "== kernel tests"
  "$BIN/kernels-tests" --test-threads=1 2>&1 | tee "$OUT/kernel-tests.log"
  echo "== tape tests"
  "$BIN/model-tests" explicit:: --test-threads=1 2>&1 | tee "$OUT/tape-tests.log"
  echo "== ops (one block's pieces, fused and plain)"
  "$BIN/bench_gpu" --ops --batch 16 2>&1 | tee -a "$R"
  echo "== mtrain fused"
  "$BIN/bench_gpu" --batch 16 --steps "$steps" --warmup 2 --profile 2>&1 | tee -a "$R"
  echo "== torch"
  T=scripts/bench/torch_gpt_ref.py
  python3 $T --batch 16 --steps 20 --warmup 5 2>&1 | grep '^{' | tee -a "$R"
  python3 $T --batch 16 --steps 10 --warmup 3 --manual-attn 2>&1 | grep '^{' | tee -a "$R"
  if [ "${BENCH_TORCH_COMPILE:-1}" = 1 ]; then
    python3 $T --batch 16 --steps 20 --warmup 5 --compile 2>&1 | grep '^{' | tee -a "$R"
  fi
  echo "== loss curves"
  n=${BENCH_LOSS_STEPS:-200}
  D=scripts/bench/tinyshakespeare.txt
  "$BIN/bench_gpu" --batch 4 --seq 256 --data $D --loss-steps "$n" --loss-out "$OUT/loss-fused.txt" | tee -a "$R"
  # The same fused kernels differentiated by autograd: differs from the fused run only in the
  # order of bf16 roundings, so |fused - autograd| is the bf16 noise floor for the comparison.
  "$BIN/bench_gpu" --autograd --batch 4 --seq 256 --data $D --loss-steps "$n" --loss-out "$OUT/loss-autograd.txt" | tee -a "$R"
  python3 - "$R" "$OUT/loss-fused.txt" "$OUT/loss-autograd.txt" <<'PY'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if l.startswith("{")]
runs = [r for r in rows if "tokens_per_s" in r]
ours = next((r for r in runs if r.get("impl") == "mtrain" and r["mode"] == "fused"), None)
print(f"{'run':40s} {'tokens/s':>10s} {'peak GiB':>9s} {'ratio':>7s}")
for r in runs:
    name = r["impl"] + " " + r["mode"] + (" manual-attn" if r.get("manual_attn") else "") \
        + (" compile" if r.get("compile") else "") + f" b{r['batch']}"
    ratio = ours["tokens_per_s"] / r["tokens_per_s"] if ours else float("nan")
    print(f"{name:40s} {r['tokens_per_s']:>10d} {r['peak_alloc_gib']:>9.2f} {ratio:>7.3f}")
def curve(p):
    return [float(l.split()[1]) for l in open(p)]
def compare(name, f, p):
    d = [abs(a - b) for a, b in zip(f, p)]
    print(f"loss curves, fused vs {name}: {len(f)} steps, fused {f[0]:.4f} -> {f[-1]:.4f}, "
          f"{name} {p[0]:.4f} -> {p[-1]:.4f}, max |diff| {max(d):.4f}, "
          f"mean |diff| {sum(d) / len(d):.4f}, last 50 {sum(d[-50:]) / len(d[-50:]):.4f}")
try:
    f = curve(sys.argv[2])
    compare("autograd (noise floor)", f, curve(sys.argv[3]))
except Exception as e:
    print("loss curves: missing", e)
PY
}

# The product: the `mtrain` binary (.gpu/mtrain.xz from scripts/build-gpu.sh) on GPT-2 124M bf16
# with the preset's recipe (AdamW, clipping at 1.0), next to PyTorch eager and torch.compile with
# the same batch, accumulation and clipping, in one run. Each setting runs twice: plain (the
# tokens/s figure: median over the steps after the first few) and with --profile-phases (where a
# step's time goes, and the memory report's peak). A second binary .gpu/mtrain-before.xz, when present, runs the same settings
# for an A/B in the same call.
train() {
  OUT=${1:-.gpu/out}
  BIN=/tmp/mtrain-bench
  mkdir -p "$OUT" "$BIN"
  # shellcheck disable=SC1091
  source scripts/gpu-env.sh
  # BENCH_BINS names the binaries (.gpu/NAME.xz) to compare, the last one the subject of the
  # ratios; by default .gpu/mtrain-before.xz (when present) and .gpu/mtrain.xz.
  bins=${BENCH_BINS:-mtrain}
  [ -z "${BENCH_BINS:-}" ] && [ -f .gpu/mtrain-before.xz ] && bins="mtrain-before mtrain"
  for b in $bins; do mtrain_unpack ".gpu/$b.xz" "$BIN/$b"; done
  { date -u +%FT%TZ; nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader; } \
    | tee "$OUT/machine.txt"
  steps=${BENCH_STEPS:-30}
  R="$OUT/train.jsonl"
  : > "$R"
  for setting in "16 1" "8 8"; do
    set -- $setting
    b=$1 ga=$2
    for bin in $bins; do
      for prof in "" --profile-phases; do
        [ -n "$prof" ] && [ "$bin" != mtrain ] && continue
        dir=/tmp/mtrain-run-$bin-$b-$ga${prof:+-prof}
        rm -rf "$dir"
        echo "== $bin b$b ga$ga $prof"
        "$BIN/$bin" --config configs/gpt2-124m.toml --device cuda --dtype bf16 \
          --set batch_size=$b --set grad_accum=$ga --steps "$steps" --eval-every 0 --log-every 1 \
          --run-dir "$dir" ${prof:+$prof --mem-report} > "$OUT/$bin-b$b-ga$ga${prof:+-prof}.log" 2>&1
        echo "exit $?"
        python3 - "$dir/metrics.jsonl" "$dir/memory.jsonl" "$bin" "$b" "$ga" "$prof" <<'PY' | tee -a "$R"
import json, statistics, sys
m = [json.loads(l) for l in open(sys.argv[1])]
skip = min(5, len(m) - 1)
tok = statistics.median(r["tokens_per_s"] for r in m[skip:])
row = {"impl": sys.argv[3], "batch": int(sys.argv[4]), "grad_accum": int(sys.argv[5]),
       "profile_phases": bool(sys.argv[6]), "tokens_per_s": round(tok), "steps": len(m),
       "loss_first": m[0]["loss"], "loss_last": m[-1]["loss"]}
try:
    mem = [json.loads(l) for l in open(sys.argv[2])]
    row["peak_alloc_gib"] = round(max(r["peak"] for r in mem) / 2**30, 3)
except Exception as e:
    row["peak_alloc_gib"] = None
phases = [r["phase_ms"] for r in m[skip:] if r.get("phase_ms")]
if phases:
    keys = phases[0].keys()
    row["phase_ms"] = {k: round(statistics.median(p[k] for p in phases), 2) for k in keys}
    step = sum(row["phase_ms"].values())
    outside = sum(v for k, v in row["phase_ms"].items() if k not in ("forward", "backward"))
    row["outside_fwd_bwd_frac"] = round(outside / step, 4)
print(json.dumps(row))
PY
      done
    done
    T=scripts/bench/torch_gpt_ref.py
    python3 $T --batch "$b" --grad-accum "$ga" --grad-clip 1.0 --steps 20 --warmup 5 2>&1 | grep '^{' | tee -a "$R"
    if [ "${BENCH_TORCH_COMPILE:-1}" = 1 ]; then
      python3 $T --batch "$b" --grad-accum "$ga" --grad-clip 1.0 --steps 20 --warmup 5 --compile 2>&1 \
        | grep '^{' | tee -a "$R"
    fi
  done
  python3 - "$R" <<'PY'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if l.startswith("{")]
for b, ga in [(16, 1), (8, 8)]:
    at = [r for r in rows if r["batch"] == b and r.get("grad_accum", 1) == ga]
    ours = next((r for r in at if r["impl"] == "mtrain" and not r["profile_phases"]), None)
    print(f"-- {b} x 1024, grad_accum {ga}")
    for r in at:
        name = r["impl"] + (" compile" if r.get("compile") else "") + (" --profile-phases" if r.get("profile_phases") else "")
        ratio = ours["tokens_per_s"] / r["tokens_per_s"] if ours else float("nan")
        print(f"{name:32s} {r['tokens_per_s']:>9d} tok/s  peak {r.get('peak_alloc_gib')} GiB  mtrain/this {ratio:.3f}")
        if r.get("phase_ms"):
            print(f"{'':32s} phases {r['phase_ms']}  outside fwd/bwd {100 * r['outside_fwd_bwd_frac']:.1f}%")
PY
}

# The mtrain binary's loss curve with its hand-written backward against candle's autograd
# (`--backward tapes` / `--backward autograd`, the same forward kernels, the same seed and
# batches): GPT-2 124M, bf16, BENCH_LOSS_STEPS steps (default 200) of batch 4 x 256 on
# scripts/bench/tinyshakespeare.txt as bytes (one u16 shard each for train and val), lr 3e-4
# after 20 warmup steps.
loss() {
  OUT=${1:-.gpu/out}
  BIN=/tmp/mtrain-bench
  mkdir -p "$OUT" "$BIN"
  # shellcheck disable=SC1091
  source scripts/gpu-env.sh
  mtrain_unpack .gpu/mtrain.xz "$BIN/mtrain"
  data=/tmp/mtrain-shakespeare-bytes
  python3 - scripts/bench/tinyshakespeare.txt "$data" <<'PY'
import array, json, os, sys
raw = open(sys.argv[1], "rb").read()
out = sys.argv[2]
os.makedirs(out, exist_ok=True)
cut = int(len(raw) * 0.9)
for name, part in (("train_000", raw[:cut]), ("val_000", raw[cut:])):
    ids = array.array("H", part)
    if sys.byteorder != "little":
        ids.byteswap()
    open(f"{out}/{name}.bin", "wb").write(ids.tobytes())
    json.dump({"dtype": "u16", "n_tokens": len(ids), "vocab_size": 256}, open(f"{out}/{name}.json", "w"))
PY
  steps=${BENCH_LOSS_STEPS:-200}
  for bw in tapes autograd; do
    dir=/tmp/mtrain-loss-$bw
    rm -rf "$dir"
    echo "== mtrain --backward $bw, $steps steps"
    "$BIN/mtrain" --config configs/gpt2-124m.toml --device cuda --dtype bf16 --data "$data" \
      --set batch_size=4 --set seq_len=256 --set grad_accum=1 --steps "$steps" --lr 3e-4 \
      --min-lr 3e-4 --warmup-steps 20 --eval-every 0 --log-every 1 --backward "$bw" \
      --run-dir "$dir" > "$OUT/loss-$bw.log" 2>&1
    echo "exit $?"
    cp "$dir/metrics.jsonl" "$OUT/loss-$bw.jsonl"
  done
  python3 - "$OUT/loss-tapes.jsonl" "$OUT/loss-autograd.jsonl" <<'PY'
import json, sys
curve = lambda p: [json.loads(l)["loss"] for l in open(p)]
t, a = curve(sys.argv[1]), curve(sys.argv[2])
d = [abs(x - y) for x, y in zip(t, a)]
i = max(range(len(d)), key=d.__getitem__)
print(f"loss curves, tapes vs autograd: {len(d)} steps, tapes {t[0]:.4f} -> {t[-1]:.4f}, "
      f"autograd {a[0]:.4f} -> {a[-1]:.4f}; mean |diff| {sum(d) / len(d):.4f}, "
      f"max {d[i]:.4f} (step {i + 1}), last 50 {sum(d[-50:]) / len(d[-50:]):.4f}; "
      f"mean loss of the last 50 {sum(t[-50:]) / 50:.4f} vs {sum(a[-50:]) / 50:.4f}")
PY
}

case "${1:-}" in
  build) build ;;
  run) shift; run "$@" ;;
  train) shift; train "$@" ;;
  loss) shift; loss "$@" ;;
  *) echo "usage: $0 build | run [OUT_DIR] | train [OUT_DIR] | loss [OUT_DIR]" >&2; exit 2 ;;
esac
