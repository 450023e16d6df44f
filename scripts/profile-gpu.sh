#!/usr/bin/env bash
# Per-kernel device time of one training step: the `mtrain` binary next to PyTorch (torch.compile
# by default), from Nsight Compute's `gpu__time_duration` of every kernel, at given model sizes.
#
# Usage, on the GPU machine from the repository root, after `scripts/build-gpu.sh` here:
#   scripts/profile-gpu.sh [OUT_DIR]
# Environment:
#   PROFILE_CASES  cases "NAME:L,H,C:B,T" separated by spaces (default: 774M at 8 x 1024 and 124M
#                  at 4 x 4096, "774m:36,20,1280:8,1024 124m:12,12,768:4,4096")
#   PROFILE_TORCH  PyTorch variants to profile, "compile" and/or "eager" (default "compile"; "none")
#
# ncu runs each kernel alone (serialised), so a sum is device time without overlap or host gaps.
# The binary runs two optimizer steps; the kernels of the second (after the first step's AdamW
# launch, up to and including the second's) are one step. PyTorch runs its warm-up (compilation
# included) unprofiled and one step between cudaProfilerStart and Stop (`--profile-range`). The
# summary groups kernels by name and by kind (GEMM, attention, LayerNorm, ...), largest first.
set -uo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT"
OUT=${1:-.gpu/profile}
BIN=/tmp/mtrain-bench
mkdir -p "$OUT" "$BIN"
# shellcheck disable=SC1091
source scripts/gpu-env.sh
[ -x "$BIN/mtrain" ] || mtrain_unpack .gpu/mtrain.xz "$BIN/mtrain"
NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
M=gpu__time_duration.sum
cases=${PROFILE_CASES:-"774m:36,20,1280:8,1024 124m:12,12,768:4,4096"}
RUNS=/dev/shm/mtrain-profile
for c in $cases; do
  IFS=: read -r name lhc bt <<< "$c"
  IFS=, read -r L H C <<< "$lhc"
  IFS=, read -r B T <<< "$bt"
  tag="$name-${B}x$T"
  echo "== $tag: mtrain (2 steps under ncu)"
  rm -rf "$RUNS"
  timeout 300 "$NCU" --clock-control none --metrics $M --csv --page raw --print-units base \
    --log-file "$OUT/mtrain-$tag.csv" \
    "$BIN/mtrain" --config configs/gpt2-124m.toml --device cuda --dtype bf16 \
    --set model.n_layer="$L" --set model.n_head="$H" --set model.n_embd="$C" \
    --set model.block_size="$T" --set seq_len="$T" --set batch_size="$B" --set grad_accum=1 \
    --steps 2 --eval-every 0 --log-every 1 --run-dir "$RUNS" > "$OUT/mtrain-$tag.out" 2>&1
  echo "exit $?"
  rm -rf "$RUNS"
  for v in ${PROFILE_TORCH:-compile}; do
    [ "$v" = none ] && continue
    echo "== $tag: torch $v (one step under ncu)"
    flag=""; [ "$v" = compile ] && flag=--compile
    timeout 300 "$NCU" --clock-control none --metrics $M --csv --page raw --print-units base \
      --profile-from-start off --target-processes application-only --log-file "$OUT/torch-$v-$tag.csv" \
      python3 scripts/bench/torch_gpt_ref.py --preset "gpt2-$name" --batch "$B" --seq "$T" \
      --grad-clip 1.0 --steps 1 --warmup 3 $flag --profile-range > "$OUT/torch-$v-$tag.out" 2>&1
    echo "exit $?"
  done
done
python3 - "$OUT" <<'PY'
import csv, collections, glob, os, re, sys

def kernels(path):
    """(name, ms) of every kernel in an ncu raw CSV, in launch order."""
    rows = list(csv.reader(open(path)))
    head = next(i for i, r in enumerate(rows) if "Kernel Name" in r)
    cols = rows[head]
    k, v = cols.index("Kernel Name"), cols.index("gpu__time_duration.sum")
    out = []
    for r in rows[head + 1:]:
        try:
            out.append((r[k], float(r[v].replace(",", "")) / 1e6))
        except (ValueError, IndexError):
            continue
    return out

def one_step(ks):
    """The binary's second optimizer step: after the first AdamW launch, through the second."""
    ends = [i for i, (n, _) in enumerate(ks) if n.startswith("adamw_multi")]
    return ks[ends[0] + 1:ends[1] + 1] if len(ends) >= 2 else ks

KINDS = [  # first match wins; names lower-cased
    ("attention", r"flash|fmha|attention|sdpa|cudnn"),
    ("gemm", r"nvjet|gemm|xmma|cutlass|splitk|sm90_|cublas"),
    ("loss", r"^ce_|cross_entropy|log_softmax|nll|softmax"),
    ("layernorm", r"ln_|layer_norm|layernorm"),
    ("gelu", r"gelu|tanh"),
    ("bias", r"bias"),
    ("optimizer", r"adam|sq_sum|norm|multi_tensor|foreach"),
    ("embedding", r"emb_|embedding|index|scatter|gather"),
    ("heads split/merge, copies", r"heads_|copy|transpose|cast|convert|to_dtype|ucopy"),
]

def kind(name):
    n = name.lower()
    return next((k for k, pat in KINDS if re.search(pat, n)), "other")

def short(name):
    n = name.replace("(anonymous namespace)::", "").removeprefix("void ")
    return re.sub(r"\(.*", "", n)[:80]

def report(label, ks):
    total = sum(t for _, t in ks)
    print(f"\n== {label}: {len(ks)} kernels, {total:.2f} ms of device time")
    by_kind = collections.defaultdict(lambda: [0, 0.0])
    by_name = collections.defaultdict(lambda: [0, 0.0])
    for n, t in ks:
        by_kind[kind(n)][0] += 1; by_kind[kind(n)][1] += t
        by_name[short(n)][0] += 1; by_name[short(n)][1] += t
    for k, (c, t) in sorted(by_kind.items(), key=lambda x: -x[1][1]):
        print(f"  {k:28s} {t:9.3f} ms {100 * t / total:5.1f}% {c:6d}x")
    print("  -- top kernels")
    for n, (c, t) in sorted(by_name.items(), key=lambda x: -x[1][1])[:25]:
        print(f"  {t:9.3f} ms {100 * t / total:5.1f}% {c:6d}x  {n}")
    return {k: t for k, (c, t) in by_kind.items()}, total

out = sys.argv[1]
for path in sorted(glob.glob(f"{out}/mtrain-*.csv")):
    tag = os.path.basename(path)[len("mtrain-"):-4]
    try:
        ours, tot = report(f"mtrain {tag} (one step)", one_step(kernels(path)))
    except Exception as e:
        print(f"mtrain {tag}: no profile ({e})"); continue
    for tp in sorted(glob.glob(f"{out}/torch-*-{tag}.csv")):
        v = os.path.basename(tp).split("-")[1]
        try:
            theirs, ttot = report(f"torch {v} {tag} (one step)", kernels(tp))
        except Exception as e:
            print(f"torch {v} {tag}: no profile ({e})"); continue
        print(f"\n== {tag}: mtrain - torch {v}, ms of device time by kind (total {tot:.2f} vs {ttot:.2f})")
        for k in sorted(set(ours) | set(theirs), key=lambda k: -(ours.get(k, 0) - theirs.get(k, 0))):
            a, b = ours.get(k, 0.0), theirs.get(k, 0.0)
            print(f"  {k:28s} {a:9.3f} {b:9.3f}  {a - b:+9.3f}")
PY
