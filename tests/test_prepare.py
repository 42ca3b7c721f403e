"""dflash-data prepare/merge on a tiny random target: shards, resume without duplicates, bad input."""

from __future__ import annotations

import hashlib
import json
import shutil

import numpy as np
import pytest
from click.testing import CliRunner

from dflash.commands.data import data_command
from dflash.data import prepare as prep
from dflash.data.identity import target_fingerprint
from dflash.data.prompts import HELD_OUT, is_held_out, load_prompts
from dflash.data.shards import ShardDataset
from dflash.data.synthetic import word_text, word_tokenizer
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
    for name, rec in manifest["shards"].items():  # what preflight's dataset check compares
        data = (tmp_path / "d" / name).read_bytes()
        assert rec["bytes"] == len(data) and rec["sha256"] == hashlib.sha256(data).hexdigest()
    assert manifest["target"] == target_fingerprint(str(target))
    assert manifest["target"]["vocab_size"] == 64 and len(manifest["target"]["tokenizer_sha256"]) == 64


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
    assert "Error: prompt 1 is more than 64 tokens with the chat template, the target's context is 64" in res.output
    assert len(res.output.strip().splitlines()) == 1


def test_prompt_lines_end_at_newline_only(tmp_path):
    """U+2028, U+0085, a form feed or a lone CR inside a prompt never split it (str.splitlines() would); a CRLF
    line end is one line end, in .txt and .jsonl alike."""
    odd = "one\u2028two\u0085three\x0cfour\rfive"
    txt = tmp_path / "p.txt"
    txt.write_bytes(f"{odd}\r\nsecond\n".encode())
    assert load_prompts(str(txt)) == [odd, "second"]
    jsonl = tmp_path / "p.jsonl"
    rows = [json.dumps({"prompt": odd.replace("\r", " ")}, ensure_ascii=False), json.dumps(odd.replace("\r", " "),
                                                                                          ensure_ascii=False)]
    jsonl.write_bytes(("\r\n".join(rows) + "\r\n").encode())
    assert load_prompts(str(jsonl)) == [odd.replace("\r", " ")] * 2


RSS_PROBE = """
import resource, sys
from transformers import AutoTokenizer
from dflash.data.prompts import PromptError, load_prompts, prompts_within
tok = AutoTokenizer.from_pretrained(sys.argv[1])
prompts_within(tok, ["warm up the tokenizer"], 64)
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
try:
    prompts_within(tok, load_prompts(sys.argv[2]), 64)
except PromptError as e:
    print(e)
print((resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) // 1024)
"""


