"""The compile cache artifact (dflash.runs.compile_artifact, dflash.train.compile_cache): its file checked before any
byte reaches torch, one line and a cold start for every artifact a run cannot use, and on the CPU the real round trip:
`dflash-train --warm-cache` compiles with inductor, saves, and a fresh process with empty caches loads it, compiles
no graph from scratch and gets the same losses.

The preflight verdicts on an artifact (match, mismatch per field, truncated, missing) are in
tests/test_preflight_checks_source.py, the facts preflight reads from a real file in tests/test_preflight_facts.py.
"""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest
import torch

from dflash.runs import compile_artifact as artifact
from dflash.train import compile_cache
from dflash.train.warmup import needed_batches
from trainkit import REPO, tiny_config, write_toml

MACHINE = {"torch": "2.10.0+cu128", "triton": "3.6.0", "gpu_name": "NVIDIA H200", "compute_capability": "9.0"}


def _write(tmp_path, sections=None, **manifest):
    path = tmp_path / "a.dfcache"
    return artifact.write(path, {**MACHINE, **manifest}, sections if sections is not None else
                          {"torch": b"\x01" * 5000, "triton": b"\x02" * 300}), path


# ---------------------------------------------------------------- the file


def test_a_whole_artifact_reads_back_every_section_and_its_manifest(tmp_path):
    _, path = _write(tmp_path, cold={"seconds": 120.4})
    header, problem = artifact.read_header(path)
    assert problem is None and header["manifest"]["cold"] == {"seconds": 120.4} and header["size"] == path.stat().st_size
    assert [s["name"] for s in header["sections"]] == ["torch", "triton"]
    manifest, sections = artifact.read_sections(path)
    assert manifest["torch"] == "2.10.0+cu128" and sections == {"torch": b"\x01" * 5000, "triton": b"\x02" * 300}
    assert path.read_bytes().startswith(artifact.MAGIC)
    assert artifact.read_header(tmp_path / "nowhere.dfcache") == (None, None)


def test_a_copy_cut_anywhere_is_truncated_before_any_section_is_read(tmp_path):
    _, path = _write(tmp_path)
    blob = path.read_bytes()
    header_end = blob.index(b"\n}") + 2
    for cut in (0, 5, len(artifact.MAGIC) + 3, header_end - 10, header_end + 10, len(blob) - 1):
        path.write_bytes(blob[:cut])
        header, problem = artifact.read_header(path)
        assert header is None and problem.startswith("truncated: "), (cut, problem)
        with pytest.raises(artifact.ArtifactError, match="^truncated: "):
            artifact.read_sections(path)
    path.write_bytes(blob[:-1])
    assert artifact.read_header(path)[1] == f"truncated: {len(blob) - 1:,} of {len(blob):,} bytes"


def test_a_foreign_or_corrupted_file_is_one_problem_each(tmp_path):
    _, path = _write(tmp_path)
    blob = path.read_bytes()
    path.write_bytes(b"PK\x03\x04" + blob[4:])  # a zip, or anything else
    assert artifact.read_header(path) == (None, "not a dflash compile cache artifact")
    path.write_bytes(blob + b"\0")
    assert artifact.read_header(path)[1] == f"1 bytes more than its sections hold ({len(blob):,})"
    path.write_bytes(blob.replace(b'"format": 1', b'"format": 7'))
    assert artifact.read_header(path)[1] == "format 7, this dflash reads format 1"
    path.write_bytes(blob[:-1] + b"\x03")  # one byte of the last section changed: the header still reads
    assert artifact.read_header(path)[1] is None
    with pytest.raises(artifact.ArtifactError, match="^section 'triton' does not match its sha256"):
        artifact.read_sections(path)


