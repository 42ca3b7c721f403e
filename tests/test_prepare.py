"""dflash-data prepare/merge on a tiny random target: shards, resume without duplicates, bad input."""

from __future__ import annotations

import json

import numpy as np
import pytest
from click.testing import CliRunner

from dflash import prepare as prep
from dflash.cli import data_command
from dflash.data import ShardDataset
from dflash.prompts import HELD_OUT, is_held_out, load_prompts
from dflash.synthetic import word_text, word_tokenizer
from trainkit import chat_target

N_PROMPTS = 10


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    return chat_target(tmp_path_factory.mktemp("prep"), "qwen3", context=64)


@pytest.fixture
def prompt_file(tmp_path):
    path = tmp_path / "prompts.txt"
    path.write_text("\n".join(word_text(2 + i % 4, start=i) for i in range(N_PROMPTS)) + "\n")
    return path


def _prepare(target, prompts, out, *extra):
    args = ["prepare", "--target", str(target), "--prompts", str(prompts), "--out", str(out),
            "--max-new-tokens", "6", "--shard-size", "4", "--batch-size", "3", "--device", "cpu", *extra]
    return CliRunner().invoke(data_command, args)


def _rows(path):
    ds = ShardDataset(path)
    return [tuple(int(t) for t in ds.get(i)[0]) for i in range(ds.num_samples)], ds


def test_prepare_writes_prompt_plus_completion_shards(target, prompt_file, tmp_path):
    res = _prepare(target, prompt_file, tmp_path / "d")
    assert res.exit_code == 0, res.output
    rows, ds = _rows(tmp_path / "d")
    assert ds.num_samples == N_PROMPTS and len(ds.shards) == 3  # 4 + 4 + 2
    tok = word_tokenizer()
    for i, line in enumerate(prompt_file.read_text().splitlines()):
        ids, mask = ds.get(i)
        prompt = tok.apply_chat_template([{"role": "user", "content": line}], add_generation_prompt=True,
                                         tokenize=True, return_dict=True)["input_ids"]
        assert list(ids[: len(prompt)]) == list(prompt)  # samples keep prompt order
        assert not mask[: len(prompt)].any() and mask[len(prompt):].all()  # loss on the completion only
        assert 1 <= len(ids) - len(prompt) <= 6
    manifest = json.loads((tmp_path / "d" / prep.MANIFEST).read_text())
    assert [(e["start"], e["end"]) for e in manifest["shards"].values()] == [(0, 4), (4, 8), (8, 10)]


def test_interrupted_prepare_resumes_without_duplicates(target, prompt_file, tmp_path, monkeypatch):
    full = _prepare(target, prompt_file, tmp_path / "full")
    assert full.exit_code == 0, full.output
    expected, _ = _rows(tmp_path / "full")

    calls = {"n": 0}
    real = prep.TransformersEngine.generate

    def dies_in_second_shard(self, *a, **k):
        calls["n"] += 1
        if calls["n"] == 3:  # batches of 3: shard 0 = 2 calls, then the crash
            raise KeyboardInterrupt
        return real(self, *a, **k)

    monkeypatch.setattr(prep.TransformersEngine, "generate", dies_in_second_shard)
    first = _prepare(target, prompt_file, tmp_path / "d")
    assert first.exit_code != 0
    assert sorted(p.name for p in (tmp_path / "d").glob("*.arrow")) == ["shard-00000.arrow"]

    monkeypatch.setattr(prep.TransformersEngine, "generate", real)
    second = _prepare(target, prompt_file, tmp_path / "d")
    assert second.exit_code == 0, second.output
    assert "1 already done (resuming)" in second.output
    rows, ds = _rows(tmp_path / "d")
    assert rows == expected  # same samples, same order, none twice
    assert ds.num_samples == N_PROMPTS

    again = _prepare(target, prompt_file, tmp_path / "d")
    assert again.exit_code == 0 and "nothing to do" in again.output
    assert _rows(tmp_path / "d")[0] == expected


