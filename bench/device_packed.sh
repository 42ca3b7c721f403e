#!/usr/bin/env bash
# One H200, each call in the foreground and inside the device's 600 s: the Qwen3.6-27B preset co-located and packed
# (data.packing) on the users' length mix (lognormal around 2,826 tokens, sigma 0.6, capped at 16,384), >= 150 steps
# over two calls on one warm machine, then a packed run of one length (2,816) beside it (issue #46).
#   PART=mix     bash bench/device_packed.sh  # cold cache, --fresh; SIGTERM at DEADLINE s: exit 75 with a checkpoint
#   PART=resume  bash bench/device_packed.sh  # --resume latest on the same machine, to STEPS (or DEADLINE again)
#   PART=uniform bash bench/device_packed.sh  # the one-length reference, REF_STEPS steps (warm inductor cache)
# Carry .whl (.whl/fla: fla-core 0.6.0 + einops 0.8.2; .whl/base: pydantic, pydantic-core, annotated-types,
# typing-inspection). Logs, metrics, outcome and pace summaries land in $OUT after every call; the run dirs in runs/.
set -uo pipefail
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
  .whl/fla/*.whl .whl/base/*.whl || exit 1
export PYTHONPATH=.:/tmp/site
OUT=${OUT:-.cache/out}; mkdir -p "$OUT"
source "$(dirname "$0")/device_waivers.sh"  # W=(--waive ... --reason ...)
CFG=${CFG:-configs/qwen3.6-27b-5t3d.toml}
STEPS=${STEPS:-155}; SAVE=${SAVE:-60}; REF_STEPS=${REF_STEPS:-40}; DEADLINE=${DEADLINE:-480}
MIX=.cache/syn-lognormal-2826; UNI=.cache/syn-2816
PACKED=(--set 'topology.target_gpus=[]' --set 'topology.drafter_gpus=[]' --set data.packing=true
        --set data.pack_remainders=false --set train.log_every=5 --set train.keep_last=1)

train() {  # name, data, steps, deadline, extra args...: one dflash-train run, NVML every 250 ms, SIGTERM at deadline
  local name=$1 data=$2 steps=$3 deadline=$4; shift 4
  nvidia-smi --query-gpu=index,memory.used --format=csv,noheader,nounits -lms 250 >> "$OUT/nvml_$name.csv" & local smi=$!
  local t0; t0=$(date +%s)
  timeout -k 90 -s TERM "$deadline" python3 -m dflash.commands.train --config "$CFG" --set target.random_init=true "${PACKED[@]}" \
    --set output_dir=\"runs/$name\" --set data.path=\"$data\" --max-steps "$steps" --no-progress "${W[@]}" "$@" 2>&1 \
    | grep -av Warning >> "$OUT/train_$name.log"
  echo "$name $*: dflash-train rc=${PIPESTATUS[0]} in $(( $(date +%s) - t0 )) s" | tee -a "$OUT/progress_$name.txt"
  kill $smi
  cp "runs/$name/metrics.jsonl" "$OUT/metrics_$name.jsonl"; cp "runs/$name/outcome.json" "$OUT/outcome_$name.json"
  python3 bench/pace_summary.py "runs/$name" --min-steps 20 --out "$OUT/pace_$name.json" 2>&1 | tee "$OUT/pace_$name.txt"
  grep -a "compile\|startup\|first step\|recompil\|stopped\|error" "$OUT/train_$name.log" | cut -c1-400 | tail -12
}

case ${PART:-mix} in
  mix) python3 bench/make_synthetic.py --out "$MIX" --samples 1600 --length 2826 --sigma 0.6 --max-length 16384 \
         --vocab 248320 > /dev/null
       python3 -m dflash.commands.estimate --config "$CFG" "${PACKED[@]}" --set data.path=\"$MIX\" \
         > "$OUT/estimate_q36-packed.txt" 2>&1
       train q36-packed "$MIX" "$STEPS" "$DEADLINE" --set train.save_every="$SAVE" --fresh ;;
  resume) train q36-packed "$MIX" "$STEPS" "$DEADLINE" --set train.save_every="$SAVE" --resume latest ;;
  uniform) rm -rf runs/q36-packed/checkpoints  # 19.3 GiB each: the disk holds three
       python3 bench/make_synthetic.py --out "$UNI" --samples 1200 --length 2816 --vocab 248320 > /dev/null
       train q36-packed-uniform "$UNI" "$REF_STEPS" "$DEADLINE" --set train.save_every=$(( REF_STEPS / 2 )) --fresh ;;
  *) echo "unknown PART ${PART} (mix, resume, uniform)"; exit 2 ;;
esac
