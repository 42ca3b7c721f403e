"""One runner for every GPU measurement: set up, run, sample NVML, stop before the deadline, summarise.

    PYTHONPATH=. python3 bench/runner.py --list                                   # every recipe, what it measures
    PYTHONPATH=. python3 bench/runner.py q36-packed-mix --deadline 570            # a named recipe
    PYTHONPATH=. python3 bench/runner.py q36-packed-mix --deadline 570            # again: resumes from its checkpoint
    PYTHONPATH=. python3 bench/runner.py step-sweep gpu-tests --deadline 570      # two recipes share the call's time
    PYTHONPATH=. python3 bench/runner.py step-sweep cal-drafter --side-by-side    # at once, GPU 0 and GPU 1
    PYTHONPATH=. python3 bench/runner.py train --config RUN.toml --data syn:400,1500,0.8,8192,151936 --steps 40
    uv run python bench/runner.py tiny-cpu --deadline 60 --out .cache/out        # the CPU recipes the suite runs

A recipe is one of two kinds. A train recipe (Recipe) is one dflash-train run, resumed from its checkpoint by the next
call. A commands recipe (Commands) is a few commands run one after another: the bench scripts (bench/train_step.py,
bench/target_rate.py, bench/memory_calibration.py, ...), pytest, or dflash commands; each is written as a shell line
(`NAME=VALUE ... python3 ARGS`, a trailing `&` runs it beside the next one) with {work} (the recipe's folder: what the
commands write there is bundled), {data} (its synthetic data), {fresh} (an empty folder made for this call: a cold
inductor cache) and {waivers} (the device waivers). A recipe of 2 GPUs says so and is refused in one line, exit 2,
where fewer are visible.

What one call does, in the foreground and inside --deadline seconds (a device call's limit):
1. Set up: carried wheels (.whl/**/*.whl, and .cache/xfer-*/ where a wheel too big for one call travels in parts,
   NAME.whl.part, joined in folder order) installed once into a site folder the children import; on an image that
   is not this project's uv environment, the device waivers (torch-build, env-drift, cuda-libs, model-source) with
   their reason.
2. Each recipe in its share of the time left (equal, or in proportion to the seconds each needs, expect_s, where every
   recipe of the call has one): its synthetic data (bench/make_synthetic.py's writer, kept when already
   there), then each command in its own process group. A train recipe: `dflash-estimate` of its config, then
   `dflash-train`, --fresh the first time, --resume latest when its run dir holds a checkpoint and its outcome is not
   finished. NVML is sampled every 0.25 s for each command's processes (what the card holds for it and its children:
   torch, the CUDA context, libraries, workers, ranks) and the device. Before the recipe's share ends the runner sends
   SIGTERM to the process group, as a scheduler does, waits --grace s (a train run: for exit 75 and the checkpoint)
   and records how long the stop took; commands not yet started are recorded as skipped.
3. Under --out (default $OUT, else .cache/out), one name per recipe (a device call brings back at most 8 files):
   RECIPE.json (the summary: a train run's steady rates as bench/pace_summary.py computes them, graphs after step 1,
   saves, the stop, NVML peak against the estimate; each command's exit, time, stop and NVML peak) and RECIPE.tar.gz
   (a train run's log, metrics.jsonl, outcome.json, snapshot.json, preflight.json, the estimate and the NVML samples;
   each command's log and NVML samples and the files under {work}, checkpoints and files over 8 MiB left out).

Exit: 0 when every recipe ran (a train run stopped at the deadline included: the next call resumes it; every command
of a commands recipe exited 0), 1 when one failed, was stopped or was skipped, 2 for bad arguments or a recipe that
needs more GPUs than are visible.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tarfile
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

WAIVERS = [("torch-build", "device image ships its own torch build, not the profile's"),
           ("env-drift", "device image is not a uv environment of this project"),
           ("cuda-libs", "device image carries its own CUDA wheels"),
           ("model-source", "device copy of the working tree")]
SAMPLE_S = 0.25  # NVML sampling period
BUNDLE_MAX = 8 << 20  # bytes: a file under {work} larger than this stays out of RECIPE.tar.gz (weights, shards)


@dataclass
class Recipe:
    """A dflash-train run to measure: its config, overrides, data and length; the next call resumes it."""
    name: str
    about: str
    config: str
    data: str  # "syn:SAMPLES,LENGTH,SIGMA,MAX_LENGTH,VOCAB" (synthetic, written under .cache/) or a dataset folder
    steps: int
    save_every: int
    sets: list[str] = field(default_factory=list)
    env: dict = field(default_factory=dict)
    args: list[str] = field(default_factory=list)  # more dflash-train arguments (a waiver)
    gpus: int = 1
    grace: float = 90  # seconds a stopped run has to write its checkpoint and exit 75
    expect_s: float = 0  # seconds it needs on a GPU, as measured or estimated (0: unknown): a call shares its time by it


@dataclass
class Commands:
    """Commands to measure, one after another: shell lines `NAME=VALUE ... python3 ARGS [&]` (the module docstring)."""
    name: str
    about: str
    commands: list[str]
    gpus: int = 1
    data: str | None = None  # a "syn:..." spec: {data} in the commands
    env: dict = field(default_factory=dict)  # for every command ({fresh}, {work} allowed)
    grace: float = 15  # seconds a stopped command has to exit before SIGKILL
    expect_s: float = 0  # seconds it needs on a GPU, as measured or estimated (0: unknown): a call shares its time by it


# --------------------------------------------------------------------------- the recipes

Q36, Q36_8GPU, Q27 = "configs/qwen3.6-27b-5t3d.toml", "configs/qwen3.6-27b-8gpu.toml", "configs/qwen3-27b-5t3d.toml"
Q8, Q8_SPLIT = "configs/qwen3-8b-1gpu.toml", "configs/qwen3-8b-1t1d.toml"
Q36_MIX, Q36_ONE = "syn:1600,2826,0.6,16384,248320", "syn:1200,2826,0,0,248320"
Q36_EPOCH = "syn:900,2826,0.6,16384,248320"  # the same mix, 51 packs an epoch: steps 11-61 are one, in one call
Q8_MIX, Q8_ONE = "syn:2400,1500,0.7,8192,151936", "syn:2400,1500,0,0,151936"
SHAPES = ["target.random_init=true"]  # the presets' targets are config.json alone: shapes, no weights
ONE_GPU = ["topology.target_gpus=[]", "topology.drafter_gpus=[]"]
PACKED = [*ONE_GPU, "data.packing=true", "data.pack_remainders=false"]
BUCKETED = [*ONE_GPU, "data.packing=false", "data.pack_remainders=true"]  # the 27B presets before they packed
SPLIT = ['topology.target_gpus=["0"]', 'topology.drafter_gpus=["1"]']  # 1 target + 1 drafter
Q8_PACKED = ["data.token_budget=16384", "train.batch_anchors=1024", "data.max_batch_size=64"]  # the preset's is 1
MEASURING = ["--waive", "gpu-memory", "--reason", "measuring it"]  # preflight's memory verdict is what is measured
COLD = {"TORCHINDUCTOR_CACHE_DIR": "{fresh}"}  # an empty inductor cache: the first step is a cold start
DATA = 'python3 -c "import sys; from dflash.commands.data import data_main; data_main(sys.argv[1:])"'
EVAL = 'python3 -c "import sys; from dflash.commands.eval import eval_main; eval_main(sys.argv[1:])"'
RATE = "python3 bench/target_rate.py"
CAL = "python3 bench/memory_calibration.py"


def parity_train(mode: str, gpu: int) -> str:
    return (f"CUDA_VISIBLE_DEVICES={gpu} python3 -m dflash.commands.train --config configs/demo-cpu.toml --set "
            f"device=cuda --set target.dtype=bfloat16 --set train.compile=true --set train.fp8={mode} --set "
            f"train.epochs=6 --set eval.every=500 --set data.path={{fresh}}/train --set eval.path={{fresh}}/heldout "
            f"--set output_dir={{work}}/parity-{mode} --fresh --no-progress {{waivers}}")


def parity_eval(mode: str, gpu: int) -> str:
    return (f"CUDA_VISIBLE_DEVICES={gpu} {EVAL} --target smollm2 --drafter {{work}}/parity-{mode} --prompts held-out "
            f"--limit 32 --max-new-tokens 64 --device cuda --json {{work}}/eval_{mode}.json")


def artifact_q36(*extra: str) -> list[str]:
    """The artifact-q36 commands: --warm-cache on empty caches (the cold start, then a fresh process from the
    artifact), preflight's verdict on it, a step from it with empty caches, then a step warm on the same machine
    (the first command's caches, no artifact). TRITON_PRINT_AUTOTUNING shows what fla's autotuning costs cold."""
    sets = " ".join(f"--set {x}" for x in [*SHAPES, *PACKED, *extra, "train.compile_cache={work}/q36.dfcache",
                                           "data.path={data}"])
    train = f"python3 -m dflash.commands.train --config {Q36} {sets}"
    steps = "--max-steps 1 --fresh --no-progress {waivers}"  # launch to step 1 is the figure; each save is 19 GiB
    return [f"TRITON_PRINT_AUTOTUNING=1 TORCHINDUCTOR_CACHE_DIR={{fresh}}/cold TRITON_CACHE_DIR={{fresh}}/cold-triton "
            f"{train} --warm-cache {{waivers}}",
            f"python3 -m dflash.commands.preflight --profile train-cu128 --config {Q36} {sets}",
            f"TORCHINDUCTOR_CACHE_DIR={{fresh}}/warm TRITON_CACHE_DIR={{fresh}}/warm-triton {train} --set "
            f"output_dir={{work}}/run {steps}",
            f"TORCHINDUCTOR_CACHE_DIR={{fresh}}/cold TRITON_CACHE_DIR={{fresh}}/cold-triton {train} --set "
            f"train.compile_cache={{fresh}}/none.dfcache --set output_dir={{work}}/run-warm {steps}"]  # no artifact


def fake_rank(steps: int) -> str:
    return (f"python3 bench/fake_rank.py --config {Q36_8GPU} --gpu-memory 95GiB --max-steps {steps} --set "
            "output_dir={work}/run --set data.path={data} --set train.save_every=40 --set train.keep_last=1 "
            "--out {work}/fake_rank.json")


RECIPES = {r.name: r for r in [
    # the users' 27B job on one GPU: packed, and bucketed as before data.packing
    Recipe("q36-packed-mix", "the users' 27B preset co-located and packed on a lognormal mix around 2,826 tokens "
           "(sigma 0.6): the packed rate's claim, one epoch of packs after step 10 and 60 steps after it (one H200)",
           Q36, Q36_EPOCH, 72, 40, [*SHAPES, *PACKED], expect_s=520),
    Recipe("q36-packed-mix-fp8", "q36-packed-mix with target.precision = fp8: the same packs, the fp8 target's pace "
           "beside bf16 (issue #55; one H200; alone, it fits one H100)", Q36, Q36_EPOCH, 72, 40, [*SHAPES, *PACKED, "target.precision=fp8"],
           expect_s=450),
    Recipe("q36-packed-one-fp8", "q36-packed-one with target.precision = fp8: the reference beside q36-packed-mix-fp8, "
           "which fits one H100 at the preset's budget (the 27B packed ratio where no H200 is lent)", Q36, Q36_ONE, 40,
           30, [*SHAPES, *PACKED, "target.precision=fp8"], expect_s=260),
    Recipe("q36-packed-one", "the same, every sample 2,826 tokens: the reference beside the mix (one H200)", Q36,
           Q36_ONE, 40, 30, [*SHAPES, *PACKED], expect_s=260),  # beside gpu-tests in one call
    Recipe("q36-packed-mix-gamma", "q36-packed-mix with train.slot_weights = gamma (the preset's is cap): the "
           "two slot weightings' step time, same batches", Q36, Q36_EPOCH, 40, 1000,
           [*SHAPES, *PACKED, 'train.slot_weights="gamma"']),
    Recipe("q8-packed-mix", "the Qwen3-8B preset co-located and packed (budget 16,384) on a lognormal mix around "
           "1,500 tokens (sigma 0.7): the packed ratio on an H100", Q8, Q8_MIX, 120, 60,
           [*SHAPES, *PACKED, *Q8_PACKED]),
    Recipe("q8-packed-one", "the same, every sample 1,500 tokens", Q8, Q8_ONE, 60, 30, [*SHAPES, *PACKED, *Q8_PACKED]),
    Recipe("q36-mix", "the 27B preset co-located in length buckets (pack_remainders, as before data.packing) on the "
           "lognormal mix: steady rate, recompiles, save stall (one H200, issue #32)", Q36, Q36_MIX, 160, 80,
           [*SHAPES, *BUCKETED]),
    Recipe("q36-one", "the same, every sample 2,816 tokens: the reference beside q36-mix", Q36,
           "syn:1200,2816,0,0,248320", 40, 20, [*SHAPES, *BUCKETED]),
    Recipe("q8-bucketed-epoch", "one epoch of the 8B preset on a lognormal mix around 1,500 tokens (sigma 0.8, 16 "
           "buckets, budget 16,384) with TORCH_LOGS=recompiles: graphs at step 1 and at the end, each recompile's "
           "reason", Q8, "syn:400,1500,0.8,8192,151936", 1000, 1000,
           [*SHAPES, "data.token_budget=16384", "data.max_batch_size=16", "train.max_anchors=1024",
            "train.batch_anchors=1024", "train.epochs=1"], env={"TORCH_LOGS": "recompiles"}),
    # split and data-parallel runs (2 GPUs)
    Recipe("q36-1t1d", "2 GPUs: the 27B preset as 1 target + 1 drafter, 8 steps of 2,816 tokens: per-role rates, "
           "NVML per role against the estimate, the suggested 8-GPU split", Q36, "syn:200,2816,0,0,248320", 8, 1000,
           [*SHAPES, *SPLIT, "train.log_every=2"], gpus=2),
    Recipe("q36-1t1d-pace", "2 GPUs: the 27B preset as 1 target + 1 drafter on the lognormal mix, 75 steps, a save "
           "at 40: the steady state, the save stall, the split it suggests (issue #27)", Q36, Q36_MIX, 75, 40,
           [*SHAPES, *SPLIT], args=MEASURING, gpus=2),
    Recipe("q36-coloc2", "2 GPUs: the 27B preset co-located data parallel on both, the mix, 30 steps (beside "
           "q36-coloc1: the data-parallel ratio)", Q36, Q36_MIX, 30, 15,
           [*SHAPES, *ONE_GPU, 'topology.colocated_gpus=["0","1"]'], args=MEASURING, gpus=2),
    Recipe("q36-coloc1", "the same on GPU 0 alone", Q36, Q36_MIX, 30, 15,
           [*SHAPES, *ONE_GPU, 'topology.colocated_gpus=["0"]'], args=MEASURING),
    Recipe("q8-1t1d", "2 GPUs: Qwen3-8B shapes as 1 target + 1 drafter over NCCL, one 3,072-token row a step, 150 "
           "steps: throughput, busy rates and waits per role, NVML per GPU", Q8_SPLIT, "syn:2048,3072,0,0,151936",
           150, 1000, SHAPES, gpus=2),
    Recipe("q8-1t1d-pace", "2 GPUs: the same on a lognormal mix around 2,826 tokens (budget 16,384), 75 steps, a "
           "save at 40", Q8_SPLIT, "syn:1600,2826,0.6,8192,151936", 75, 40,
           [*SHAPES, "data.token_budget=16384", "data.max_batch_size=16"], args=MEASURING, gpus=2),
    Recipe("q27-1t1d", "2 GPUs: the 27B-class dense preset as 1 target + 1 drafter, 25 steps of 2,816 tokens",
           Q27, "syn:400,2816,0,0,151936", 25, 1000, [*SHAPES, *SPLIT, "train.log_every=5"], args=MEASURING, gpus=2),
    # the bench scripts
    Commands("step-sweep", "the co-located drafter step at 512 x 16 and 1024 x 32 (one 3,072-token row) against "
             "SpecForge, with its GPU profile and torch.compile's phase times; an empty inductor cache, so the first "
             "step is the cold start", ["python3 bench/train_step.py --sweep --profile 12 --compile-times --json "
                                        "{work}/sweep.json"], env=COLD),
    Commands("step-sweep-layer", "the same sweep with train.recompute = layer", [
        "python3 bench/train_step.py --sweep --set train.recompute=layer --json {work}/sweep_layer.json"], env=COLD),
    Commands("step-sweep-fp8", "the same sweep with train.fp8 = mlp (beside step-sweep: --side-by-side)", [
        "python3 bench/train_step.py --sweep --profile 12 --set train.fp8=mlp --json {work}/sweep_fp8.json"], env=COLD),
    Commands("recompute-q36", "the users' 27B drafter step at recompute layer, mlp and off (issue #54): the 27B preset "
             "co-located and packed with the fp8 target, which fits one H100 at 512 anchors x block 32 in a 49,152-token "
             "row; the drafter's time is the step less the target's on the same batches; one inductor cache, so the "
             "target compiles once", [
                 f"python3 bench/train_step.py --config {Q36} --set target.precision=fp8 --set train.batch_anchors=512 "
                 f"--set train.max_anchors=512 --set 'topology.target_gpus=[]' --set 'topology.drafter_gpus=[]' "
                 f"--set train.recompute={mode} --warmup 2 --steps 6 --json {{work}}/recompute_{mode}.json"
                 for mode in ("layer", "mlp", "off")], env=COLD, expect_s=330),
    Commands("cold-start", "the 512 x 16 step twice on one empty inductor cache: the cold first step with "
             "torch.compile's phase times, then the warm one", [
                 "python3 bench/train_step.py --warmup 2 --steps 3 --compile-times --json {work}/cold.json",
                 "python3 bench/train_step.py --warmup 2 --steps 3 --json {work}/warm.json"], env=COLD),
    Commands("flex-rows", "one training-mask flex call in the trainer's row layout under autocast, forward + "
             "backward, default tiles", ["FLEX_LAYOUT=rows FLEX_AUTOCAST=1 FLEX_ONLY=default python3 "
                                         "bench/flex_options.py {work}/flex_rows.json"], env=COLD),
    Commands("flex-options", "forward + backward of one training-mask flex call per kernel_options set (tile sizes)",
             ["python3 bench/flex_options.py {work}/flex_options.json"], env=COLD),
    Commands("flex-trainer", "the flex call through the trainer's own path (whole tiles), 1024 x 32 static, 512 x 16, "
             "then 1024 x 32 with the dynamic graph", ["FLEX_LAYOUT=trainer FLEX_SHAPES=1024x32,512x16,1024x32 "
                                                       "python3 bench/flex_options.py {work}/flex_trainer.json"],
             env=COLD),
    Commands("flex-chunks", "each row's anchors split over 1, 2, 4, 8 rows in flex's row layout under autocast", [
        "FLEX_CHUNKS=1,2,4,8 FLEX_LAYOUT=rows FLEX_AUTOCAST=1 FLEX_ONLY=default python3 bench/flex_options.py "
        "{work}/flex_chunks.json"], env=COLD),
    Commands("fp8-matmul", "every matmul of one drafter layer in bf16 and e4m3 (row scales, then one per tensor)", [
        "python3 bench/fp8_matmul.py --json {work}/fp8_rows.json",
        "python3 bench/fp8_matmul.py --per-tensor --json {work}/fp8_tensor.json"]),
    Commands("fp8-mlp", "the compiled MLP block forward + backward in bf16, with dflash's fp8 matmuls and with "
             "torchao's float8 training (rowwise, weight gradient bf16 and fp8): is the library as fast (issue #55)",
             ["python3 bench/fp8_mlp.py --json {work}/fp8_mlp.json"], expect_s=150),
    Commands("compile-probe", "the first calls of each compiled piece in a fresh process, an empty inductor cache",
             ["python3 bench/compile_probe.py"], env=COLD),
    Commands("save-stall", "a checkpoint save's stall with about the users' drafter state (hidden 5120, 5 layers), "
             "on the training thread and in the background, 6 steps", [
                 "python3 bench/save_stall.py --device cuda --hidden 5120 --layers 5 --steps 6 --out "
                 "{work}/save_stall.json"]),
    Commands("save-stall-pinned", "the background save alone, 40 steps, a save every 20: the stall with host buffers "
             "pinned ahead", ["python3 bench/save_stall.py --device cuda --hidden 5120 --layers 5 --steps 40 "
                              "--save-every 20 --background-only --out {work}/save_stall_pinned.json"]),
    Commands("target-compile", "the target role eager then compiled on the same model, with the features' relative "
             "error: Qwen3-8B 16,384 tokens in 4 rows, Qwen3.6-27B (fla-core) 49,152 in 8", [
                 f"{RATE} --config {Q8} --set data.token_budget=16384 --rows 4 --steps 8 --compile both --out "
                 "{work}/rate_8b.json",
                 f"{RATE} --config {Q36} --rows 8 --warmup 1 --steps 3 --compile both --out {{work}}/rate_q36.json"]),
    Commands("target-kernels-q36", "the Qwen3.6-27B target role eager at 49,152 tokens with transformers' PyTorch "
             "Gated DeltaNet fallback, then with fla-core's kernels", [
                 f"{RATE} --config {Q36} --warmup 1 --steps 3 --compile off --pytorch-linear-attention --out "
                 "{work}/rate_fallback.json",
                 f"{RATE} --config {Q36} --warmup 1 --steps 3 --compile off --out {{work}}/rate_fla.json"]),
    Commands("fp8-target-8b", "target.precision = fp8 on the Qwen3-8B target role (16,384 tokens packed, lognormal mean "
             "1,500, sigma 0.7, compiled): bf16 then fp8, each load's NVML peak against the predicted peak, the rate, "
             "the fp8 features' and logits' relative error and cosine against the same weights in bf16; then "
             "tests/test_target_fp8.py (torchao vs the emulation)", [
                 f"{RATE} --config {Q8} --set data.token_budget=16384 --packed 1500,0.7 --steps 8 --compile on --out "
                 "{work}/rate_8b_bf16.json",
                 f"{RATE} --config {Q8} --set data.token_budget=16384 --set target.precision=fp8 --packed 1500,0.7 "
                 "--steps 8 --compile on --vs-bf16 --out {work}/rate_8b_fp8.json",
                 "python3 -m pytest tests/test_target_fp8.py -q -p no:cacheprovider -n 0 -rA"], expect_s=130),
    Commands("fp8-target-q36", "target.precision = fp8 on the Qwen3.6-27B target role (49,152 tokens packed, lognormal "
             "mean 2,826, sigma 0.6, compiled, fla-core): the fp8 load's NVML peak against the predicted peak, its "
             "rate, its features and logits against the same weights in bf16, then bf16's rate", [
                 f"{RATE} --config {Q36} --set target.precision=fp8 --packed 2826,0.6 --warmup 1 --steps 3 --compile on "
                 "--vs-bf16 --out {work}/rate_q36_fp8.json",
                 f"{RATE} --config {Q36} --packed 2826,0.6 --warmup 1 --steps 3 --compile on --out "
                 "{work}/rate_q36_bf16.json"],
             expect_s=230),
    Commands("fla-cold-q36", "what fla's autotuning costs a cold start and what keeping its choices saves: the "
             "Qwen3.6-27B target role alone (fp8, 49,152 tokens packed, compiled) from empty caches, autotuning (its "
             "choices harvested), then from empty caches again with them kept (DFLASH_FLA_TUNED)", [
                 f"TORCHINDUCTOR_CACHE_DIR={{fresh}}/a TRITON_CACHE_DIR={{fresh}}/a-triton DFLASH_FLA_TUNED=off {RATE} "
                 f"--config {Q36} --set target.precision=fp8 --packed 2826,0.6 --warmup 1 --steps 3 --compile on "
                 "--fla-harvest {work}/fla_choices.json --out {work}/cold_tuning.json",
                 f"TORCHINDUCTOR_CACHE_DIR={{fresh}}/b TRITON_CACHE_DIR={{fresh}}/b-triton "
                 f"DFLASH_FLA_TUNED={{work}}/fla_choices.json {RATE} --config {Q36} --set target.precision=fp8 --packed "
                 "2826,0.6 --warmup 1 --steps 3 --compile on --out {work}/cold_kept.json"], expect_s=260),
    Commands("target-mask", "the target role eager on padded batches without and with the padding mask: Qwen3-8B "
             "16,384 tokens in 4 rows, Qwen3.6-27B 49,152 in 8", [
                 f"{RATE} --config {Q8} --set data.token_budget=16384 --rows 4 --compile off --out {{work}}/rate_8b.json",
                 f"{RATE} --config {Q8} --set data.token_budget=16384 --rows 4 --compile off --padding-mask --out "
                 "{work}/rate_8b_mask.json",
                 f"{RATE} --config {Q36} --rows 8 --steps 4 --compile off --out {{work}}/rate_q36.json",
                 f"{RATE} --config {Q36} --rows 8 --steps 4 --compile off --padding-mask --out "
                 "{work}/rate_q36_mask.json"]),
    Commands("cal-drafter", "the drafter role's memory calibration points (each in a fresh process, torch and NVML "
             "peaks), as many as 200 s allow", [f"{CAL} --roles drafter --budget-s 200 --timeout-s 120 --breakdown --out {{work}}"],
             env=COLD, expect_s=240),
    Commands("cal-target", "every target-role memory calibration point, merged into a copy of "
             "tests/data/memory_calibration.json", [
                 f"{CAL} --roles target --budget-s 300 --timeout-s 120 --breakdown --merge tests/data/memory_calibration.json "
                 "--out {work}"], expect_s=330),
    Commands("cal-target-q36", "the hybrid 27B target role's calibration point at 49,152 tokens (fla-core kernels)",
             [f"{CAL} --roles target --only q36-27b-49k-a1024-b32-d5-kl-off --timeout-s 100 --out {{work}}"],
             env=COLD),
    Commands("fake-rank-mix", "rank 0 of the users' 8 GPUs (the 8-GPU 27B preset, drafter FSDP2 1/8) under torch's "
             "fake process group, held to 95 GiB, 64 steps of the lognormal mix, a save at 40: one rank's memory and "
             "compute (issue #40)", [fake_rank(64)], data="syn:3000,2826,0.6,16384,248320"),
    Commands("fake-rank-one", "the same, 40 steps of 2,816 tokens: the reference at the same mean",
             [fake_rank(40)], data="syn:2000,2816,0,0,248320"),
    Commands("q8-1t1d-torchrun", "2 GPUs: q8-1t1d started by torchrun, 30 steps (every rank through the collective "
             "preflight gate)", ["python3 -m torch.distributed.run --standalone --nproc-per-node 2 -m "
                                 f"dflash.commands.torchrun --config {Q8_SPLIT} --set output_dir={{work}}/run --set "
                                 "data.path={data} --set train.max_steps=30 --fresh {waivers}"],
             data="syn:2048,3072,0,0,151936", gpus=2),
    Commands("q36-1t1d-layouts", "which layout of 8 GPUs (95 and 139 GiB) trains fastest at the busy rates "
             "q36-1t1d-pace measured on this machine (reads runs/q36-1t1d-pace)", [
                 f"python3 -m dflash.commands.estimate --config {Q36} --gpu-memory {mem} --rates-from "
                 "runs/q36-1t1d-pace" for mem in ("95GiB", "139GiB")], gpus=0),
    Commands("fp8-parity", "2 GPUs: the demo's recipe on CUDA (SmolLM2-135M target, 1,600 chitchat prompts x 128 "
             "greedy tokens, 6 epochs) trained in bf16 on GPU 0 beside train.fp8 = mlp on GPU 1 on the same data, "
             "then dflash-eval of both on 32 held-out prompts: the acceptance fp8 costs", [
                 f"{DATA} prepare --target smollm2 --prompts chitchat --out {{fresh}}/train --limit 1600 "
                 "--max-new-tokens 128 --batch-size 64 --device cuda",
                 f"{DATA} prepare --target smollm2 --prompts held-out --out {{fresh}}/heldout --limit 16 "
                 "--max-new-tokens 128 --batch-size 16 --device cuda",
                 parity_train("off", 0) + " &", parity_train("mlp", 1),
                 parity_eval("off", 0) + " &", parity_eval("mlp", 1)], gpus=2),
    Commands("probe", "the probe of the machine on GPU 0 (docs/estimate.md): what a run's process holds outside "
             "torch, step by step; the cache (the second split probe starts none); preflight's gpu-memory check and "
             "dflash-estimate --probe using the figure; a probe past its timeout; the GPU test", [
                 "python3 -m preflight.probe --gpus 0 --steps context,matmul,attention,flex,fla,nccl --no-cache "
                 "--timeout 300 --json",
                 "python3 -m preflight.probe --gpus 0 --steps context,matmul,attention,nccl",
                 "python3 -m preflight.probe --gpus 0 --steps context,matmul,attention,nccl",
                 f"python3 -m dflash.commands.preflight --profile train-cu128 --config {Q8} --set "
                 "target.random_init=true --set data.path={data} --set output_dir={work}/run --json {waivers}",
                 f"python3 -m dflash.commands.estimate --config {Q8} --from-nvml --probe --cuda 13.0",
                 "python3 -m preflight.probe --gpus 0 --steps context,matmul,attention,nccl --no-cache --timeout 2",
                 "python3 -m pytest tests/test_probe.py -q -p no:cacheprovider -k on_a_gpu"],
             env={"DFLASH_CACHE": "{fresh}"}, data="syn:200,1500,0,0,151936", expect_s=120),
    Commands("artifact-tiny", "the compile cache artifact on CUDA, tiny preset: --warm-cache, then a cold start and "
             "one from the artifact, each in a fresh process with empty caches, twice (bench/compile_artifact.py)",
             ["python3 bench/compile_artifact.py --device cuda --runs 2 --out {work}/compile_artifact_tiny.json -- "
              "{waivers}"], expect_s=120),
    Commands("artifact-q36", "the compile cache artifact of the users' 27B preset co-located and packed (one H200): "
             "--warm-cache on an empty cache (the cold start, then a fresh process from the artifact), preflight's "
             "verdict on it, a step from it with empty caches, a step warm on the same machine", artifact_q36(),
             data=Q36_MIX, expect_s=450),
    Commands("artifact-q36-fp8", "artifact-q36 with target.precision = fp8, which fits one H100 at the preset's "
             "budget (the estimate: 68.8 GiB co-located, recompute layer; 395 s on an H100 when each start ran 3 steps)",
             artifact_q36("target.precision=fp8"), data=Q36_MIX, expect_s=450),
    Commands("cold-q36-fp8", "artifact-q36-fp8's first command alone: --warm-cache on empty caches (the cold start, "
             "fla's kept choices for this GPU included), then its fresh process from the artifact",
             artifact_q36("target.precision=fp8")[:1], data=Q36_MIX, expect_s=260),
    Commands("cold-step-q36-fp8", "one step of the 27B preset co-located, packed, fp8 target, from empty caches and "
             "no artifact: launch to step 1 cold, fla's kept choices for this GPU included",
             artifact_q36("target.precision=fp8")[3:], data=Q36_MIX, expect_s=170),
    Commands("gpu-tests", "the GPU-only tests, whole (pytest -m gpu): 4 workers, then the ones that need the GPU to "
             "themselves (gpu_alone) in one process", [
                 "python3 -m pytest -m 'gpu and not gpu_alone' -q -p no:cacheprovider -n 4 --dist loadfile -rA",
                 "python3 -m pytest -m gpu_alone -q -p no:cacheprovider -n 0 -rA"], expect_s=240),  # 178 s + 1 process
    Commands("gpu-alone-tests", "the GPU tests that need the GPU to themselves (pytest -m gpu_alone), one process", [
        "python3 -m pytest -m gpu_alone -q -p no:cacheprovider -n 0 -rA"], expect_s=80),
    # the CPU checks of this runner (tests/test_bench_smoke.py)
    Commands("cpu-commands", "CPU: the packing bench and a tiny co-located step (the suite's check of the commands "
             "kind)", ["python3 bench/packing.py --samples 3000",
                       "python3 bench/train_step.py --device cpu --tiny --warmup 1 --steps 2 --data {fresh} --json "
                       "{work}/train_step.json"], gpus=0),
]}
CPU_RECIPE = "tiny-cpu"  # made on the spot: the tiny CPU preset (its target and data written under the run dir)


def weight(rest: list) -> float:
    """The first recipe's share of the time left to `rest`: in proportion to their expect_s where each has one,
    else equal."""
    if all(r.expect_s > 0 for r in rest):
        return rest[0].expect_s / sum(r.expect_s for r in rest)
    return 1 / len(rest)


def parse_data(spec: str) -> tuple[int, int, float, int, int] | None:
    """(samples, length, sigma, max_length, vocab) of a "syn:..." spec; None for a folder. Raises ValueError."""
    if not spec.startswith("syn:"):
        return None
    parts = spec[4:].split(",")
    if len(parts) != 5:
        raise ValueError(f"--data {spec!r}: write syn:SAMPLES,LENGTH,SIGMA,MAX_LENGTH,VOCAB (MAX_LENGTH 0: none)")
    try:
        samples, length, sigma, cap, vocab = int(parts[0]), int(parts[1]), float(parts[2]), int(parts[3]), int(parts[4])
    except ValueError:
        raise ValueError(f"--data {spec!r}: SAMPLES, LENGTH, MAX_LENGTH and VOCAB are integers, SIGMA a number") from None
    if samples < 1 or length < 2 or sigma < 0 or vocab < 3:
        raise ValueError(f"--data {spec!r}: needs SAMPLES >= 1, LENGTH >= 2, SIGMA >= 0, VOCAB >= 3")
    return samples, length, sigma, cap, vocab


def make_data(spec: str) -> Path:
    """The dataset folder of a spec: a synthetic one is written once under .cache/ (kept when already there)."""
    parsed = parse_data(spec)
    if parsed is None:
        return Path(spec)
    samples, length, sigma, cap, vocab = parsed
    from dflash.data.synthetic import write_random_dataset

    out = REPO / ".cache" / f"syn-{samples}x{length}-s{sigma:g}-c{cap}-v{vocab}"
    return Path(write_random_dataset(out, samples, length, vocab, sigma=sigma, max_length=cap or None))


def tiny_cpu(root: Path) -> Recipe:
    """The CPU recipe: the tests' tiny preset (dflash.data.synthetic's tiny target and pattern data)."""
    from bench.common import TINY_TARGET
    from dflash.data.synthetic import write_pattern_dataset, write_target

    root.mkdir(parents=True, exist_ok=True)
    target = write_target(root / "tiny-shapes", TINY_TARGET, weights=False)  # shapes: random_init builds it
    data = write_pattern_dataset(root / "tiny-data")
    config = root / "tiny.toml"
    config.write_text("\n".join([
        'device = "cpu"', f"[target]\npath = {json.dumps(str(target))}\nrandom_init = true\ndtype = \"float32\"",
        "[drafter]\nnum_layers = 1\nblock_size = 4",
        "[data]\ntoken_budget = 512\nmax_batch_size = 8\nnum_buckets = 2",
        "[train]\nmax_anchors = 16\ngamma = 4.0\nlr = 0.01\nwarmup_ratio = 0.1\nloss_chunk = 64\ncompile = false",
    ]) + "\n")
    return Recipe(CPU_RECIPE, "the tiny CPU preset, stopped by the deadline", str(config), str(data), 100_000, 20,
                  ["train.log_every=2"], gpus=0)


# --------------------------------------------------------------------------- set-up


def install_wheels(site: Path) -> str | None:
    """Carried wheels installed once into `site`; the folder for PYTHONPATH, or None. Wheels: .whl/ and its sub-folders,
    and .cache/xfer-*/ (a wheel too big for one call's carry travels as NAME.whl.part in two folders, joined here)."""
    wheels = sorted((REPO / ".whl").rglob("*.whl")) if (REPO / ".whl").is_dir() else []
    xfer = sorted((REPO / ".cache").glob("xfer-*/"))
    wheels += [w for d in xfer for w in sorted(d.glob("*.whl"))]
    parts = sorted({part.name for d in xfer for part in d.glob("*.whl.part")})
    if not (wheels or parts) or not is_device_image():  # this project's own environment has what it needs
        return None
    site.mkdir(parents=True, exist_ok=True)
    for name in parts:
        joined = site.parent / name.removesuffix(".part")
        joined.write_bytes(b"".join((d / name).read_bytes() for d in xfer if (d / name).exists()))
        wheels.append(joined)
    stamp = site / ".installed"
    names = "\n".join(w.name for w in wheels)
    if not (stamp.exists() and stamp.read_text() == names):
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
                        "--no-cache-dir", "--upgrade", "--target", str(site), *map(str, wheels)], check=True)
        stamp.write_text(names)
    return str(site)


