"""Fact gathering: torch version without importing torch, dist-infos, PATH, libraries, git, checkpoints, shards."""

from __future__ import annotations

import base64
import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.ipc as ipc
import pytest

from dflash.config import config_from_dict
from dflash.data.identity import DatasetError
from preflight import pyenv
from preflight.facts.dataset import dataset, scan_shard
from preflight.facts.environment import parse_torch_version_py, record_verified, sync_record, torch_build, verify_records
from preflight.facts.gather import gather
from preflight.facts.paths import parse_ldconfig, path_entries, scan_lib_dir
from preflight.facts.run import run_dir, target_custom_code, target_shape
from preflight.facts.source import compile_cache, git_commit, model_source, model_source_record
from preflight.nvml import FakeGpuInfo
from preflight.profiles import REPO_ROOT

FIXTURE = Path(__file__).parent / "data" / "nvml_fake_8gpu.json"


def test_parse_torch_version_py():
    text = ("from typing import Optional\n__version__ = '2.11.0+cu130'\ndebug = False\n"
            "cuda: Optional[str] = '13.0'\nhip: Optional[str] = None\n")
    assert parse_torch_version_py(text) == ("2.11.0+cu130", "13.0")
    text = "__version__ = '2.10.0+cpu'\ncuda: Optional[str] = None\n"
    assert parse_torch_version_py(text) == ("2.10.0+cpu", None)
    assert parse_torch_version_py("nothing here") is None


def test_torch_build_reads_installed_version_module():
    tb = torch_build()
    assert tb is not None and tb.source.endswith("version.py")
    assert tb.version.startswith("2.10.0") and tb.cuda == "12.8"


def _dist_info(site: Path, name: str, version: str) -> None:
    d = site / f"{name.replace('-', '_')}-{version}.dist-info"
    d.mkdir(parents=True)
    (d / "METADATA").write_text(
        f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n\nLong: description\nName: not-this\n"
    )


