#!/usr/bin/env bash
# One 2x H200 call re-checking the step and the hybrid target after a change (device image: torch 2.11.0+cu130,
# no uv, no registry; carry .whl/ with .whl/fla/ = fla-core 0.6.0 + einops 0.8.2, installed to .cache/fla here).
#   bash bench/device_check.sh          # logs and JSON under $OUT (default .cache/out)
# Phase 1, in parallel. GPU 0, on an empty inductor cache: `bench/train_step.py --sweep --profile 12` (its first
#   step is the cold start at the 512 x 16 shape), one epoch of a length-bucketed lognormal mix through
#   dflash-train with TORCH_LOGS=recompiles (graphs at the first step and at the end, every recompile's reason),
#   then the GPU-only tests. GPU 1: the hybrid target role's memory calibration point (fla-core kernels), then
#   drafter-role points (CAL_ONLY) with the time left.
# Phase 2: the Qwen3.6-27B 1 target + 1 drafter run (configs/qwen3.6-27b-5t3d.toml, fla-core kernels on the
#   target), ending with the measured per-role rates and the suggested 8-GPU split.
# Knobs: SKIP_EPOCH=1 skips the bucketed epoch, SKIP_Q36=1 phase 2, SKIP_TARGET=1 GPU 1's target point;
#   CAL_ONLY="--only NAME ..." picks the drafter points, CAL_S their time.
set -uo pipefail
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 PYTHONPATH=${PYTHONPATH:-.}
OUT=${OUT:-.cache/out}; mkdir -p "$OUT"
source "$(dirname "$0")/device_waivers.sh"  # W=(--waive ... --reason ...)
python3 -m pip install -q --no-deps --no-index --target .cache/fla .whl/fla/*.whl && export PYTHONPATH="$PYTHONPATH:.cache/fla"
(
  export CUDA_VISIBLE_DEVICES=0 TORCHINDUCTOR_CACHE_DIR=$(mktemp -d)
  timeout 220 python3 bench/train_step.py --sweep --profile 12 --compile-times --json "$OUT/sweep.json"
  if [ -z "${SKIP_EPOCH:-}" ]; then
  python3 bench/make_synthetic.py --out .cache/syn-mix --samples 400 --length 1500 --sigma 0.8 --max-length 8192
  TORCH_LOGS=recompiles timeout 150 python3 -m dflash.commands.train --config configs/qwen3-8b-1gpu.toml --set target.random_init=true --set data.path=\".cache/syn-mix\" \
    --set output_dir=\"runs/bucketed\" --set data.token_budget=16384 --set data.max_batch_size=16 \
    --set train.max_anchors=1024 --set train.batch_anchors=1024 --set train.epochs=1 --set train.log_every=5 \
    --set train.keep_last=1 --fresh --no-progress "${W[@]}" > "$OUT/bucketed.log" 2>&1
  echo "== bucketed epoch"; grep -A3 "Recompiling" "$OUT/bucketed.log" | cut -c1-260 | head -20
  grep -v Warning "$OUT/bucketed.log" | grep -E "first step|done" | tail -2
  fi
  python3 -m pytest -q -p no:cacheprovider tests/test_attention.py tests/test_loss_kernel.py tests/test_target.py tests/test_step.py -m gpu 2>&1 | tail -2
) > "$OUT/gpu0.log" 2>&1 &
(
  export CUDA_VISIBLE_DEVICES=1 TORCHINDUCTOR_CACHE_DIR=$(mktemp -d)
  [ -z "${SKIP_TARGET:-}" ] && timeout 110 python3 bench/memory_calibration.py --roles target --only q36-27b-49k-a1024-b32-d5-kl-off --timeout-s 100 \
    --out "$OUT/cal_target" 2>&1 | grep -v Warning | grep -E "^\[|q36" | tail -3
  timeout $((${CAL_S:-200} + 20)) python3 bench/memory_calibration.py --roles drafter --budget-s $((${CAL_S:-200} - 30)) \
    --timeout-s 100 ${CAL_ONLY:-} --out "$OUT/cal" 2>&1 | grep -v Warning | tail -12
) > "$OUT/cal.log" 2>&1 &
wait
grep -v "Warning\|_warn_once\|warnings.warn" "$OUT/gpu0.log" | grep -v "^\[.*\] top\|^\[.*\]   .* x[0-9]" | cut -c1-220
cat "$OUT/cal.log"
[ -n "${SKIP_Q36:-}" ] && exit 0
python3 bench/make_synthetic.py --out .cache/syn-2816 --samples 200 --length 2816 --vocab 248320 > /dev/null
echo "=== Qwen3.6-27B 1+1 $(date +%T)"
timeout ${Q36_S:-230} python3 -m dflash.commands.train --config configs/qwen3.6-27b-5t3d.toml --set target.random_init=true --target-gpus 0 --drafter-gpus 1 \
  --set data.path=\".cache/syn-2816\" --set output_dir=\"runs/q36-1t1d\" --set train.log_every=2 --set train.keep_last=1 \
  --fresh --max-steps ${STEPS_Q36:-8} --no-progress "${W[@]}" > "$OUT/q36.log" 2>&1
grep -v Warning "$OUT/q36.log" | grep -E "estimate|GiB|step|suggested|measured|done|target|drafter|Error" | tail -22
cp runs/q36-1t1d/outcome.json "$OUT/q36_outcome.json" 2>/dev/null
