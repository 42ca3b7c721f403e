#!/usr/bin/env bash
# One H200: the target role eager and then compiled (dflash.models.target.compile_target) on the same model, plus
# the GPU tests of the compiled target (device image: python3 with torch, no uv; carry .whl with .whl/fla/ =
# fla-core 0.6.0 + einops 0.8.2 and .whl/base/ = pydantic and its three deps, installed to .cache/fla here).
#   bash bench/device_target_compile.sh      # logs and JSON under $OUT (default .cache/out)
# Shapes are the records' (bench/README.md, "Target role rate"): Qwen3-8B 16,384 tokens in 4 rows and
# Qwen3.6-27B 49,152 tokens in 8 rows (the last row 1/8 padding), random weights of the real shapes.
# RUN=tests,8b,q36 picks the parts.
set -uo pipefail
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 PYTHONPATH=${PYTHONPATH:-.}
OUT=${OUT:-.cache/out}; mkdir -p "$OUT"; RUN=${RUN:-tests,8b,q36}
python3 -m pip install -q --upgrade --no-deps --no-index --target .cache/fla .whl/fla/*.whl $(ls .whl/base/*.whl 2>/dev/null) \
  && export PYTHONPATH="$PYTHONPATH:.cache/fla"
if [[ $RUN == *tests* ]]; then
  timeout 300 python3 -m pytest -x -q -p no:cacheprovider -p no:logging -o addopts="" tests/test_target_compile.py -m gpu \
    2>&1 | grep -a "^E \|passed\|failed\|rror" | cut -c1-400 | head -30
fi
if [[ $RUN == *8b* ]]; then
  python3 bench/target_rate.py --config configs/qwen3-8b-1gpu.toml --set data.token_budget=16384 --rows 4 --steps 8 \
    --out "$OUT/rate_8b_compile.json" 2>&1 | grep -v Warning | grep "tok/s\|Error\|error"
fi
if [[ $RUN == *q36* ]]; then
  python3 bench/target_rate.py --config configs/qwen3.6-27b-5t3d.toml --rows 8 --steps 4 \
    --out "$OUT/rate_q36_compile.json" 2>&1 | grep -v Warning | grep "tok/s\|kernels\|Error\|error"
fi
