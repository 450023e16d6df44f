# Sourced by the CPU benchmark scripts: a busy machine measures the neighbour, so each run (or
# round) starts on a quiet machine, and every run's load is logged.
#
# before_run NAME waits up to QUIET_WAIT seconds (default 120) for the one-minute load average
# to fall to LOAD_LIMIT (default 0.5 per core), names the run in BUSY if it still starts above
# it, and logs the load it starts at to $OUT/load.log; `before_run NAME nowait` only logs.
# after_run NAME logs the load it ended at. A script prints no ratio while BUSY is not empty.
# cpu_line: the CPU's model, family, model number and AVX-512 (the gemm's kernels differ).
# bench_binary: sets MTRAIN to the mtrain the script runs: $MTRAIN where given (a binary built
# elsewhere, on a machine without Rust), else this checkout's, built first.
QUIET_WAIT=${QUIET_WAIT:-120}
# The load average counts the whole machine, so the limit does too: every CPU, not only those a
# taskset leaves this script (`nproc --all`).
LOAD_LIMIT=${LOAD_LIMIT:-$(awk -v n="$(nproc --all)" 'BEGIN { print 0.5 * n }')}
BUSY=() # "run: load" for every run that started above LOAD_LIMIT
load() { cut -d' ' -f1-3 /proc/loadavg; }
above_limit() { awk -v l="$(cut -d' ' -f1 /proc/loadavg)" -v m="$LOAD_LIMIT" 'BEGIN { exit !(l > m) }'; }
before_run() { # NAME [nowait]
    local waited=0
    if [ "${2:-}" != nowait ]; then
        while above_limit && [ "$waited" -lt "$QUIET_WAIT" ]; do sleep 5; waited=$((waited + 5)); done
        if above_limit; then BUSY+=("$1: $(cut -d' ' -f1 /proc/loadavg)"); fi
    fi
    echo "$1: load before $(load)" >>"$OUT/load.log"
}
after_run() { echo "$1: load after $(load)" >>"$OUT/load.log"; }
cpu_line() {
    echo "$(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | xargs), family $(grep -m1 'cpu family' /proc/cpuinfo | cut -d: -f2 | xargs) model $(grep -m1 '^model[[:space:]]' /proc/cpuinfo | cut -d: -f2 | xargs), $(grep -qw avx512f /proc/cpuinfo && echo AVX-512 || echo 'no AVX-512')"
}
bench_binary() {
    if [ -z "${MTRAIN:-}" ]; then
        MTRAIN=target/release/mtrain
        cargo build --release --workspace --bin mtrain
    fi
}
: >"$OUT/load.log"
