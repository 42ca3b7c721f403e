#!/usr/bin/env bash
# The split-topology runs on a 2x H200 device machine (device image: torch 2.11.0+cu130, no uv).
#   bash bench/device_split.sh            # writes logs and JSON under $OUT (default .cache/out)
#   STEPS_8B=250 RUN_27B=0 bash bench/device_split.sh   # the 8B run only, 250 steps
#   STEPS_8B=60 TORCHRUN_STEPS=30 RUN_27B=0 bash bench/device_split.sh   # + the same run under torchrun
#   RUN_8B=0 CFG_27B=configs/qwen3.6-27b-5t3d.toml bash bench/device_split.sh  # the Qwen3.6-27B hybrid 1+1 run only
# 1) Qwen3-8B-shaped target on GPU 0 feeding a 5-layer drafter on GPU 1 (block 16, 512 anchors, 1x3072 tokens)
# 2) the incident's 27B-class run scaled to 1 target + 1 drafter (block 32, 1024 anchors, 49152-token batches)
set -uo pipefail
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 PYTHONPATH=${PYTHONPATH:-.}
OUT=${OUT:-.cache/out}; mkdir -p "$OUT"
source "$(dirname "$0")/device_waivers.sh"  # W=(--waive ... --reason ...)
watch_start() { nvidia-smi --query-gpu=index,memory.used --format=csv,noheader,nounits -lms 250 > "$OUT/$1" & SMI=$!; }
watch_stop() { kill $SMI; python3 - "$OUT/$1" <<'PY'
import sys, collections
peak = collections.defaultdict(int)
for line in open(sys.argv[1]):
    parts = [x.strip() for x in line.split(",")]
    if len(parts) == 2 and parts[1].isdigit():
        peak[parts[0]] = max(peak[parts[0]], int(parts[1]))
print(sys.argv[1].rsplit("/", 1)[-1], "NVML peak used MiB per GPU:", dict(peak))
PY
}
if [ "${RUN_8B:-1}" = 1 ]; then
python3 bench/make_synthetic.py --out .cache/syn-3072 --samples 2048 --length 3072
python3 -m dflash.commands.preflight --profile train-cu128 --config configs/qwen3-8b-1t1d.toml --set target.random_init=true --fresh --json "${W[@]}" \
  > "$OUT/preflight_8b_1t1d.json"; echo "preflight rc=$?"
python3 -m dflash.commands.estimate --config configs/qwen3-8b-1t1d.toml --from-nvml > "$OUT/estimate_8b_1t1d.txt" 2>&1
echo "=== 8B 1+1 $(date +%T)"
watch_start nvml_8b_1t1d.csv
python3 -m dflash.commands.train --config configs/qwen3-8b-1t1d.toml --set target.random_init=true --fresh --max-steps ${STEPS_8B:-150} --no-progress \
  "${W[@]}" 2>&1 | tee "$OUT/train_8b_1t1d.log" | grep -v Warning
watch_stop nvml_8b_1t1d.csv
cp runs/qwen3-8b-1t1d/metrics.jsonl "$OUT/metrics_8b_1t1d.jsonl"
if [ "${TORCHRUN_STEPS:-0}" -gt 0 ]; then
  # 3) the same 1+1 run started by torchrun: every rank goes through the collective preflight gate
  echo "=== 8B 1+1 torchrun $(date +%T)"
  watch_start nvml_8b_torchrun.csv
  python3 -m torch.distributed.run --standalone --nproc-per-node 2 -m dflash.commands.torchrun \
    --config configs/qwen3-8b-1t1d.toml --set target.random_init=true --set output_dir=\"runs/qwen3-8b-torchrun\" \
    --set train.max_steps=${TORCHRUN_STEPS} --fresh "${W[@]}" 2>&1 | tee "$OUT/train_8b_torchrun.log" | grep -v Warning
  watch_stop nvml_8b_torchrun.csv
  cp runs/qwen3-8b-torchrun/metrics.jsonl "$OUT/metrics_8b_torchrun.jsonl"
  cp runs/qwen3-8b-torchrun/preflight.json "$OUT/preflight_8b_torchrun.json"
fi
fi
[ "${RUN_27B:-1}" = 1 ] || exit 0
CFG_27B=${CFG_27B:-configs/qwen3-27b-5t3d.toml}
echo "=== 27B 1+1 $(date +%T)"
python3 bench/make_synthetic.py --out .cache/syn-2816 --samples 400 --length 2816
python3 -m dflash.commands.estimate --config "$CFG_27B" --set topology.target_gpus=[\"0\"] \
  --set topology.drafter_gpus=[\"1\"] --from-nvml > "$OUT/estimate_27b_1t1d.txt" 2>&1
watch_start nvml_27b_1t1d.csv
python3 -m dflash.commands.train --config "$CFG_27B" --set target.random_init=true --target-gpus 0 --drafter-gpus 1 \
  --set data.path=\".cache/syn-2816\" --set output_dir=\"runs/qwen3-27b-1t1d\" --set train.log_every=5 \
  --fresh --max-steps ${STEPS_27B:-25} --no-progress "${W[@]}" --waive gpu-memory --reason "measuring it" \
  2>&1 | tee "$OUT/train_27b_1t1d.log" | grep -v Warning
watch_stop nvml_27b_1t1d.csv
cp runs/qwen3-27b-1t1d/metrics.jsonl "$OUT/metrics_27b_1t1d.jsonl"
