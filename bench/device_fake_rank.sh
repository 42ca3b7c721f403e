#!/usr/bin/env bash
# One H200 as rank 0 of the users' 8 GPUs of 95 GiB (issue #40): configs/qwen3.6-27b-8gpu.toml (co-located data
# parallel, the drafter FSDP2-sharded 1/8) under torch's fake process group (bench/fake_rank.py), held to 95 GiB, on
# the lognormal mix around 2,826 tokens (sigma 0.6, the data of bench/device_lengths.sh) for STEPS steps with a save
# inside; then the uniform 2,816-token reference at the same mean. Carry .whl (.whl/fla: fla-core 0.6.0 + einops
# 0.8.2; .whl/base: pydantic, pydantic-core, annotated-types, typing-inspection). It outlasts one device call:
#   PART=start bash bench/device_fake_rank.sh   # data, then `PART=run` in its own session (setsid)
#   WAIT=540 PART=poll bash bench/device_fake_rank.sh   # waits up to WAIT s for the run to end, prints its progress
#   PART=collect bash bench/device_fake_rank.sh  # the JSONs, logs and estimates into $OUT
#   PART=gpu bash bench/device_fake_rank.sh      # pytest -m gpu, whole, its log into $OUT
# Everything lands in .cache/fake (kept between calls of one machine). CFG/STEPS/SAVE/REF_STEPS/MEM override.
set -uo pipefail
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 PYTHONPATH=${PYTHONPATH:-.}
OUT=${OUT:-.cache/out}; mkdir -p "$OUT"
L=.cache/fake; mkdir -p "$L"
python3 -m pip install -q --upgrade --no-deps --no-index --target .cache/fla .whl/fla/*.whl .whl/base/*.whl \
  && export PYTHONPATH="$PYTHONPATH:.cache/fla"
CFG=${CFG:-configs/qwen3.6-27b-8gpu.toml}; MEM=${MEM:-95GiB}
STEPS=${STEPS:-64}; SAVE=${SAVE:-40}; REF_STEPS=${REF_STEPS:-40}
MIX=.cache/syn-lognormal-2826; UNI=.cache/syn-2816

fake() {  # name, data, steps, extra --set pairs...: one fake-rank run and the estimate of its config
  local name=$1 data=$2 steps=$3; shift 3
  local sets=(--set output_dir=\"runs/fake-$name\" --set data.path=\"$data\" --set train.save_every=$SAVE
              --set train.keep_last=1 "$@")
  python3 bench/fake_rank.py --config "$CFG" --gpu-memory "$MEM" --max-steps "$steps" "${sets[@]}" \
    --out "$L/fake_rank_$name.json" 2>&1 | grep -av Warning > "$L/train_$name.log"
  echo "$name: fake_rank rc=${PIPESTATUS[0]} $(date +%T): $(tail -n 1 "$L/train_$name.log")" | tee -a "$L/progress.txt"
  python3 -m dflash.commands.estimate --config "$CFG" "${sets[@]}" --gpu-memory "$MEM" --cuda "$(python3 -c \
    'import torch; print(torch.version.cuda)')" --rates 12.55k,46.3k > "$L/estimate_$name.txt" 2>&1
  rm -rf "runs/fake-$name/checkpoints"  # 20 GiB each: the next run needs the disk
}

for part in ${PART:-start}; do
  echo "=== $part $(date +%T)"
  case $part in
    start) python3 bench/make_synthetic.py --out "$MIX" --samples 3000 --length 2826 --sigma 0.6 --max-length 16384 \
             --vocab 248320
           python3 bench/make_synthetic.py --out "$UNI" --samples 2000 --length 2816 --vocab 248320
           rm -rf "$L/progress.txt" runs/fake-*
           setsid nohup env PART=run STEPS=$STEPS REF_STEPS=$REF_STEPS bash "$0" > "$L/run.log" 2>&1 < /dev/null &
           sleep 2; echo "started: $L/run.log" ;;
    run) fake mix "$MIX" "$STEPS"
         fake uniform "$UNI" "$REF_STEPS"
         echo "all done $(date +%T)" | tee -a "$L/progress.txt" ;;
    poll) [ -f "$L/run.log" ] || { echo "no run on this machine (a fresh one: the last went back); PART=start"; exit 1; }
          end=$(( $(date +%s) + ${WAIT:-0} ))
          while ! grep -q "all done" "$L/progress.txt" 2>/dev/null && [ "$(date +%s)" -lt "$end" ]; do sleep 10; done
          cat "$L/progress.txt" 2>/dev/null; tail -n 3 "$L/run.log"
          for f in "$L"/train_*.log; do [ -f "$f" ] && { echo "--- $f"; grep -a "recompil\|rror\|Traceback" "$f" | head -5
            tail -n 2 "$f" | cut -c1-300; }; done ;;
    collect) cp "$L"/*.json "$L"/*.txt "$OUT"/ 2>/dev/null; tar -C "$L" -czf "$OUT/fake_logs.tgz" . && ls -la "$OUT" ;;
    gpu) timeout 540 python3 -m pytest -q -p no:cacheprovider -p no:logging -o addopts="" -m gpu -rA 2>&1 \
           | grep -av Warning > "$OUT/pytest_gpu.log"
         grep -a "^E \|passed\|failed\|PASS\|FAIL\|rror" "$OUT/pytest_gpu.log" | cut -c1-300 | tail -40 ;;
    *) echo "unknown PART $part (start, run, poll, collect, gpu)"; exit 2 ;;
  esac
done