def test_resume_with_other_settings_is_refused(target, prompt_file, tmp_path):
    assert _prepare(target, prompt_file, tmp_path / "d", "--limit", "4").exit_code == 0
    res = _prepare(target, prompt_file, tmp_path / "d", "--limit", "4", "--max-new-tokens", "9")
    assert res.exit_code == 2
    assert "prepared with other settings (max_new_tokens 6 -> 9)" in res.output
    grown = _prepare(target, prompt_file, tmp_path / "d", "--limit", "8")  # a longer list extends it
    assert grown.exit_code == 0, grown.output
    assert ShardDataset(tmp_path / "d").num_samples == 8


def test_empty_prompt_file_is_a_clear_error(target, tmp_path):
    empty = tmp_path / "empty.txt"
    empty.write_text("\n  \n")
    res = _prepare(target, empty, tmp_path / "d")
    assert res.exit_code == 2
    assert res.output.strip() == (
        f"Error: {empty}: the prompt file holds no prompts (one per line, or JSONL with \"prompt\")"
    )
    assert not (tmp_path / "d").exists()


def test_prompt_longer_than_context_is_a_clear_error(target, tmp_path):
    long = tmp_path / "long.jsonl"
    long.write_text(json.dumps({"prompt": word_text(3)}) + "\n" + json.dumps({"prompt": word_text(80)}) + "\n")
    res = _prepare(target, long, tmp_path / "d")
    assert res.exit_code == 2
    assert "Error: prompt 1 is 82 tokens with the chat template, the target's context is 64" in res.output
    assert len(res.output.strip().splitlines()) == 1


def test_sglang_engine_outside_its_profile(target, prompt_file, tmp_path, monkeypatch):
    monkeypatch.setattr(prep.importlib.util, "find_spec", lambda name: None)
    res = _prepare(target, prompt_file, tmp_path / "d", "--engine", "sglang")
    assert res.exit_code == 2
    assert "--engine sglang needs the infer-cu130 profile" in res.output


def test_merge_keeps_inputs_and_refuses_to_overwrite(target, prompt_file, tmp_path):
    assert _prepare(target, prompt_file, tmp_path / "a", "--limit", "5").exit_code == 0
    assert _prepare(target, prompt_file, tmp_path / "b").exit_code == 0
    before = {p: p.read_bytes() for d in ("a", "b") for p in (tmp_path / d).iterdir()}
    res = CliRunner().invoke(data_command, ["merge", str(tmp_path / "a"), str(tmp_path / "b"),
                                         "--out", str(tmp_path / "c")])
    assert res.exit_code == 0, res.output
    a, _ = _rows(tmp_path / "a")
    b, _ = _rows(tmp_path / "b")
    assert _rows(tmp_path / "c")[0] == a + b
    assert {p: p.read_bytes() for p in before} == before

    res = CliRunner().invoke(data_command, ["merge", str(tmp_path / "a"), "--out", str(tmp_path / "c")])
    assert res.exit_code == 2 and "already exists; pick another --out or pass --overwrite" in res.output
    res = CliRunner().invoke(data_command, ["merge", str(tmp_path / "a"), "--out", str(tmp_path / "c"), "--overwrite"])
    assert res.exit_code == 0 and _rows(tmp_path / "c")[0] == a


def test_chitchat_split_is_by_conversation_and_deterministic():
    train, held = load_prompts("chitchat"), load_prompts(HELD_OUT)
    assert load_prompts(HELD_OUT, 50) == held[:50]  # same order every time
    assert 1000 < len(held) < 0.1 * len(train)
    # Texts may repeat across conversations ("hello how are you?"), but nearly all held-out ones are unseen.
    seen = set(train)
    assert np.mean([h in seen for h in held]) < 0.05
    share = np.mean([is_held_out(f"conv-{i}") for i in range(4000)])
    assert 0.03 < share < 0.08
