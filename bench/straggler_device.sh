#!/bin/bash
# Issue 23 on the device machine (one H200, 16 vCPUs, a quiet host): bench/straggler.py's 4-rank gloo jobs on a
# host that is not oversubscribed, and bench/sdk_overhead.py on a real H200 step for this checkout's SDK against a
# baseline SDK tree. Run from the repository root (the device tool copies it there):
#   bash bench/straggler_device.sh SCENARIOS_A SCENARIOS_B FIRST_SEED HEALTHY [BASELINE_SDK_SRC]
# A: unpinned scenarios (healthy, compute, loader, slow_all); B: the affinity scenarios, whose plant pins a rank
# and a spinner to the first core the rank may use, run beside A.
# ISOLATE (environment, default 1): the two sides run on DISJOINT cores (taskset), each on its own half of the
# host's physical cores (with every hyperthread sibling of those cores, so no side shares a core's execution
# units with the other): a rank of A can never land on B's plant core (the pinned rank and its spinner) nor
# beside B's CPU-bound loader work. The plant core is then the first core of B's half. ISOLATE=0: the
# arrangement of stops 31-34 (both sides on every core: an A rank the scheduler put on B's plant core was
# contended like a planted one). $OUT/cores.txt records the topology and each side's cores.
# Every rank writes its run-queue delay and CPU time per step (tests/fixtures/straggler/job.py's side channel,
# kept in REC_A/sched, REC_B/sched); bench/straggler_sched.py reads them.
# BENCH_ARGS (environment): more bench/straggler.py options for both processes, e.g. BENCH_ARGS="--hidden 1024".
# LIMIT_S (environment): stop the straggler jobs after this many seconds, so that what was recorded still comes
# back packed (the device call's limit kills everything, the packing too).
# REC_A, REC_B (environment, default /tmp/recA, /tmp/recB): where the runs are recorded; TGZ (default rec.tgz).
# Stop 31 ran: healthy,compute affinity,affinity_weak 500 20;  healthy,compute,slow_all affinity,loader 550 8 <base>;
# and with BENCH_ARGS="--hidden 1024": healthy,compute,slow_all affinity,affinity_weak,loader 600 12.
# Stops 32-34 ran it with ISOLATE=0 (it was the only arrangement); stop 35 added ISOLATE and ran, with
# BENCH_ARGS="--hidden 1024": ISOLATE=0 healthy,slow_all loader,affinity,affinity_weak 6000 3 (--seeds 2), then
# healthy,slow_all affinity,affinity_weak 6100 5 (--seeds 5), and healthy,compute,slow_all
# loader,affinity,affinity_weak 7000 6 (bench/results/straggler_stop35.txt).
set -u
export PYTHONPATH=$PWD/sdk/src:$PWD/engine/src PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}
REC_A=${REC_A:-/tmp/recA}
REC_B=${REC_B:-/tmp/recB}
mkdir -p "$OUT"
{ uname -r; nproc; python3 -c "import torch;print('torch',torch.__version__)"; } > "$OUT/env.txt" 2>&1
CORES_A="" CORES_B=""
if [ "${ISOLATE:-1}" = 1 ]; then
  read -r CORES_A CORES_B < <(python3 - <<'PY'
import glob, os
def cpus(text):
    out = []
    for part in text.strip().split(","):
        lo, _, hi = part.partition("-")
        out += range(int(lo), int(hi or lo) + 1)
    return out
allowed = os.sched_getaffinity(0)
groups = {tuple(c for c in cpus(open(p).read()) if c in allowed)
          for p in glob.glob("/sys/devices/system/cpu/cpu[0-9]*/topology/thread_siblings_list")}
groups = sorted(g for g in groups if g)
half = len(groups) // 2   # B (5 busy threads: 4 ranks and the spinner) gets the larger half
a = sorted(c for g in groups[:half] for c in g)
b = sorted(c for g in groups[half:] for c in g)
print(",".join(map(str, a)), ",".join(map(str, b)))
PY
)
fi
{ echo "ISOLATE=${ISOLATE:-1} A=${CORES_A:-all} B=${CORES_B:-all}"; lscpu 2>/dev/null | grep -iE "^CPU\(s\)|thread|core|socket|model name"
  grep . /sys/devices/system/cpu/cpu[0-9]*/topology/thread_siblings_list 2>/dev/null; } >> "$OUT/cores.txt"
on() { if [ -n "$1" ]; then echo "taskset -c $1"; fi; }
# shellcheck disable=SC2046,SC2086  # on() and BENCH_ARGS are lists of words
$(on "$CORES_B") timeout "${LIMIT_S:-100000}" python3 bench/straggler.py --only "$2" --seeds 4 --first-seed "$3" \
    --record "$REC_B" --record-all ${BENCH_ARGS:-} > "$OUT/B.txt" 2>&1 &
# shellcheck disable=SC2046,SC2086
$(on "$CORES_A") timeout "${LIMIT_S:-100000}" python3 bench/straggler.py --only "$1" --healthy "$4" --seeds 4 \
    --first-seed "$3" --record "$REC_A" --record-all ${BENCH_ARGS:-} > "$OUT/A.txt" 2>&1
wait
if [ -n "${5:-}" ]; then  # after the straggler jobs: the overhead bench must not share the host with them
  ( for sdk in "$5" sdk/src; do echo "== SDK $sdk"; PYTHONPATH=$PWD/$sdk python3 bench/sdk_overhead.py --device cuda \
      --skip log,mlp,transformer --steps 60 --blocks 6 2>&1 | grep -v Warning; done ) > "$OUT/overhead.txt" 2>&1
fi
tar -czf "$OUT/${TGZ:-rec.tgz}" -C "$(dirname "$REC_A")" "$(basename "$REC_A")" "$(basename "$REC_B")" 2>/dev/null
