#!/usr/bin/env bash
# One GPU: the compile cache artifact (issue #56) on CUDA. Carry .whl like bench/device_lengths.sh (pydantic & co in
# .whl/base, fla-core + einops in .whl/fla).
#   PART=tests bash bench/device_artifact.sh   # the artifact's tests (CPU ones; the round trip compiles with inductor)
#   PART=tiny  bash bench/device_artifact.sh   # the tiny preset: --warm-cache, then cold vs from the artifact (2 pairs)
#   PART=q36   bash bench/device_artifact.sh   # the Qwen3.6-27B preset co-located: --warm-cache (writes and times the
#                                              # artifact), preflight on it, 3 steps from it with empty caches
# Output in $OUT: compile_artifact_tiny.json, q36_*.log, the artifact's manifest.
set -uo pipefail
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 PYTHONPATH=${PYTHONPATH:-.}
OUT=${OUT:-.cache/out}; mkdir -p "$OUT"
python3 -m pip install -q --upgrade --no-deps --no-index --target .cache/fla .whl/fla/*.whl .whl/base/*.whl \
  && export PYTHONPATH="$PYTHONPATH:.cache/fla"
source "$(dirname "$0")/device_waivers.sh"  # W=(--waive ... --reason ...)
CFG=${CFG:-configs/qwen3.6-27b-5t3d.toml}
ONE_GPU=(--set 'topology.target_gpus=[]' --set 'topology.drafter_gpus=[]')
A=.cache/artifact; mkdir -p "$A"
MIX=.cache/syn-lognormal-2826

for part in ${PART:-tests}; do
  echo "=== $part $(date +%T)"
  case $part in
    tests) timeout 590 python3 -m pytest -q -p no:cacheprovider -o addopts="" tests/test_compile_artifact.py \
             tests/test_preflight_checks_source.py 2>&1 | tail -15 ;;
    tiny) python3 bench/compile_artifact.py --device cuda --runs 2 --out "$OUT/compile_artifact_tiny.json" -- "${W[@]}" ;;
    q36) [ -d "$MIX" ] || python3 bench/make_synthetic.py --out "$MIX" --samples 1600 --length 2826 --sigma 0.6 \
           --max-length 16384 --vocab 248320
         ART=(--set "train.compile_cache=\"$A/q36.dfcache\"" --set "data.path=\"$MIX\"")
         t0=$(date +%s)
         python3 -m dflash.commands.train --config "$CFG" "${ONE_GPU[@]}" "${ART[@]}" --warm-cache "${W[@]}" 2>&1 \
           | grep -av Warning | tee "$OUT/q36_warm.log" | grep -a "^warm-cache:"
         echo "warm-cache $(( $(date +%s) - t0 )) s"
         python3 -m dflash.commands.preflight --profile train-cu128 --config "$CFG" "${ONE_GPU[@]}" "${ART[@]}" 2>&1 \
           | tee "$OUT/q36_preflight.log" | grep -a "compile-cache"
         TORCHINDUCTOR_CACHE_DIR=$(mktemp -d) TRITON_CACHE_DIR=$(mktemp -d) python3 -m dflash.commands.train \
           --config "$CFG" "${ONE_GPU[@]}" "${ART[@]}" --set output_dir=\"runs/q36-artifact\" --max-steps 3 --fresh \
           --no-progress "${W[@]}" 2>&1 | grep -av Warning | tee "$OUT/q36_from_artifact.log" \
           | grep -a "^compile cache:\|^compile:\|^first step\|^startup"
         python3 -c "from dflash.runs.compile_artifact import read_header; import json, sys; h, p = read_header(sys.argv[1]); \
print(p or json.dumps({k: v for k, v in h['manifest'].items() if k not in ('drafter',)}, indent=1))" "$A/q36.dfcache" \
           > "$OUT/q36_manifest.json"; cat "$OUT/q36_manifest.json" | head -60 ;;
  esac
done