def is_device_image() -> bool:
    """Whether this Python is not one of this project's uv environments (then preflight needs the device waivers)."""
    prefix = Path(sys.prefix).resolve()
    return not (prefix == (REPO / ".venv").resolve() or (REPO / ".venvs").resolve() in prefix.parents)


def waivers() -> list[str]:
    return [a for check, why in WAIVERS for a in ("--waive", check, "--reason", why)] if is_device_image() else []


def visible_gpus() -> int:
    """GPUs a child would see: nvidia-smi -L's count (0 without a driver), at most CUDA_VISIBLE_DEVICES' entries."""
    try:
        listed = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=60).stdout
    except (OSError, subprocess.SubprocessError):
        return 0
    count = sum(line.startswith("GPU ") for line in listed.splitlines())
    mask = os.environ.get("CUDA_VISIBLE_DEVICES")
    return count if mask is None else min(count, len([d for d in mask.split(",") if d.strip()]))


# --------------------------------------------------------------------------- NVML


def family(pid: int) -> set[int]:
    """`pid` and its descendants, from /proc (a command's workers, ranks or pytest workers hold GPU memory too)."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError, ValueError, IndexError):
            ppid = int(stat.read_text().rsplit(")", 1)[1].split()[1])
            children.setdefault(ppid, []).append(int(stat.parent.name))
    out, todo = set(), [pid]
    while todo:
        out.add(todo[-1])
        todo += children.get(todo.pop(), [])
    return out


class Sampler:
    """NVML every SAMPLE_S s on a thread: per GPU, the device's used bytes and what process `pid` and its descendants
    hold (the whole process: torch's allocator, the CUDA context, libraries, NCCL). Nothing without NVML (a CPU
    machine)."""

    def __init__(self, pid: int):
        self.pid, self.rows, self._stop = pid, [], threading.Event()
        self.t0 = time.monotonic()
        try:
            import pynvml

            pynvml.nvmlInit()
            self.nvml = pynvml
            self.handles = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(pynvml.nvmlDeviceGetCount())]
        except Exception:  # no NVML here: nothing to sample
            self.nvml, self.handles = None, []
        self.thread = threading.Thread(target=self._run, daemon=True)
        if self.handles:
            self.thread.start()

    def _run(self) -> None:
        while not self._stop.wait(SAMPLE_S):
            t = round(time.monotonic() - self.t0, 2)
            pids = family(self.pid)
            for i, h in enumerate(self.handles):
                with contextlib.suppress(Exception):
                    used = self.nvml.nvmlDeviceGetMemoryInfo(h).used
                    mine = sum(p.usedGpuMemory or 0 for p in self.nvml.nvmlDeviceGetComputeRunningProcesses(h)
                               if p.pid in pids)
                    self.rows.append((t, i, used, mine))

    def stop(self) -> None:
        self._stop.set()
        if self.thread.is_alive():
            self.thread.join()

    def csv(self) -> str:
        return "t_s,gpu,device_used_bytes,process_used_bytes\n" + "".join(f"{t},{i},{u},{m}\n" for t, i, u, m in self.rows)

    def peaks(self) -> dict:
        out = {}
        for _t, i, used, mine in self.rows:
            p = out.setdefault(str(i), {"device_gib": 0.0, "process_gib": 0.0})
            p["device_gib"] = max(p["device_gib"], round(used / 2**30, 2))
            p["process_gib"] = max(p["process_gib"], round(mine / 2**30, 2))
        return out


# --------------------------------------------------------------------------- running children


@dataclass
class Child:
    """A started command: its process (a group of its own), NVML sampler and log."""
    proc: subprocess.Popen
    sampler: Sampler
    log: io.StringIO
    reader: threading.Thread
    started: float = field(default_factory=time.monotonic)
    wall_s: float | None = None  # from its start to its exit
    stopped: bool = False  # still running when the deadline's SIGTERM went

    @classmethod
    def start(cls, argv: list[str], env: dict, head: str = "") -> Child:
        proc = subprocess.Popen(argv, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                start_new_session=True)
        log = io.StringIO(head)
        log.seek(0, io.SEEK_END)
        reader = threading.Thread(target=lambda: [log.write(line) for line in proc.stdout], daemon=True)
        reader.start()
        return cls(proc, Sampler(proc.pid), log, reader)

    def finish(self) -> None:
        self.sampler.stop()
        self.reader.join(timeout=5)


def supervise(children: list[Child], until: float, grace: float, t0: float) -> dict:
    """Wait for every child; at the monotonic time `until` SIGTERM each one's process group, SIGKILL after `grace` s.
    The stop's record: signalled, at_s (after t0), signal_to_exit_s, killed_after_grace."""
    stop = {"signalled": False}
    procs = [c.proc for c in children]
    while any(p.poll() is None for p in procs):
        now = time.monotonic()
        for c in children:
            if c.wall_s is None and c.proc.poll() is not None:
                c.wall_s = round(now - c.started, 1)
        if now >= until and not stop["signalled"]:
            stop.update(signalled=True, at_s=round(now - t0, 1))
            t_sig = now
            for c in children:
                c.stopped = c.proc.poll() is None
            signal_groups(procs, signal.SIGTERM)
        if stop["signalled"] and now - t_sig > grace:
            signal_groups(procs, signal.SIGKILL)
            stop["killed_after_grace"] = True
            break
        time.sleep(0.1)
    for p in procs:
        p.wait()
    if stop["signalled"]:
        stop["signal_to_exit_s"] = round(time.monotonic() - t_sig, 1)
    for c in children:
        c.wall_s = c.wall_s if c.wall_s is not None else round(time.monotonic() - c.started, 1)
        c.finish()
    return stop


