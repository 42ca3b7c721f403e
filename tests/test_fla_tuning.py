"""fla's autotuning choices kept (dflash.models.fla_tuning): harvested from fla's own Triton autotuners, set in them
before a cold start, read from a harvest or a compile cache artifact, refused for another Triton. On CPU fla's kernels
do not run, but its autotuners are the real objects the target's first forward consults."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("fla.ops.utils.cumsum")
triton = pytest.importorskip("triton")

from dflash.models import fla_kept, fla_tuning  # noqa: E402
from dflash.runs import compile_artifact as artifact  # noqa: E402
from dflash.train.compiled import fla_text  # noqa: E402

KERNEL = "fla.ops.utils.cumsum.chunk_local_cumsum_scalar_kernel"
KEY = (1, 32, 64, True, False, "torch.float32", "torch.float32")  # its key: B, H, BT, IS_VARLEN, REVERSE, dtypes


@pytest.fixture
def tuner():
    """fla's real autotuner of one kernel, its choices restored after the test."""
    found = fla_tuning.autotuners()
    assert KERNEL in found, sorted(found)[:5]
    t = found[KERNEL]
    saved = dict(t.cache)
    t.cache.clear()
    yield t
    t.cache.clear()
    t.cache.update(saved)
    if hasattr(t, "bench_time"):
        del t.bench_time


def chosen(tuner) -> triton.Config:
    return tuner.configs[-1]  # one of the kernel's own configs, as its autotuning would choose


def test_a_choice_is_harvested_and_set_again_in_a_cold_process(tuner):
    tuner.cache[KEY] = chosen(tuner)
    tuner.bench_time = 3.25
    kept = json.loads(json.dumps(fla_tuning.harvest()))  # as a file holds it
    entry = kept["kernels"][KERNEL]
    assert kept["triton"] == triton.__version__ and kept["fla"] == fla_tuning.fla_version() and entry["tuned_s"] == 3.25
    assert entry["entries"] == [{"key": list(KEY), "config": {
        "kwargs": dict(chosen(tuner).kwargs), "num_warps": chosen(tuner).num_warps,
        "num_stages": chosen(tuner).num_stages, "num_ctas": chosen(tuner).num_ctas, "maxnreg": None}}]
    assert fla_tuning.tuning_seconds() == (3.25, 1)
    tuner.cache.clear()  # a cold process: nothing chosen
    assert fla_tuning.seed(kept) == 1
    got = tuner.cache[KEY]  # Triton's autotuner finds the key chosen: it runs this config, tuning nothing
    assert (got.kwargs, got.num_warps, got.num_stages) == (chosen(tuner).kwargs, chosen(tuner).num_warps,
                                                           chosen(tuner).num_stages)
    assert fla_tuning.seed(kept) == 0  # a key chosen already is left as it is
    other = {"kernels": {"fla.not.loaded_kernel": entry, KERNEL: {"entries": []}}}
    assert fla_tuning.seed(other) == 0
    tuner.cache.clear()  # a config this kernel does not offer here (another GPU's list): never launched untried
    foreign = {**entry["entries"][0], "config": {**entry["entries"][0]["config"], "num_warps": 64}}
    assert fla_tuning.seed({"kernels": {KERNEL: {"entries": [foreign]}}}) == 0 and KEY not in tuner.cache


