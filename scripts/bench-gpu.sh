#!/usr/bin/env bash
# Single-GPU training speed: mtrain (fused kernels, hand-written backward) next to PyTorch, one run.
#
# Usage:
#   scripts/bench-gpu.sh build            # here: builds and packs .gpu/bench_gpu.xz,
#                                         # .gpu/kernels-tests.xz and .gpu/model-tests.xz
#   scripts/bench-gpu.sh run [OUT_DIR]    # on the GPU machine, from the repository root
#   scripts/bench-gpu.sh train [OUT_DIR]  # the mtrain binary next to PyTorch (see train())
#   scripts/bench-gpu.sh loss [OUT_DIR]   # the binary's loss, --backward tapes vs autograd
#   scripts/bench-gpu.sh sizes [OUT_DIR]  # the binary next to eager and torch.compile, model
#                                         # sizes and context lengths (see sizes())
#   scripts/bench-gpu.sh attn [OUT_DIR]   # attention forward/backward alone next to SDPA
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
  [ -d .git ] && { grep -qx '.gpu/' .git/info/exclude 2>/dev/null || echo '.gpu/' >> .git/info/exclude; }
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
    host = [r["phase_host_ms"] for r in m[skip:] if r.get("phase_host_ms")]
    if host:
        row["phase_host_ms"] = {k: round(statistics.median(p[k] for p in host), 2) for k in keys}
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
# batches), or two binaries' curves (BENCH_LOSS_RUNS): GPT-2 124M, bf16, BENCH_LOSS_STEPS steps (default 200) of batch 4 x 256 on
# scripts/bench/tinyshakespeare.txt as bytes (one u16 shard each for train and val), lr 3e-4
# after 20 warmup steps.
loss() {
  OUT=${1:-.gpu/out}
  BIN=/tmp/mtrain-bench
  mkdir -p "$OUT" "$BIN"
  # shellcheck disable=SC1091
  source scripts/gpu-env.sh
  # BENCH_LOSS_RUNS: the two runs compared, "BINARY:BACKWARD" (default the binary's tapes
  # against its autograd; "mtrain-before:tapes mtrain:tapes" compares two binaries).
  runs=${BENCH_LOSS_RUNS:-"mtrain:tapes mtrain:autograd"}
  for r in $runs; do [ -x "$BIN/${r%%:*}" ] || mtrain_unpack ".gpu/${r%%:*}.xz" "$BIN/${r%%:*}"; done
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
  files=()
  for r in $runs; do
    bin=${r%%:*} bw=${r##*:}
    dir=/tmp/mtrain-loss-$bin-$bw
    rm -rf "$dir"
    echo "== $bin --backward $bw, $steps steps"
    "$BIN/$bin" --config configs/gpt2-124m.toml --device cuda --dtype bf16 --data "$data" \
      --set batch_size=4 --set seq_len=256 --set grad_accum=1 --steps "$steps" --lr 3e-4 \
      --min-lr 3e-4 --warmup-steps 20 --eval-every 0 --log-every 1 --backward "$bw" \
      --run-dir "$dir" > "$OUT/loss-$bin-$bw.log" 2>&1
    echo "exit $?"
    cp "$dir/metrics.jsonl" "$OUT/loss-$bin-$bw.jsonl"
    files+=("$OUT/loss-$bin-$bw.jsonl")
  done
  python3 - "${files[@]}" <<'PY'
import json, os, sys
curve = lambda p: [json.loads(l)["loss"] for l in open(p)]
t, a = curve(sys.argv[1]), curve(sys.argv[2])
n1, n2 = (os.path.basename(p)[len("loss-"):-len(".jsonl")] for p in sys.argv[1:3])
d = [abs(x - y) for x, y in zip(t, a)]
i = max(range(len(d)), key=d.__getitem__)
print(f"loss curves, {n1} vs {n2}: {len(d)} steps, {n1} {t[0]:.4f} -> {t[-1]:.4f}, "
      f"{n2} {a[0]:.4f} -> {a[-1]:.4f}; mean |diff| {sum(d) / len(d):.4f}, "
      f"max {d[i]:.4f} (step {i + 1}), last 50 {sum(d[-50:]) / len(d[-50:]):.4f}; "
      f"mean loss of the last 50 {sum(t[-50:]) / 50:.4f} vs {sum(a[-50:]) / 50:.4f}")
PY
}

# The binary against PyTorch eager and torch.compile over model sizes and context lengths, one
# table: BENCH_CASES lists "NAME:L,H,C:B,T" (default GPT-2 124M, 350M, 774M, 1.5B at 8 x 1024,
# 124M at 4 x 4096 and 2 x 8192; head size 128: 124M with 6 heads at 8 x 1024 and 4 x 4096, and
# GPT-3 6.7B's width with 8 layers at 4 x 2048; NAME is torch_gpt_ref.py's preset without its
# "gpt2-"), grad_accum 1, clipping 1.0, bf16. Every run does BENCH_WARMUP
# steps (default 5) then BENCH_STEPS timed ones (default 25); throughput is the tokens of the
# timed steps over their summed step times (the binary) or their wall time (PyTorch). The
# binaries are BENCH_BINS (.gpu/NAME.xz, default "mtrain"), the last one the subject of the
# ratios; its peak memory comes from a short extra run with --mem-report. BENCH_TORCH (default
# "eager compile", "none" for neither) picks the PyTorch variants, each stopped after
# BENCH_TORCH_TIMEOUT seconds (default 420). MFU: 6N + 12·L·C·T FLOP per token over 989 TFLOP/s.
sizes() {
  OUT=${1:-.gpu/out}
  BIN=/tmp/mtrain-bench
  mkdir -p "$OUT" "$BIN"
  # shellcheck disable=SC1091
  source scripts/gpu-env.sh
  bins=${BENCH_BINS:-mtrain}
  for b in $bins; do [ -x "$BIN/$b" ] || mtrain_unpack ".gpu/$b.xz" "$BIN/$b"; done
  subject=${bins##* }
  cases=${BENCH_CASES:-"124m:12,12,768:8,1024 350m:24,16,1024:8,1024 774m:36,20,1280:8,1024 1.5b:48,25,1600:8,1024 124m:12,12,768:4,4096 124m:12,12,768:2,8192 124m-h128:12,6,768:8,1024 124m-h128:12,6,768:4,4096 6.7b-8l:8,32,4096:4,2048"}
  warm=${BENCH_WARMUP:-5}
  steps=${BENCH_STEPS:-25}
  R="$OUT/sizes.jsonl"
  RUNS=/dev/shm/mtrain-sizes
  : > "$R"
  for c in $cases; do
    IFS=: read -r name lhc bt <<< "$c"
    IFS=, read -r L H C <<< "$lhc"
    IFS=, read -r B T <<< "$bt"
    set_args="--set model.n_layer=$L --set model.n_head=$H --set model.n_embd=$C --set model.block_size=$T --set seq_len=$T --set batch_size=$B --set grad_accum=1"
    for bin in $bins; do
      for mem in "" --mem-report; do
        [ -n "$mem" ] && [ "$bin" != "$subject" ] && continue
        n=$((warm + steps)); [ -n "$mem" ] && n=3
        rm -rf "$RUNS"
        echo "== $name ${B}x$T $bin $mem"
        t0=$(date +%s)
        # The run is stopped once its last step is logged: the final checkpoint it would write
        # (16 bytes per parameter) is no part of the measurement, and takes longer than it.
        # shellcheck disable=SC2086
        "$BIN/$bin" --config configs/gpt2-124m.toml --device cuda --dtype bf16 $set_args \
          --steps "$n" --eval-every 0 --log-every 1 --run-dir "$RUNS" $mem \
          > "$OUT/sizes-$bin-$name-${B}x$T${mem:+-mem}.log" 2>&1 &
        pid=$!
        for _ in $(seq 1200); do
          kill -0 $pid 2>/dev/null || break
          [ "$( (wc -l < "$RUNS/metrics.jsonl") 2>/dev/null || echo 0)" -ge "$n" ] && { sleep 0.5; break; }
          sleep 0.25
        done
        kill $pid 2>/dev/null; wait $pid
        echo "exit $? ($(( $(date +%s) - t0 )) s)"
        python3 - "$RUNS" "$bin" "$name" "$L" "$C" "$B" "$T" "$warm" "$mem" <<'PY' | tee -a "$R"
import json, sys
d, bin_, name, L, C, B, T, warm, mem = sys.argv[1:]
L, C, B, T, warm = int(L), int(C), int(B), int(T), int(warm)
row = {"impl": bin_, "preset": name, "batch": B, "seq": T}
try:
    m = [json.loads(l) for l in open(f"{d}/metrics.jsonl")]
    if mem:
        row["peak_alloc_gib"] = round(max(json.loads(l)["peak"] for l in open(f"{d}/memory.jsonl")) / 2**30, 3)
    else:
        timed = m[warm:]
        tok = B * T * len(timed)
        secs = sum(B * T / r["tokens_per_s"] for r in timed)
        n = 50304 * C + L * (12 * C * C + 13 * C) + 2 * C
        row.update(steps=len(timed), tokens_per_s=round(tok / secs), loss_last=m[-1]["loss"],
                   mfu=round(tok / secs * (6 * n + 12 * L * C * T) / 989e12, 4))
except Exception as e:
    row["error"] = repr(e)
print(json.dumps(row))
PY
      done
    done
    for v in ${BENCH_TORCH:-eager compile}; do
      [ "$v" = none ] && continue
      flag=""; [ "$v" = compile ] && flag=--compile
      echo "== $name ${B}x$T torch $v"
      t0=$(date +%s)
      timeout "${BENCH_TORCH_TIMEOUT:-420}" python3 scripts/bench/torch_gpt_ref.py --preset "gpt2-$name" --batch "$B" --seq "$T" \
        --grad-clip 1.0 --steps "$steps" --warmup "$warm" $flag 2>&1 | grep '^{' | tee -a "$R"
      echo "($(( $(date +%s) - t0 )) s)"
    done
  done
  rm -rf "$RUNS"
  python3 - "$R" "$subject" <<'PY'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if l.startswith("{")]
for r in rows:  # torch_gpt_ref.py names its preset "gpt2-124m", the binary's rows "124m"
    r["preset"] = r["preset"].removeprefix("gpt2-")
subject = sys.argv[2]
print("| model, batch x seq | " + " | ".join(["binary", "eager", "compile", "vs eager", "vs compile",
      "MFU binary / compile", "peak GiB binary / eager / compile"]) + " |")
for p, b, t in dict.fromkeys((r["preset"], r["batch"], r["seq"]) for r in rows):
    at = [r for r in rows if (r["preset"], r["batch"], r["seq"]) == (p, b, t)]
    get = lambda f: next((r for r in at if f(r) and "tokens_per_s" in r), None)
    ours = get(lambda r: r["impl"] == subject)
    eager = get(lambda r: r["impl"] == "torch" and not r["compile"])
    comp = get(lambda r: r["impl"] == "torch" and r["compile"])
    mem = next((r["peak_alloc_gib"] for r in at if r["impl"] == subject and "peak_alloc_gib" in r), None)
    tok = lambda r: f"{r['tokens_per_s'] / 1e3:.1f}k" if r else "-"
    ratio = lambda r: f"{ours['tokens_per_s'] / r['tokens_per_s']:.3f}" if r and ours else "-"
    mfu = lambda r: f"{100 * r['mfu']:.1f}%" if r else "-"
    pk = lambda r: f"{r['peak_alloc_gib']:.2f}" if r else "-"
    others = " ".join(f"{r['impl']} {tok(r)}" for r in at if r["impl"] not in (subject, "torch") and "tokens_per_s" in r)
    print(f"| {p}, {b} x {t} | {tok(ours)} | {tok(eager)} | {tok(comp)} | {ratio(eager)} | {ratio(comp)} | "
          f"{mfu(ours)} / {mfu(comp)} | {mem} / {pk(eager)} / {pk(comp)} |" + (f" ({others})" if others else ""))
PY
}

# Attention alone, the hand-written path's forward and backward (bench_gpu --attn) next to
# PyTorch's SDPA (default choice and flash forced), at BENCH_ATTN shapes "B,H,T,D/..." (default
# T = 1024, 4096, 8192 at head size 64, the presets' heads). The binary runs with its default
# kernels ("mtrain": flash_hopper.cu's on an H100/H200 where they apply) and then with each of
# BENCH_ATTN_KERNELS: by default the Hopper kernels with the two-pass backward at every length
# ("mtrain-hopper-two-pass"), the wide mma.sync kernels of flash_wide.cu ("mtrain-wide") and
# the 16-row ones of kernels.cu ("mtrain-narrow").
attn() {
  OUT=${1:-.gpu/out}
  BIN=/tmp/mtrain-bench
  mkdir -p "$OUT" "$BIN"
  # shellcheck disable=SC1091
  source scripts/gpu-env.sh
  [ -x "$BIN/bench_gpu" ] || mtrain_unpack .gpu/bench_gpu.xz "$BIN/bench_gpu"
  shapes=${BENCH_ATTN:-"16,12,1024,64/8,20,1024,64/4,12,4096,64/2,12,8192,64"}
  "$BIN/bench_gpu" --attn "$shapes" 2>&1 | tee "$OUT/attn.jsonl"
  # BENCH_ATTN_KERNELS: the other kernel choices timed beside the default ("mtrain-NAME" for
  # MTRAIN_FLASH_KERNELS=NAME).
  for kn in ${BENCH_ATTN_KERNELS:-hopper-two-pass wide narrow}; do
    MTRAIN_FLASH_KERNELS=$kn "$BIN/bench_gpu" --attn "$shapes" 2>&1 \
      | sed "s/\"impl\": \"mtrain\"/\"impl\": \"mtrain-$kn\"/" | tee -a "$OUT/attn.jsonl"
  done
  # BENCH_ATTN_BLOCKS (say "1 3"): the wide kernels again with their registers fitted to that
  # many blocks per SM (MTRAIN_FLASH_MIN_BLOCKS; the source's default is 2).
  for nb in ${BENCH_ATTN_BLOCKS:-}; do
    MTRAIN_FLASH_MIN_BLOCKS=$nb "$BIN/bench_gpu" --attn "$shapes" 2>&1 \
      | sed "s/\"impl\": \"mtrain\"/\"impl\": \"mtrain-b$nb\"/" | tee -a "$OUT/attn.jsonl"
  done
  python3 scripts/bench/torch_attn_ref.py --shapes "$shapes" 2>&1 | grep '^{' | tee -a "$OUT/attn.jsonl"
  python3 - "$OUT/attn.jsonl" <<'PY'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if l.startswith("{")]
for s in dict.fromkeys(tuple(r["attn"]) for r in rows):
    at = [r for r in rows if tuple(r["attn"]) == s]
    ours = next((r for r in at if r["impl"] == "mtrain"), None)
    for r in at:
        name = r["impl"] + (" " + r["backend"] if "backend" in r else "")
        rel = f"  mtrain/this time fwd {ours['fwd_ms'] / r['fwd_ms']:.2f} bwd {ours['bwd_ms'] / r['bwd_ms']:.2f}" if ours else ""
        print(f"B,H,T,D {list(s)} {name:16s} fwd {r['fwd_ms']:8.3f} ms {r['fwd_tflops']:6.1f} TF/s  "
              f"bwd {r['bwd_ms']:8.3f} ms {r['bwd_tflops']:6.1f} TF/s{rel}")
PY
}

case "${1:-}" in
  build) build ;;
  run) shift; run "$@" ;;
  train) shift; train "$@" ;;
  loss) shift; loss "$@" ;;
  sizes) shift; sizes "$@" ;;
  attn) shift; attn "$@" ;;
  *) echo "usage: $0 build | run [OUT_DIR] | train [OUT_DIR] | loss [OUT_DIR] | sizes [OUT_DIR] | attn [OUT_DIR]" >&2; exit 2 ;;
esac
