"""preflight/checks/source.py: compile-cache and model-source, fed facts (pass and fail paths)."""

from __future__ import annotations

import pytest

from dflash.runs import compile_artifact
from preflight.checks.source import check_compile_cache, check_model_source
from preflight.facts.source import CompileCache, ModelSource
from preflight_ctx import CLASSES, TARGET, make_ctx

# ---------------------------------------------------------------- compile-cache


def test_compile_cache_missing_warns_with_the_command_that_makes_it(tmp_path):
    ctx = make_ctx(tmp_path)
    ctx.compile_cache = CompileCache(str(tmp_path / "cache.artifacts" / "run.dfcache"), False, others=2)
    r = check_compile_cache(ctx)
    assert r.status == "warn" and r.summary.startswith(f"cold: no compile cache artifact {ctx.compile_cache.path} "
                                                       "(2 made for other runs beside it); every graph compiles at launch")
    assert r.fix == "uv run dflash-train --config run.toml --warm-cache"
    named = ctx.config.model_copy(update={"train": ctx.config.train.model_copy(update={"compile_cache": "/data/a.dfcache"})})
    ctx.config = named
    assert check_compile_cache(ctx).fix == ("uv run dflash-train --config run.toml --warm-cache --set "
                                            "train.compile_cache=/data/a.dfcache")


def test_compile_cache_match_passes_with_the_measured_starts(tmp_path):
    ctx = make_ctx(tmp_path)
    r = check_compile_cache(ctx)
    assert r.status == "pass" and r.fix is None
    assert r.summary == (f"warm: about 45 s to step 1; cold about 120 s from {ctx.compile_cache.path} (353.0 MB): "
                         "matches torch 2.10.0+cu128, triton 3.6.0, NVIDIA H200 (9.0), shape classes rows >= 2 "
                         "16 x 3072, 2 x 24000; one row 1 x 41000"), r.summary


@pytest.mark.parametrize("field, made, expected", [
    ("torch", "2.11.0+cu130", "torch 2.11.0+cu130 -> 2.10.0+cu128"),
    ("triton", "3.5.1", "triton 3.5.1 -> 3.6.0"),
    ("gpu_name", "NVIDIA RTX PRO 6000 Blackwell", "gpu_name NVIDIA RTX PRO 6000 Blackwell -> NVIDIA H200"),
    ("compute_capability", "12.0", "compute_capability 12.0 -> 9.0"),
    ("shape_classes", [["rows >= 2", 16, 3072], ["one row", 1, 41000]],
     "shape classes rows >= 2 16 x 3072; one row 1 x 41000 -> rows >= 2 16 x 3072, 2 x 24000; one row 1 x 41000"),
])
def test_compile_cache_mismatch_per_field_is_stale_naming_it(tmp_path, field, made, expected):
    ctx = make_ctx(tmp_path)
    ctx.compile_cache.manifest[field] = made
    r = check_compile_cache(ctx)
    assert r.status == "warn" and r.summary.startswith(f"stale: {ctx.compile_cache.path} (353.0 MB) was made for "
                                                       "another setup (")
    assert expected in r.summary and "a run ignores it and starts cold (warm: about 45 s" in r.summary, r.summary
    assert r.fix == "uv run dflash-train --config run.toml --warm-cache"


def test_compile_cache_another_drafter_or_target_is_stale(tmp_path):
    """The run's side (drafter config, target dtype): another graph than the artifact holds."""
    ctx = make_ctx(tmp_path)
    ctx.config = ctx.config.model_copy(update={"drafter": ctx.config.drafter.model_copy(update={"block_size": 16})})
    ctx.compile_cache.run = compile_artifact.run_facts(ctx.config, TARGET, CLASSES)
    r = check_compile_cache(ctx)
    assert r.status == "warn" and "drafter block_size 32 -> 16" in r.summary, r.summary
    ctx.compile_cache.run["target"]["dtype"] = "float32"
    r = check_compile_cache(ctx)
    assert "target dtype bfloat16 -> float32" in r.summary, r.summary


@pytest.mark.parametrize("problem", ["truncated: 1,000 of 353,000,000 bytes", "not a dflash compile cache artifact"])
def test_compile_cache_truncated_or_foreign_is_cold(tmp_path, problem):
    ctx = make_ctx(tmp_path)
    ctx.compile_cache.manifest, ctx.compile_cache.error, ctx.compile_cache.size_bytes = None, problem, 1000
    r = check_compile_cache(ctx)
    assert r.status == "warn" and r.summary == f"cold: {ctx.compile_cache.path} (1,000 bytes): {problem}; a run ignores it"
    assert r.fix == "uv run dflash-train --config run.toml --warm-cache"


def test_compile_cache_unknown_shapes_pass_saying_what_was_not_compared(tmp_path):
    ctx = make_ctx(tmp_path)
    ctx.compile_cache.run, ctx.compile_cache.run_error = None, "the dataset data was not read"
    r = check_compile_cache(ctx)
    assert r.status == "pass" and r.summary.endswith("; not compared: shape classes (the dataset data was not read)")


# ---------------------------------------------------------------- model-source


def test_model_source_modified_fails_naming_file_and_stat(tmp_path):
    ctx = make_ctx(tmp_path)
    stat = " dflash/model.py | 4 +++-\n 1 file changed, 3 insertions(+), 1 deletion(-)"
    ctx.model_source = ModelSource("git", commit="0123456789abcdef", modified=["dflash/model.py"],
                                   states={"dflash/model.py": "modified"}, diff_stat=stat,
                                   verified=["dflash/loss.py"])
    r = check_model_source(ctx)
    assert r.status == "fail"
    assert "dflash/model.py (modified)" in r.summary and "1 file changed" in r.summary
    assert "0123456789ab" in r.summary and r.data["commit"] == "0123456789abcdef"
    assert r.fix.startswith("git stash push --include-untracked -- dflash/model.py")


