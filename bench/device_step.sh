#!/usr/bin/env bash
# The drafter-step measurements on a 2x H200 device machine (device image: torch 2.11.0+cu130, no uv).
#   bash bench/device_step.sh          # logs and JSON under $OUT (default .cache/out)
# GPU 0: the GPU-only tests (compiled flex attention over several shapes, fused loss kernel), then
#        `bench/train_step.py --sweep --profile 12` with recompute as auto picks it (first-step time, ms/step,
#        memory, GPU kernels by kind for the step / the target alone / the drafter's part, host waits), then the
#        sweep with recompute=layer.
# GPU 1: the cold start (the 512 x 16 bench twice on one fresh inductor cache: empty cache = cold first step
#        with torch.compile's per-phase times, the second process finds the cache = warm first step); one epoch
#        of a length-bucketed lognormal mix through dflash-train (compiled graphs at the first step and at the
#        end); then drafter-role memory calibration points (bench/memory_calibration.py) with the time left.
set -uo pipefail
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 PYTHONPATH=${PYTHONPATH:-.}
OUT=${OUT:-.cache/out}; mkdir -p "$OUT"
source "$(dirname "$0")/device_waivers.sh"  # W=(--waive ... --reason ...)
CAL_BUDGET_S=${CAL_BUDGET_S:-240}
CAL_ONLY=${CAL_ONLY:-}  # e.g. "--only 8b-16k-a512-b16-d5 --only ..."
(
  export CUDA_VISIBLE_DEVICES=0 TORCHINDUCTOR_CACHE_DIR=$(mktemp -d)
  python3 -m pytest -q -s -p no:cacheprovider tests/test_attention.py tests/test_loss_kernel.py -m gpu -k cuda 2>&1 \
    | grep -E "passed|failed|Error|compiled graphs" | tail -6
  timeout 250 python3 bench/train_step.py --sweep --profile 12 --json "$OUT/sweep_auto.json"
  [ "${SWEEP_LAYER:-1}" = 1 ] && timeout 200 python3 bench/train_step.py --sweep --set train.recompute=layer --json "$OUT/sweep_layer.json"
) > "$OUT/gpu0.log" 2>&1 &
(
  export CUDA_VISIBLE_DEVICES=1 TORCHINDUCTOR_CACHE_DIR=$(mktemp -d)
  echo "== cold cache"; timeout 200 python3 bench/train_step.py --warmup 2 --steps 3 --compile-times > "$OUT/cold.log" 2>&1
  grep -E "first step|ms/step|compile_fx|async_compile.wait|PyCodeCache|inductor_import|_compile.compile_inner|entire_frame" "$OUT/cold.log" | head -14
  echo "== warm cache"; timeout 120 python3 bench/train_step.py --warmup 2 --steps 3 | grep -E "first step|ms/step"
  echo "== bucketed epoch $(date +%T)"
  python3 bench/make_synthetic.py --out .cache/syn-mix --samples 400 --length 1500 --sigma 0.8 --max-length 8192
  TORCH_LOGS=recompiles timeout 240 python3 -m dflash.commands.train --config configs/qwen3-8b-1gpu.toml --set target.random_init=true --set data.path=\".cache/syn-mix\" \
    --set output_dir=\"runs/bucketed\" --set data.token_budget=16384 --set data.max_batch_size=16 \
    --set train.max_anchors=1024 --set train.batch_anchors=1024 --set train.epochs=1 --set train.log_every=5 \
    --set train.keep_last=1 --fresh --no-progress "${W[@]}" > "$OUT/bucketed.log" 2>&1
  grep -A3 "Recompiling" "$OUT/bucketed.log" | cut -c1-300 | head -24; grep -v Warning "$OUT/bucketed.log" | grep -E "^step|done|first step" | tail -4
  python3 - <<'EOF'
import json
rows = [json.loads(l) for l in open("runs/bucketed/metrics.jsonl") if l.strip()]
print("bucketed epoch: compiled graphs per logged step:", [(r.get("step"), r.get("compiled_graphs")) for r in rows if "compiled_graphs" in r])
EOF
  cp runs/bucketed/metrics.jsonl "$OUT/bucketed_metrics.jsonl" 2>/dev/null
  echo "== calibration $(date +%T)"
  timeout $((CAL_BUDGET_S + 60)) python3 bench/memory_calibration.py --roles drafter --budget-s "$CAL_BUDGET_S" --timeout-s 150 \
    $CAL_ONLY --out "$OUT/cal" 2>&1 | grep -v Warning | tail -16
) > "$OUT/gpu1.log" 2>&1 &
wait
cat "$OUT/gpu0.log" "$OUT/gpu1.log" | grep -v "Warning\|_warn_once\|warnings.warn"