def test_use_kept_reads_the_file_the_env_names_and_refuses_another_triton(tuner, tmp_path, monkeypatch):
    tuner.cache[KEY] = chosen(tuner)
    kept = fla_tuning.harvest()
    tuner.cache.clear()
    good = tmp_path / "choices.json"
    good.write_text(json.dumps(kept))
    lines = []
    monkeypatch.setenv(fla_tuning.ENV, str(good))
    assert fla_tuning.use_kept("NVIDIA H100 80GB HBM3", lines.append) == 1
    assert lines == ["fla: 1 kept kernel choice(s) for NVIDIA H100 80GB HBM3 set from choices.json (the rest autotune)"]
    tuner.cache.clear()
    old = tmp_path / "old.json"
    old.write_text(json.dumps({**kept, "triton": "3.1.0"}))
    monkeypatch.setenv(fla_tuning.ENV, str(old))
    lines.clear()
    assert fla_tuning.use_kept("NVIDIA H100 80GB HBM3", lines.append) == 0 and KEY not in tuner.cache
    assert lines == [f"fla: {old} was tuned with Triton 3.1.0, this is {triton.__version__}; its kernels autotune"]
    other_fla = tmp_path / "other_fla.json"
    other_fla.write_text(json.dumps({**kept, "fla": "0.1.0"}))  # another fla: other kernels may sit behind the names
    monkeypatch.setenv(fla_tuning.ENV, str(other_fla))
    lines.clear()
    assert fla_tuning.use_kept("NVIDIA H100 80GB HBM3", lines.append) == 0 and KEY not in tuner.cache
    assert lines == [f"fla: {other_fla} was tuned with fla 0.1.0, this is {fla_tuning.fla_version()}; its kernels "
                     "autotune"]
    for value, line in ((str(tmp_path / "none.json"), f"fla: {fla_tuning.ENV}={tmp_path / 'none.json'}: not a file; "
                                                      "its kernels autotune (name a harvest, or off)"), ("off", None)):
        monkeypatch.setenv(fla_tuning.ENV, value)
        lines.clear()
        assert fla_tuning.use_kept("NVIDIA H100 80GB HBM3", lines.append) == 0
        assert lines == ([line] if line else [])
    elsewhere = tmp_path / "a100.json"
    elsewhere.write_text(json.dumps({**kept, "gpu_name": "NVIDIA A100-SXM4-80GB"}))  # fla's configs differ per GPU
    monkeypatch.setenv(fla_tuning.ENV, str(elsewhere))
    lines.clear()
    assert fla_tuning.use_kept("NVIDIA H100 80GB HBM3", lines.append) == 0 and KEY not in tuner.cache
    assert lines == [f"fla: {elsewhere} was tuned on NVIDIA A100-SXM4-80GB, this is NVIDIA H100 80GB HBM3; its "
                     "kernels autotune"]
    entry = kept["kernels"][KERNEL]["entries"][0]
    for broken in ({"entries": "x"}, {"entries": [{"key": list(KEY)}]}, {"entries": [{**entry, "key": [[1]]}]},
                   [entry], {"entries": [{**entry, "config": {"kwargs": {}}}]}):
        malformed = tmp_path / "malformed.json"
        malformed.write_text(json.dumps({**kept, "kernels": {KERNEL: broken}}))
        monkeypatch.setenv(fla_tuning.ENV, str(malformed))
        lines.clear()  # one line and fla tunes, never a crash after the target's weights have loaded
        assert fla_tuning.use_kept("NVIDIA H100 80GB HBM3", lines.append) == 0 and KEY not in tuner.cache
        assert lines == [f"fla: {malformed}: malformed: {KERNEL}'s entries are not [{{'key': [...], 'config': "
                         "{'kwargs': ..., ...}}]; its kernels autotune"], lines
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    monkeypatch.setenv(fla_tuning.ENV, str(bad))
    lines.clear()
    assert fla_tuning.use_kept("x", lines.append) == 0
    assert lines == [f"fla: {bad}: unreadable (JSONDecodeError); its kernels autotune"]
    monkeypatch.delenv(fla_tuning.ENV)
    lines.clear()  # a GPU model nothing is kept for: fla autotunes, nothing said
    assert fla_tuning.use_kept("A GPU nobody measured", lines.append) == 0 and lines == []


def test_the_kept_file_is_named_by_the_gpu_model():
    assert fla_kept.kept_path("NVIDIA H100 80GB HBM3").name == "NVIDIA_H100_80GB_HBM3.json"
    assert fla_kept.kept_path("NVIDIA H200").parent == fla_kept.KEPT
    committed = sorted(fla_kept.KEPT.glob("*.json"))
    assert committed  # each one a run reads: well formed, under its GPU model's name
    for path in committed:
        kept, problem = fla_kept.read_kept(path)
        assert problem is None and kept["kernels"] and fla_kept.kept_path(kept["gpu_name"]) == path, (path, problem)


def test_an_artifacts_recorded_choices_are_kept_and_one_without_is_refused(tuner, tmp_path, capsys):
    """python -m dflash.train.fla_choices ARTIFACT [OUT]: the choices --warm-cache recorded, written where a cold
    start reads them; an artifact without any, or not an artifact, is one line and exit 2, nothing written."""
    from dflash.train.fla_choices import main, recorded

    tuner.cache[KEY] = chosen(tuner)
    kept = fla_tuning.harvest()
    made = artifact.write(tmp_path / "a.dfcache", {"gpu_name": "NVIDIA H100 80GB HBM3", "fla_choices": kept},
                          {"torch": b"x"})
    assert recorded(made) == (kept, "NVIDIA H100 80GB HBM3", None)
    out = tmp_path / "kept" / "h100.json"
    assert main([str(made), str(out)]) == 0
    assert fla_kept.read_kept(out) == ({**kept, "gpu_name": "NVIDIA H100 80GB HBM3"}, None)
    assert "1 kernel(s)' choices for NVIDIA H100 80GB HBM3" in capsys.readouterr().out
    bare = artifact.write(tmp_path / "cpu.dfcache", {"gpu_name": "cpu"}, {"torch": b"x"})
    for bad, why in ((bare, "it recorded no fla choices"), (tmp_path / "none.dfcache", "no such file")):
        assert main([str(bad), str(tmp_path / "x.json")]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and why in err and "--warm-cache" in err, err
    assert not (tmp_path / "x.json").exists()
    blocked = tmp_path / "a-file"
    blocked.write_text("")
    assert main([str(made), str(blocked / "kept.json")]) == 2  # OUT under a file: one line, nothing written
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"fla_choices: cannot write {blocked / 'kept.json'} (")
    assert fla_kept.read_kept(made) == (None, "unreadable (UnicodeDecodeError)")  # an artifact is not a harvest


