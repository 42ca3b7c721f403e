#!/usr/bin/env bash
# The target role's rate on one H200 at the incident's 49152-token batches, with the PyTorch Gated DeltaNet
# fallback and then with fla-core's Triton kernels (device image: python3 with torch, no uv, no registry).
#   uvx pip download fla-core==0.6.0 einops==0.8.2 --no-deps -d .cache/wheels   # here, once (carried: .cache/wheels)
#   bash bench/device_target_rate.sh                                            # on the device; JSON under $OUT
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=${PYTHONPATH:-.}
OUT=${OUT:-.cache/out}; mkdir -p "$OUT"
CFG=${CFG:-configs/qwen3.6-27b-5t3d.toml}
echo "== fallback"; timeout 280 python3 bench/target_rate.py --config "$CFG" --out "$OUT/target_rate_fallback.json" 2>&1 | grep -v Warning
python3 -m pip install -q --no-deps --no-index --target .cache/fla .cache/wheels/*.whl
echo "== fla-core"; PYTHONPATH="$PYTHONPATH:.cache/fla" timeout 280 python3 bench/target_rate.py --config "$CFG" \
  --out "$OUT/target_rate_fla.json" 2>&1 | grep -v Warning