def test_differences_name_each_field_and_the_shape_classes():
    run = {"target": {"model_type": "qwen3", "dtype": "bfloat16"}, "drafter": {"block_size": 32},
           "shape_classes": [["rows >= 2", 8, 63], ["one row", 1, 48]]}
    made = {**MACHINE, **json.loads(json.dumps(run))}
    assert artifact.differences(made, {**MACHINE, **run}) == []
    now = {**MACHINE, "torch": "2.11.0+cu130", "compute_capability": "12.0",
           "target": {"model_type": "qwen3", "dtype": "float32"}, "drafter": {"block_size": 16},
           "shape_classes": [["rows >= 2", 8, 70], ["one row", 1, 48]]}
    assert artifact.differences(made, now) == [
        "torch 2.10.0+cu128 -> 2.11.0+cu130", "compute_capability 9.0 -> 12.0", "target dtype bfloat16 -> float32",
        "drafter block_size 32 -> 16", "shape classes rows >= 2 8 x 63; one row 1 x 48 -> rows >= 2 8 x 70; one row 1 x 48"]


def test_an_artifact_of_the_fp8_target_does_not_match_a_bf16_run(tmp_path):
    """target.precision changes every target graph: the manifest records it and a run in the other one is told."""
    cfg, _ = tiny_config(tmp_path)
    fp8 = cfg.model_copy(update={"target": cfg.target.model_copy(update={"precision": "fp8"})})
    made = {**MACHINE, **artifact.run_facts(fp8, {}, [])}
    assert artifact.differences(made, {**MACHINE, **artifact.run_facts(cfg, {}, [])}) == ["target precision fp8 -> bf16"]
    del made["target"]["precision"]  # made before the manifest recorded it: fp8 or not, nobody can tell
    assert artifact.differences(made, {**MACHINE, **artifact.run_facts(cfg, {}, [])}) == [
        "target precision not recorded (an older dflash made it) -> bf16"]


def test_the_default_place_is_beside_the_profiles_cache_dir_and_a_carried_file_wins(tmp_path):
    cfg, _ = tiny_config(tmp_path)
    path = artifact.artifact_path(cfg, tmp_path / "inductor" / "train-cu128")
    assert path == tmp_path / "inductor" / "train-cu128.artifacts" / f"{cfg.target_hash()[:8]}-{cfg.drafter_hash()[:8]}.dfcache"
    carried = cfg.model_copy(update={"train": cfg.train.model_copy(update={"compile_cache": str(tmp_path / "c.dfcache")})})
    assert artifact.resolve(carried, tmp_path / "x").train.compile_cache == str(tmp_path / "c.dfcache")
    assert artifact.resolve(cfg, tmp_path / "inductor" / "train-cu128").train.compile_cache == str(path)


# ---------------------------------------------------------------- loading: one line, never a crash


@pytest.fixture
def run_cfg(tmp_path):
    """The tiny preset, compiled, its artifact at tmp_path/a.dfcache; (cfg, the lengths it trains on, this machine
    and run's facts)."""
    from dflash.data.plan import schedule

    cfg, _ = tiny_config(tmp_path, compile=True)
    cfg = cfg.model_copy(update={"train": cfg.train.model_copy(update={"compile_cache": str(tmp_path / "a.dfcache")})})
    lengths = schedule(cfg, 1)[0].lengths
    return cfg, lengths, {**compile_cache.machine_facts(cfg), **compile_cache.run_facts(cfg, lengths)}


@pytest.fixture
def torch_load(monkeypatch):
    """What reaches torch.compiler.load_cache_artifacts."""
    calls = []
    monkeypatch.setattr(torch.compiler, "load_cache_artifacts", lambda data: calls.append(data) or "cache info")
    return calls


def _load(cfg, lengths) -> tuple[bool, list[str]]:
    lines = []
    return compile_cache.load(cfg, lengths, log=lines.append), lines


def test_a_matching_artifact_is_loaded_with_its_triton_files_in_one_line(tmp_path, run_cfg, torch_load, monkeypatch):
    cfg, lengths, now = run_cfg
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "triton"))
    (tmp_path / "made" / "ab12").mkdir(parents=True)
    (tmp_path / "made" / "ab12" / "kernel.json").write_text("{}")
    (tmp_path / "made" / "ab12" / "kernel.cubin").write_bytes(b"\x7fELF")
    tar, files = compile_cache.pack_triton(tmp_path / "made")
    assert files == 2 and compile_cache.pack_triton(tmp_path / "nothing") == (None, 0)  # a CPU run: no section
    artifact.write(cfg.train.compile_cache, {**now, "cold": {"seconds": 120.4}, "warm": {"seconds": 45.2}},
                   {"torch": b"torch bytes", "triton": tar})
    loaded, lines = _load(cfg, lengths)
    assert loaded and torch_load == [b"torch bytes"] and len(lines) == 1
    assert lines[0].startswith(f"compile cache: loaded {cfg.train.compile_cache} (") and \
        lines[0].endswith(", 2 Triton cache file(s) written) for rows >= 2 8 x 63, 7 x 45, 8 x 59; one row 1 x 48; "
                          "warm: about 45 s to step 1; cold about 120 s"), lines
    assert (tmp_path / "triton" / "ab12" / "kernel.cubin").read_bytes() == b"\x7fELF"


