#!/usr/bin/env bash
# One H200, what issue #27 measures on one GPU (parts run on 2026-12-01, session 10: bench/README.md, "Target role
# alone" and "Checkpoint saves off the step loop"). Carry .whl (.whl/fla: fla-core 0.6.0 + einops 0.8.2; .whl/base:
# pydantic, pydantic-core, annotated-types, typing-inspection), PYTHONPATH=. on the device image. Parts (PART, default
# all four, about 12 minutes: two device calls, e.g. PART="tests rate" then PART="save sweep"):
#   tests  the compiled target's GPU tests, dense and hybrid (fla's autotune ~4 min), and the pinned save buffers;
#   rate   the Qwen3.6-27B target role eager then compiled, 49,152 tokens in 8 rows (~2.5 min);
#   save   a background save's stall with about the users' drafter state (hidden 5120, 5 layers; ~3 min);
#   sweep  the bf16 drafter step sweep (512 x 16 / 1024 x 32; 145 / 525 ms before), the real Trainer built on the GPU.
#   PART="tests rate" bash bench/device_pace_1gpu.sh      # logs and JSON under $OUT (default .cache/out)
set -uo pipefail
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 PYTHONPATH=${PYTHONPATH:-.}
OUT=${OUT:-.cache/out}; mkdir -p "$OUT"
python3 -m pip install -q --upgrade --no-deps --no-index --target .cache/fla .whl/fla/*.whl .whl/base/*.whl \
  && export PYTHONPATH="$PYTHONPATH:.cache/fla"
for part in ${PART:-tests rate save sweep}; do
  echo "=== $part $(date +%T)"
  case $part in
    tests) timeout 280 python3 -m pytest -x -q -p no:cacheprovider -p no:logging -o addopts="" \
             tests/test_target_compile.py tests/test_checkpoint_async.py -m gpu \
             2>&1 | grep -a "^E \|passed\|failed\|rror" | cut -c1-400 | head -20 ;;
    rate) timeout 240 python3 bench/target_rate.py --config configs/qwen3.6-27b-5t3d.toml --rows 8 --warmup 1 \
            --steps 3 --out "$OUT/rate_q36_compile.json" 2>&1 | grep -a "tok/s\|kernels\|relative\|rror" ;;
    save) timeout 200 python3 bench/save_stall.py --device cuda --hidden 5120 --layers 5 --steps 40 --save-every 20 \
            --background-only --out "$OUT/h200_save_stall_pinned.json" 2>&1 | grep -a "stall\|rror" ;;
    sweep) timeout 300 python3 bench/train_step.py --sweep --json "$OUT/train_step_sweep.json" 2>&1 \
             | grep -av "Warning" | tail -n 12 ;;
    *) echo "unknown PART $part (tests, rate, save, sweep)"; exit 2 ;;
  esac
done
