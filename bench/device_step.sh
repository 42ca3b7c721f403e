#!/usr/bin/env bash
# The drafter-step measurements on a 2x H200 device machine (device image: torch 2.11.0+cu130, no uv).
#   bash bench/device_step.sh          # logs and JSON under $OUT (default .cache/out)
# GPU 0: the GPU-only tests (compiled flex attention, fused loss kernel), then `bench/train_step.py --sweep
#        --profile 30` with recompute as auto picks it (first-step time, ms/step, memory, where each step's
#        GPU time goes); SWEEP_LAYER=1: also with recompute=layer; FLEX_OPTIONS=1: bench/flex_options.py.
# GPU 1: the cold start (the 512 x 16 bench twice on one fresh inductor cache: empty cache = cold first
#        step, the second process finds the cache = warm first step), then the drafter-role memory
#        calibration points (bench/memory_calibration.py) with what time is left.
set -uo pipefail
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 PYTHONPATH=${PYTHONPATH:-.}
OUT=${OUT:-.cache/out}; mkdir -p "$OUT"
CAL_BUDGET_S=${CAL_BUDGET_S:-330}
(
  export CUDA_VISIBLE_DEVICES=0 TORCHINDUCTOR_CACHE_DIR=$(mktemp -d)
  python3 -m pytest -q -p no:cacheprovider tests/test_attention.py tests/test_loss_kernel.py -m gpu -k cuda 2>&1 | tail -3
  timeout 250 python3 bench/train_step.py --sweep --profile 30 --json "$OUT/sweep_auto.json"
  [ "${SWEEP_LAYER:-0}" = 1 ] && timeout 200 python3 bench/train_step.py --sweep --set train.recompute=layer --json "$OUT/sweep_layer.json"
  [ "${FLEX_OPTIONS:-0}" = 1 ] && timeout 240 python3 bench/flex_options.py "$OUT/flex_options.json"
) > "$OUT/gpu0.log" 2>&1 &
(
  export CUDA_VISIBLE_DEVICES=1 TORCHINDUCTOR_CACHE_DIR=$(mktemp -d)
  echo "== cold cache"; timeout 200 python3 bench/train_step.py --warmup 2 --steps 3 | grep -E "first step|ms/step"
  echo "== warm cache"; timeout 120 python3 bench/train_step.py --warmup 2 --steps 3 | grep -E "first step|ms/step"
  timeout $((CAL_BUDGET_S + 60)) python3 bench/memory_calibration.py --roles drafter --budget-s "$CAL_BUDGET_S" --timeout-s 150 \
    --out "$OUT/cal" 2>&1 | grep -v Warning | tail -25
) > "$OUT/gpu1.log" 2>&1 &
wait
cat "$OUT/gpu0.log" "$OUT/gpu1.log" | grep -v "Warning\|_warn_once\|warnings.warn"
