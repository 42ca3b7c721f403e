#!/usr/bin/env bash
# 2x H200 (kind nvidia-h200-x2; ask `status` first): the users' job at its steady state, the figures issue #27 asks
# for that need two GPUs. Carry .whl (.whl/fla: fla-core 0.6.0 + einops 0.8.2; .whl/base: pydantic, pydantic-core,
# annotated-types, typing-inspection); one PART per device call, each under its 10 minutes:
#   PART=warm  bash bench/device_pace_2gpu.sh   # data + the 27B 1+1 --warm-cache (every bucket shape, target too)
#   PART=27b   bash bench/device_pace_2gpu.sh   # 27B 1+1, 75 steps, a save at 40: >= 60 steady steps, save stall,
#                                               # time to first step with the warm cache, NVML vs estimate, 8-GPU split
#   PART=coloc bash bench/device_pace_2gpu.sh   # 27B co-located data parallel on both GPUs, then on GPU 0 alone
#   PART=8b    bash bench/device_pace_2gpu.sh   # Qwen3-8B 1+1, 75 steps, a save at 40
# A fresh machine forgets the data and the compile cache: run warm and 27b in one call where time allows
# (PART="warm 27b"). Each run is summarised by bench/pace_summary.py into $OUT/pace_<run>.json.
set -uo pipefail
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 PYTHONPATH=${PYTHONPATH:-.}
OUT=${OUT:-.cache/out}; mkdir -p "$OUT"
python3 -m pip install -q --upgrade --no-deps --no-index --target .cache/fla .whl/fla/*.whl .whl/base/*.whl \
  && export PYTHONPATH="$PYTHONPATH:.cache/fla"
source "$(dirname "$0")/device_waivers.sh"  # W=(--waive ... --reason ...)
CFG=${CFG:-configs/qwen3.6-27b-5t3d.toml}  # CFG=<a tiny CPU config> PART=27b smoke-tests the script on a CPU
DATA=.cache/syn-lognormal-2826
# The incident's data: lengths lognormal around 2,826 tokens, capped at the 27B preset's 49,152-token batch budget.
python3 bench/make_synthetic.py --out "$DATA" --samples "${SAMPLES:-1600}" --length 2826 --sigma 0.6 --max-length 16384 \
  --vocab "${VOCAB:-248320}"
COMMON=(--set data.path=\"$DATA\" --set train.log_every=5 --set train.save_every=40 --no-progress "${W[@]}"
        --waive gpu-memory --reason "measuring it")

train() {  # name, extra args...: one dflash-train run, its log, NVML every 250 ms, its pace summary
  local name=$1; shift
  local smi=
  if command -v nvidia-smi >/dev/null; then
    nvidia-smi --query-gpu=index,memory.used --format=csv,noheader,nounits -lms 250 > "$OUT/nvml_$name.csv" & smi=$!
  fi
  python3 -m dflash.commands.train --config "$CFG" --set target.random_init=true --set output_dir=\"runs/$name\" "${COMMON[@]}" "$@" 2>&1 \
    | grep -v Warning > "$OUT/train_$name.log"
  echo "$name: dflash-train rc=${PIPESTATUS[0]}"; [ -z "$smi" ] || kill $smi
  tail -n 12 "$OUT/train_$name.log"
  python3 bench/pace_summary.py "runs/$name" --min-steps "${MIN_STEPS:-60}" --out "$OUT/pace_$name.json"
}

for part in ${PART:-warm 27b}; do (  # a subshell each: one part's CFG, DATA and COMMON never reach the next
  echo "=== $part $(date +%T)"
  case $part in
    warm) python3 -m dflash.commands.train --config "$CFG" --set target.random_init=true --target-gpus 0 --drafter-gpus 1 --warm-cache \
            --set data.path=\"$DATA\" "${W[@]}" 2>&1 | grep -v Warning | tail -n 20 ;;
    27b) python3 -m dflash.commands.estimate --config "$CFG" --set topology.target_gpus=[\"0\"] \
           --set topology.drafter_gpus=[\"1\"] --from-nvml > "$OUT/estimate_27b_1t1d.txt" 2>&1
         train q36-1t1d --target-gpus 0 --drafter-gpus 1 --fresh --max-steps 75
         for gpu in 95GiB 139GiB; do  # which layout of 8 GPUs trains fastest at the busy rates just measured
           python3 -m dflash.commands.estimate --config "$CFG" --gpu-memory $gpu --rates-from runs/q36-1t1d \
             | sed -n '/^pace/,/^fastest/p' | tee "$OUT/layouts_$gpu.txt"
         done ;;
    coloc) MIN_STEPS=20 train q36-coloc2 --colocated-gpus 0,1 --fresh --max-steps 30 --set train.save_every=15
           MIN_STEPS=20 train q36-coloc1 --colocated-gpus 0 --fresh --max-steps 30 --set train.save_every=15
           python3 - "$OUT" <<'PY'
import json, sys
two, one = (json.load(open(f"{sys.argv[1]}/pace_q36-coloc{n}.json"))["steady_tok_per_s"]["mean"] for n in (2, 1))
print(f"co-located data parallel: 2 GPUs {two:.0f} tok/s, 1 GPU {one:.0f} tok/s: {two / one:.2f}x (target >= 1.8x)")
PY
         ;;
    8b) CFG=configs/qwen3-8b-1t1d.toml DATA=.cache/syn-lognormal-2826-8b
        python3 bench/make_synthetic.py --out "$DATA" --samples 1600 --length 2826 --sigma 0.6 --max-length 8192
        COMMON[1]="data.path=\"$DATA\""
        train q3-8b-1t1d --fresh --max-steps 75 --set data.token_budget=16384 --set data.max_batch_size=16 ;;
    *) echo "unknown PART $part (warm, 27b, coloc, 8b)"; exit 2 ;;
  esac
) || exit; done
