#!/usr/bin/env bash
# One H200, what issue #27 measures on one GPU (run in parts on 2026-12-01, session 10: bench/README.md, "Target role
# alone" and "Checkpoint saves off the step loop"). Carry .whl (.whl/fla: fla-core 0.6.0 + einops 0.8.2; .whl/base:
# pydantic, pydantic-core, annotated-types, typing-inspection), PYTHONPATH=. on the device image; about 9 minutes.
#   bash bench/device_pace_1gpu.sh      # logs and JSON under $OUT (default .cache/out)
# 1. the compiled target's GPU tests, dense and hybrid (fla's autotune makes the hybrid one ~4 min), and the pinned
#    host buffers of a background save;
# 2. the Qwen3.6-27B target role eager then compiled, 49,152 tokens in 8 rows (~2.5 min: fla autotunes ~50 s, the
#    compile ~25 s);
# 3. a background save's stall on CUDA with about the users' drafter state (hidden 5120, 5 layers; ~3 min).
set -uo pipefail
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 PYTHONPATH=${PYTHONPATH:-.}
OUT=${OUT:-.cache/out}; mkdir -p "$OUT"
python3 -m pip install -q --upgrade --no-deps --no-index --target .cache/fla .whl/fla/*.whl .whl/base/*.whl \
  && export PYTHONPATH="$PYTHONPATH:.cache/fla"
timeout 280 python3 -m pytest -x -q -p no:cacheprovider -p no:logging -o addopts="" tests/test_target_compile.py \
  tests/test_checkpoint_async.py -m gpu \
  2>&1 | grep -a "^E \|passed\|failed\|rror" | cut -c1-400 | head -20
timeout 240 python3 bench/target_rate.py --config configs/qwen3.6-27b-5t3d.toml --rows 8 --warmup 1 --steps 3 \
  --out "$OUT/rate_q36_compile.json" 2>&1 | grep -a "tok/s\|kernels\|relative\|rror"
timeout 200 python3 bench/save_stall.py --device cuda --hidden 5120 --layers 5 --steps 40 --save-every 20 \
  --background-only --out "$OUT/h200_save_stall_pinned.json" 2>&1 | grep -a "stall\|rror"