def test_model_source_record_mode(tmp_path):
    ctx = make_ctx(tmp_path)
    ctx.model_source = ModelSource("record", commit="dflash==0.1.0", modified=["dflash/loss.py"],
                                   states={"dflash/loss.py": "differs from RECORD"}, verified=["dflash/model.py"])
    r = check_model_source(ctx)
    assert r.status == "fail" and "dflash==0.1.0" in r.summary
    assert r.fix.startswith("uv pip install --reinstall --no-deps dflash==0.1.0")
    ctx.model_source = ModelSource("record", commit="dflash==0.1.0", verified=["dflash/model.py"])
    assert check_model_source(ctx).status == "pass"


def test_model_source_covers_the_whole_package_and_untracked_files_warn(tmp_path):
    ctx = make_ctx(tmp_path)
    every = ["dflash/attention.py", "dflash/data.py", "dflash/model.py", "dflash/step.py", "dflash/train.py"]
    ctx.model_source = ModelSource("git", commit="0123456789abcdef", files=every, verified=every)
    r = check_model_source(ctx)
    assert (r.status, r.summary) == ("pass", "all 5 source files of dflash/ match git HEAD 0123456789ab")
    # a hack in the data loader changes a run as much as one in the model
    ctx.model_source = ModelSource("git", commit="0123456789abcdef", files=[*every, "dflash/scratch.py"],
                                   modified=["dflash/data.py", "dflash/scratch.py"],
                                   states={"dflash/data.py": "modified", "dflash/scratch.py": "untracked"},
                                   verified=[f for f in every if f != "dflash/data.py"])
    r = check_model_source(ctx)
    assert r.status == "fail" and r.summary.startswith("training source modified against git HEAD 0123456789ab: "
                                                       "dflash/data.py (modified)")
    assert r.summary.endswith("; also untracked: dflash/scratch.py")
    # an untracked file alone is imported by no committed module: a warning, with the same fix
    ctx.model_source = ModelSource("git", commit="0123456789abcdef", files=[*every, "dflash/scratch.py"],
                                   modified=["dflash/scratch.py"], states={"dflash/scratch.py": "untracked"},
                                   verified=every)
    r = check_model_source(ctx)
    assert r.status == "warn" and "1 file(s) in dflash/ not in git HEAD 0123456789ab (untracked): dflash/scratch.py" in r.summary
    assert r.fix.startswith("git stash push --include-untracked -- dflash/scratch.py")


def test_a_cold_start_of_a_hybrid_target_says_whether_fla_will_autotune(tmp_path, monkeypatch):
    """A hybrid target (Gated DeltaNet layers: fla's kernels) starting cold: the warning says whether fla's autotuning
    choices are kept for the target GPU's model and this Triton, or how to keep them; a dense target says nothing."""
    import dataclasses
    import json

    from dflash.models import fla_kept

    ctx = make_ctx(tmp_path)
    ctx.compile_cache = CompileCache(str(tmp_path / "run.dfcache"), False)
    assert "fla" not in check_compile_cache(ctx).summary  # a dense target
    ctx.target_shape = dataclasses.replace(ctx.target_shape, linear_layers=48)
    monkeypatch.setattr(fla_kept, "KEPT", tmp_path / "fla_tuned")
    r = check_compile_cache(ctx)
    assert r.status == "warn" and r.summary.endswith(
        "; fla autotunes its kernels at launch (50 s of the 27B target's first step on an H100; --warm-cache records "
        "its choices, python -m dflash.train.fla_choices ARTIFACT keeps them for this GPU model)"), r.summary
    kept = tmp_path / "fla_tuned" / "NVIDIA_H200.json"
    kept.parent.mkdir()
    kept.write_text(json.dumps({"triton": "3.6.0", "fla": "0.6.0", "kernels": {}}))
    ctx.distributions["fla-core"] = ["0.6.0"]
    assert check_compile_cache(ctx).summary.endswith(
        "; fla's autotuning choices are kept for NVIDIA H200 (dflash/models/fla_tuned/NVIDIA_H200.json): fla tunes only shapes not kept there")
    ctx.env["DFLASH_FLA_TUNED"] = "off"  # the run will tune: so says its preflight
    assert "fla autotunes its kernels at launch" in check_compile_cache(ctx).summary
    mine = tmp_path / "mine.json"
    mine.write_text(kept.read_text())
    ctx.env["DFLASH_FLA_TUNED"] = str(mine)  # a file named for the run instead of the GPU's own
    assert check_compile_cache(ctx).summary.endswith(
        f"; fla's autotuning choices are kept for NVIDIA H200 (DFLASH_FLA_TUNED={mine}): fla tunes only shapes not kept there")
    del ctx.env["DFLASH_FLA_TUNED"]
    for other in ({"triton": "3.1.0", "fla": "0.6.0"}, {"triton": "3.6.0", "fla": "0.5.0"},
                  {"triton": "3.6.0", "fla": "0.6.0", "gpu_name": "NVIDIA H100 80GB HBM3"}):  # tuned elsewhere
        kept.write_text(json.dumps({**other, "kernels": {}}))
        assert "fla autotunes its kernels at launch" in check_compile_cache(ctx).summary
