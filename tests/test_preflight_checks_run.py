"""preflight/checks/run.py: config, run-dir and disk, fed facts (pass and fail paths)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from preflight.checks.run import _size, check_config, check_disk, check_run_dir, checkpoint_bytes
from preflight.facts.run import Checkpoint, Disk, RunDir
from preflight.facts.run import disk as disk_facts
from preflight_ctx import SPLIT, GiB, MiB, make_ctx, recorded

# ---------------------------------------------------------------- run-dir


def _with_checkpoint(ctx, step=690, config_over=None, samples=1000, fingerprint=None):
    saved = ctx.config.model_dump()
    for dotted, v in (config_over or {}).items():
        sec, key = dotted.split(".")
        saved[sec][key] = v
    meta = {"step": step, "config": saved,
            "dataset": {"path": ctx.config.data.path, "samples": samples,
                        "fingerprint": fingerprint or ctx.dataset.fingerprint}}
    older = dict(meta, step=500)
    ctx.run_dir.checkpoints = [Checkpoint(500, "ckpt/step_00000500", older),
                               Checkpoint(step, f"ckpt/step_{step:08d}", meta)]
    return ctx


def test_run_dir_with_checkpoints_needs_intent(tmp_path):
    ctx = _with_checkpoint(make_ctx(tmp_path))
    r = check_run_dir(ctx)
    assert r.status == "fail"
    assert "newest step_00000690 (step 690)" in r.summary
    assert "--resume" in r.fix and "--fresh" in r.fix
    ctx.resume_intent = "fresh"
    assert check_run_dir(ctx).status == "pass"
    ctx.resume_intent = "resume"
    r = check_run_dir(ctx)
    assert r.status == "pass" and "step 690" in r.summary


def test_run_dir_resume_refuses_a_checkpoint_the_trainer_would_refuse(tmp_path):
    from dflash.runs.verify import LEGACY_REASON

    ctx = _with_checkpoint(make_ctx(tmp_path))
    ctx.run_dir.checkpoints = ctx.run_dir.checkpoints[1:]
    ctx.run_dir.newest.error = LEGACY_REASON  # what preflight.facts.run.run_dir records for an old pickled trainer_state.pt
    ctx.resume_intent = "resume"
    r = check_run_dir(ctx)
    assert r.status == "fail" and "step_00000690 cannot be resumed: written by an older dflash version" in r.summary
    assert "--fresh" in r.fix
    ctx.resume_intent = "fresh"
    assert check_run_dir(ctx).status == "pass"


def test_run_dir_resume_skips_damaged_newer_checkpoints_as_the_trainer_does(tmp_path):
    """`--resume latest` takes the newest checkpoint that verifies; preflight says which one and what it skips."""
    ctx = _with_checkpoint(make_ctx(tmp_path))
    ctx.resume_intent = "resume"
    truncated = "optimizer.pt is 4,096 bytes, meta.json recorded 8,192 (truncated or rewritten since the save)"
    ctx.run_dir.newest.error = truncated
    r = check_run_dir(ctx)
    assert r.status == "warn"
    assert r.summary == f"--resume from step_00000500 (step 500); --resume latest skips step_00000690: {truncated}"
    assert r.data["resume"]["step"] == 500 and r.data["skipped"] == [{"step": 690, "problem": truncated}]
    ctx.run_dir.checkpoints[0].error = "trainer_state.json content differs from its sha256 in meta.json (damaged since " \
                                       "the save)"
    ctx.run_dir.deep = True
    r = check_run_dir(ctx)
    assert r.status == "fail" and r.summary.startswith("--resume: none of the 2 checkpoints verifies (sizes and "
                                                       "sha256): step_00000500: trainer_state.json content differs")
    assert "--fresh" in r.fix


def test_run_dir_resume_that_changes_the_lr_schedule_warns(tmp_path):
    """The incident's `--max-steps` on resume: lr fell 18x in 5 steps while preflight said "config compatible".
    The change itself is the trainer's rule, gathered as a fact (test_schedule_rule.py checks they agree)."""
    ctx = _with_checkpoint(make_ctx(tmp_path))
    ctx.resume_intent = "resume"
    ctx.run_dir.schedule_change = "total steps 20,000 -> 1,200 (train.max_steps 20000 -> None)"
    r = check_run_dir(ctx)
    assert r.status == "warn" and "compatible" not in r.summary
    assert "the lr schedule changes (total steps 20,000 -> 1,200 (train.max_steps 20000 -> None)): dflash-train " \
           "refuses this resume without --allow-schedule-change" in r.summary
    assert "--allow-schedule-change" in r.fix and r.data["schedule_change"].startswith("total steps 20,000")