@pytest.mark.parametrize("change", ["torch", "gpu_name", "shape_classes", "drafter"])
def test_an_artifact_made_for_another_setup_is_never_handed_to_torch(tmp_path, run_cfg, torch_load, change):
    cfg, lengths, now = run_cfg
    other = {"torch": "2.11.0+cu130", "gpu_name": "NVIDIA B200", "shape_classes": [["rows >= 2", 8, 512]],
             "drafter": {**now["drafter"], "block_size": 16}}[change]
    artifact.write(cfg.train.compile_cache, {**now, change: other}, {"torch": b"torch bytes"})
    loaded, lines = _load(cfg, lengths)
    assert not loaded and torch_load == [] and len(lines) == 1, lines
    assert lines[0].startswith(f"compile cache: {cfg.train.compile_cache} not loaded: made for another setup (")
    assert lines[0].endswith("); cold start (make one here: dflash-train --config <this config> --warm-cache)")


def test_a_truncated_corrupted_foreign_or_missing_artifact_is_one_line_and_a_cold_start(tmp_path, run_cfg, torch_load):
    cfg, lengths, now = run_cfg
    path = artifact.write(cfg.train.compile_cache, now, {"torch": b"\x01" * 4000})
    blob = path.read_bytes()
    for bad, why in ((blob[:-100], "truncated: "), (blob[:-1] + b"\x02", "section 'torch' does not match its sha256"),
                     (b"\x89PNG\r\n" + blob[6:], "not a dflash compile cache artifact")):
        path.write_bytes(bad)
        loaded, lines = _load(cfg, lengths)
        assert not loaded and torch_load == [] and len(lines) == 1, lines
        assert why in lines[0] and lines[0].endswith("cold start (make one: dflash-train --config <this config> "
                                                     "--warm-cache)"), lines
    path.unlink()
    assert _load(cfg, lengths)[1] == [f"compile cache: {path}: no such file; cold start (make one: dflash-train "
                                      "--config <this config> --warm-cache)"]
    assert compile_cache.load(cfg.model_copy(update={"train": cfg.train.model_copy(update={"compile_cache": ""})}),
                              lengths, log=pytest.fail) is None  # no profile resolved it: nothing to say


def test_bytes_torch_refuses_are_one_line_not_a_crash(tmp_path, run_cfg):
    cfg, lengths, now = run_cfg
    artifact.write(cfg.train.compile_cache, now, {"torch": b"not a pickle of torch's cache artifacts"})
    loaded, lines = _load(cfg, lengths)
    assert not loaded and lines == [f"compile cache: {cfg.train.compile_cache} not loaded: torch refused it (ValueError: "
                                    "its cache artifacts do not read back (torch.compiler.load_cache_artifacts returned "
                                    "None)); cold start"]


def test_a_triton_tar_cannot_write_outside_triton_cache_dir_nor_over_a_file(tmp_path):
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for name, data in (("../escape", b"x"), ("/abs", b"y"), ("ok/kernel", b"new"), ("kept", b"new")):
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
        link = tarfile.TarInfo("link")
        link.type, link.linkname = tarfile.SYMTYPE, "/etc/passwd"
        tar.addfile(link)
    (tmp_path / "cache").mkdir()
    (tmp_path / "cache" / "kept").write_bytes(b"old")
    assert compile_cache.unpack_triton(buf.getvalue(), tmp_path / "cache") == 1
    assert sorted(p.relative_to(tmp_path).as_posix() for p in tmp_path.rglob("*") if p.is_file()) == \
        ["cache/kept", "cache/ok/kernel"]
    assert (tmp_path / "cache" / "kept").read_bytes() == b"old"