def test_the_compile_line_says_what_fla_tuned():
    assert fla_text({"fla_kernels_tuned": 0, "fla_autotune_s": 0.0}) == ""
    assert fla_text({"fla_kernels_tuned": 9, "fla_autotune_s": 41.26}) == "; fla's autotuning 41.3 s (9 kernel(s))"


def test_a_process_that_only_loads_fla_keeps_one_config_a_kernel(tuner):
    """The memory probe loads fla's kernels and tunes none: each autotuner keeps its first config, so Triton compiles
    each kernel once (a tuner with one config runs it without tuning)."""
    saved = {name: t.configs for name, t in fla_tuning.autotuners().items()}
    try:
        many = sum(len(c) > 1 for c in saved.values())
        first = tuner.configs[0]
        assert many > 1 and fla_tuning.first_configs_only() == many
        assert tuner.configs == [first] and all(len(t.configs) == 1 for t in fla_tuning.autotuners().values())
        assert fla_tuning.first_configs_only() == 0
    finally:
        for name, t in fla_tuning.autotuners().items():
            t.configs = saved[name]


def test_a_pack_in_a_token_bucket_not_kept_takes_the_nearest_kept_choice(tmp_path, monkeypatch):
    """l2norm's key holds NB = cdiv(tokens x heads, 65,536): a kept file of the buckets one run met leaves a pack
    of another length to tune mid-run; every bucket up to twice the largest kept finds the nearest kept choice."""
    import fla.modules.norm.l2norm  # noqa: F401  (loads the kernel's autotuner)

    name = "fla.modules.norm.l2norm.l2norm_fwd_kernel"
    t = fla_tuning.autotuners()[name]
    assert list(t.keys) == ["D", "NB"]  # fla's own key: the bucket's place is found by name
    saved, filled = dict(t.cache), dict(fla_tuning.FILLED)
    t.cache.clear()
    try:
        dtypes = ["torch.bfloat16", "torch.bfloat16", "torch.float32"]
        low, high = fla_tuning._config_dict(t.configs[0]), fla_tuning._config_dict(t.configs[-1])
        kept = {"kernels": {name: {"entries": [{"key": [128, 22, *dtypes], "config": low},
                                               {"key": [128, 24, *dtypes], "config": high}]}}}
        assert fla_tuning.seed(kept) == 48
        assert t.cache[(128, 23, *dtypes)] is t.configs[0]  # a tie goes to the smaller bucket
        assert t.cache[(128, 1, *dtypes)] is t.configs[0] and t.cache[(128, 48, *dtypes)] is t.configs[-1]
        assert (128, 49, *dtypes) not in t.cache and (64, 23, *dtypes) not in t.cache  # another width tunes
        assert fla_tuning.seed(kept) == 0
        assert [e["key"][1] for e in fla_tuning.harvest()["kernels"][name]["entries"]] == [22, 24]  # kept, not filled
        t.cache.clear()
        fla_tuning.FILLED.clear()
        file = tmp_path / "kept.json"
        file.write_text(json.dumps({**fla_tuning.harvest("NVIDIA H200"), **kept}))
        monkeypatch.setenv(fla_tuning.ENV, str(file))
        lines = []
        assert fla_tuning.use_kept("NVIDIA H200", lines.append) == 48
        assert lines == ["fla: 2 kept kernel choice(s) for NVIDIA H200 set from kept.json, 46 other token bucket(s) "
                         "from the nearest kept (the rest autotune)"]  # the filled ones are not counted as kept
    finally:
        t.cache.clear()
        t.cache.update(saved)
        fla_tuning.FILLED.clear()
        fla_tuning.FILLED.update(filled)
    assert fla_tuning.buckets_filled(["B", "H"], {(1, 2): "c"}) == {}  # a key without a bucket: exact keys only


