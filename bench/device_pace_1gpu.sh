#!/usr/bin/env bash
# One H200, what issue #27 still needs measured on one GPU (written 2026-12-01 when device time ran out; not yet run
# as a whole: its parts ran alone). Carry .whl (.whl/fla: fla-core 0.6.0 + einops 0.8.2; .whl/base: pydantic,
# pydantic-core, annotated-types, typing-inspection), PYTHONPATH=. on the device image; about 9 minutes.
#   bash bench/device_pace_1gpu.sh      # logs and JSON under $OUT (default .cache/out)
# 1. the compiled target's GPU tests, dense and hybrid (fla's autotune makes the hybrid one ~4 min);
# 2. the Qwen3.6-27B target role eager then compiled, 49,152 tokens in 8 rows (the >= 12.7K tok/s target);
# 3. the background save's stall on CUDA with about the users' drafter state (hidden 5120, 5 layers).
set -uo pipefail
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 PYTHONPATH=${PYTHONPATH:-.}
OUT=${OUT:-.cache/out}; mkdir -p "$OUT"
python3 -m pip install -q --upgrade --no-deps --no-index --target .cache/fla .whl/fla/*.whl .whl/base/*.whl \
  && export PYTHONPATH="$PYTHONPATH:.cache/fla"
timeout 280 python3 -m pytest -x -q -p no:cacheprovider -p no:logging -o addopts="" tests/test_target_compile.py -m gpu \
  2>&1 | grep -a "^E \|passed\|failed\|rror" | cut -c1-400 | head -20
timeout 200 python3 bench/target_rate.py --config configs/qwen3.6-27b-5t3d.toml --rows 8 --warmup 1 --steps 3 \
  --out "$OUT/rate_q36_compile.json" 2>&1 | grep -a "tok/s\|kernels\|relative\|rror"
timeout 120 python3 bench/save_stall.py --device cuda --hidden 5120 --layers 5 --steps 6 \
  --out "$OUT/h200_save_stall.json" 2>&1 | grep -a "stall\|rror"