def test_run_dir_resume_incompatible_fails(tmp_path):
    ctx = _with_checkpoint(make_ctx(tmp_path), config_over={"drafter.block_size": 16, "target.path": "other-27b"})
    ctx.resume_intent = "resume"
    r = check_run_dir(ctx)
    assert r.status == "fail"
    assert "drafter.block_size 16 -> 32" in r.summary and "target.path 'other-27b' -> 'smollm2'" in r.summary


def test_run_dir_resume_reports_changed_dataset(tmp_path):
    """The data position is the trainer's rule, gathered as a fact (test_resume_rule.py checks they agree)."""
    ctx = _with_checkpoint(make_ctx(tmp_path), samples=902_000, fingerprint="0" * 16)
    ctx.resume_intent = "resume"
    ctx.run_dir.data_restart = "dataset changed since the checkpoint: 902,000 -> 1,000 samples"
    ctx.run_dir.data_known = True
    r = check_run_dir(ctx)
    assert r.status == "warn" and "902,000 -> 1,000 samples (the epoch restarts from its first batch)" in r.summary
    assert r.data["dataset"]["old_samples"] == 902_000 and r.data["dataset"]["new_samples"] == 1000


def test_run_dir_unwritable_and_resume_without_checkpoint_fail(tmp_path):
    ctx = make_ctx(tmp_path)
    ctx.resume_intent = "resume"
    r = check_run_dir(ctx)
    assert r.status == "fail" and "no finished checkpoint" in r.summary
    ctx.run_dir = RunDir(ctx.config.output_dir, True, False, "run is not writable by this user")
    r = check_run_dir(ctx)
    assert r.status == "fail" and r.summary.endswith("cannot be written: run is not writable by this user")


# ---------------------------------------------------------------- disk


def test_disk_fails_when_checkpoints_do_not_fit(tmp_path):
    ctx = make_ctx(tmp_path)
    ctx.disk = Disk(ctx.config.output_dir, free_bytes=10 * MiB)
    r = check_disk(ctx)
    assert r.status == "fail" and r.data["checkpoints_to_write"] == 4  # keep_last 3 + the one being written
    ctx.run_dir.checkpoints = [Checkpoint(690, "ckpt/step_00000690", size_bytes=2 * GiB)]
    ctx.disk = Disk(ctx.config.output_dir, free_bytes=7 * GiB)
    r = check_disk(ctx)
    assert r.status == "fail" and r.data["need_bytes"] == 8 * GiB and "size of step_00000690" in r.summary
    ctx.resume_intent = "resume"  # the kept one already counts
    assert check_disk(ctx).status == "pass"


