"""preflight/checks/source.py: compile-cache and model-source, fed facts (pass and fail paths)."""

from __future__ import annotations

from preflight.checks.source import check_compile_cache, check_model_source
from preflight.facts.source import CompileCache, ModelSource
from preflight_ctx import make_ctx

# ---------------------------------------------------------------- compile-cache


def test_compile_cache_cold_warns_with_warm_command(tmp_path):
    ctx = make_ctx(tmp_path)
    ctx.compile_cache = CompileCache(str(tmp_path / "cache"), False)
    r = check_compile_cache(ctx)
    assert r.status == "warn" and r.summary.startswith("cold:")
    assert r.fix == "uv run dflash-train --config run.toml --warm-cache"


def test_compile_cache_mismatch_warns_naming_field(tmp_path):
    ctx = make_ctx(tmp_path)
    ctx.compile_cache.manifest["torch"] = "2.11.0+cu130"
    r = check_compile_cache(ctx)
    assert r.status == "warn" and "torch 2.11.0+cu130 -> 2.10.0+cu128" in r.summary
    ctx = make_ctx(tmp_path)
    ctx.config = ctx.config.model_copy(update={"drafter": ctx.config.drafter.model_copy(update={"block_size": 16})})
    r = check_compile_cache(ctx)  # the manifest was written for block_size 32
    assert r.status == "warn" and "drafter_hash" in r.summary
    for change in ({"target": {"compile": False}}, {"data": {"max_batch_size": 1}}, {"data": {"path": "other"}}):
        ctx = make_ctx(tmp_path)
        section, fields = next(iter(change.items()))
        ctx.config = ctx.config.model_copy(update={section: getattr(ctx.config, section).model_copy(update=fields)})
        r = check_compile_cache(ctx)
        assert r.status == "warn" and "target_hash" in r.summary and "drafter_hash" not in r.summary, r.summary
    ctx = make_ctx(tmp_path)
    del ctx.compile_cache.manifest["target_hash"]  # a cache warmed before the manifest named the target's graphs
    r = check_compile_cache(ctx)
    assert r.status == "warn" and "target_hash None ->" in r.summary


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