def test_a_compiled_run_looks_for_its_artifact_before_its_first_compile(tmp_path, monkeypatch):
    """Trainer.run asks compile_cache.load before the warm-up (here: a truncated artifact, compilation itself stubbed
    off to keep this fast): its one line comes before the first step's, and the run goes on."""
    from dflash.train.trainer import Trainer

    cfg, _ = tiny_config(tmp_path, max_steps=1)
    path = tmp_path / "a.dfcache"
    path.write_bytes(artifact.MAGIC[:7])
    cfg = cfg.model_copy(update={"train": cfg.train.model_copy(update={"compile_cache": str(path)})})
    monkeypatch.setattr(compile_cache, "compiles", lambda cfg: True)
    lines: list[str] = []
    (tmp_path / "run").mkdir()
    assert Trainer.colocated(cfg, None, log=lines.append).run(progress=False) == 0
    said = [i for i, line in enumerate(lines) if line.startswith("compile cache:")]
    first = next(i for i, line in enumerate(lines) if line.startswith("first step:"))
    assert len(said) == 1 and said[0] < first, lines
    assert lines[said[0]] == (f"compile cache: {path}: truncated: 7 bytes; cold start (make one: dflash-train "
                              "--config <this config> --warm-cache)")


def test_a_run_from_an_artifact_primes_only_the_batches_its_warm_up_needed(tmp_path):
    """The artifact's warm-up recorded the graphs after each batch; a run that loaded it runs the warm batches up to
    the last that built a graph and says how many it left out. Without a record: every batch."""
    from dflash.train.trainer import Trainer
    from dflash.train.warmup import prime

    assert needed_batches([7, 7, 7]) == 1 and needed_batches([4, 4, 4, 6]) == 4 and needed_batches([2, 5, 5]) == 2
    assert needed_batches(None) is None and needed_batches([]) is None and needed_batches(["7"]) is None
    assert needed_batches(5) is None and needed_batches({"a": 1}) is None and needed_batches([True]) is None
    cfg, _ = tiny_config(tmp_path, max_steps=1)
    lines: list[str] = []
    trainer = Trainer.colocated(cfg, None, log=lines.append)
    prime(trainer, {"cold": {"graphs_after": [3, 3, 3, 3]}})
    assert "batches of" in lines[-1] and lines[-1].endswith(
        "; 3 more the artifact's warm-up showed build nothing were not run"), lines[-1]
    assert lines[-1].startswith("compile: 1 shape class(es) (rows >= 2) in 1 batches of "), lines[-1]
    for manifest in (None, {"cold": ["x"]}, {"cold": {"graphs_after": 5}}):  # no record, or a corrupt one: all
        prime(trainer, manifest)
        assert lines[-1].startswith("compile: 2 shape class(es) (rows >= 2, one row) in 4 batches of ") and \
            "were not run" not in lines[-1], lines[-1]


# ---------------------------------------------------------------- the round trip on the CPU, inductor compiling


