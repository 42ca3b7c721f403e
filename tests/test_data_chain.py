"""The users' own data, end to end, as the README's "Your data" runs it: regenerate -> import -> train -> eval.

Each stage is the real command in a child process, on the embedded SmolLM2 target, against conftest's `server`
(`transformers serve` of the same target on CPU): a few two-turn conversations get the served target's replies,
become shards with exact assistant masks, train a 1-layer drafter for 3 steps and are decoded speculatively.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pytest
from tokenizers import Tokenizer

from trainkit import metrics, run_config, train_cmd, write_toml

REPO = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent
ORIGINAL = "ORIGINAL REPLY"  # every assistant turn of the input; a regenerated one never says it
END_OF_TURN = "<|im_end|>"  # SmolLM2's (ChatML) end-of-turn marker: learned with each reply
MAX_TOKENS, SEED = 8, 0


def _conversations() -> list[dict]:
    """Three two-turn conversations: OpenAI messages (the first with a system message) and one ShareGPT row."""
    def questions(i):
        return [f"Tell me fact {i} about the moon.", f"Tell me fact {i + 1} about the moon."]

    system = [{"role": "system", "content": "You answer briefly."}]
    openai = [{"id": f"moon-{i}", "messages": (system if i == 0 else []) + [
        {"role": role, "content": text} for q in questions(i) for role, text in (("user", q), ("assistant", ORIGINAL))]}
        for i in range(2)]
    share = {"id": "moon-2", "conversations": [
        {"from": who, "value": text} for q in questions(2) for who, text in (("human", q), ("gpt", ORIGINAL))]}
    return [*openai, share]


def _command(tool: str, *args) -> subprocess.CompletedProcess:
    return subprocess.run([str(BIN / tool), *map(str, args)], cwd=REPO, capture_output=True, text=True, timeout=300)


def _learned_spans(input_ids: list[int], loss_mask: list[int]) -> list[list[int]]:
    """The runs of consecutive learned tokens of one row."""
    return [[t for t, _ in run] for learned, run in itertools.groupby(zip(input_ids, loss_mask), key=lambda p: p[1])
            if learned]


@pytest.mark.slow
def test_regenerate_import_train_eval(server, smollm2_path, tmp_path):
    conv = tmp_path / "conv.jsonl"
    conv.write_text("".join(json.dumps(r) + "\n" for r in _conversations()))

    # regenerate: every id once, every assistant turn the served target's own reply to the regenerated history
    regen = tmp_path / "regen.jsonl"
    p = _command("dflash-data", "regenerate", "--input", conv, "--server", server.url, "--out", regen, "--no-progress",
                 "--max-tokens", MAX_TOKENS, "--temperature", 0, "--seed", SEED)
    assert p.returncode == 0, p.stderr
    assert "regenerated 3 conversations" in p.stdout and "0 already done, 0 skipped" in p.stdout
    rows = {r["id"]: r["messages"] for r in map(json.loads, regen.read_text().splitlines())}
    assert sorted(rows) == ["moon-0", "moon-1", "moon-2"] and len(regen.read_text().splitlines()) == 3
    for messages in rows.values():
        replies = [m["content"] for m in messages if m["role"] == "assistant"]
        assert len(replies) == 2 and all(r.strip() and ORIGINAL not in r for r in replies), messages
    asked = rows["moon-0"]
    for turn in (2, 4):  # the reply to [system, user] and to [system, user, regenerated reply, user]
        answer = server.chat({"messages": asked[:turn], "max_tokens": MAX_TOKENS, "temperature": 0.0, "seed": SEED,
                              "stream": False})
        assert asked[turn]["content"] == answer["choices"][0]["message"]["content"], turn

    # import: the manifest names the regenerated file by sha256 and counts its rows; the masks are the replies
    data = tmp_path / "data"
    p = _command("dflash-data", "import", regen, "--target", smollm2_path, "--out", data, "--no-progress")
    assert p.returncode == 0, p.stderr
    manifest = json.loads((data / "manifest.json").read_text())
    sha = hashlib.sha256(regen.read_bytes()).hexdigest()
    assert manifest["settings"]["sources"] == [{"name": "regen.jsonl", "sha256": sha, "format": "messages"}]
    totals = manifest["import"]["totals"]
    assert (totals["rows"], totals["samples"], totals["turns"], totals["malformed"]) == (3, 3, 6, 0)
    [shard] = sorted(data.glob("shard-*.arrow"))
    table = pa.ipc.open_file(pa.memory_map(str(shard))).read_all().to_pylist()
    assert sorted(r["id"] for r in table) == sorted(rows)
    tokenizer = Tokenizer.from_file(str(smollm2_path / "tokenizer.json"))
    for row in table:
        spans = [tokenizer.decode(s, skip_special_tokens=False) for s in _learned_spans(row["input_ids"], row["loss_mask"])]
        assert spans == [m["content"] + END_OF_TURN for m in rows[row["id"]] if m["role"] == "assistant"], row["id"]

    # train: a 1-layer drafter on the imported shards, 3 steps, through the gate like any run
    cfg, raw = run_config(tmp_path, smollm2_path, data, drafter={"num_layers": 1, "block_size": 4, "mask_token_id": 0},
                          max_steps=3, save_every=3, max_anchors=8)
    out = subprocess.run(train_cmd(write_toml(raw, tmp_path / "run.toml"), "--fresh"), cwd=REPO, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert f"dataset {data}: 3 samples" in out.stdout
    run_dir = Path(cfg.output_dir)
    assert [r["step"] for r in metrics(run_dir)] == [1, 2, 3]
    assert (run_dir / "checkpoints" / "step_00000003").is_dir() and (run_dir / "drafter" / "config.json").is_file()

    # eval: the drafter against the same target on the regenerated conversations' first questions, lossless
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": m[-4]["content"]}) + "\n" for m in rows.values()))
    p = _command("dflash-eval", "--target", smollm2_path, "--drafter", run_dir, "--prompts", prompts,
                 "--max-new-tokens", 6, "--limit", 2)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    assert f"eval: drafter {run_dir / 'drafter'} (1 layers, trained block 4) on 2 prompts" in p.stdout
    assert "mean acceptance length" in p.stdout and "lossless: 12 tokens identical to target-only greedy" in p.stdout
