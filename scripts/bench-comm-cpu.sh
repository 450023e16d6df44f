#!/usr/bin/env bash
# CPU backend bandwidth next to what one TCP stream on loopback can carry, measured in one run.
#
# Runs `mtrain bench-comm --op all-reduce` with NPROC ranks (default 4) on loopback, then
# `iperf3` single-stream loopback throughput, and prints both with the ratio
#   peak all-reduce busbw / iperf3 single-stream bandwidth.
# A ring all-reduce moves 2(n-1)/n of the tensor over each rank's outgoing link, which is what
# busbw normalises for, so a ring that streams well gets close to one TCP stream's bandwidth
# (less the CPU time the reduction itself takes on a machine with few cores).
#
# Usage: scripts/bench-comm-cpu.sh            (env: NPROC=4 MINBYTES=1M MAXBYTES=256M ITERS=10)
# Results: printed, and the raw JSON kept in target/bench-comm-cpu/.
set -euo pipefail
cd "$(dirname "$0")/.."

NPROC=${NPROC:-4}
MINBYTES=${MINBYTES:-1M}
MAXBYTES=${MAXBYTES:-256M}
ITERS=${ITERS:-10}
OUT=target/bench-comm-cpu
mkdir -p "$OUT"

if ! command -v iperf3 >/dev/null; then
    echo "installing iperf3 ..." >&2
    if [ "$(id -u)" = 0 ]; then SUDO=""; else SUDO="sudo"; fi
    $SUDO apt-get update -qq && DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq iperf3 >/dev/null
fi

cargo build --release -p mtrain-trainer --bin mtrain
MTRAIN=target/release/mtrain

echo "== mtrain bench-comm: all-reduce, $NPROC ranks on loopback =="
CMD=("$MTRAIN" --nproc-per-node "$NPROC" bench-comm -b "$MINBYTES" -e "$MAXBYTES" -f 4 --op all-reduce -n "$ITERS" -w 2 --json "$OUT/all-reduce.json")
echo "+ ${CMD[*]}"
"${CMD[@]}"

echo "== iperf3: one TCP stream on loopback, 5 s =="
PORT=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')
iperf3 -s -1 -B 127.0.0.1 -p "$PORT" >/dev/null 2>&1 &
SERVER=$!
sleep 0.5
iperf3 -c 127.0.0.1 -p "$PORT" -t 5 -P 1 -J >"$OUT/iperf3.json"
wait "$SERVER" || true

python3 - "$OUT/all-reduce.json" "$OUT/iperf3.json" <<'PY'
import json, sys
bench = json.load(open(sys.argv[1]))
iperf = json.load(open(sys.argv[2]))
tcp_gbs = iperf["end"]["sum_received"]["bits_per_second"] / 8 / 1e9
best = max(bench["rows"], key=lambda r: r["busbw_gbps"])
wrong = sum(r["wrong"] for r in bench["rows"])
print(f"iperf3 single stream (loopback): {tcp_gbs:.3f} GB/s")
print(f"all-reduce peak busbw, {bench['world_size']} ranks: {best['busbw_gbps']:.3f} GB/s at {best['bytes']} B "
      f"(algbw {best['algbw_gbps']:.3f} GB/s, {best['time_us']:.0f} us)")
print(f"ratio busbw / one TCP stream: {best['busbw_gbps'] / tcp_gbs:.2f}; #wrong over all sizes: {wrong}")
PY
