"""dflash-lock check: each way a committed lock can be wrong fails with one line naming it."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from preflight.lockfile import check_all, diff_locks, judge_lock, parse_lock
from preflight.profiles import ENVS_DIR, REPO_ROOT, load_profile

H = "--hash=sha256:" + "ab" * 32
CU128_LOCK = f"""# fixture
torch==2.10.0 ; sys_platform == 'linux' \\
    {H}
triton==3.6.0 \\
    {H}
nvidia-cuda-runtime-cu12==12.8.90 \\
    {H}
nvidia-cublas-cu12==12.8.4.1 \\
    {H}
nvidia-ml-py==13.615.71 \\
    {H}
numpy==2.4.6 ; python_full_version < '3.12' \\
    {H}
numpy==2.5.5 ; python_full_version >= '3.12' \\
    {H}
"""
CU130_LOCK = CU128_LOCK.replace("nvidia-cuda-runtime-cu12==12.8.90", "nvidia-cuda-runtime==13.0.96").replace(
    "nvidia-cublas-cu12==12.8.4.1", "nvidia-cublas==13.1.1.3")


def manifest(name="train-cu128", torch="2.10.0", cuda="12.8"):
    return (f'name = "{name}"\ngroup = "{name}"\nrole = "train"\ntorch = "{torch}"\ncuda = "{cuda}"\n'
            f'driver_min = "570.26"\ncompile_cache = "~/.cache/x"\n')


def envs(tmp_path: Path, lock: str, man: str | None = None) -> Path:
    d = tmp_path / "envs"
    d.mkdir()
    (d / "train-cu128.toml").write_text(man or manifest())
    (d / "train-cu128.lock").write_text(lock)
    return d


def kinds(problems):
    return sorted({p.kind for p in problems})


def test_good_fixture_passes(tmp_path):
    assert check_all(envs(tmp_path, CU128_LOCK), fresh=False) == []


def test_python_forked_pins_are_not_duplicates():
    lock = parse_lock(CU128_LOCK)
    assert lock.duplicates == []
    assert lock.version("numpy") in ("2.4.6", "2.5.5")


def test_hand_edited_version_differs_from_fresh_export(tmp_path):
    prof = load_profile("train-cu128", envs(tmp_path, CU128_LOCK))
    edited = CU128_LOCK.replace("triton==3.6.0", "triton==3.5.1")
    problems = judge_lock(prof, edited, fresh=CU128_LOCK)
    assert kinds(problems) == ["stale"]
    assert "triton==3.5.1" in problems[0].message and "dflash-lock write" in problems[0].message


def test_lock_with_url_fails(tmp_path):
    lock = "--index-url https://example.invalid/simple\n" + CU128_LOCK
    problems = check_all(envs(tmp_path, lock), fresh=False)
    assert kinds(problems) == ["url"]
    assert "line 1" in problems[0].message


def test_cu128_manifest_with_cuda13_lock_fails(tmp_path):
    problems = check_all(envs(tmp_path, CU130_LOCK), fresh=False)
    assert kinds(problems) == ["cuda"]
    text = " ".join(p.message for p in problems)
    assert "nvidia-cublas==13.1.1.3 is a CUDA 13 wheel" in text
    assert "CUDA 13.0 runtime; profile is CUDA 12.8" in text


def test_cu12_wheel_in_cuda13_profile_fails(tmp_path):
    lock = CU130_LOCK + f"nvidia-nccl-cu12==2.27.5 \\\n    {H}\n"
    problems = check_all(envs(tmp_path, lock, manifest(torch="2.10.0", cuda="13.0")), fresh=False)
    assert [p.message for p in problems] == ["nvidia-nccl-cu12==2.27.5 is a CUDA 12 wheel; profile is CUDA 13.0"]


def test_duplicate_pin_fails(tmp_path):
    lock = CU128_LOCK + f"triton==3.6.0 \\\n    {H}\n"
    problems = check_all(envs(tmp_path, lock), fresh=False)
    assert kinds(problems) == ["duplicate"]
    assert "triton is pinned twice" in problems[0].message


def test_torch_differs_from_manifest(tmp_path):
    problems = check_all(envs(tmp_path, CU128_LOCK, manifest(torch="2.9.1")), fresh=False)
    assert [p.message for p in problems] == ["torch==2.10.0 locked; manifest says 2.9.1"]


def test_unhashed_pin_fails(tmp_path):
    problems = check_all(envs(tmp_path, CU128_LOCK + "packaging==25.0\n"), fresh=False)
    assert kinds(problems) == ["unhashed"]


def test_cli_exit_codes_and_json(tmp_path):
    bad = envs(tmp_path, CU128_LOCK + f"triton==3.6.0 \\\n    {H}\n")
    cmd = [sys.executable, "-m", "dflash.commands.lock", "check", "--no-export", "--envs-dir", str(bad)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    assert proc.returncode == 1
    assert proc.stdout.strip().splitlines() == ["train-cu128: duplicate: triton is pinned twice (lines 4 and 16)"]
    proc = subprocess.run(cmd + ["--json"], capture_output=True, text=True)
    doc = json.loads(proc.stdout)
    assert proc.returncode == 1 and doc["ok"] is False and doc["problems"][0]["kind"] == "duplicate"
    (bad / "train-cu128.lock").write_text(CU128_LOCK)
    proc = subprocess.run(cmd, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout


def test_cli_errors_are_one_line(tmp_path):
    env = dict(os.environ, UV=str(tmp_path / "no-uv"))
    proc = subprocess.run([sys.executable, "-m", "dflash.commands.lock", "write"], capture_output=True, text=True,
                          cwd=REPO_ROOT, env=env)
    assert proc.returncode == 1 and proc.stdout == ""
    assert proc.stderr.startswith("dflash-lock: error: cannot run uv (") and proc.stderr.count("\n") == 1
    proc = subprocess.run([sys.executable, "-m", "dflash.commands.lock", "diff", "train-cu128", "nope"],
                          capture_output=True, text=True, cwd=REPO_ROOT)
    assert proc.returncode == 2 and proc.stderr.startswith("dflash-lock: error: unknown profile 'nope'")


def test_diff_puts_torch_and_cuda_runtime_first():
    rows = diff_locks(parse_lock(CU128_LOCK), parse_lock(CU130_LOCK))
    assert [r[0] for r in rows[:3]] == ["nvidia-cuda-runtime", "nvidia-cuda-runtime-cu12", "nvidia-cublas"]
    rows = diff_locks(parse_lock(CU128_LOCK), parse_lock(CU128_LOCK.replace("torch==2.10.0", "torch==2.14.1")))
    assert rows == [("torch", "2.10.0", "2.14.1")]


def test_committed_locks_are_host_free_and_consistent():
    """The real envs/*.lock: no URL, torch as the manifest says, CUDA wheels of the right major."""
    problems = check_all(ENVS_DIR, fresh=False)
    assert problems == [], [p.message for p in problems]


@pytest.mark.skipif(not shutil.which("uv"), reason="uv not installed")
def test_committed_locks_equal_fresh_export():
    if not (REPO_ROOT / "uv.lock").exists():
        pytest.skip("no uv.lock (created by the first `uv run`)")
    problems = check_all(ENVS_DIR, fresh=True)
    assert problems == [], [p.message for p in problems]


def test_real_diff_command_shows_torch_first():
    proc = subprocess.run([sys.executable, "-m", "dflash.commands.lock", "diff", "train-cu128", "infer-cu130"],
                          capture_output=True, text=True, cwd=REPO_ROOT)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[1].split()[:3] == ["torch", "2.10.0", "2.14.1"]
    assert any(line.startswith("nvidia-cuda-runtime ") and "13.0.96" in line for line in lines[2:6])
