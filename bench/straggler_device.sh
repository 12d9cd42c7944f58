#!/bin/bash
# Issue 23 on the device machine (one H200, 16 vCPUs, a quiet host): bench/straggler.py's 4-rank gloo jobs on a
# host that is not oversubscribed, and bench/sdk_overhead.py on a real H200 step for this checkout's SDK against a
# baseline SDK tree. Run from the repository root (the device tool copies it there):
#   bash bench/straggler_device.sh SCENARIOS_A SCENARIOS_B FIRST_SEED HEALTHY [BASELINE_SDK_SRC]
# A: unpinned scenarios (healthy, compute, loader, slow_all); B: the affinity scenarios, which pin a rank and a
# spinner to core 0 (one at a time), run beside A. With BASELINE_SDK_SRC (e.g. a `git archive` of the previous
# commit's sdk/src carried along), the overhead bench runs for both SDKs at the same time on the GPU.
# BENCH_ARGS (environment): more bench/straggler.py options for both processes, e.g. BENCH_ARGS="--hidden 1024".
# LIMIT_S (environment): stop the straggler jobs after this many seconds, so that what was recorded still comes
# back packed (the device call's limit kills everything, the packing too).
# Stop 31 ran: healthy,compute affinity,affinity_weak 500 20;  healthy,compute,slow_all affinity,loader 550 8 <base>;
# and with BENCH_ARGS="--hidden 1024": healthy,compute,slow_all affinity,affinity_weak,loader 600 12.
set -u
export PYTHONPATH=$PWD/sdk/src:$PWD/engine/src PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
{ uname -r; nproc; python3 -c "import torch;print('torch',torch.__version__)"; } > "$OUT/env.txt" 2>&1
if [ -n "${5:-}" ]; then
  ( for sdk in "$5" sdk/src; do echo "== SDK $sdk"; PYTHONPATH=$PWD/$sdk python3 bench/sdk_overhead.py --device cuda \
      --skip log,mlp,transformer --steps 60 --blocks 6 2>&1 | grep -v Warning; done ) > "$OUT/overhead.txt" 2>&1 &
fi
# shellcheck disable=SC2086  # BENCH_ARGS is a list of options
timeout "${LIMIT_S:-100000}" python3 bench/straggler.py --only "$2" --seeds 4 --first-seed "$3" --record /tmp/recB --record-all ${BENCH_ARGS:-} \
    > "$OUT/B.txt" 2>&1 &
# shellcheck disable=SC2086
timeout "${LIMIT_S:-100000}" python3 bench/straggler.py --only "$1" --healthy "$4" --seeds 4 --first-seed "$3" --record /tmp/recA --record-all \
    ${BENCH_ARGS:-} > "$OUT/A.txt" 2>&1
wait
tar -czf "$OUT/rec.tgz" -C /tmp recA recB 2>/dev/null
