"""The run checks: config (what the schema cannot judge alone), run-dir (resume or fresh, and what a resume
loads), disk (room for the checkpoints)."""

from __future__ import annotations

import os

from dflash.config import FP8_MIN_CAPABILITY, default_target_layer_ids
from dflash.memory.shape import drafter_shape, drafter_state_bytes
from dflash.models.custom_code import CUSTOM_CODE_FIX
from dflash.models.weights import weights_problem
from dflash.runs.resume import incompatible, incompatible_fix
from dflash.runs.rundir import describe_leftovers
from preflight.checks.common import GiB, MiB, config_arg, gib, no_shape, result
from preflight.checks.gpus import capability, drafter_gpus, target_gpus
from preflight.facts.context import Context
from preflight.report import CheckResult


def check_config(ctx: Context) -> CheckResult:
    """What the config schema cannot judge alone: the target must load, with real weights unless target.random_init
    says otherwise (dflash.models.weights), and the values that index into it fit it."""
    cfg, where = ctx.config, config_arg(ctx)
    shape = ctx.target_shape
    if shape is None:
        return result("config", "fail", f"target.path {cfg.target.path!r} cannot be read: {no_shape(ctx)}",
                      f"set target.path in {where} to a Hugging Face model folder with config.json, or 'smollm2'",
                      target=cfg.target.path)
    layers, vocab = shape.num_layers, shape.vocab
    data = dict(target=cfg.target.path, num_layers=layers, vocab=vocab)
    problems, fixes = [], []
    if ctx.target_custom_code:  # dflash-train would refuse to load it (dflash.models.target.refuse_custom_code)
        problems.append(ctx.target_custom_code.removesuffix(f"; {CUSTOM_CODE_FIX}"))
        fixes.append(f"set target.path in {where} to a model whose architecture transformers ships (a folder without "
                     "its own code), or upgrade transformers")
        data["custom_code"] = ctx.target_custom_code
    weights = None
    if ctx.target_weights is not None:  # gathered (tests that do not state it judge the rest)
        data["weights"] = ctx.target_weights
        weights = weights_problem(cfg.target.random_init, cfg.target.path, ctx.target_weights, where)
        if weights and weights[0] == "fail":
            problems.append(weights[1])
            fixes.append(weights[2])
    ids = list(cfg.drafter.target_layer_ids)
    if ids:
        outside = [i for i in ids if i >= layers]
        if outside:
            problems.append(f"drafter.target_layer_ids {outside} outside 0..{layers - 1} of the {layers}-layer target")
            fixes.append(f"set drafter.target_layer_ids in {where} to ids in 0..{layers - 1}, or [] to spread them evenly")
    else:
        try:
            ids = default_target_layer_ids(layers, cfg.drafter.num_layers)
        except ValueError as e:
            problems.append(f"drafter.target_layer_ids [] ({e})")
            fixes.append(f"lower drafter.num_layers in {where}, or set drafter.target_layer_ids")
    mask = cfg.drafter.mask_token_id
    if mask is not None and mask >= vocab:
        problems.append(f"drafter.mask_token_id {mask} outside 0..{vocab - 1} (the target's vocab_size is {vocab})")
        fixes.append(f"set drafter.mask_token_id in {where} below {vocab}, or remove it to take the pad token")
    heads, kv = drafter_shape(cfg, shape).heads, drafter_shape(cfg, shape).kv_heads
    if heads % kv:
        problems.append(f"drafter heads {heads} not a multiple of its kv heads {kv} (unset fields take the target's)")
        fixes.append(f"set drafter.num_attention_heads and drafter.num_key_value_heads in {where} (heads a multiple of kv)")
    if cfg.train.fp8 != "off":
        _fp8_problems(ctx, drafter_shape(cfg, shape), where, problems, fixes)
    if cfg.target.precision == "fp8":
        _fp8_target_problems(ctx, where, problems, fixes)
    if cfg.data.packing and cfg.data.max_batch_size == 1:  # an H100 run recompiled from step 12 and stopped at 42
        problems.append("data.packing with data.max_batch_size = 1 packs one sample a row: nothing packs, and the "
                        "rows' lengths vary from step to step (a graph for each range of them)")
        fixes.append(f"set data.max_batch_size in {where} to 64 (or above), or data.packing = false")
    data.update(target_layer_ids=ids, mask_token_id=mask)
    if problems:
        return result("config", "fail", "; ".join(problems), "; ".join(fixes), problems=problems, **data)
    if weights:  # random weights, allowed: said first
        data["random_init"] = True
        return result("config", "warn", f"{weights[1]}; {cfg.target.path}: {layers} layers, vocab {vocab:,}; the "
                      f"drafter reads layers {ids}, mask token {'from the target' if mask is None else mask}",
                      weights[2], **data)
    return result("config", "pass", f"target {cfg.target.path}: {layers} layers, vocab {vocab:,}; the drafter reads layers "
                  f"{ids}, mask token {'from the target' if mask is None else mask}", **data)


