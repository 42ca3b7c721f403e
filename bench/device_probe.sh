#!/usr/bin/env bash
# The probe of the machine on a GPU (docs/estimate.md, "Memory outside torch"): what a run's process holds outside
# torch on GPU 0, step by step; the cache; preflight's gpu-memory check and dflash-estimate using the figure; a busy
# GPU, a timeout; no probe left behind. Device image: torch 2.11.0+cu130, nvidia-ml-py, no uv (PYTHONPATH=.);
# carry .whl/ (pydantic and the rest, and .whl/fla/ = fla-core + einops for the fla step, as bench/device_check.sh).
#   bash bench/device_probe.sh           # logs and JSON under $OUT (default .cache/out)
set -uo pipefail
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 PYTHONPATH=${PYTHONPATH:-.}
export DFLASH_CACHE=${DFLASH_CACHE:-$(mktemp -d)}  # an empty cache: the first probe measures
OUT=${OUT:-.cache/out}; mkdir -p "$OUT"
source "$(dirname "$0")/device_waivers.sh"  # W=(--waive ... --reason ...)
if ls .whl/fla/*.whl > /dev/null 2>&1; then
  python3 -m pip install -q --no-deps --no-index --target .cache/fla .whl/fla/*.whl && export PYTHONPATH="$PYTHONPATH:.cache/fla"
fi
gpu_memory() {  # the gpu-memory check of a dflash-preflight --json report on stdin
  python3 -c 'import json, sys; c = [c for c in json.load(sys.stdin)["checks"] if c["id"] == "gpu-memory"][0]
print(c["status"], "|", c["summary"]); print("fix:", c.get("fix")); print("rows:", json.dumps(c["data"].get("gpus")))'
}
nvidia-smi --query-gpu=index,name,memory.used,memory.total,driver_version --format=csv | tee "$OUT/probe_nvidia_smi.csv"

echo "== 1. every step on GPU 0, measured (no cache)"
python3 -m preflight.probe --gpus 0 --steps context,matmul,attention,flex,fla,nccl --no-cache --timeout 300 \
  | tee "$OUT/probe_all_steps.txt"
python3 -m preflight.probe --gpus 0 --steps context,matmul,attention,flex,fla,nccl --no-cache --timeout 300 --json \
  > "$OUT/probe_all_steps.json"
echo "== 2. a split's steps, measured then cached (the second run starts no probe)"
python3 -m preflight.probe --gpus 0 --steps context,matmul,attention,nccl | tee "$OUT/probe_split_steps.txt"
time python3 -m preflight.probe --gpus 0 --steps context,matmul,attention,nccl | tee -a "$OUT/probe_split_steps.txt"
ls -l "$DFLASH_CACHE/probe"

echo "== 3. preflight's gpu-memory with the measured overhead (Qwen3-8B co-located on GPU 0)"
python3 -m dflash.commands.preflight --profile train-cu128 --config configs/qwen3-8b-1gpu.toml --json "${W[@]}" \
  > "$OUT/probe_preflight.json"; gpu_memory < "$OUT/probe_preflight.json"
echo "== 4. dflash-estimate --probe"
python3 -m dflash.commands.estimate --config configs/qwen3-8b-1gpu.toml --from-nvml --probe | head -4 \
  | tee "$OUT/probe_estimate.txt"

echo "== 5. a GPU another process holds: not probed, the constant, a warning"
python3 -c "import torch, time; x = torch.empty(2 << 30, dtype=torch.uint8, device='cuda'); print('holding 2 GiB', flush=True); time.sleep(90)" &
HOLD=$!; sleep 20
DFLASH_CACHE=$(mktemp -d) python3 -m dflash.commands.preflight --profile train-cu128 --config configs/qwen3-8b-1gpu.toml \
  --json "${W[@]}" > "$OUT/probe_preflight_busy.json"; gpu_memory < "$OUT/probe_preflight_busy.json"
kill "$HOLD"; wait "$HOLD" 2> /dev/null

echo "== 6. a probe past its timeout: one line, killed"
DFLASH_CACHE=$(mktemp -d) python3 -m preflight.probe --gpus 0 --steps context,matmul,attention,nccl --timeout 2
echo "== 7. nothing left on the GPU"
nvidia-smi --query-compute-apps=pid,used_memory --format=csv | tee "$OUT/probe_apps_after.csv"
echo "== 8. the GPU test"
python3 -m pytest tests/test_probe.py -q -p no:cacheprovider -k on_a_gpu 2>&1 | tail -3