def test_disk_counts_only_the_checkpoints_a_short_run_writes(tmp_path):
    """A 3-step run saves once (at its end), so keep_last does not ask the disk for four checkpoints."""
    ctx = make_ctx(tmp_path)
    one, _ = checkpoint_bytes(ctx)
    ctx.disk = Disk(ctx.config.output_dir, free_bytes=2 * one)
    assert check_disk(ctx).status == "fail"
    ctx.config = ctx.config.model_copy(update={"train": ctx.config.train.model_copy(update={"max_steps": 3})})
    r = check_disk(ctx)
    assert r.status == "pass" and r.data["checkpoints_to_write"] == 1, r.summary
    ctx.config = ctx.config.model_copy(update={"train": ctx.config.train.model_copy(
        update={"max_steps": 1000, "save_every": 500})})  # saves at 500 and 1000 (the end): 2, under keep_last + 1
    assert check_disk(ctx).data["checkpoints_to_write"] == 2
    ctx.disk = Disk(ctx.config.output_dir, free_bytes=one)
    assert "lower train.keep_last" not in check_disk(ctx).fix  # keep_last is not what asks for the room
    ctx.run_dir.checkpoints = [Checkpoint(300, "ckpt/step_00000300", size_bytes=one)]  # stopped at 300
    ctx.resume_intent = "resume"
    assert check_disk(ctx).data["checkpoints_to_write"] == 2  # 500 and 1000 are still to come
    ctx.run_dir.checkpoints = [Checkpoint(700, "ckpt/step_00000700", size_bytes=one)]
    assert check_disk(ctx).data["checkpoints_to_write"] == 1


def test_disk_counts_the_best_checkpoint_a_held_out_run_keeps(tmp_path):
    """With held-out evaluation the best checkpoint is never pruned: keep_last + the one written + best."""
    ctx = make_ctx(tmp_path)
    ctx.disk = Disk(ctx.config.output_dir, free_bytes=10 * MiB)
    ctx.config = ctx.config.model_copy(update={"eval": ctx.config.eval.model_copy(update={"holdout": 10})})
    assert check_disk(ctx).data["checkpoints_to_write"] == ctx.config.train.keep_last + 2


def test_disk_fix_names_what_the_run_dir_could_free(tmp_path):
    """A full disk's fix names the unfinished saves and moved-aside folders of the run dir, with their sizes."""
    from dflash.runs import rundir

    out = Path(make_ctx(tmp_path).config.output_dir)
    tmp = rundir.checkpoints_dir(out) / "step_00000010.tmp"  # a save a crash or a full disk cut short
    tmp.mkdir(parents=True)
    (tmp / "optimizer.pt").write_bytes(b"\0" * 3 * MiB)
    (out / "replaced-20260101-000000" / "checkpoints").mkdir(parents=True)
    (out / "replaced-20260101-000000" / "checkpoints" / "w").write_bytes(b"\0" * 5 * MiB)
    (out / "metrics.abandoned-20260101-000000.jsonl").write_bytes(b"\0" * MiB)
    (out / "replaced-20260102-000000").symlink_to(tmp_path)  # a link is never counted (nor followed)
    found = disk_facts(str(out))
    assert found.leftovers == [("replaced-20260101-000000", 5 * MiB, "moved aside by --fresh"),
                               ("checkpoints/step_00000010.tmp", 3 * MiB, "an unfinished save"),
                               ("metrics.abandoned-20260101-000000.jsonl", MiB, "metrics rows moved aside by a resume")]
    ctx = make_ctx(tmp_path)
    ctx.disk = Disk(found.path, free_bytes=10 * MiB, output_dir=str(out), leftovers=found.leftovers)
    r = check_disk(ctx)
    assert r.status == "fail" and r.data["reclaimable_bytes"] == 9 * MiB
    short = _size(r.data["need_bytes"] - 10 * MiB)
    assert r.fix == (f"free {short} at {found.path} (9.0 MiB reclaimable in {out}: replaced-20260101-000000 5.0 MiB "
                     "(moved aside by --fresh), checkpoints/step_00000010.tmp 3.0 MiB (an unfinished save), "
                     "metrics.abandoned-20260101-000000.jsonl 1.0 MiB (metrics rows moved aside by a resume), yours to "
                     "delete), lower train.keep_last, or move output_dir to a larger disk")