def _fp8_problems(ctx: Context, d, where: str, problems: list[str], fixes: list[str]) -> None:
    """train.fp8 needs fp8 tensor cores on the drafter's GPU and MLP sizes the fp8 matmuls take (dflash.models.fp8)."""
    fp8 = ctx.config.train.fp8
    if d.hidden % 16 or d.intermediate % 16:
        problems.append(f"train.fp8 = {fp8!r} needs the drafter's hidden and intermediate sizes divisible by 16, "
                        f"got {d.hidden} and {d.intermediate}")
        fixes.append(f"set train.fp8 = \"off\" in {where}")
    old = [g for g in drafter_gpus(ctx) if (capability(g.compute_capability) or FP8_MIN_CAPABILITY) < FP8_MIN_CAPABILITY]
    for gpu in old[:1]:
        problems.append(f"train.fp8 = {fp8!r} needs compute capability {'.'.join(map(str, FP8_MIN_CAPABILITY))}+, the "
                        f"drafter's GPU {gpu.name} has {gpu.compute_capability}")
        fixes.append(f"set train.fp8 = \"off\" in {where}, or train on an Ada/Hopper-class GPU")


def _fp8_target_problems(ctx: Context, where: str, problems: list[str], fixes: list[str]) -> None:
    """target.precision = "fp8" needs fp8 tensor cores on every GPU that runs the target (dflash.models.target_fp8);
    on CPU it is emulated."""
    old = [g for g in target_gpus(ctx) if (capability(g.compute_capability) or FP8_MIN_CAPABILITY) < FP8_MIN_CAPABILITY]
    for gpu in old[:1]:
        problems.append(f"target.precision = \"fp8\" needs compute capability {'.'.join(map(str, FP8_MIN_CAPABILITY))}+ "
                        f"(fp8 tensor cores), the target's GPU {gpu.name} has {gpu.compute_capability}")
        fixes.append(f"set target.precision = \"bf16\" in {where}, or run the target on an Ada/Hopper-class GPU or newer")


def check_run_dir(ctx: Context) -> CheckResult:
    rd = ctx.run_dir
    intent = ctx.resume_intent
    how = "sizes and sha256" if rd.deep else "sizes"
    data = dict(path=rd.path, exists=rd.exists, writable=rd.writable, intent=intent,
                checkpoints=[c.step for c in rd.checkpoints], verified_by=how)
    if not rd.writable:
        return result("run-dir", "fail", f"output dir {rd.path} cannot be written: {rd.problem}",
                      f"set output_dir in {config_arg(ctx)} to a writable folder with free space", **data)
    newest = rd.newest
    if newest is None:
        if intent == "resume":
            return result("run-dir", "fail", f"--resume given but {rd.path} holds no finished checkpoint",
                          "drop --resume (a fresh run starts at step 0)", **data)
        return result("run-dir", "pass", f"{rd.path} is writable and holds no checkpoint: a fresh run", **data)
    name = os.path.basename(newest.path)
    data["newest"] = {"step": newest.step, "path": newest.path}
    if intent is None:
        return result("run-dir", "fail",
                      f"{rd.path} holds {len(rd.checkpoints)} checkpoint(s), newest {name} (step {newest.step}); "
                      "say whether to resume it or start over", "add --resume to continue it, or --fresh to start over "
                      "(--fresh moves the old checkpoints aside)", **data)
    if intent == "fresh":
        return result("run-dir", "pass", f"--fresh: {len(rd.checkpoints)} existing checkpoint(s) (newest {name}, "
                      f"step {newest.step}) will be moved aside, not resumed", **data)
    # --resume latest takes the newest checkpoint that verifies (dflash.runs.resume.resolve_resume)
    usable = [c for c in rd.checkpoints if c.meta is not None and not c.error]
    chosen = usable[-1] if usable else None
    skipped = [c for c in rd.checkpoints if chosen is None or c.step > chosen.step]
    data["skipped"] = [{"step": c.step, "problem": c.error or "meta.json unreadable"} for c in skipped]
    said = "; ".join(f"{os.path.basename(c.path)}: {c.error or 'meta.json unreadable'}" for c in skipped)
    if chosen is None:
        only = skipped[0]
        what = f"newest checkpoint {name} cannot be resumed: {only.error or 'meta.json unreadable'}" \
            if len(skipped) == 1 else f"none of the {len(skipped)} checkpoints verifies ({how}): {said}"
        return result("run-dir", "fail", f"--resume: {what}", "use --fresh, or give --resume an earlier checkpoint "
                      "folder (moved aside ones are under checkpoints.abandoned-*)", **data)
    cname = os.path.basename(chosen.path)
    data["resume"] = {"step": chosen.step, "path": chosen.path}
    # the trainer refuses the same line before it loads the weights (dflash.runs.resume.incompatible)
    refused = incompatible(chosen.path, chosen.meta, ctx.config, ctx.target_shape.num_layers if ctx.target_shape else None)
    if refused:
        return result("run-dir", "fail", refused, incompatible_fix(config_arg(ctx)), **data)
    notes, fixes = [], []
    if skipped:
        notes.append(f"--resume latest skips {said}")
        fixes.append("move the damaged checkpoint(s) aside, or pass --fresh")
    if rd.schedule_change:  # the trainer's own rule (dflash.data.plan.schedule_change), so both say the same
        data["schedule_change"] = rd.schedule_change
        notes.append(f"the lr schedule changes ({rd.schedule_change}): dflash-train refuses this resume without "
                     "--allow-schedule-change")
        fixes.append(f"restore those settings in {config_arg(ctx)}, or pass --allow-schedule-change")
    old = chosen.meta.get("dataset") or {}
    ds = ctx.dataset
    if ds is not None and ds.error is None and not any(s.error for s in ds.shards):
        data["dataset"] = {"old_samples": old.get("samples"), "new_samples": ds.samples,
                           "old_path": old.get("path"), "new_path": ds.path}
    same = "dataset unchanged"
    if rd.data_known and rd.data_restart:  # the trainer's own rule (dflash.runs.resume.data_restart)
        data["data_restart"] = rd.data_restart
        notes.append(f"{rd.data_restart} (the epoch restarts from its first batch)")
        fixes.append("use --fresh if the new data should start a new run")
    elif rd.data_known and old.get("path") and old.get("path") != ctx.config.data.path:
        same = (f"dataset unchanged (the same shards moved: data.path {old['path']} -> {ctx.config.data.path}; "
                "the position in the epoch is kept)")
        if notes:
            notes.append(same)
    if notes:
        return result("run-dir", "warn", f"--resume from {cname} (step {chosen.step}); " + "; ".join(notes),
                      "; ".join(fixes), **data)
    return result("run-dir", "pass", f"--resume from {cname} (step {chosen.step}, {how} verified): config and lr "
                  f"schedule unchanged, {same}", **data)