def test_a_huge_prompt_costs_what_a_context_length_prompt_costs(target, tmp_path):
    """A 20 MB one-line prompt against a 64-token context: cut before it is tokenized (peak RSS growth in MiB,
    reading the file included, measured in a fresh interpreter)."""
    import subprocess
    import sys

    huge = tmp_path / "huge.txt"
    huge.write_text("short prompt\n" + (word_text(8) + " ") * (20_000_000 // (len(word_text(8)) + 1)) + "\n")
    res = subprocess.run([sys.executable, "-c", RSS_PROBE, str(target), str(huge)], capture_output=True, text=True,
                         timeout=300)
    assert res.returncode == 0, res.stderr
    said, grew = res.stdout.strip().splitlines()
    assert said == "prompt 1 is more than 64 tokens with the chat template, the target's context is 64 " \
                   "(max_position_embeddings); shorten or drop it"
    assert int(grew) < 300, f"peak RSS grew {grew} MiB"


def test_sglang_engine_outside_its_profile(target, prompt_file, tmp_path, monkeypatch):
    monkeypatch.setattr(prep.importlib.util, "find_spec", lambda name: None)
    res = _prepare(target, prompt_file, tmp_path / "d", "--engine", "sglang")
    assert res.exit_code == 2
    assert "--engine sglang needs the infer-cu130 profile" in res.output


@pytest.fixture
def two_datasets(target, prompt_file, tmp_path):
    """a: the first 5 prompts; b: 6 other prompts (no sample in common)."""
    other = tmp_path / "other.txt"
    other.write_text("\n".join(word_text(3 + i % 3, start=40 + i) for i in range(6)) + "\n")
    assert _prepare(target, prompt_file, tmp_path / "a", "--limit", "5").exit_code == 0
    assert _prepare(target, other, tmp_path / "b").exit_code == 0
    return tmp_path / "a", tmp_path / "b"


def _snapshot(*folders):
    return {p: p.read_bytes() for d in folders for p in sorted(d.rglob("*")) if p.is_file()}


def _merge(*args):
    return CliRunner().invoke(data_command, ["merge", *map(str, args)])


def test_merge_keeps_inputs_and_moves_a_replaced_output_aside(two_datasets, tmp_path):
    a, b = two_datasets
    before = _snapshot(a, b)
    res = _merge(a, b, "--out", tmp_path / "c")
    assert res.exit_code == 0, res.output
    rows_a, rows_b = _rows(a)[0], _rows(b)[0]
    assert _rows(tmp_path / "c")[0] == rows_a + rows_b
    assert _snapshot(a, b) == before
    manifest = json.loads((tmp_path / "c" / prep.MANIFEST).read_text())
    assert manifest["target"] == json.loads((a / prep.MANIFEST).read_text())["target"]  # both inputs agree
    for name, rec in manifest["shards"].items():
        assert rec["sha256"] == hashlib.sha256((tmp_path / "c" / name).read_bytes()).hexdigest()

    res = _merge(a, "--out", tmp_path / "c")
    assert res.exit_code == 2 and "already exists; pick another --out or pass --overwrite" in res.output
    old = _snapshot(tmp_path / "c")
    res = _merge(a, "--out", tmp_path / "c", "--overwrite")
    assert res.exit_code == 0, res.output
    assert _rows(tmp_path / "c")[0] == rows_a
    aside = [p for p in tmp_path.iterdir() if p.name.startswith("c.replaced-")]
    assert len(aside) == 1 and f"the previous {tmp_path / 'c'} moved to {aside[0]} (nothing deleted)" in res.output
    assert {p.relative_to(aside[0]): v for p, v in _snapshot(aside[0]).items()} == \
        {p.relative_to(tmp_path / "c"): v for p, v in old.items()}
    assert _snapshot(a, b) == before


def test_merge_never_writes_into_an_input(two_datasets, tmp_path):
    a, b = two_datasets
    before = _snapshot(a, b)
    res = _merge(a, b, "--out", a / "sub")
    assert res.exit_code == 2
    assert f"merge: --out {a / 'sub'} is inside the input {a}, which merge never writes to" in res.output
    res = _merge(a, "--out", a, "--overwrite")
    assert res.exit_code == 2 and "is inside the input" in res.output
    res = _merge(a, "--out", tmp_path, "--overwrite")  # replacing --out would move the input aside
    assert res.exit_code == 2 and f"the input {a} is inside --out {tmp_path}" in res.output
    assert _snapshot(a, b) == before and not (a / "sub").exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith((".sub", "."))]  # no temp folder left


def test_merge_refuses_the_same_data_twice(two_datasets, tmp_path):
    a, b = two_datasets
    res = _merge(a, b, a, "--out", tmp_path / "c")
    assert res.exit_code == 2 and f"merge: {a} is given twice" in res.output
    copy = tmp_path / "a-copy"
    shutil.copytree(a, copy)
    res = _merge(a, copy, "--out", tmp_path / "c")  # same content under another name: the manifests' sha256
    assert res.exit_code == 2 and "merge: the same shard content twice" in res.output
    (copy / prep.MANIFEST).unlink()  # no manifest to say it: found while copying, nothing written
    res = _merge(b, copy, a, "--out", tmp_path / "c")
    assert res.exit_code == 2 and "the same shard content twice" in res.output
    assert f"{copy / 'shard-00000.arrow'}" in res.output and f"{a / 'shard-00000.arrow'}" in res.output
    assert not (tmp_path / "c").exists() and not list(tmp_path.glob(".c.*"))


def test_merge_refuses_inputs_built_for_different_targets(two_datasets, tmp_path):
    a, b = two_datasets
    manifest = json.loads((b / prep.MANIFEST).read_text())
    manifest["target"]["vocab_size"] = 248_320
    (b / prep.MANIFEST).write_text(json.dumps(manifest))
    res = _merge(a, b, "--out", tmp_path / "c")
    assert res.exit_code == 2
    assert f"merge: {b} was built for another target than {a} (vocab_size 64 -> 248320)" in res.output
    assert not (tmp_path / "c").exists()


def test_manifest_records_target_and_hashes_of_data_written_elsewhere(target, tmp_path):
    from dflash.data.shards import write_shard

    data = tmp_path / "elsewhere"
    write_shard(data / "x.arrow", [[1, 2, 3], [4, 5]], [[0, 1, 1], [1, 1]])
    res = CliRunner().invoke(data_command, ["manifest", str(data), "--target", str(target)])
    assert res.exit_code == 0, res.output
    manifest = json.loads((data / prep.MANIFEST).read_text())
    assert manifest["target"] == target_fingerprint(str(target))
    assert manifest["shards"]["x.arrow"]["sha256"] == hashlib.sha256((data / "x.arrow").read_bytes()).hexdigest()
    write_shard(data / "y.arrow", [[1, 200]], [[1, 1]])  # id 200 >= the target's vocabulary of 64
    res = CliRunner().invoke(data_command, ["manifest", str(data), "--target", str(target)])
    assert res.exit_code == 2
    assert "holds token ids 1..200, outside the vocabulary of" in res.output and "(64)" in res.output
    (data / "y.arrow").unlink()
    write_shard(data / "x.arrow", [[1, 2, 3], [4, 6]], [[0, 1, 1], [1, 1]])  # same size, other content
    res = CliRunner().invoke(data_command, ["manifest", str(data), "--target", str(target)])
    assert res.exit_code == 2 and "x.arrow differ(s) from the sha256 manifest.json recorded" in res.output


def test_chitchat_split_is_by_conversation_and_deterministic():
    train, held = load_prompts("chitchat"), load_prompts(HELD_OUT)
    assert load_prompts(HELD_OUT, 50) == held[:50]  # same order every time
    assert 1000 < len(held) < 0.1 * len(train)
    # Texts may repeat across conversations ("hello how are you?"), but nearly all held-out ones are unseen.
    seen = set(train)
    assert np.mean([h in seen for h in held]) < 0.05
    share = np.mean([is_held_out(f"conv-{i}") for i in range(4000)])
    assert 0.03 < share < 0.08


def test_a_fifo_or_a_device_as_prompts_is_refused_before_it_is_read(tmp_path):
    import os

    from dflash.data.prompts import PromptError

    fifo = tmp_path / "prompts.txt"
    os.mkfifo(fifo)  # reading it would block until a writer comes
    for path in (fifo, "/dev/zero"):
        with pytest.raises(PromptError, match="not a regular file"):
            load_prompts(str(path))
