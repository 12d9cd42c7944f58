#!/bin/bash
# The SDK's cost on a real GPU step (bench/sdk_overhead.py --device cuda: GPT-2 small, bf16 autocast, the sync
# check), this checkout's SDK and a baseline SDK tree taking turns, ROUNDS rounds each, then this SDK's log()
# microbench and fp16 + GradScaler. Run from the repository root on the device machine:
#   bash bench/sdk_overhead_device.sh BASELINE_SDK_SRC [ROUNDS] [STEPS]
# BASELINE_SDK_SRC: a baseline's sdk/src (e.g. `git archive REF sdk/src | tar -x -C out/base` then carry out/base:
# out/base/sdk/src). Output on stdout and in $OUT/sdk_overhead.txt.
set -u
BASE=${1:?baseline sdk/src}
ROUNDS=${2:-2}
STEPS=${3:-60}
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
{
  nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
  python3 -c "import torch, sys; print(torch.__version__, sys.version.split()[0])"
  nproc
  for round in $(seq 1 "$ROUNDS"); do
    for side in base head; do
      src=$PWD/sdk/src
      [ "$side" = base ] && src=$BASE
      echo "== SDK $side round $round"
      PYTHONPATH=$src python3 bench/sdk_overhead.py --device cuda --skip log,mlp,transformer --steps "$STEPS" \
        --blocks 6 2>&1 | grep -v "sync_debug\|warn_deprecated\|^ *warnings.warn"
    done
  done
  echo "== SDK head log + fp16"
  PYTHONPATH=$PWD/sdk/src python3 bench/sdk_overhead.py --device cuda --amp fp16 --skip mlp,transformer \
    --steps "$STEPS" --blocks 6 2>&1 | grep -v "sync_debug\|warn_deprecated\|^ *warnings.warn"
} | tee "$OUT/sdk_overhead.txt"