@pytest.mark.e2e
def test_warm_cache_round_trip_on_cpu(tmp_path):
    """`dflash-train --warm-cache` with empty inductor and Triton caches (DFLASH_CPU_COMPILE=1: the drafter's pieces
    compile with inductor on the CPU): it compiles every graph from scratch, writes the artifact (no Triton section:
    nothing ran through Triton) and times a fresh process with empty caches that loads it: there, every graph comes
    from the artifact, none is compiled from scratch, and the warm-up's losses are this process's. That process is
    `dflash-train --check-artifact`: the artifact loaded by the function a run's Trainer.run calls before its warm-up
    (test_a_compiled_run_looks_for_its_artifact_before_its_first_compile), then the run's own warm-up."""
    _, raw = tiny_config(tmp_path, compile=True)
    raw["train"]["compile_cache"] = str(tmp_path / "tiny.dfcache")
    config = write_toml(raw, tmp_path / "run.toml")

    env = dict(os.environ, DFLASH_CPU_COMPILE="1", TORCHINDUCTOR_CACHE_DIR=str(tmp_path / "inductor"),
               TRITON_CACHE_DIR=str(tmp_path / "triton"))
    made = subprocess.run([sys.executable, "-m", "dflash.commands.train", "--config", str(config), "--warm-cache"],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    assert made.returncode == 0, made.stdout + made.stderr
    header, problem = artifact.read_header(tmp_path / "tiny.dfcache")
    assert problem is None and [s["name"] for s in header["sections"]] == ["torch"]
    m = header["manifest"]
    cold, warm = m["cold"], m["warm"]
    assert m["gpu_name"] == "cpu" and m["torch"] == torch.__version__ and m["triton_files"] == 0
    assert [c[0] for c in m["shape_classes"]] == ["rows >= 2", "rows >= 2", "rows >= 2", "one row"]
    assert cold["fx_graph_misses"] >= 4 and cold["fx_graph_hits"] == 0, cold
    assert warm["loaded"] and warm["fx_graph_misses"] == 0 and warm["fx_graph_hits"] == cold["fx_graph_misses"], warm
    assert warm["losses"] == cold["losses"] and len(cold["losses"]) == 4 and m["same_losses"] is True
    # graphs after each warm batch: a run from the artifact primes up to the last batch that built one
    assert len(cold["graphs_after"]) == 4 and cold["graphs_after"] == sorted(cold["graphs_after"])
    assert warm["batches_needed"] == needed_batches(cold["graphs_after"])
    assert warm["seconds"] <= warm["seconds_all_batches"]
    lines = made.stdout.splitlines()
    assert any(line.startswith(f"warm-cache: wrote {tmp_path / 'tiny.dfcache'} (") for line in lines), lines
    assert f"warm-cache: a fresh process with empty caches took {warm['fx_graph_hits']} graph(s) from it and compiled " \
           "0 from scratch; its losses equal this process's" in lines


def test_the_loss_comparison_says_how_far_apart_two_processes_are():
    """Equal, apart by a relative amount (kernels reducing in another order), or not comparable."""
    from dflash.train.compile_cache import loss_gap, losses_text

    assert loss_gap([2.0, 4.0], [2.0, 4.0]) == 0.0 and loss_gap([2.0, 4.0], [2.0, 4.002]) == pytest.approx(5e-4, rel=1e-3)
    assert loss_gap([1.0], None) is None and loss_gap([1.0], [1.0, 2.0]) is None
    assert loss_gap([float("nan")], [1.0]) is None and loss_gap([0.0], [1e-6]) == pytest.approx(1.0)
    assert losses_text({"same_losses": True}) == "equal this process's"
    assert losses_text({"same_losses": False, "losses_max_rel_diff": 5e-4}) == \
        "differ from this process's by at most 5.0e-04 (relative)"
    assert losses_text({"same_losses": False, "losses_max_rel_diff": None}) == "are not comparable with this process's"


def _agreeing_rank(rank: int, port: int, out: str) -> None:
    """One of two gloo ranks: the warm batches each says it needs, and what they agree on."""
    import types

    import torch.distributed as dist

    from dflash.train.trainer import Trainer

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        me = types.SimpleNamespace(group=dist.group.WORLD, device=torch.device("cpu"))
        asked = [(1, 4), (2, 2), (3, None)]  # (rank 0's, rank 1's): None, a rank whose artifact did not load
        got = [Trainer.agreed_batches(me, pair[rank]) for pair in asked]
        Path(out, f"rank{rank}.json").write_text(json.dumps(got))
    finally:
        dist.destroy_process_group()


def test_the_ranks_of_a_sharded_drafter_prime_the_same_batches(tmp_path):
    """A sharded drafter's warm-up is collective: the ranks run the most batches any needs, all of them where a rank
    loaded no artifact, so none waits on a collective the others never call."""
    import torch.multiprocessing as mp

    from trainkit import free_port

    mp.spawn(_agreeing_rank, args=(free_port(), str(tmp_path)), nprocs=2, join=True)
    for rank in (0, 1):
        assert json.loads((tmp_path / f"rank{rank}.json").read_text()) == [4, 2, None]