def test_installed_distributions_finds_each_and_duplicates(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    _dist_info(a, "Flash-Attn", "2.8.3")
    _dist_info(a, "torch", "2.11.0+cu130")
    _dist_info(b, "torch", "2.10.0+cu128")
    got = pyenv.installed_distributions([str(a), str(b), str(tmp_path / "missing")])
    assert got == {"flash-attn": ["2.8.3"], "torch": ["2.11.0+cu130", "2.10.0+cu128"]}


def test_installed_distributions_matches_this_environment():
    got = pyenv.installed_distributions()
    assert "dflash" in got and "pydantic" in got and "torch" in got


def test_path_entries_mark_python_envs(tmp_path):
    me, other, plain = tmp_path / "me", tmp_path / "other", tmp_path / "plain"
    for root in (me, other):
        (root / "bin").mkdir(parents=True)
        (root / "pyvenv.cfg").write_text("home = x\n")
    plain.mkdir()
    conda = tmp_path / "conda"
    (conda / "bin").mkdir(parents=True)
    (conda / "conda-meta").mkdir()
    path = ":".join([str(other / "bin"), str(conda / "bin"), str(me / "bin"), str(plain), str(tmp_path / "gone")])
    entries = path_entries(path, str(me))
    assert [(e.exists, e.python_env is not None, e.is_self) for e in entries] == [
        (True, True, False), (True, True, False), (True, True, True), (True, False, False), (False, False, False)]


def _exe(path: Path, text: str = "#!/bin/sh\n") -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    path.chmod(0o755)
    return path


def test_path_entries_name_what_runs_from_another_env_and_cuda_toolkits(tmp_path):
    me, other = tmp_path / "me", tmp_path / "sglang-env"
    for root in (me, other):
        (root / "pyvenv.cfg").parent.mkdir(parents=True, exist_ok=True)
        (root / "pyvenv.cfg").write_text("home = x\n")
        _exe(root / "bin" / "python")
    _exe(other / "bin" / "ninja")
    _exe(other / "bin" / "sglang")
    (other / "bin" / "README").write_text("not executable")
    toolkit = tmp_path / "cuda-13.0"
    _exe(toolkit / "bin" / "nvcc")
    (toolkit / "version.json").write_text(json.dumps({"cuda": {"name": "CUDA SDK", "version": "13.0.2"}}))
    wrapper = _exe(tmp_path / "local" / "bin" / "nvcc", "#!/bin/sh\necho 'Cuda compilation tools, release 12.4, V12.4.131'\n")
    linked = tmp_path / "linked" / "bin"
    linked.mkdir(parents=True)
    (linked / "nvcc").symlink_to(toolkit / "bin" / "nvcc")
    path = ":".join(str(p) for p in (me / "bin", other / "bin", toolkit / "bin", wrapper.parent, linked))
    entries = path_entries(path, str(me))
    assert entries[0].is_self and entries[0].commands == []  # this env: nothing to report
    assert entries[1].python_env == str(other) and entries[1].commands == ["ninja", "sglang"]  # python is found earlier
    assert [e.cuda_toolkit for e in entries] == [None, None, "13.0.2", "12.4", "13.0.2"]


def test_parse_ldconfig_groups_cuda_libraries_by_folder():
    text = ("1234 libs found in cache `/etc/ld.so.cache'\n"
            "\tlibcudart.so.13 (libc6,x86-64) => /usr/local/cuda-13.0/lib/libcudart.so.13\n"
            "\tlibcudart.so (libc6,x86-64) => /usr/local/cuda-13.0/lib/libcudart.so\n"
            "\tlibnccl.so.2 (libc6,x86-64) => /usr/lib/x86_64-linux-gnu/libnccl.so.2\n"
            "\tlibcudart.so.12 (libc6) => /usr/lib32/libcudart.so.12\n"
            "\tlibz.so.1 (libc6,x86-64) => /lib/x86_64-linux-gnu/libz.so.1\n"
            "Cache generated by: ldconfig (GNU libc) stable release version 2.36\n")
    dirs = parse_ldconfig(text)
    assert [(d.path, d.libs) for d in dirs] == [
        ("/usr/lib/x86_64-linux-gnu", {"libnccl.so.2": None}),
        ("/usr/local/cuda-13.0/lib", {"libcudart.so": 13, "libcudart.so.13": 13})]


def test_scan_lib_dir_reads_cuda_major(tmp_path):
    d13 = tmp_path / "cuda-13.0" / "lib64"
    d13.mkdir(parents=True)
    for name in ("libcudart.so.13", "libcudart.so.13.0.96", "libnccl.so.2", "libfoo.so"):
        (d13 / name).write_text("")
    lib = scan_lib_dir(str(d13))
    assert lib.exists and lib.libs == {"libcudart.so.13": 13, "libcudart.so.13.0.96": 13, "libnccl.so.2": 13}
    nccl_only = tmp_path / "nccl-cu12"
    nccl_only.mkdir()
    (nccl_only / "libnccl.so.2").write_text("")
    assert scan_lib_dir(str(nccl_only)).libs == {"libnccl.so.2": 12}  # from the dir name
    assert not scan_lib_dir(str(tmp_path / "nope")).exists


@pytest.mark.skipif(shutil.which("git") is None, reason="git not installed")
def test_model_source_git_covers_every_module_of_the_package(tmp_path):
    git = ["git", "-C", str(tmp_path), "-c", "user.name=t", "-c", "user.email=t@example.com"]
    subprocess.run(["git", "init", "-q", str(tmp_path)], check=True)
    (tmp_path / "dflash").mkdir()
    (tmp_path / "dflash" / "model.py").write_text("x = 1\n")
    (tmp_path / "dflash" / "data.py").write_text("y = 1\n")
    (tmp_path / "dflash" / "notes.txt").write_text("not code\n")
    (tmp_path / "bench.py").write_text("outside the package\n")
    subprocess.run([*git, "add", "."], check=True)
    subprocess.run([*git, "commit", "-q", "-m", "init"], check=True)
    clean = model_source(tmp_path)
    assert clean.mode == "git" and not clean.modified
    assert clean.files == clean.verified == ["dflash/data.py", "dflash/model.py"]
    (tmp_path / "dflash" / "model.py").write_text("x = 1\nimport pdb; pdb.set_trace()\n")
    (tmp_path / "dflash" / "data.py").unlink()
    (tmp_path / "dflash" / "loss.py").write_text("hack = True\n")
    (tmp_path / "bench.py").write_text("edited, but not the package\n")
    src = model_source(tmp_path)
    assert src.states == {"dflash/model.py": "modified", "dflash/data.py": "deleted", "dflash/loss.py": "untracked"}
    assert src.files == ["dflash/data.py", "dflash/loss.py", "dflash/model.py"] and src.verified == []
    assert "2 files changed" in src.diff_stat and src.commit and len(src.commit) == 40


def test_model_source_of_this_checkout_covers_all_of_dflash():
    src = model_source()
    if src.mode != "git" or src.error:
        pytest.skip("not a git checkout")
    every = {p.relative_to(REPO_ROOT).as_posix() for p in (REPO_ROOT / "dflash").rglob("*.py")}
    assert set(src.files) >= {f for f in every if src.states.get(f) != "untracked"}
    assert "dflash/train/trainer.py" in src.files and "dflash/data/shards.py" in src.files


@pytest.mark.skipif(shutil.which("git") is None, reason="git not installed")
def test_git_commit_is_the_checkouts_head_and_none_elsewhere(tmp_path):
    git = ["git", "-C", str(tmp_path / "repo"), "-c", "user.name=t", "-c", "user.email=t@example.com"]
    subprocess.run(["git", "init", "-q", str(tmp_path / "repo")], check=True)
    assert git_commit(tmp_path / "repo") is None  # no commit yet
    subprocess.run([*git, "commit", "-q", "--allow-empty", "-m", "init"], check=True)
    head = subprocess.run([*git, "rev-parse", "HEAD"], capture_output=True, text=True, check=True).stdout.strip()
    assert git_commit(tmp_path / "repo") == head
    # a worktree's .git is a file, not a folder: still its own HEAD
    subprocess.run([*git, "worktree", "add", "-q", "--detach", str(tmp_path / "wt")], check=True)
    assert git_commit(tmp_path / "wt") == head
    (tmp_path / "repo" / "sub").mkdir()
    assert git_commit(tmp_path / "repo" / "sub") is None  # inside a checkout but not its top
    assert git_commit(tmp_path / "plain") is None


def _h(data: bytes) -> str:
    return "sha256=" + base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()


def fake_dist(site: Path, name: str, files: dict[str, bytes], version: str = "1.0") -> Path:
    """An installed distribution under `site` with a RECORD of sha256 hashes and sizes, as an installer writes it."""
    info = site / f"{name}-{version}.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
    rows = []
    for rel, data in files.items():
        (site / rel).parent.mkdir(parents=True, exist_ok=True)
        (site / rel).write_bytes(data)
        rows.append(f"{rel},{'' if rel.endswith('.pyc') else _h(data)},{'' if rel.endswith('.pyc') else len(data)}")
    rows.append(f"{info.name}/RECORD,,")
    (info / "RECORD").write_text("\n".join(rows) + "\n")
    return site


def test_model_source_record_verifies_every_module_of_the_package(tmp_path, monkeypatch):
    site = fake_dist(tmp_path / "site", "fakeproj", {"fakeproj/model.py": b"x = 1\n", "fakeproj/loss.py": b"y = 1\n",
                                                     "fakeproj/data.json": b"{}"})
    monkeypatch.syspath_prepend(str(site))
    ok = model_source_record("fakeproj", "fakeproj")
    assert ok.mode == "record" and ok.verified == ["fakeproj/model.py", "fakeproj/loss.py"] and not ok.modified
    assert ok.files == ok.verified and ok.commit == "fakeproj==1.0"
    (site / "fakeproj" / "loss.py").write_text("y = 2  # hack\n")
    assert model_source_record("fakeproj", "fakeproj").modified == ["fakeproj/loss.py"]


def test_sync_record_finds_another_build_of_a_locked_version_by_its_record_only(tmp_path):
    """dflash-env sync records each locked distribution's RECORD digest; a wheel of the same version installed over
    it afterwards rewrites files and RECORD together, which only that digest sees. Only RECORD files are read."""
    from preflight.envs import VERIFIED_FILE, write_verified
    from preflight.lockfile import Pin

    env = tmp_path / "env"
    site = env / "lib" / "python3.11" / "site-packages"
    fake_dist(site, "torch", {"torch/__init__.py": b"x = 1\n"}, "2.10.0+cu128")  # the lock pins torch==2.10.0
    fake_dist(site, "click", {"click/__init__.py": b"y = 1\n"}, "8.5.1")
    fake_dist(site, "rich", {"rich/__init__.py": b""}, "15.0.0")  # installed after the sync: not in its record
    none = sync_record(env)
    assert (none.present, none.compared, none.rebuilt) == (False, 0, []) and none.path == str(env / VERIFIED_FILE)
    write_verified(env, {"torch": Pin("torch", "2.10.0", 1, ["sha256:aa"]), "click": Pin("click", "8.5.1", 2, ["sha256:bb"])})
    clean = sync_record(env)
    assert (clean.present, clean.compared, clean.rebuilt) == (True, 2, [])
    shutil.rmtree(site / "torch-2.10.0+cu128.dist-info")
    (site / "torch" / "__init__.py").write_bytes(b"x = 2  # built elsewhere\n")  # not read: RECORD only
    fake_dist(site, "torch", {"torch/version.py": b"cuda = '13.0'\n"}, "2.10.0+cu130")  # another build: ==2.10.0 too
    shutil.rmtree(site / "click-8.5.1.dist-info")
    fake_dist(site, "click", {"click/__init__.py": b"y = 2\n"}, "8.6.0")  # another version: the lock judges it
    hit = sync_record(env)
    assert (hit.compared, hit.rebuilt) == (1, [{"name": "torch", "version": "2.10.0+cu130"}]) and hit.seconds > 0


def test_verify_records_catches_an_edited_file_inside_site_packages(tmp_path, monkeypatch):
    """The incident's class of change: a line appended to an installed package's Python file, version unchanged."""
    modeling = "faketransformers/models/qwen3/modeling_qwen3.py"
    site = fake_dist(tmp_path / "site", "faketransformers", {
        modeling: b"class Qwen3: pass\n", "faketransformers/__init__.py": b"",
        "faketransformers/__pycache__/x.cpython-311.pyc": b"cache", "faketransformers/lib/libkern.so.12": b"\x7fELF" * 8})
    fake_dist(site, "fakenorecord", {"fakenorecord/a.py": b""})
    (site / "fakenorecord-1.0.dist-info" / "RECORD").unlink()
    monkeypatch.syspath_prepend(str(site))
    clean = verify_records(["faketransformers", "fakenorecord"], workers=2, hashed_in=tmp_path / "hashed")
    a, b = sorted(clean.checks, key=lambda c: c.name)
    assert (b.name, b.hashed, b.sized, b.modified, b.missing, b.error) == ("faketransformers", 2, 1, [], [], None)
    assert a.error.startswith("no RECORD") and clean.seconds > 0
    with open(site / modeling, "a") as f:
        f.write("import pdb; pdb.set_trace()  # debugging hack\n")
    (site / "faketransformers" / "__pycache__" / "x.cpython-311.pyc").write_bytes(b"recompiled")  # never hashed
    (site / "faketransformers" / "__init__.py").unlink()
    (site / "faketransformers" / "lib" / "libkern.so.12").write_bytes(b"\x7fELF" * 9)  # another build: other size
    hit = verify_records(["faketransformers"], hashed_in=tmp_path / "hashed").checks[0]
    assert hit.modified == [modeling, "faketransformers/lib/libkern.so.12"]
    assert hit.missing == ["faketransformers/__init__.py"]


def test_the_gpu_stack_and_the_target_code_are_verified_and_nothing_else():
    assert all(record_verified(n) for n in ("torch", "triton", "nvidia-nccl-cu12", "transformers", "tokenizers",
                                                 "safetensors", "sglang", "flashinfer-python", "fla-core",
                                                 "causal-conv1d", "torchao"))
    assert not any(record_verified(n) for n in ("click", "pyarrow", "dflash", "rich"))


def _ckpt(root: Path, step: int, meta: dict | str | None) -> Path:
    d = root / "checkpoints" / f"step_{step:08d}"
    d.mkdir(parents=True)
    if meta is not None:
        (d / "meta.json").write_text(meta if isinstance(meta, str) else json.dumps(meta))
    (d / "drafter.safetensors").write_bytes(b"\0" * 1000)
    return d


def test_run_dir_lists_finished_checkpoints(tmp_path):
    run = tmp_path / "run"
    _ckpt(run, 500, {"step": 500})
    _ckpt(run, 690, {"step": 690, "config": {}})
    (run / "checkpoints" / "step_00000700.tmp").mkdir()  # unfinished save: ignored
    _ckpt(run, 800, None)  # no meta.json: not a finished checkpoint (the trainer ignores it too)
    rd = run_dir(str(run))
    assert rd.writable and [c.step for c in rd.checkpoints] == [500, 690]
    assert rd.newest.meta == {"step": 690, "config": {}} and rd.newest.size_bytes >= 1000
    _ckpt(run, 900, "{not json")
    rd = run_dir(str(run))
    assert rd.newest.step == 900 and rd.newest.meta is None and "meta.json unreadable" in rd.newest.error


def test_run_dir_flags_checkpoints_a_resume_would_refuse(tmp_path):
    """Preflight judges checkpoint folders by dflash.runs.rundir's rules, the ones `dflash-train --resume` applies."""
    from dflash.runs.rundir import CHECKPOINT_FILES, LEGACY_STATE, META_NAME

    run = tmp_path / "run"
    whole = _ckpt(run, 500, {"step": 500})
    for name in set(CHECKPOINT_FILES) - {META_NAME}:
        (whole / name).parent.mkdir(parents=True, exist_ok=True)
        (whole / name).write_bytes(b"")
    (_ckpt(run, 600, {"step": 600}) / LEGACY_STATE).write_bytes(b"pickle")
    rd = run_dir(str(run))
    assert [c.step for c in rd.checkpoints] == [500, 600]
    assert rd.checkpoints[0].error is None
    assert "older dflash version" in rd.newest.error and rd.newest.meta == {"step": 600}
    (run / "checkpoints" / "step_00000600" / LEGACY_STATE).unlink()
    assert "optimizer.pt" in run_dir(str(run)).newest.error


def _recorded_ckpt(run: Path, step: int) -> Path:
    """A checkpoint whose meta.json records its files' sizes and sha256, as save_checkpoint writes it."""
    from dflash.runs.rundir import CHECKPOINT_FILES, FILES_KEY, META_NAME
    from dflash.runs.verify import record_files

    d = _ckpt(run, step, None)
    (d / "drafter.safetensors").unlink()
    for name in set(CHECKPOINT_FILES) - {META_NAME}:
        (d / name).parent.mkdir(parents=True, exist_ok=True)
        (d / name).write_bytes(bytes(range(256)) * 64)
    (d / META_NAME).write_text(json.dumps({"step": step, FILES_KEY: record_files(d)}))
    return d


def test_run_dir_checks_recorded_sizes_and_with_verify_data_the_sha256(tmp_path):
    run = tmp_path / "run"
    _recorded_ckpt(run, 500)
    newest = _recorded_ckpt(run, 600)
    assert [c.error for c in run_dir(str(run)).checkpoints] == [None, None]
    data = bytearray((newest / "optimizer.pt").read_bytes())
    data[100:164] = bytes(b ^ 0xFF for b in data[100:164])  # 64 flipped bytes: same size
    (newest / "optimizer.pt").write_bytes(bytes(data))
    assert run_dir(str(run)).newest.error is None  # sizes only: preflight's quick look cannot see it
    deep = run_dir(str(run), deep=True)
    assert deep.deep and deep.newest.error == "optimizer.pt content differs from its sha256 in meta.json (damaged " \
                                               "since the save)"
    assert deep.checkpoints[0].error is None  # the one `--resume latest` takes
    (newest / "optimizer.pt").write_bytes(bytes(data[:1000]))
    assert run_dir(str(run)).newest.error == ("optimizer.pt is 1,000 bytes, meta.json recorded 16,384 "
                                                    "(truncated or rewritten since the save)")


def test_run_dir_not_writable_when_parent_is_a_file(tmp_path):
    (tmp_path / "file").write_text("")
    rd = run_dir(str(tmp_path / "file" / "run"))
    assert not rd.writable and "is not a directory" in rd.problem


def _shard(path: Path, lengths: list[int], mask_lengths: list[int] | None = None, columns=("input_ids", "loss_mask")):
    ids = pa.array([list(range(n)) for n in lengths], type=pa.list_(pa.int32()))
    mask = pa.array([[1] * n for n in (mask_lengths or lengths)], type=pa.list_(pa.int8()))
    table = pa.table(dict(zip(columns, [ids, mask])))
    with pa.OSFile(str(path), "wb") as sink, ipc.new_file(sink, table.schema) as w:
        w.write_table(table)


def _broken_shards(folder: Path) -> list[Path]:
    """One shard per way the reader refuses one: garbage, a missing column, a wrong type, a null row, compressed."""
    folder.mkdir()
    (folder / "garbage.arrow").write_bytes(b"ARROW1 truncated garbage")
    _shard(folder / "nomask.arrow", [10], columns=("input_ids", "labels"))
    tables = {"string.arrow": pa.table({"input_ids": ["1 2"], "loss_mask": pa.array([[1]])}),
              "null.arrow": pa.table({"input_ids": pa.array([[1, 2], None], type=pa.list_(pa.int32())),
                                      "loss_mask": pa.array([[1, 1], None], type=pa.list_(pa.int8()))}),
              "zstd.arrow": pa.table({"input_ids": pa.array([list(range(300))] * 2000, type=pa.list_(pa.int32())),
                                      "loss_mask": pa.array([[1] * 300] * 2000, type=pa.list_(pa.int8()))})}
    for name, table in tables.items():
        options = ipc.IpcWriteOptions(compression="zstd" if name == "zstd.arrow" else None)
        with pa.OSFile(str(folder / name), "wb") as sink, ipc.new_file(sink, table.schema, options=options) as w:
            w.write_table(table)
    return sorted(folder.iterdir())


def test_preflight_refuses_a_shard_exactly_when_and_as_the_trainer_does(tmp_path):
    """One reader (dflash.data.shards.open_shard) behind both: the trainer's error names the shard, the problem
    preflight reports and the fix."""
    from dflash.data.shards import ShardDataset

    for path in _broken_shards(tmp_path / "broken"):
        scanned = scan_shard(path, limit=1024, first_row=0)
        with pytest.raises(DatasetError) as refused:
            ShardDataset(path)
        assert scanned.error is not None, path.name
        assert str(refused.value).startswith(f"{path}: {scanned.error}; "), (path.name, scanned.error)


def _cfg(tmp_path: Path, **data):
    return config_from_dict({"output_dir": str(tmp_path / "run"), "data": {"path": str(tmp_path / "data"), **data}})


def test_dataset_counts_and_finds_samples_that_never_fit(tmp_path):
    (tmp_path / "data").mkdir()
    _shard(tmp_path / "data" / "shard-00000.arrow", [10, 20, 30])
    _shard(tmp_path / "data" / "shard-00001.arrow", [5, 70, 40, 90])
    ds = dataset(_cfg(tmp_path, token_budget=64))
    assert ds.error is None and ds.samples == 7 and ds.limit == 64
    s1 = ds.shards[1]
    assert (s1.first_row, s1.max_len, s1.max_row, s1.over_count, s1.over) == (3, 90, 3, 2, [(3, 90), (1, 70)])
    assert dataset(_cfg(tmp_path, token_budget=128, max_length=35)).limit == 35


def test_dataset_fingerprint_matches_the_trainer(tmp_path):
    from dflash.data.shards import ShardDataset

    (tmp_path / "data").mkdir()
    _shard(tmp_path / "data" / "a.arrow", [10, 20])
    _shard(tmp_path / "data" / "b.arrow", [30])
    assert dataset(_cfg(tmp_path)).fingerprint == ShardDataset(tmp_path / "data").fingerprint


def test_dataset_reads_values_manifest_target_and_with_verify_data_the_sha256(tmp_path):
    from dflash.data.identity import ValueStats, shard_records, target_fingerprint, write_manifest

    (tmp_path / "data").mkdir()
    _shard(tmp_path / "data" / "a.arrow", [10, 1, 3])  # ids 0..n-1, loss_mask all 1
    _shard(tmp_path / "data" / "b.arrow", [4])
    ds = dataset(_cfg(tmp_path))
    assert [s.values for s in ds.shards] == [ValueStats(0, 9, 1, 1, 9 + 0 + 2), ValueStats(0, 3, 1, 1, 3)]
    assert ds.manifest is None and ds.manifest_error is None and not ds.deep
    assert ds.target == target_fingerprint("smollm2") and ds.target["vocab_size"] == 49_152
    assert all(s.sha256 is None for s in ds.shards)  # hashed only when asked
    write_manifest(tmp_path / "data", {"target": ds.target, "shards": shard_records((tmp_path / "data").glob("*.arrow"))})
    deep = dataset(_cfg(tmp_path), deep=True)
    assert deep.deep and deep.manifest["shards"]["a.arrow"]["sha256"] == deep.shards[0].sha256
    (tmp_path / "data" / "manifest.json").write_text("{")
    assert dataset(_cfg(tmp_path)).manifest_error.startswith("manifest.json unreadable")
    bad_target = config_from_dict({"output_dir": str(tmp_path / "run"), "data": {"path": str(tmp_path / "data")},
                                   "target": {"path": str(tmp_path / "nowhere")}})
    assert "config.json: not found" in dataset(bad_target).target_error


def test_dataset_corrupt_shards_are_named(tmp_path):
    (tmp_path / "data").mkdir()
    _shard(tmp_path / "data" / "a.arrow", [10, 20])
    (tmp_path / "data" / "b.arrow").write_bytes(b"ARROW1 truncated garbage")
    _shard(tmp_path / "data" / "c.arrow", [10], columns=("input_ids", "labels"))
    _shard(tmp_path / "data" / "d.arrow", [10, 12], mask_lengths=[10, 11])
    shards = {s.name: s for s in dataset(_cfg(tmp_path)).shards}
    assert shards["a.arrow"].error is None
    assert shards["b.arrow"].error.startswith("not a readable Arrow IPC file")
    assert shards["c.arrow"].error == "missing column 'loss_mask' (has: input_ids, labels)"  # the trainer's own words
    assert shards["d.arrow"].mask_mismatch == (1, 12, 11)
    assert dataset(_cfg(tmp_path / "nowhere")).error.endswith("does not exist")


def test_compile_cache_without_a_config_looks_at_nothing_per_run(tmp_path, monkeypatch):
    from preflight.profiles import load_profile

    monkeypatch.setenv("HOME", str(tmp_path))
    cc = compile_cache(load_profile("train-cu128"), {"TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "elsewhere")})
    assert cc.path == str(tmp_path / ".cache/dflash/inductor/train-cu128") and cc.env_override and cc.run is None


def test_the_artifact_the_trainer_writes_is_read_by_preflight_with_the_same_shape_classes(tmp_path, monkeypatch):
    """The run's side of the match is computed by preflight from the dataset's lengths (no torch) and by the trainer
    from its own dataset: the same. A truncated copy and a foreign file are one problem each; so is a longer file."""
    from dflash.data.plan import schedule
    from dflash.runs import compile_artifact
    from dflash.train.compile_cache import run_facts
    from preflight.profiles import compile_cache_dir, load_profile
    from trainkit import tiny_config

    monkeypatch.setenv("HOME", str(tmp_path))
    cfg, _ = tiny_config(tmp_path, compile=True)
    cfg = cfg.model_copy(update={"device": "cuda"})
    trainer_side = run_facts(cfg, schedule(cfg, 1)[0].lengths)
    path = compile_artifact.artifact_path(cfg, compile_cache_dir("train-cu128"))
    assert path.parent == tmp_path / ".cache/dflash/inductor/train-cu128.artifacts" and path.suffix == ".dfcache"
    manifest = {"torch": "2.10.0+cu128", "triton": "3.6.0", "gpu_name": "NVIDIA H200", "compute_capability": "9.0",
                **trainer_side}
    compile_artifact.write(path, manifest, {"torch": b"\x01" * 1000})
    facts = dataset(cfg)
    cc = compile_cache(load_profile("train-cu128"), {}, cfg, facts)
    assert cc.exists and cc.error is None and cc.manifest == manifest and cc.size_bytes == path.stat().st_size
    assert cc.run == trainer_side and compile_artifact.differences(manifest, cc.run) == []
    assert [c[0] for c in cc.run["shape_classes"]] == ["rows >= 2", "rows >= 2", "rows >= 2", "one row"]
    blob = path.read_bytes()
    path.write_bytes(blob[:-10])
    cc = compile_cache(load_profile("train-cu128"), {}, cfg, facts)
    assert cc.manifest is None and cc.error == f"truncated: {len(blob) - 10:,} of {len(blob):,} bytes"
    path.write_bytes(blob + b"x")
    assert compile_cache(load_profile("train-cu128"), {}, cfg, facts).error == (
        f"1 bytes more than its sections hold ({len(blob):,})")
    path.write_bytes(b"PK\x03\x04 a zip file")
    assert compile_cache(load_profile("train-cu128"), {}, cfg, facts).error == "not a dflash compile cache artifact"
    (path.parent / "other.dfcache").write_bytes(b"")
    path.unlink()
    cc = compile_cache(load_profile("train-cu128"), {}, cfg, facts)
    assert not cc.exists and cc.others == 1


def test_gather_builds_a_full_context(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    (tmp_path / "data").mkdir()
    _shard(tmp_path / "data" / "a.arrow", [10, 20])
    env = {"PATH": str(tmp_path), "LD_LIBRARY_PATH": str(tmp_path), "CUDA_VISIBLE_DEVICES": "1,0"}
    ctx = gather("train-cu128", _cfg(tmp_path), "fresh", FakeGpuInfo.from_json(FIXTURE), environ=env)
    assert ctx.profile.name == "train-cu128" and ctx.torch.cuda == "12.8"
    assert ctx.gpus.snapshot and len(ctx.gpus.snapshot.gpus) == 8 and ctx.gpus.cuda_visible_devices == "1,0"
    assert ctx.dataset.samples == 2 and ctx.run_dir.checkpoints == [] and ctx.disk.free_bytes > 0
    assert ctx.host["gpus"] == 8 and ctx.host["nvidia_driver"] == "570.133.20"
    assert ctx.target_shape.num_layers == 30 and ctx.target_error is None  # smollm2, the default target
    nogpu = gather("train-cu128", None, None, FakeGpuInfo(None), environ=env)
    assert nogpu.gpus.snapshot is None and nogpu.gpus.error == "no NVIDIA driver (NVML not found)"
    assert nogpu.run_dir is None and nogpu.dataset is None


def test_target_shape_is_read_by_the_memory_model_reader(tmp_path, monkeypatch):
    from dflash.memory.shape import load_target_shape

    monkeypatch.chdir(tmp_path)  # relative paths resolve as dflash-estimate resolves them
    shape, error = target_shape(config_from_dict({"target": {"path": "configs/targets/qwen3-8b"}}))
    assert error is None and shape == load_target_shape("configs/targets/qwen3-8b")
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "config.json").write_text("{")
    shape, error = target_shape(config_from_dict({"target": {"path": str(tmp_path / "bad")}}))
    assert shape is None and "config.json: not valid JSON" in error and "\n" not in error


def custom_code_folder(root: Path, config: dict | None = None, tokenizer: dict | None = None) -> Path:
    """A target folder whose config.json names an architecture transformers does not ship, and the code for it."""
    folder = root / "evil"
    folder.mkdir()
    shape = {"num_hidden_layers": 4, "hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4,
             "vocab_size": 1000}
    config = {"model_type": "evil_lm", "auto_map": {"AutoConfig": "configuration_evil.EvilConfig",
                                                    "AutoModelForCausalLM": "modeling_evil.EvilForCausalLM"}, **(config or {})}
    (folder / "config.json").write_text(json.dumps({**shape, **config}))
    if tokenizer is not None:
        (folder / "tokenizer_config.json").write_text(json.dumps(tokenizer))
    for module in ("configuration_evil", "modeling_evil"):
        (folder / f"{module}.py").write_text("raise SystemExit('the folder ran its code')\n")
    return folder


@pytest.mark.parametrize("config, tokenizer, says", [
    ({}, None, "config.json model_type 'evil_lm' is not an architecture transformers "),
    ({"model_type": "llama", "auto_map": {}}, {"tokenizer_class": "EvilTokenizer",
                                              "auto_map": {"AutoTokenizer": ["tokenization_evil.EvilTokenizer", None]}},
     "tokenizer_config.json tokenizer_class 'EvilTokenizer' is not a tokenizer transformers "),
    ({"model_type": "llama", "auto_map": {}}, {"tokenizer_class": "PreTrainedTokenizerFast"}, None),
    ({"model_type": "qwen3", "auto_map": {}}, {"tokenizer_class": "Qwen2TokenizerFast"}, None),
])
def test_gather_records_a_target_that_needs_its_own_code_without_importing_torch(tmp_path, config, tokenizer, says):
    folder = custom_code_folder(tmp_path, config, tokenizer)
    problem = target_custom_code(config_from_dict({"target": {"path": str(folder)}}))
    if says is None:
        assert problem is None
        return
    assert problem.startswith(f"target {folder}: custom code is refused: {says}") and "\n" not in problem, problem
    assert problem.endswith("; use a model whose architecture transformers ships (a folder without its own code), or "
                            "upgrade transformers")
    assert ("(auto_map: configuration_evil.py, modeling_evil.py)" if not tokenizer else "(auto_map: tokenization_evil.py)") \
        in problem
    assert target_custom_code(config_from_dict({})) is None  # the embedded default has no folder
    code = ("import sys\nfrom dflash.config import config_from_dict\nfrom preflight.facts.run import target_custom_code\n"
            f"assert target_custom_code(config_from_dict({{'target': {{'path': {str(folder)!r}}}}}))\n"
            "print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=REPO_ROOT)
    assert out.returncode == 0 and out.stdout == "[]\n", out.stdout + out.stderr


def test_a_file_found_matching_and_unchanged_since_is_not_read_again(tmp_path, monkeypatch):
    """verify_records keeps what it found matching by inode, size, mtime and ctime: the next check reads only what
    changed, and an edit in place (even one that puts the size and mtime back) is read and caught."""
    from preflight.facts import environment

    site = fake_dist(tmp_path / "site", "faketorch", {"faketorch/a.py": b"x = 1\n", "faketorch/b.py": b"y = 2\n"})
    monkeypatch.syspath_prepend(str(site))
    read = []
    real = environment._verify_entry
    monkeypatch.setattr(environment, "_verify_entry", lambda e: read.append(e.rel) or real(e))
    kept = tmp_path / "cache"
    verify_records(["faketorch"], hashed_in=kept)  # files changed within RACY_NS (just written) are not kept ...
    read.clear()
    assert verify_records(["faketorch"], hashed_in=kept).checks[0].hashed == 2 and len(read) == 2  # ... so read again
    monkeypatch.setattr(environment, "RACY_NS", 0)  # older than that from here on
    read.clear()
    first = verify_records(["faketorch"], hashed_in=kept).checks[0]
    assert (first.hashed, first.modified, sorted(read)) == (2, [], ["faketorch/a.py", "faketorch/b.py"])
    assert len(list(kept.glob("*.json"))) == 1
    read.clear()
    again = verify_records(["faketorch"], hashed_in=kept).checks[0]
    assert (again.hashed, again.modified, read) == (2, [], [])  # nothing read: both unchanged
    target = site / "faketorch" / "a.py"
    st = target.stat()
    target.write_bytes(b"x = 9\n")  # the same size
    os.utime(target, ns=(st.st_atime_ns, st.st_mtime_ns))  # and the mtime put back: the ctime still moved
    edited = verify_records(["faketorch"], hashed_in=kept).checks[0]
    assert (edited.modified, read) == (["faketorch/a.py"], ["faketorch/a.py"])
    read.clear()
    assert verify_records(["faketorch"], hashed_in=kept).checks[0].modified == ["faketorch/a.py"]  # never kept
    assert read == ["faketorch/a.py"]
    next(kept.glob("*.json")).write_text("{broken")  # an unreadable cache: everything read again
    read.clear()
    assert verify_records(["faketorch"], hashed_in=kept).checks[0].hashed == 2 and len(read) == 2
    (tmp_path / "a-file").write_text("")  # a cache folder that cannot be made: checked as before, no error
    assert verify_records(["faketorch"], hashed_in=tmp_path / "a-file" / "records").checks[0].hashed == 2
