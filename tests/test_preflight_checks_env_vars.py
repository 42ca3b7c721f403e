"""preflight/checks/env_vars.py: env-vars, fed facts (pass and fail paths)."""

from __future__ import annotations

import pytest

from preflight.checks.env_vars import check_env_vars
from preflight.facts.paths import PathEntry
from preflight_ctx import make_ctx

# ---------------------------------------------------------------- env-vars


def test_env_vars_a_variable_the_trainer_sets_passes_and_says_so(tmp_path):
    """Standalone preflight on a correct box: PYTORCH_CUDA_ALLOC_CONF is unset because dflash-train sets it."""
    ctx = make_ctx(tmp_path)
    ctx.env = {}
    r = check_env_vars(ctx)
    assert r.status == "pass" and r.summary.startswith(
        "PYTORCH_CUDA_ALLOC_CONF unset here: dflash-train sets PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True "
        "before torch loads; PATH clean")
    assert r.data["will_set"] == [{"name": "PYTORCH_CUDA_ALLOC_CONF", "value": "expandable_segments:True"}]


def test_env_vars_a_conflicting_value_fails(tmp_path):
    ctx = make_ctx(tmp_path)
    ctx.env = {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:False"}
    r = check_env_vars(ctx)
    assert r.status == "fail" and "PYTORCH_CUDA_ALLOC_CONF='expandable_segments:False' (need 'expandable_segments:True'" in r.summary
    assert r.fix == "export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True"


@pytest.mark.parametrize("cuda_conf", [None, "expandable_segments:True"])
def test_env_vars_pytorch_alloc_conf_is_read_first_and_must_agree(tmp_path, cuda_conf):
    ctx = make_ctx(tmp_path)
    ctx.env = {"PYTORCH_ALLOC_CONF": "max_split_size_mb:128"}
    if cuda_conf:
        ctx.env["PYTORCH_CUDA_ALLOC_CONF"] = cuda_conf
    r = check_env_vars(ctx)
    assert r.status == "fail"
    assert "PYTORCH_ALLOC_CONF='max_split_size_mb:128' overrides PYTORCH_CUDA_ALLOC_CONF (torch reads PYTORCH_ALLOC_CONF first" in r.summary
    assert r.fix == "unset PYTORCH_ALLOC_CONF"
    ctx.env["PYTORCH_ALLOC_CONF"] = "expandable_segments:True"  # the same setting under the newer name
    assert check_env_vars(ctx).status == "pass"


def test_env_vars_other_python_envs_anywhere_on_path_warn_naming_what_runs_from_them(tmp_path):
    """`uv run` puts its env first, so an sglang env later on PATH used to pass: it still runs every command the
    earlier entries lack (ninja, nvcc, a second torchrun...)."""
    ctx = make_ctx(tmp_path)
    after = str(tmp_path / "sglang-env" / "bin")
    ahead = str(tmp_path / "conda" / "bin")
    gone = str(tmp_path / "gone" / "bin")
    ctx.path_entries.append(PathEntry(after, True, str(tmp_path / "sglang-env"), commands=["sglang", "ninja", "torchrun"]))
    ctx.path_entries.insert(0, PathEntry(ahead, True, str(tmp_path / "conda"), commands=["conda", "python", "pip"]))
    ctx.path_entries.append(PathEntry(gone, False))
    r = check_env_vars(ctx)
    assert r.status == "warn"
    assert f"{after} (after this environment; runs torchrun, ninja, sglang)" in r.summary
    assert f"{ahead} (ahead of this environment; runs python, pip, conda)" in r.summary and gone in r.summary
    assert [(e["path"], e["ahead"]) for e in r.data["path_other_envs"]] == [(ahead, True), (after, False)]
    assert after not in r.fix and ahead not in r.fix and r.fix.startswith("export PATH=")
    ctx.path_entries = [e for e in ctx.path_entries if e.path != ahead and e.exists]
    ctx.path_entries[-1].commands = []
    r = check_env_vars(ctx)
    assert r.status == "warn" and f"{after} (after this environment; all its commands are found earlier)" in r.summary