def test_run_dir_resolved_layer_ids_are_compatible(tmp_path):
    from dflash.config import default_target_layer_ids

    resolved = default_target_layer_ids(30, 5)  # SmolLM2: 30 layers, 5 drafter layers
    ctx = _with_checkpoint(make_ctx(tmp_path), config_over={"drafter.target_layer_ids": resolved})
    ctx.resume_intent = "resume"
    assert check_run_dir(ctx).status == "pass"  # [] in the config resolves to the saved list
    ctx = _with_checkpoint(make_ctx(tmp_path), config_over={"drafter.target_layer_ids": [1, 2, 3, 4, 5]})
    ctx.resume_intent = "resume"
    r = check_run_dir(ctx)
    assert r.status == "fail" and "drafter.target_layer_ids [1, 2, 3, 4, 5] -> []" in r.summary


def test_disk_unknown_target_warns_and_estimates_from_the_memory_model(tmp_path):
    ctx = make_ctx(tmp_path, config={"target": {"path": str(tmp_path / "no-model")}})
    r = check_disk(ctx)
    assert r.status == "warn" and "checkpoint size unknown" in r.summary
    r = check_disk(make_ctx(tmp_path))
    assert r.status == "pass" and 0 < r.data["checkpoint_bytes"] < GiB


def test_config_passes_with_the_resolved_layers_and_mask_source(tmp_path):
    r = check_config(make_ctx(tmp_path))  # SmolLM2: 30 layers, vocab 49152, 5 drafter layers
    assert r.status == "pass", r.summary
    assert r.data["target_layer_ids"] == [1, 8, 14, 21, 27] and "mask token from the target" in r.summary


@pytest.mark.parametrize("drafter, field, allowed", [
    ({"target_layer_ids": [1, 30, 99]}, "drafter.target_layer_ids [30, 99]", "outside 0..29 of the 30-layer target"),
    ({"mask_token_id": 49152}, "drafter.mask_token_id 49152", "outside 0..49151"),
    ({"num_layers": 40}, "drafter.target_layer_ids []", "cannot spread 40 distinct layers over [1, 27]"),
    ({"num_attention_heads": 8}, "drafter heads 8", "not a multiple of its kv heads 3"),
])
def test_config_fails_on_values_that_do_not_fit_the_target_naming_field_range_and_fix(tmp_path, drafter, field, allowed):
    r = check_config(make_ctx(tmp_path, config={"drafter": drafter}))
    assert r.status == "fail" and field in r.summary and allowed in r.summary, r.summary
    assert "run.toml" in r.fix


@pytest.mark.parametrize("setup, says", [
    (lambda d: None, "config.json: not found"),
    (lambda d: (d.mkdir(), (d / "config.json").write_text("{not json")), "not valid JSON"),
    (lambda d: (d.mkdir(), (d / "config.json").write_text('{"hidden_size": 64}')), "missing key"),
    (lambda d: (d.mkdir(), (d / "config.json").write_text('{"num_hidden_layers": 0, "hidden_size": 64, '
                '"intermediate_size": 64, "num_attention_heads": 4, "vocab_size": 10}')), "sizes must be positive"),
])
def test_config_fails_when_the_target_cannot_be_read(tmp_path, setup, says):
    target = tmp_path / "target"
    setup(target)
    ctx = make_ctx(tmp_path, config={"target": {"path": str(target)}})
    r = check_config(ctx)
    assert r.status == "fail" and "target.path" in r.summary and says in r.summary, r.summary
    assert r.fix.startswith("set target.path in run.toml")


def test_config_fails_when_loading_the_target_would_be_refused_for_its_own_code(tmp_path):
    """The fact gather records (dflash.models.custom_code) fails the check: folder, field and fix in one line each."""
    ctx = make_ctx(tmp_path)
    ctx.target_custom_code = ("target /m: custom code is refused: config.json model_type 'evil_lm' is not an architecture "
                              "transformers 5.19.0 ships (auto_map: modeling_evil.py); use a model whose architecture "
                              "transformers ships (a folder without its own code), or upgrade transformers")
    r = check_config(ctx)
    assert r.status == "fail" and r.summary == ("target /m: custom code is refused: config.json model_type 'evil_lm' is "
                                                "not an architecture transformers 5.19.0 ships (auto_map: modeling_evil.py)")
    assert r.fix.startswith("set target.path in run.toml to a model whose architecture transformers ships")
    assert r.data["custom_code"] == ctx.target_custom_code


