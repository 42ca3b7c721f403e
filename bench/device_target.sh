#!/usr/bin/env bash
# One 2x H200 call measuring the target role after a change to its forward (device image: torch 2.11.0+cu130,
# no uv, no registry; carry .whl/ with .whl/fla/ = fla-core 0.6.0 + einops 0.8.2, installed to .cache/fla here).
#   bash bench/device_target.sh          # logs and JSON under $OUT (default .cache/out)
# GPU 0: every target-role memory calibration point (bench/memory_calibration.py --roles target), merged into a
#   copy of tests/data/memory_calibration.json ($OUT/cal/memory_calibration.json) and refitted.
# GPU 1: the target role's rate (bench/target_rate.py) on padded batches with and without the padding mask:
#   Qwen3-8B 16,384 tokens in 4 rows and Qwen3.6-27B (fla-core kernels) 49,152 tokens in 8 rows; then the
#   GPU-only tests.
set -uo pipefail
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 PYTHONPATH=${PYTHONPATH:-.}
OUT=${OUT:-.cache/out}; mkdir -p "$OUT"
python3 -m pip install -q --no-deps --no-index --target .cache/fla .whl/fla/*.whl && export PYTHONPATH="$PYTHONPATH:.cache/fla"
(
  export CUDA_VISIBLE_DEVICES=0
  timeout ${CAL_S:-400} python3 bench/memory_calibration.py --roles target --budget-s $((${CAL_S:-400} - 60)) --timeout-s 150 \
    --merge tests/data/memory_calibration.json --out "$OUT/cal" 2>&1 | grep -v Warning | tail -24
) > "$OUT/cal.log" 2>&1 &
(
  export CUDA_VISIBLE_DEVICES=1
  for mask in "" --padding-mask; do
    python3 bench/target_rate.py --config configs/qwen3-8b-1gpu.toml --set data.token_budget=16384 --rows 4 $mask \
      --out "$OUT/rate_8b${mask:+_mask}.json" 2>&1 | grep "tok/s"
  done
  for mask in "" --padding-mask; do
    python3 bench/target_rate.py --config configs/qwen3.6-27b-5t3d.toml --rows 8 --steps 4 $mask \
      --out "$OUT/rate_q36${mask:+_mask}.json" 2>&1 | grep "tok/s"
  done
  python3 -m pytest -q -p no:cacheprovider tests/test_attention.py tests/test_loss_kernel.py tests/test_target.py tests/test_step.py -m gpu 2>&1 | tail -2
) > "$OUT/gpu1.log" 2>&1 &
wait
cat "$OUT/cal.log" "$OUT/gpu1.log"
