#!/usr/bin/env bash
# One H200: the users' job on the users' length mix (issue #32). The Qwen3.6-27B preset co-located on GPU 0, data
# lognormal around 2,826 tokens (sigma 0.6, capped at 16,384, the data bench/device_pace_2gpu.sh makes): --warm-cache,
# then STEPS steps with a save at SAVE; the uniform 2,816-token reference after it. Carry .whl (.whl/fla: fla-core
# 0.6.0 + einops 0.8.2; .whl/base: pydantic, pydantic-core, annotated-types, typing-inspection). The run outlasts one
# device call (10 minutes), so it runs detached and later calls look at it:
#   PART=tests  bash bench/device_lengths.sh   # flex attention's CUDA tests first (a broken compiled path: stop here)
#   PART=start  bash bench/device_lengths.sh   # data, then `PART=run` in its own session (setsid): returns at once
#   PART=poll   bash bench/device_lengths.sh   # the run's log so far
#   PART=gpu    bash bench/device_lengths.sh   # pytest -m gpu, whole (after the run: it shares the GPU otherwise)
#   PART=collect bash bench/device_lengths.sh  # pace summaries, logs and outcome.json into $OUT
#   PART=probe  bash bench/device_lengths.sh   # the mix run alone, in the foreground (a short look, STEPS steps)
# Everything lands in .cache/lengths (kept between calls of one machine). CFG/STEPS/SAVE/REF_STEPS override; MIX_ARGS
# adds settings to the mix run (and its warm-up), MIX_NAME names it: packed batches (issue #41) are
#   MIX_NAME=q36-packed MIX_ARGS="--set data.packing=true --set data.pack_remainders=false" PART=start ...
set -uo pipefail
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 PYTHONPATH=${PYTHONPATH:-.}
OUT=${OUT:-.cache/out}; mkdir -p "$OUT"
L=.cache/lengths; mkdir -p "$L"
python3 -m pip install -q --upgrade --no-deps --no-index --target .cache/fla .whl/fla/*.whl .whl/base/*.whl \
  && export PYTHONPATH="$PYTHONPATH:.cache/fla"
source "$(dirname "$0")/device_waivers.sh"  # W=(--waive ... --reason ...)
CFG=${CFG:-configs/qwen3.6-27b-5t3d.toml}
STEPS=${STEPS:-160}; SAVE=${SAVE:-80}; REF_STEPS=${REF_STEPS:-40}  # keep_last 1: the 64 GiB disk holds 3 saves
MIX=.cache/syn-lognormal-2826; UNI=.cache/syn-2816
MIX_NAME=${MIX_NAME:-q36-mix}; read -r -a MIX_SET <<< "${MIX_ARGS:-}"
ONE_GPU=(--set 'topology.target_gpus=[]' --set 'topology.drafter_gpus=[]')

train() {  # name, data, steps, extra args...: one co-located dflash-train run, NVML every 250 ms, its pace summary
  local name=$1 data=$2 steps=$3; shift 3
  nvidia-smi --query-gpu=index,memory.used --format=csv,noheader,nounits -lms 250 > "$L/nvml_$name.csv" & local smi=$!
  python3 -m dflash.commands.train --config "$CFG" --set target.random_init=true "${ONE_GPU[@]}" --set output_dir=\"runs/$name\" \
    --set data.path=\"$data\" --set train.log_every=5 --set train.save_every=$SAVE --set train.keep_last=1 \
    --max-steps "$steps" --fresh \
    --no-progress "${W[@]}" "$@" 2>&1 | grep -av Warning > "$L/train_$name.log"
  echo "$name: dflash-train rc=${PIPESTATUS[0]} $(date +%T)" | tee -a "$L/progress.txt"
  kill $smi
  python3 -m dflash.commands.estimate --config "$CFG" "${ONE_GPU[@]}" --set data.path=\"$data\" "$@" > "$L/estimate_$name.txt" 2>&1
  python3 bench/pace_summary.py "runs/$name" --min-steps 20 --out "$L/pace_$name.json" > "$L/pace_$name.txt" 2>&1
  rm -rf "runs/$name/checkpoints"  # 19.3 GiB each: the next run needs the disk
}

for part in ${PART:-tests}; do
  echo "=== $part $(date +%T)"
  case $part in
    tests) timeout 300 python3 -m pytest -x -q -p no:cacheprovider -p no:logging -o addopts="" -m gpu \
             tests/test_attention.py tests/test_packing_exact.py tests/test_compiled_lengths.py 2>&1 | grep -a "^E \|passed\|failed\|rror" \
             | cut -c1-400 | head -20 ;;
    start) python3 bench/make_synthetic.py --out "$MIX" --samples 1600 --length 2826 --sigma 0.6 --max-length 16384 \
             --vocab 248320
           python3 bench/make_synthetic.py --out "$UNI" --samples 1200 --length 2816 --vocab 248320
           rm -f "$L/progress.txt"
           setsid nohup env PART=run SKIP_WARM="${SKIP_WARM:-}" STEPS=$STEPS REF_STEPS=$REF_STEPS MIX_NAME="$MIX_NAME" \
             MIX_ARGS="${MIX_ARGS:-}" bash "$0" \
             > "$L/run.log" 2>&1 < /dev/null &
           sleep 2; echo "started: $L/run.log" ;;
    probe) python3 bench/make_synthetic.py --out "$MIX" --samples 1600 --length 2826 --sigma 0.6 --max-length 16384 \
             --vocab 248320  # the mix run alone, in the foreground, from a cold cache: a short probe, no steady state
           train "$MIX_NAME" "$MIX" "$STEPS" "${MIX_SET[@]}"; cat "$L/pace_$MIX_NAME.txt"
           cp "runs/$MIX_NAME/metrics.jsonl" "$OUT/metrics_$MIX_NAME.jsonl"; cp "runs/$MIX_NAME/outcome.json" \
             "$OUT/outcome_$MIX_NAME.json"; cp "$L"/*_"$MIX_NAME".* "$OUT/" ;;
    run) t0=$(date +%s)
         [ -n "${SKIP_WARM:-}" ] || python3 -m dflash.commands.train --config "$CFG" --set target.random_init=true "${ONE_GPU[@]}" --set data.path=\"$MIX\" "${MIX_SET[@]}" --warm-cache \
           "${W[@]}" 2>&1 | grep -av Warning > "$L/warm.log"
         echo "warm-cache rc=${PIPESTATUS[0]} $(( $(date +%s) - t0 )) s $(date +%T)" | tee -a "$L/progress.txt"
         train "$MIX_NAME" "$MIX" "$STEPS" "${MIX_SET[@]}"
         train q36-uniform "$UNI" "$REF_STEPS" --set train.save_every=$(( REF_STEPS / 2 ))
         echo "all done $(date +%T)" | tee -a "$L/progress.txt" ;;
    poll) cat "$L/progress.txt" 2>/dev/null; tail -n 4 "$L/warm.log" 2>/dev/null
          for f in "$L"/train_*.log; do [ -f "$f" ] && { echo "--- $f"; grep -a "recompil\|error\|Error" "$f" | head -5
            tail -n 3 "$f"; }; done ;;
    gpu) timeout 420 python3 -m pytest -q -p no:cacheprovider -p no:logging -o addopts="" -m gpu -rA 2>&1 \
           | grep -av Warning | tee "$L/pytest_gpu.log" | grep -a "^E \|passed\|failed\|PASS\|FAIL\|rror\|from float32" \
           | cut -c1-300 | tail -40 ;;
    collect) for name in "$MIX_NAME" q36-uniform; do
               [ -d "runs/$name" ] && cp "runs/$name/outcome.json" "$L/outcome_$name.json" \
                 && cp "runs/$name/metrics.jsonl" "$L/metrics_$name.jsonl"
               cat "$L/pace_$name.txt" 2>/dev/null; done
             tar -C "$L" -czf "$OUT/lengths.tgz" . && ls -la "$OUT" ;;
    *) echo "unknown PART $part (tests, start, run, poll, gpu, collect, probe)"; exit 2 ;;
  esac
done