def test_config_checks_fp8_against_the_drafters_gpu_and_sizes(tmp_path):
    """train.fp8 = "mlp" passes on H200s with SmolLM2's sizes (576 / 1536); an A100-class GPU (8.0) or an MLP size
    not divisible by 16 fails before launch, naming the value and the fix."""
    assert check_config(make_ctx(tmp_path, config={"train": {"fp8": "mlp"}})).status == "pass"
    old = recorded()
    for g in old["gpus"]:
        g["compute_capability"] = "8.0"
    r = check_config(make_ctx(tmp_path, config={"train": {"fp8": "mlp"}}, gpus=old))
    assert r.status == "fail" and "compute capability 8.9+" in r.summary and "has 8.0" in r.summary, r.summary
    assert 'set train.fp8 = "off" in run.toml' in r.fix
    r = check_config(make_ctx(tmp_path, config={"train": {"fp8": "mlp"}, "drafter": {"intermediate_size": 1000}}))
    assert r.status == "fail" and "divisible by 16, got 576 and 1000" in r.summary, r.summary
    mixed = recorded()
    mixed["gpus"][int(SPLIT["drafter_gpus"][-1])]["compute_capability"] = "8.0"  # one drafter GPU of several
    r = check_config(make_ctx(tmp_path, config={"train": {"fp8": "mlp"}}, gpus=mixed))
    assert r.status == "fail" and "has 8.0" in r.summary, r.summary
    unknown = recorded()
    for g in unknown["gpus"]:
        g["compute_capability"] = "0.0"  # older recorded snapshots: not judged
    assert check_config(make_ctx(tmp_path, config={"train": {"fp8": "mlp"}}, gpus=unknown)).status == "pass"


def test_config_refuses_an_fp8_target_on_a_gpu_without_fp8_tensor_cores(tmp_path):
    """target.precision = "fp8" passes on H200s and on CPU (emulated); a target GPU of compute capability 8.0 fails
    in one line naming it, with the fix; an A100 that only trains the drafter does not matter."""
    fp8 = {"target": {"precision": "fp8"}}
    assert check_config(make_ctx(tmp_path, config=fp8)).status == "pass"
    old = recorded()
    for g in old["gpus"]:
        g["compute_capability"] = "8.0"
    r = check_config(make_ctx(tmp_path, config=fp8, gpus=old))
    assert r.status == "fail" and "\n" not in r.summary, r.summary
    assert r.summary == (f'target.precision = "fp8" needs compute capability 8.9+ (fp8 tensor cores), the target\'s GPU '
                         f'{old["gpus"][0]["name"]} has 8.0'), r.summary
    assert r.fix == 'set target.precision = "bf16" in run.toml, or run the target on an Ada/Hopper-class GPU or newer'
    assert check_config(make_ctx(tmp_path, config={**fp8, "device": "cpu"}, gpus=old)).status == "pass"
    split = {"target": {"precision": "fp8"}, "topology": dict(SPLIT)}
    drafter_only = recorded()
    drafter_only["gpus"][int(SPLIT["drafter_gpus"][0])]["compute_capability"] = "8.0"
    assert check_config(make_ctx(tmp_path, config=split, gpus=drafter_only)).status == "pass"
    target_too = recorded()
    target_too["gpus"][int(SPLIT["target_gpus"][-1])]["compute_capability"] = "8.0"
    r = check_config(make_ctx(tmp_path, config=split, gpus=target_too))
    assert r.status == "fail" and "has 8.0" in r.summary, r.summary
    assert check_config(make_ctx(tmp_path, config={"target": {"precision": "bf16"}}, gpus=old)).status == "pass"


