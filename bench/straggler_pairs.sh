#!/bin/bash
# Issue 23 on the device machine's 16 cores: several bench/straggler.py processes side by side, each confined to
# its own PAIR of cores (taskset), so that every 4-rank gloo job sees what this repository's 2-core machine gives
# it (four ranks time-sliced on two cores) on an otherwise quiet host -- many 2-core runs in one call.
# Run from the repository root (the device tool copies it there):
#   LIMIT_S=480 bash bench/straggler_pairs.sh FIRST_SEED "SCENARIOS:HEALTHY:SEEDS" ["SCENARIOS:HEALTHY:SEEDS" ...]
# one argument per core pair (pair k uses cores 2k and 2k+1, k from 1; seeds FIRST_SEED + 100k onwards);
# SCENARIOS is bench/straggler.py's --only list. Each pair's runs are recorded (--record-all) and packed into
# $OUT/rec.tgz even when LIMIT_S stops them; $OUT/pairK.txt holds each pair's table.
# Stop 32 ran: LIMIT_S=470 bash bench/straggler_pairs.sh 1000 healthy:8:0 healthy:8:0 healthy:8:0 \
#   affinity,affinity_weak:0:3 compute,loader:0:3 slow_all,healthy:3:2
set -u
export PYTHONPATH=$PWD/sdk/src:$PWD/engine/src PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
first=$1
shift
k=1
for spec in "$@"; do
  IFS=: read -r only healthy seeds <<< "$spec"
  taskset -c "$((2 * k)),$((2 * k + 1))" timeout "${LIMIT_S:-100000}" python3 bench/straggler.py --only "$only" \
      --healthy "$healthy" --seeds "$seeds" --first-seed "$((first + 100 * k))" --record "/tmp/rec/pair$k" \
      --record-all ${BENCH_ARGS:-} > "$OUT/pair$k.txt" 2>&1 &
  k=$((k + 1))
done
wait
tar -czf "$OUT/rec.tgz" -C /tmp rec 2>/dev/null
