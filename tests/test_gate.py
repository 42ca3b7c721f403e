"""preflight.gate: the gate every entry point runs, and the profile facts the trainer may ask for."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess

import pytest

from dflash.config import config_from_dict
from dflash.runs.rundir import PREFLIGHT_NAME
from preflight import gate
from preflight.profiles import ENVS_DIR, ProfileError, load_profile


def test_profile_facts_for_the_trainer(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    assert gate.profile_env("train-cu128") == load_profile("train-cu128").env
    assert gate.compile_cache_dir("train-cu128") == tmp_path / ".cache/dflash/inductor/train-cu128"
    assert (gate.repo_root() / "envs") == ENVS_DIR
    with pytest.raises(ProfileError, match="unknown profile 'nope'"):
        gate.compile_cache_dir("nope")


def test_apply_profile_env_sets_only_what_is_unset(monkeypatch):
    monkeypatch.setattr(gate, "profile_env", lambda name: {"DFLASH_T_A": "1", "DFLASH_T_B": "2"})
    monkeypatch.delenv("DFLASH_T_A", raising=False)
    monkeypatch.setenv("DFLASH_T_B", "user-choice")
    said = []
    assert gate.apply_profile_env("train-cu128", said.append) == {"DFLASH_T_A": "1"}
    assert os.environ["DFLASH_T_A"] == "1" and said == ["profile train-cu128: set DFLASH_T_A=1"]
    assert os.environ["DFLASH_T_B"] == "user-choice"  # left alone: the env-vars check reports it
    monkeypatch.undo()
    assert gate.apply_profile_env("nope", said.append) == {}  # the profile check reports an unknown profile


def test_provenance_names_the_lock_and_the_commit():
    prov = gate.provenance("train-cu128")
    assert prov["lock_sha256"] == hashlib.sha256((ENVS_DIR / "train-cu128.lock").read_bytes()).hexdigest()
    if shutil.which("git") and (gate.repo_root() / ".git").exists():
        head = subprocess.run(["git", "-C", str(gate.repo_root()), "rev-parse", "HEAD"], capture_output=True,
                              text=True).stdout.strip()
        assert prov["git_commit"] == head
    assert gate.provenance("nope")["lock_sha256"] is None


def test_run_gate_refuses_with_one_line_per_failure_then_passes_when_waived(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    cfg = config_from_dict({"output_dir": str(tmp_path / "run"), "device": "cpu",
                            "data": {"path": str(tmp_path / "no-data")}})
    refused = gate.run_gate(cfg, {}, None)
    failed = [c.id for c in refused.report.with_status("fail")]
    assert not refused.ok and "dataset" in failed
    assert [n.split(":")[0] for n in refused.notes] == ["preflight"] * len(failed)
    assert any(n.startswith("preflight: FAIL dataset: data.path ") and "  fix: " in n for n in refused.notes)
    assert refused.verdict.startswith(f"refusing to start: {len(failed)} preflight check(s) failed")
    waived = gate.run_gate(cfg, {i: "test: accepted" for i in failed}, "fresh")
    assert waived.ok and waived.verdict == f"preflight: ok ({len(waived.report.checks)} checks, {len(failed)} waived)"
    assert any(n.startswith("preflight: waived dataset: ") for n in waived.notes)
    saved = json.loads((tmp_path / "run" / PREFLIGHT_NAME).read_text())
    assert saved["ok"] is True and saved["profile"] == "train-cu128"
    with pytest.raises(gate.WaiverError, match="--waive disk-space: unknown check id") as e:
        gate.run_gate(cfg, {"disk-space": "x"}, None)
    assert e.value.exit_code == 2
