#!/usr/bin/env bash
# The drafter-step measurements on a 2x H200 device machine (device image: torch 2.11.0+cu130, no uv).
#   bash bench/device_step.sh          # logs and JSON under $OUT (default .cache/out)
# GPU 0: the GPU-only attention test, then `bench/train_step.py --sweep --profile 30` (first-step time, ms/step,
#        memory, and where each step's GPU time goes).
# GPU 1: the cold start: bench/compile_probe.py, then the 512 x 16 bench twice on one fresh inductor cache
#        (empty cache = cold first step; the second process finds the cache = warm first step).
set -uo pipefail
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 PYTHONPATH=${PYTHONPATH:-.}
OUT=${OUT:-.cache/out}; mkdir -p "$OUT"
SWEEP_ARGS=${SWEEP_ARGS:-}
(
  export CUDA_VISIBLE_DEVICES=0 TORCHINDUCTOR_CACHE_DIR=$(mktemp -d)
  python3 -m pytest -q -p no:cacheprovider tests/test_attention.py -k cuda 2>&1 | tail -3
  timeout 540 python3 bench/train_step.py --sweep --profile 30 --json "$OUT/sweep.json" $SWEEP_ARGS
) > "$OUT/gpu0.log" 2>&1 &
(
  export CUDA_VISIBLE_DEVICES=1 TORCHINDUCTOR_CACHE_DIR=$(mktemp -d)
  timeout 200 python3 bench/compile_probe.py
  export TORCHINDUCTOR_CACHE_DIR=$(mktemp -d)
  echo "== cold cache"; timeout 300 python3 bench/train_step.py --warmup 2 --steps 3 $SWEEP_ARGS | grep -E "first step|ms/step"
  echo "== warm cache"; timeout 200 python3 bench/train_step.py --warmup 2 --steps 3 $SWEEP_ARGS | grep -E "first step|ms/step"
) > "$OUT/gpu1.log" 2>&1 &
wait
cat "$OUT/gpu0.log" "$OUT/gpu1.log" | grep -v Warning