def test_what_a_runs_first_step_tuned_fills_the_other_buckets_and_is_kept_in_its_run_dir(tmp_path, capsys):
    """A GPU with no kept file: the first step tunes l2norm for its pack's bucket; keep_tuned lets every other
    bucket take that choice (no 10 s tuning when a pack of another length comes) and writes fla_choices.json, which
    fla_choices keeps; the filled buckets are never harvested as if tuned."""
    import fla.modules.norm.l2norm  # noqa: F401

    from dflash.train.fla_choices import main

    name = "fla.modules.norm.l2norm.l2norm_fwd_kernel"
    t = fla_tuning.autotuners()[name]
    saved, filled = dict(t.cache), dict(fla_tuning.FILLED)
    t.cache.clear()
    key = (128, 22, "torch.bfloat16", "torch.bfloat16", "torch.float32")
    try:
        assert fla_tuning.keep_tuned("NVIDIA H200", tmp_path / "fla_choices.json") is None  # fla tuned nothing: nothing said or written
        t.cache[key] = t.configs[3]
        t.bench_time = 10.5  # as Triton's autotuner records its tuning
        line = fla_tuning.keep_tuned("NVIDIA H200", tmp_path / "fla_choices.json")
        path = tmp_path / "fla_choices.json"
        assert line.startswith(f"fla: tuned 1 kernel(s) in 10.5 s; choices in {path}: `python -m dflash.train.")
        assert t.cache[(128, 23, *key[2:])] is t.configs[3] and len(t.cache) == 44
        written = json.loads(path.read_text())
        assert written["gpu_name"] == "NVIDIA H200" and written["kernels"][name]["entries"] == [
            {"key": list(key), "config": fla_tuning._config_dict(t.configs[3])}]  # the tuned key alone
        out = tmp_path / "kept.json"
        assert main([str(path), str(out)]) == 0 and json.loads(out.read_text())["kernels"] == written["kernels"]
        assert "1 kernel(s)' choices for NVIDIA H200" in capsys.readouterr().out
        cfg = written["kernels"][name]["entries"][0]["config"]  # a kept file adds what a run brings, drops nothing
        prior = {**written, "kernels": {"fla.x.other_kernel": {"tuned_s": 1.0, "entries": [{"key": [1], "config": cfg}]},
                                        name: {"entries": [{"key": [128, 24, *key[2:]], "config": cfg},
                                                           {"key": list(key), "config": {**cfg, "num_warps": 1}}]}}}
        out.write_text(json.dumps(prior))
        assert main([str(path), str(out)]) == 0 and "(2 kept there before, kept with them)" in capsys.readouterr().out
        got = json.loads(out.read_text())["kernels"]
        assert set(got) == {name, "fla.x.other_kernel"}
        assert got[name]["entries"] == [*written["kernels"][name]["entries"], prior["kernels"][name]["entries"][0]]
        out.write_text(json.dumps({**prior, "triton": "3.1.0"}))  # another Triton's file: replaced, not merged
        assert main([str(path), str(out)]) == 0 and json.loads(out.read_text())["kernels"] == written["kernels"]
        capsys.readouterr()
        (tmp_path / "bad.json").write_text("[]")
        assert main([str(tmp_path / "bad.json"), str(out)]) == 2
        assert "bad.json: not a harvest of fla's choices" in capsys.readouterr().err
    finally:
        t.cache.clear()
        t.cache.update(saved)
        fla_tuning.FILLED.clear()
        fla_tuning.FILLED.update(filled)
        if hasattr(t, "bench_time"):
            del t.bench_time


def test_keeping_what_fla_tuned_never_stops_a_run(tmp_path, monkeypatch):
    """A run dir that cannot be written, or a harvest that fails: one line, nothing left behind, no exception."""
    monkeypatch.setattr(fla_tuning, "tuning_seconds", lambda: (4.0, 1))
    monkeypatch.setattr(fla_tuning, "harvest", lambda gpu: {"gpu_name": gpu, "kernels": {}})
    assert fla_tuning.keep_tuned("NVIDIA H200", tmp_path / "fla_choices.json") == \
        "fla: tuned 1 kernel(s) in 4.0 s; none of their choices can be written to a file"  # no empty file offered
    monkeypatch.setattr(fla_tuning, "harvest", lambda gpu: {"gpu_name": gpu, "kernels": {"k": {"entries": []}}})
    line = fla_tuning.keep_tuned("NVIDIA H200", tmp_path / "gone" / "fla_choices.json")
    assert line.startswith(f"fla: tuned 1 kernel(s) in 4.0 s; their choices not written to {tmp_path / 'gone' / 'fla_choices.json'}")
    assert not (tmp_path / "gone").exists()
    monkeypatch.setattr(fla_tuning, "harvest", lambda gpu: 1 / 0)
    assert fla_tuning.keep_tuned("NVIDIA H200", tmp_path / "fla_choices.json") == \
        "fla: its tuned choices were not kept (ZeroDivisionError: division by zero)"
    assert list(tmp_path.iterdir()) == []