def checkpoint_bytes(ctx: Context) -> tuple[int | None, str]:
    """Bytes of one checkpoint: the newest one on disk, else the drafter's training state from the memory model."""
    newest = ctx.run_dir.newest if ctx.run_dir else None
    if newest is not None and newest.size_bytes:
        return newest.size_bytes, f"size of {os.path.basename(newest.path)}"
    if ctx.target_shape is None:
        return None, no_shape(ctx)
    return drafter_state_bytes(ctx.config, ctx.target_shape), "estimate: drafter params x 12 B (fp32 weights, AdamW m and v)"


def _size(n: int | float) -> str:
    """GiB, or MiB below one GiB (a tiny run's checkpoints and a full disk both read as 0.0 GiB otherwise)."""
    return gib(n) if n >= GiB else f"{n / MiB:.1f} MiB"


def saves_left(cfg, start: int = 0) -> int:
    """Checkpoints a run can still write after step `start` (a large number when it trains by epochs): with
    train.max_steps, one every save_every steps and one at the end, and one at each held-out evaluation (eval.every)
    that improves."""
    steps = cfg.train.max_steps
    if not steps:
        return 1 << 30
    if start >= steps:
        return 0
    every = cfg.train.save_every
    evals = steps // cfg.eval.every - start // cfg.eval.every if cfg.eval.every and cfg.eval.enabled else 0
    return steps // every - start // every + (1 if steps % every else 0) + evals


def check_disk(ctx: Context) -> CheckResult:
    dk = ctx.disk
    cfg = ctx.config
    if dk.error or dk.free_bytes is None:
        return result("disk", "fail", f"cannot measure free space at {dk.path}: {dk.error}",
                      f"set output_dir in {config_arg(ctx)} to an existing, readable filesystem", path=dk.path)
    one, how = checkpoint_bytes(ctx)
    data = dict(path=dk.path, free_bytes=dk.free_bytes, checkpoint_bytes=one, basis=how, keep_last=cfg.train.keep_last)
    if one is None:
        return result("disk", "warn", f"{_size(dk.free_bytes)} free at {dk.path}; checkpoint size unknown ({how})",
                      f"check target.path in {config_arg(ctx)}", **data)
    resuming = ctx.run_dir is not None and ctx.resume_intent == "resume"
    existing = len(ctx.run_dir.checkpoints) if resuming else 0
    start = ctx.run_dir.newest.step if resuming and ctx.run_dir.newest else 0
    held = cfg.train.keep_last + 1 + (1 if cfg.eval.enabled else 0)  # kept, the one written, best (never pruned)
    left = saves_left(cfg, start)
    count = max(1, min(held - existing, left))
    need = count * one
    data.update(need_bytes=need, checkpoints_to_write=count)
    summary = (f"{_size(dk.free_bytes)} free at {dk.path}; {count} more checkpoint(s) of {_size(one)} "
               f"({how}) need {_size(need)}")
    if dk.leftovers:
        data["reclaimable_bytes"] = sum(n for _, n, _ in dk.leftovers)
    if dk.free_bytes < need:
        spare = describe_leftovers(dk.leftovers, dk.output_dir or cfg.output_dir)
        return result("disk", "fail", summary, f"free {_size(need - dk.free_bytes)} at {dk.path}"
                      + (f" ({spare}, yours to delete)" if spare else "")
                      + (", lower train.keep_last," if left >= held - existing else "")
                      + " or move output_dir to a larger disk", **data)
    return result("disk", "pass", summary, **data)