def signal_groups(procs: list[subprocess.Popen], sig: int) -> None:
    for p in procs:
        if p.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, sig)


def bundle(path: Path, files: dict[str, Path], texts: dict[str, str]) -> None:
    """One archive per recipe (a device call brings back at most 8 files): the files and the texts by name."""
    with tarfile.open(path, "w:gz") as tar:
        for name, file in files.items():
            tar.add(file, arcname=name)
        for name, text in texts.items():
            data = text.encode()
            info = tarfile.TarInfo(name)
            info.size, info.mtime = len(data), int(time.time())
            tar.addfile(info, io.BytesIO(data))


# --------------------------------------------------------------------------- a train recipe


def run_dir(recipe: Recipe) -> Path:
    return REPO / "runs" / recipe.name


def resumable(out: Path) -> bool:
    """A run dir with a checkpoint whose outcome is not "finished": the next call goes on from it."""
    from dflash.runs import rundir

    if not rundir.list_checkpoints(out):
        return False
    with contextlib.suppress(OSError, ValueError):
        return (json.loads((out / "outcome.json").read_text()).get("ended") or {}).get("how") != "finished"
    return True


def train_argv(recipe: Recipe, data: Path, out: Path, fresh: bool) -> list[str]:
    sets = [*recipe.sets, f"output_dir={json.dumps(str(out))}", f"data.path={json.dumps(str(data))}",
            f"train.save_every={recipe.save_every}", "train.keep_last=1"]
    if not any(s.startswith("train.log_every=") for s in sets):
        sets.append("train.log_every=5")
    argv = [sys.executable, "-m", "dflash.commands.train", "--config", recipe.config, "--max-steps", str(recipe.steps),
            "--no-progress", *(a for s in sets for a in ("--set", s)), *recipe.args, *waivers()]
    return argv + (["--fresh"] if fresh else ["--resume", "latest"])


