"""dflash.data.synthetic: reproducible random targets and synthetic datasets of the asked shape."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from dflash.data.shards import ShardDataset
from dflash.data.synthetic import (
    WORD_TOKENIZER_IDS,
    random_target,
    target_config,
    word_text,
    word_tokenizer,
    write_pattern_dataset,
    write_random_dataset,
    write_target,
)
from dflash.models.target import load_target


def test_same_seed_same_weights_other_seed_other_weights(tmp_path):
    config = target_config("llama", vocab_size=96, num_hidden_layers=2)
    a = load_file(str(write_target(tmp_path / "a", config, seed=3) / "model.safetensors"))
    b = load_file(str(write_target(tmp_path / "b", config, seed=3) / "model.safetensors"))
    c = random_target(config, seed=4).state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert not torch.equal(a["model.embed_tokens.weight"], c["model.embed_tokens.weight"])
    loaded = load_target(tmp_path / "a", "float32", "cpu")
    assert type(loaded).__name__ == "LlamaForCausalLM" and loaded.config.num_hidden_layers == 2


def test_config_only_target_builds_on_the_device(tmp_path):
    config = target_config(vocab_size=100, hidden_size=32, head_dim=8)
    path = write_target(tmp_path / "t", config, weights=False)
    assert json.loads((path / "config.json").read_text()) == config
    assert not (path / "model.safetensors").exists()
    model = load_target(path, "float32", "cpu", random_init=True)
    assert model.get_input_embeddings().weight.shape == (100, 32)


def test_word_tokenizer_target_and_text(tmp_path):
    tok = word_tokenizer()
    assert len(tok) == WORD_TOKENIZER_IDS["vocab_size"] and tok.pad_token_id == 0 and tok.eos_token_id == 1
    text = word_text(5, start=2)
    assert tok.decode(tok(text)["input_ids"]) == text
    with pytest.raises(ValueError, match="word-level tokenizer needs its ids"):
        write_target(tmp_path / "bad", target_config(), tokenizer=True)
    path = write_target(tmp_path / "chat", target_config(**WORD_TOKENIZER_IDS), tokenizer=True, weights=False)
    assert (path / "tokenizer.json").is_file()


def test_pattern_rows_follow_their_step(tmp_path):
    ds = ShardDataset(write_pattern_dataset(tmp_path / "d", samples=10, shards=3))
    assert len(ds) == 10 and len(ds.shards) == 3
    for i in range(len(ds)):
        ids, mask = ds.get(i)
        step = (int(ids[1]) - int(ids[0])) % 12
        assert step in (1, 2, 3, 5) and all((b - a) % 12 == step for a, b in zip(ids[:-1], ids[1:]))
        assert 24 <= len(ids) < 64 and mask.tolist() == [0] * (len(ids) // 3) + [1] * (len(ids) - len(ids) // 3)


def test_random_dataset_fixed_lengths_and_mix(tmp_path):
    fixed = ShardDataset(write_random_dataset(tmp_path / "f", samples=7, length=50, vocab=40, per_shard=3))
    assert len(fixed.shards) == 3 and fixed.lengths.tolist() == [50] * 7
    ids, mask = fixed.get(6)
    assert ids.min() >= 1 and ids.max() < 39 and mask.tolist() == [0] * 5 + [1] * 45
    mix = ShardDataset(write_random_dataset(tmp_path / "m", 2000, 300, 1000, sigma=0.8, max_length=900,
                                            prompt_share=0.25))
    assert mix.lengths.min() >= 16 and mix.lengths.max() == 900 and 250 < mix.lengths.mean() < 330
    ids, mask = mix.get(0)
    assert int((mask == 0).sum()) == len(ids) // 4


def test_a_matching_folder_is_reused_a_changed_one_rewritten_a_foreign_one_refused(tmp_path):
    path = write_random_dataset(tmp_path / "d", 4, 20, 50)
    shard = path / "shard-00000.arrow"
    before = shard.stat().st_mtime_ns
    write_random_dataset(path, 4, 20, 50)
    assert shard.stat().st_mtime_ns == before
    write_random_dataset(path, 5, 30, 50)
    assert ShardDataset(path).lengths.tolist() == [30] * 5
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("keep")
    with pytest.raises(ValueError, match="not written by dflash.data.synthetic"):
        write_pattern_dataset(tmp_path / "mine")
    assert (tmp_path / "mine" / "notes.txt").read_text() == "keep"
    assert np.all(ShardDataset(path).get(0)[0] < 49)
