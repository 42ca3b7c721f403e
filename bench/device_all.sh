#!/usr/bin/env bash
# Every GPU measurement of the open issues in one 2x H200 call (device image: torch 2.11.0+cu130, no uv, no registry).
#   bash bench/device_all.sh        # logs, JSON, run snapshots under $OUT (default .cache/out)
# Carry: .whl/ (pydantic etc., installed before this) and .whl/fla/ (fla-core 0.6.0 + einops 0.8.2 wheels).
# Phase 1, in parallel: GPU 1 re-measures the drafter-role memory calibration points; GPU 0 runs the step sweep,
#   the flex call in the trainer's layout, and the Qwen3.6-27B target role with and without fla-core's kernels.
# Phase 2: a Qwen3.6-27B hybrid 1 target + 1 drafter run (the public drafter recipe, block 32, 49152-token
#   batches), then a short Qwen3-8B 1+1 run; dflash-diff between the two run dirs and against this machine.
set -uo pipefail
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 PYTHONPATH=${PYTHONPATH:-.}
OUT=${OUT:-.cache/out}; mkdir -p "$OUT"
source "$(dirname "$0")/device_waivers.sh"  # W=(--waive ... --reason ...)
(
  export CUDA_VISIBLE_DEVICES=1 TORCHINDUCTOR_CACHE_DIR=$(mktemp -d)
  timeout ${CAL_S:-300} python3 bench/memory_calibration.py --roles drafter --budget-s $((${CAL_S:-300} - 50)) --timeout-s 120 \
    --out "$OUT/cal" 2>&1 | grep -v Warning | tail -22
) > "$OUT/cal.log" 2>&1 &
(
  export CUDA_VISIBLE_DEVICES=0 TORCHINDUCTOR_CACHE_DIR=$(mktemp -d)
  timeout 130 python3 bench/train_step.py --sweep --json "$OUT/sweep.json" | grep -v Warning
  FLEX_LAYOUT=rows FLEX_AUTOCAST=1 FLEX_ONLY=default timeout 60 python3 bench/flex_options.py "$OUT/flex_rows.json" | grep -v Warning
  T=(--config configs/qwen3.6-27b-5t3d.toml --steps 3 --warmup 1)
  echo "== target fallback"; timeout 100 python3 bench/target_rate.py "${T[@]}" --out "$OUT/target_rate_fallback.json" 2>&1 | grep -v Warning | tail -4
  python3 -m pip install -q --no-deps --no-index --target .cache/fla .whl/fla/*.whl
  echo "== target fla-core"; PYTHONPATH="$PYTHONPATH:.cache/fla" timeout 100 python3 bench/target_rate.py "${T[@]}" \
    --out "$OUT/target_rate_fla.json" 2>&1 | grep -v Warning | tail -4
) > "$OUT/gpu0.log" 2>&1 &
wait
python3 bench/make_synthetic.py --out .cache/syn-2816 --samples 200 --length 2816
python3 bench/make_synthetic.py --out .cache/syn-3072 --samples 256 --length 3072
echo "=== Qwen3.6-27B 1+1 $(date +%T)"
timeout ${Q36_S:-200} python3 -m dflash.commands.train --config configs/qwen3.6-27b-5t3d.toml --set target.random_init=true --target-gpus 0 --drafter-gpus 1 \
  --set data.path=\".cache/syn-2816\" --set output_dir=\"runs/q36-1t1d\" --set train.log_every=2 --set train.keep_last=1 \
  --fresh --max-steps ${STEPS_Q36:-8} --no-progress "${W[@]}" 2>&1 | grep -v Warning | tail -25
echo "=== Qwen3-8B 1+1 $(date +%T)"
timeout 100 python3 -m dflash.commands.train --config configs/qwen3-8b-1t1d.toml --set target.random_init=true --set data.path=\".cache/syn-3072\" \
  --set output_dir=\"runs/8b-1t1d\" --fresh --max-steps 20 --no-progress "${W[@]}" 2>&1 | grep -v Warning | tail -6
echo "=== dflash-diff"; python3 -m dflash.commands.diff runs/8b-1t1d runs/q36-1t1d; echo "rc=$?"
echo "=== dflash-diff --here"; python3 -m dflash.commands.diff --here runs/8b-1t1d; echo "rc=$?"
for r in q36-1t1d 8b-1t1d; do mkdir -p "$OUT/$r"; cp runs/$r/{snapshot,outcome,preflight}.json runs/$r/metrics.jsonl "$OUT/$r/" 2>/dev/null; done
cat "$OUT/gpu0.log" "$OUT/cal.log"