def test_config_refuses_packing_one_sample_a_row(tmp_path):
    """data.packing with max_batch_size = 1 packs nothing and varies the row's length every step (an H100 run of it
    recompiled from step 12 and stopped at the recompile limit at 42): refused before launch, with the fix."""
    r = check_config(make_ctx(tmp_path, config={"data": {"packing": True, "max_batch_size": 1}}))
    assert r.status == "fail" and r.summary.startswith("data.packing with data.max_batch_size = 1 packs one sample a row")
    assert r.fix == "set data.max_batch_size in run.toml to 64 (or above), or data.packing = false"
    assert check_config(make_ctx(tmp_path, config={"data": {"packing": True, "max_batch_size": 2}})).status == "pass"


# ---------------------------------------------------------------- config: real weights, or random ones on purpose

SHAPES = {"model_type": "qwen3", "num_hidden_layers": 8, "hidden_size": 64, "intermediate_size": 128,
          "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 1000}


def _target(tmp_path, *weights: str) -> Path:
    """A target folder of shapes (config.json), plus empty files of these weight names."""
    folder = tmp_path / "target"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(SHAPES))
    for name in weights:
        (folder / name).write_bytes(b"")
    return folder


@pytest.mark.parametrize("weights", [("model.safetensors",), ("model.safetensors.index.json",
                                                              "model-00001-of-00002.safetensors"),
                                     ("pytorch_model.bin",), ("model-00001-of-00002.safetensors",)])
def test_config_refuses_random_init_when_the_target_folder_holds_weights(tmp_path, weights):
    """The preset's random_init left in, target.path pointed at real weights: one line naming both, and the fix."""
    folder = _target(tmp_path, *weights)
    r = check_config(make_ctx(tmp_path, config={"target": {"path": str(folder), "random_init": True}}))
    assert r.status == "fail", r.summary
    assert r.summary.startswith(f"target.random_init = true but target.path {folder} holds weights ({weights[0]}")
    assert r.summary.endswith("the run would ignore them and train against random weights"), r.summary
    assert r.fix == "drop target.random_init (from run.toml or the --set that gives it) to train against those weights"


def test_config_refuses_a_target_folder_of_shapes_alone_naming_both_ways_out(tmp_path):
    """What a preset as shipped meets: configs/targets/... hold config.json alone, and random_init is off."""
    folder = _target(tmp_path)
    r = check_config(make_ctx(tmp_path, config={"target": {"path": str(folder)}}))
    assert r.status == "fail"
    assert r.summary == (f"target.path {folder} holds no weights (model.safetensors or pytorch_model.bin), only the "
                         "model's shapes")
    assert r.fix == ("set target.path in run.toml to the folder of your model's weights; for memory and speed "
                     "measurements on these shapes alone, add --set target.random_init=true")


def test_config_warns_that_random_weights_teach_the_drafter_nothing(tmp_path):
    folder = _target(tmp_path)
    r = check_config(make_ctx(tmp_path, config={"target": {"path": str(folder), "random_init": True}}))
    assert r.status == "warn", r.summary
    assert r.summary.startswith("the target has random weights: the drafter learns nothing useful "
                                f"(target.random_init = true; {folder} holds no weights); ")
    assert "8 layers, vocab 1,000" in r.summary and r.data["random_init"] is True
    assert r.fix.startswith("for a drafter worth training, set target.path in run.toml to your model's weights")


def test_config_with_real_weights_and_random_init_off_passes_as_before(tmp_path):
    folder = _target(tmp_path, "model.safetensors")
    r = check_config(make_ctx(tmp_path, config={"target": {"path": str(folder)}}))
    assert r.status == "pass" and r.data["weights"] == ["model.safetensors"], r.summary
    assert check_config(make_ctx(tmp_path)).status == "pass"  # the embedded SmolLM2 holds its GGUF