def estimate(recipe: Recipe, data: Path, env: dict) -> str:
    """dflash-estimate of the recipe's run as this machine will run it: its GPUs' memory (NVML) where one is visible,
    and the CUDA of the torch installed here, as the run's own preflight takes them."""
    import torch

    sets = [*recipe.sets, f"data.path={json.dumps(str(data))}"]
    machine = (["--from-nvml"] if visible_gpus() else []) + (["--cuda", torch.version.cuda] if torch.version.cuda else [])
    argv = [sys.executable, "-m", "dflash.commands.estimate", "--config", recipe.config, *machine,
            *(a for s in sets for a in ("--set", s))]
    p = subprocess.run(argv, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    return f"$ {shlex.join(argv[1:])}\n{p.stdout}{p.stderr}"


def measure(recipe: Recipe, until: float, grace: float, out_dir: Path, env: dict) -> dict:
    """Run one train recipe up to the monotonic time `until` (SIGTERM to its process group then), summarise, bundle."""
    from bench.pace_summary import summarize

    data = make_data(recipe.data)
    out = run_dir(recipe)
    fresh = not resumable(out)
    env = {**env, **recipe.env}
    est = estimate(recipe, data, env)
    argv = train_argv(recipe, data, out, fresh)
    t0 = time.monotonic()
    child = Child.start(argv, env)
    stop = supervise([child], until, grace, t0)
    rc = child.proc.returncode
    summary = {"recipe": recipe.name, "about": recipe.about, "command": shlex.join(argv[1:]), "fresh": fresh,
               "rc": rc, "ok": rc in (0, 75), "wall_s": round(time.monotonic() - t0, 1), "stop": stop,
               "nvml_peak": child.sampler.peaks()}
    try:
        summary["pace"] = summarize(out)
    except Exception as e:  # a run that died before it wrote its records: the log says why
        summary["pace"] = {"error": f"{type(e).__name__}: {e}"}
    with contextlib.suppress(OSError, ValueError):
        ended = json.loads((out / "outcome.json").read_text()).get("ended") or {}
        summary["ended"] = ended
    records = ("metrics.jsonl", "outcome.json", "snapshot.json", "stopped.json", "preflight.json", "fla_choices.json")
    bundle(out_dir / f"{recipe.name}.tar.gz", {n: out / n for n in records if (out / n).exists()},
           {"train.log": child.log.getvalue(), "estimate.txt": est, "nvml.csv": child.sampler.csv()})
    (out_dir / f"{recipe.name}.json").write_text(json.dumps(summary, indent=2) + "\n")
    return summary


# --------------------------------------------------------------------------- a commands recipe


def parse_command(line: str, subs: dict[str, str]) -> tuple[dict, list[str], bool]:
    """A recipe's shell line -> (its NAME=VALUE settings, argv with python3 as this interpreter, runs beside the next)."""
    words = shlex.split(line)
    beside = words[-1] == "&"
    words = words[:-1] if beside else words
    env = {}
    while words and "=" in words[0] and words[0].split("=", 1)[0].isidentifier():
        key, value = words.pop(0).split("=", 1)
        env[key] = value
    argv = [a for w in words for a in (waivers() if w == "{waivers}" else [fill(w, subs)])]
    assert argv and argv[0] == "python3", f"a recipe command runs python3: {line!r}"
    return {k: fill(v, subs) for k, v in env.items()}, [sys.executable, *argv[1:]], beside


def fill(text: str, subs: dict[str, str]) -> str:
    for key, value in subs.items():
        text = text.replace(key, value)
    return text


def artifact_headers(files: dict[str, Path]) -> dict[str, str]:
    """{name.header.json: its header} of each compile cache artifact in `files` (too large to bundle: its manifest
    holds the starts it measured, their graph counts and compile phases)."""
    from dflash.runs.compile_artifact import read_header

    found = {}
    for name, path in files.items():
        if path.suffix == ".dfcache":
            header, problem = read_header(path)
            found[f"{name}.header.json"] = json.dumps(header if header is not None else
                                                      {"error": problem or "no such file"}, indent=2) + "\n"
    return found


def run_commands(recipe: Commands, until: float, grace: float, out_dir: Path, env: dict) -> dict:
    """Run a commands recipe's lines up to the monotonic time `until` (SIGTERM to the running ones' process groups
    then; the rest skipped), summarise, bundle each command's log and NVML samples and the files under {work}."""
    work = REPO / ".cache" / "recipes" / recipe.name
    if work.exists():
        shutil.rmtree(work)  # last call's files (and checkpoints): not this call's results
    work.mkdir(parents=True)
    subs = {"{work}": str(work), "{fresh}": tempfile.mkdtemp(prefix=f"{recipe.name}-"),
            "{data}": str(make_data(recipe.data)) if recipe.data else ""}
    env = {**env, **{k: fill(v, subs) for k, v in recipe.env.items()}}
    t0 = time.monotonic()
    done, texts, batch = [], {}, []
    for i, line in enumerate(recipe.commands, 1):
        batch.append((i, line, *parse_command(line, subs)))
        if batch[-1][-1] and i < len(recipe.commands):  # "&": started with the next line
            continue
        if time.monotonic() >= until:
            done += [{"command": line, "skipped": "the recipe's deadline came first"} for _, line, *_ in batch]
            batch = []
            continue
        children = [Child.start(argv, {**env, **extra}, f"$ {line}\n") for _, line, extra, argv, _ in batch]
        stop = supervise(children, until, grace, t0)
        for (n, line, *_), child in zip(batch, children):
            texts[f"{n:02d}.log"], texts[f"{n:02d}.nvml.csv"] = child.log.getvalue(), child.sampler.csv()
            done.append({"command": line, "rc": child.proc.returncode, "wall_s": child.wall_s,
                         "stop": stop if child.stopped else {"signalled": False}, "nvml_peak": child.sampler.peaks(),
                         "log": f"{n:02d}.log"})
        batch = []
    shutil.rmtree(subs["{fresh}"], ignore_errors=True)
    files = {str(f.relative_to(work)): f for f in sorted(work.rglob("*")) if f.is_file()}
    left_out = sorted(n for n, f in files.items() if "checkpoints" in Path(n).parts or f.stat().st_size > BUNDLE_MAX)
    texts.update(artifact_headers({n: files[n] for n in left_out}))
    bundle(out_dir / f"{recipe.name}.tar.gz", {n: f for n, f in files.items() if n not in left_out}, texts)
    for checkpoints in [d for d in work.rglob("checkpoints") if d.is_dir()]:
        shutil.rmtree(checkpoints)  # nothing resumes a commands recipe; the next recipe may need the disk
    summary = {"recipe": recipe.name, "about": recipe.about, "gpus": recipe.gpus,
               "ok": all(c.get("rc") == 0 and not c["stop"]["signalled"] for c in done if "rc" in c)
               and not any("skipped" in c for c in done),
               "wall_s": round(time.monotonic() - t0, 1), "commands": done,
               "files": sorted(set(files) - set(left_out)), "left_out": left_out}
    (out_dir / f"{recipe.name}.json").write_text(json.dumps(summary, indent=2) + "\n")
    return summary


# --------------------------------------------------------------------------- the call


def line(s: dict) -> str:
    """One line of a recipe's result."""
    if "commands" in s:
        ran = [c for c in s["commands"] if "rc" in c]
        skipped = len(s["commands"]) - len(ran)
        exits = ", ".join(f"{'stopped ' if c['stop']['signalled'] else ''}exit {c['rc']}" for c in ran)
        peak = max((g["process_gib"] for c in ran for g in c["nvml_peak"].values()), default=None)
        return (f"{s['recipe']}: {len(ran)} of {len(s['commands'])} commands ran ({exits or 'none'})"
                f"{f', {skipped} skipped at the deadline' if skipped else ''} in {s['wall_s']} s; "
                f"{f'NVML peak {peak} GiB' if peak is not None else 'no NVML'}; {len(s['files'])} files bundled")
    pace = s.get("pace") or {}
    steady = pace.get("steady_tok_per_s") or {}
    stop = s.get("stop") or {}
    gpus = pace.get("gpus") or []
    mem = "; ".join(f"GPU {g['index']} NVML {g['nvml_peak_gib']} vs {g['estimate_gib']} GiB predicted"
                    for g in gpus) or "no NVML"
    stopped = (f"; SIGTERM at {stop['at_s']} s -> exit {s['rc']} in {stop.get('signal_to_exit_s')} s"
               if stop.get("signalled") else f"; exit {s['rc']}")
    return (f"{s['recipe']}: {pace.get('steps', 0)} steps ({'fresh' if s['fresh'] else 'resumed'}), steady "
            f"{steady.get('median', '-')} median / {steady.get('mean', '-')} mean tok/s over "
            f"{steady.get('windows', 0)} windows, recompiles after step 1: {pace.get('recompiles')}; {mem}{stopped}")


def listing() -> str:
    rows = []
    for r in RECIPES.values():
        what = f"{r.steps} steps" if isinstance(r, Recipe) else f"{len(r.commands)} command{'s' * (len(r.commands) > 1)}"
        gpus = f"{r.gpus} GPU{'s' * (r.gpus != 1)}"
        rows.append(f"{r.name:20} {gpus:7} {what:11} {r.about}")
    rows.append(f"{CPU_RECIPE:20} {'0 GPUs':7} {'':11} the tiny CPU preset, stopped by the deadline (the suite's check of "
                "the train kind)")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("recipes", nargs="*", help=f"recipe names (--list), {CPU_RECIPE}, or 'train' with --config/--data")
    p.add_argument("--list", action="store_true", help="print the recipes and exit")
    p.add_argument("--deadline", type=float, default=560, help="seconds this call may take in all (default 560)")
    p.add_argument("--grace", type=float, default=None, help="seconds a stopped command has to exit before SIGKILL "
                   "(default: 90 for a train run, its checkpoint; 15 for a commands recipe)")
    p.add_argument("--reserve", type=float, default=None,
                   help="seconds kept for the stop and the summary before the deadline (default: grace + 15)")
    p.add_argument("--out", type=Path, default=None, help="results folder (default $OUT, else .cache/out)")
    p.add_argument("--side-by-side", action="store_true", help="run the recipes at once, each on a GPU of its own "
                   "(GPU i for the i-th; 1-GPU recipes), each until the deadline")
    p.add_argument("--fresh", action="store_true", help="start every train recipe over (its run dir is moved aside)")
    p.add_argument("--config", help="'train': the run config")
    p.add_argument("--data", help="'train': a dataset folder or syn:SAMPLES,LENGTH,SIGMA,MAX_LENGTH,VOCAB")
    p.add_argument("--steps", type=int, default=100, help="'train': steps")
    p.add_argument("--save-every", type=int, default=50, help="'train': train.save_every")
    p.add_argument("--set", action="append", default=[], dest="sets", help="'train': a config override, as dflash-train")
    args = p.parse_args(argv)
    if args.list or not args.recipes:
        print(listing())
        return 0 if args.list else 2
    unknown = [n for n in args.recipes if n not in RECIPES and n not in (CPU_RECIPE, "train")]
    if unknown:
        p.error(f"unknown recipe {unknown[0]!r}; --list shows them")
    if args.deadline <= 0 or (args.grace is not None and args.grace <= 0):
        p.error("--deadline and --grace must be > 0")
    start = time.monotonic()
    recipes = []
    for name in args.recipes:
        if name == "train":
            if not args.config or not args.data:
                p.error("'train' needs --config and --data")
            try:
                parse_data(args.data)
            except ValueError as e:
                p.error(str(e))
            recipes.append(Recipe(Path(args.config).stem, "a run of --config", args.config, args.data, args.steps,
                                  args.save_every, args.sets, gpus=0))  # its GPUs: the config's to say
        elif name == CPU_RECIPE:
            recipes.append(tiny_cpu(REPO / ".cache" / "tiny-cpu"))
        else:
            recipes.append(RECIPES[name])
    if args.side_by_side and (wide := next((r for r in recipes if r.gpus > 1), None)):
        p.error(f"--side-by-side gives each recipe one GPU; {wide.name} needs {wide.gpus}")
    on_gpus = sum(r.gpus > 0 for r in recipes)
    needs, who = ((on_gpus, f"--side-by-side of {len(recipes)} recipes") if args.side_by_side else
                  max(((r.gpus, r.name) for r in recipes)))
    if needs and needs > (seen := visible_gpus()):
        gpus = f"{needs} GPU{'s' * (needs > 1)}"
        print(f"runner: {who} needs {gpus}, {seen} visible here (nvidia-smi -L, CUDA_VISIBLE_DEVICES): "
              f"run it on a machine with {gpus}", file=sys.stderr)
        return 2
    out_dir = args.out or Path(os.environ.get("OUT") or REPO / ".cache" / "out")
    out_dir.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, PYTHONUNBUFFERED="1", NCCL_NVLS_ENABLE="0")
    site = install_wheels(Path(tempfile.gettempdir()) / "dflash-bench-site")
    if site:  # this process reads configs and summaries too (bench/pace_summary.py imports pydantic)
        sys.path.insert(0, site)
    env["PYTHONPATH"] = os.pathsep.join(x for x in (str(REPO), site, env.get("PYTHONPATH")) if x)
    reserve = args.reserve if args.reserve is not None else (args.grace or max(r.grace for r in recipes)) + 15
    for recipe in recipes:
        if args.fresh and isinstance(recipe, Recipe) and run_dir(recipe).exists():
            run_dir(recipe).rename(run_dir(recipe).with_name(f"{recipe.name}.old-{int(time.time())}"))

    def run(recipe: Recipe | Commands, until: float, extra: dict) -> bool:
        kind = measure if isinstance(recipe, Recipe) else run_commands
        s = kind(recipe, until, args.grace or recipe.grace, out_dir, {**env, **extra})
        print(line(s), flush=True)
        return s["ok"]

    if args.side_by_side:  # each recipe on a GPU of its own, all of them until the deadline
        until = start + args.deadline - reserve
        mask = os.environ.get("CUDA_VISIBLE_DEVICES")
        devices = [d.strip() for d in mask.split(",")] if mask else [str(i) for i in range(len(recipes))]
        ok = [False] * len(recipes)
        threads = [threading.Thread(target=lambda i=i, r=r: ok.__setitem__(i, run(r, until, {
            "CUDA_VISIBLE_DEVICES": devices[i]}))) for i, r in enumerate(recipes)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        return 0 if all(ok) else 1
    failed = 0
    for i, recipe in enumerate(recipes):
        left = args.deadline - (time.monotonic() - start) - reserve
        share = left * weight(recipes[i:])  # what is left, shared by the recipes still to run
        if share < 30:
            print(f"runner: {recipe.name}: skipped, {left:.0f} s left before the deadline", file=sys.stderr)
            failed += 1
            continue
        failed += not run(recipe, time.monotonic() + share, {})
    return 1 if failed else 0

if __name__ == "__main__":
    sys.exit(main())
