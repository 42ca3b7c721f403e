"""Packed batches (data.packing): the packs' fill and rules, the same packs every epoch in a new order, resume, and
the plan that picks them."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from dflash.commands.data import data_main
from dflash.config import config_from_dict
from dflash.data.buckets import BucketBatchSampler
from dflash.data.identity import DatasetError
from dflash.data.packing import PackedBatchSampler
from dflash.data.plan import batch_sampler, schedule, schedule_change
from dflash.data.shards import ShardDataset, write_shard
from trainkit import run_config, split_raw, write_toml

BUDGET, MAX_BS = 49152, 64  # the 27B presets' batching


def users_mix(n: int = 3000, seed: int = 0) -> np.ndarray:
    """The users' new completions: lognormal lengths around 2,826 tokens (sigma 0.6), clipped to [16, budget]."""
    mu = np.log(2826) - 0.6 ** 2 / 2
    return np.clip(np.random.default_rng(seed).lognormal(mu, 0.6, size=n), 16, BUDGET).astype(np.int64)


def small_mix(seed: int, n: int = 2000) -> np.ndarray:
    return np.clip(np.random.default_rng(seed).lognormal(5.5, 1.0, size=n), 1, 4096).astype(np.int64)


def test_packs_fill_98_percent_of_the_budget_on_the_users_mix():
    """The figure data.packing's description gives: 169 batches an epoch and 99.7% of the budget used, against 178
    and 94.7% bucketed with pack_remainders (76.6% without)."""
    lengths = users_mix()
    packed = PackedBatchSampler(lengths, BUDGET, MAX_BS, seed=0)
    remainders = BucketBatchSampler(lengths, BUDGET, MAX_BS, 16, seed=0, pack_remainders=True)
    assert packed.fill == lengths.sum() / (packed.batches_per_epoch * BUDGET)
    assert packed.fill >= 0.98, packed.fill
    assert (packed.batches_per_epoch, round(packed.fill, 3)) == (169, 0.997)
    assert (remainders.batches_per_epoch, round(remainders.fill, 3)) == (178, 0.947)
    assert packed.batches_per_epoch >= -(-lengths.sum() // BUDGET)  # never above the budget


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("max_bs", [1, 4, 64])
def test_every_sample_once_an_epoch_within_the_budget_and_the_batch_size(seed, max_bs):
    lengths = small_mix(seed)
    sampler = PackedBatchSampler(lengths, 4096, max_bs, seed=seed)
    for epoch in range(3):
        batches = sampler.epoch_batches(epoch)
        assert len(batches) == sampler.batches_per_epoch == len(sampler)
        for b in batches:
            assert 1 <= len(b) <= max_bs
            assert lengths[b].sum() <= 4096
            assert b == sorted(b)  # ascending: collate lays them end to end in this order
        assert np.array_equal(np.sort(np.concatenate(batches)), np.arange(lengths.size))  # each sample exactly once
    if max_bs == 1:
        assert sampler.batches_per_epoch == lengths.size


def test_the_same_packs_every_epoch_in_another_order():
    sampler = PackedBatchSampler(users_mix(), BUDGET, MAX_BS, seed=0)
    epochs = [sampler.epoch_batches(e) for e in range(3)]
    assert epochs[0] != epochs[1] != epochs[2] != epochs[0]  # reshuffled per epoch
    assert all(sorted(map(tuple, e)) == sorted(map(tuple, epochs[0])) for e in epochs)  # the same packs
    assert sampler.epoch_batches(1) == epochs[1]  # and the same order on every call


def test_deterministic_across_instances_and_the_seed_orders_only():
    lengths = users_mix(seed=3)
    a = PackedBatchSampler(lengths, BUDGET, MAX_BS, seed=11)
    b = PackedBatchSampler(lengths.copy(), BUDGET, MAX_BS, seed=11)
    assert a.epoch_batches(4) == b.epoch_batches(4)
    other = PackedBatchSampler(lengths, BUDGET, MAX_BS, seed=12).epoch_batches(0)
    assert other != a.epoch_batches(0) and sorted(other) == sorted(a.epoch_batches(0))


def test_a_handed_out_batch_edited_by_its_caller_leaves_the_packs_alone():
    sampler = PackedBatchSampler(small_mix(0), 4096, 16, seed=0)
    first = sampler.epoch_batches(0)
    first[0].append(-1)
    assert all(-1 not in b for b in sampler.epoch_batches(0) + sampler.epoch_batches(1))


def test_resume_mid_epoch_walks_the_uninterrupted_sequence():
    lengths = small_mix(9, n=600)
    a = PackedBatchSampler(lengths, 4096, 16, seed=3)
    per_epoch = a.batches_per_epoch
    it = iter(a)
    for _ in range(per_epoch + 5):  # into the second epoch
        next(it)
    state = a.state_dict()
    assert state == {"epoch": 1, "index": 5, "seed": 3, "batches_per_epoch": per_epoch}
    expected = [next(it) for _ in range(per_epoch)]  # crosses into epoch 2

    b = PackedBatchSampler(lengths, 4096, 16, seed=3)
    b.load_state_dict(state)
    got = [x for _, x in zip(range(per_epoch), b)]
    assert got == expected
    assert got[0][:2] == (1, 5) and got[-1][:2] == (2, 4)
    b.load_state_dict({"epoch": 2, "index": per_epoch})  # past the end: the next epoch's start
    assert next(iter(b)) == (3, 0, a.epoch_batches(3)[0])
    with pytest.raises(ValueError, match="epoch and index must be >= 0"):
        b.load_state_dict({"epoch": 0, "index": -1})


def test_bad_lengths_are_the_bucketed_samplers_errors():
    for lengths, says in (([], "no samples to batch"), ([3, 0, 4], "sample 1 is empty"),
                          ([10, 20, 5000, 30, 6000], r"sample 2 has 5,000 tokens > data.token_budget 4,096 \(and 1 more\)")):
        with pytest.raises(DatasetError, match=says):
            BucketBatchSampler(np.array(lengths), 4096, 16, 4, seed=0)
        with pytest.raises(DatasetError, match=says):
            PackedBatchSampler(np.array(lengths), 4096, 16, seed=0)
    with pytest.raises(ValueError, match="token_budget and max_batch_size must be >= 1"):
        PackedBatchSampler(np.array([3]), 4096, 0, seed=0)


def test_a_sample_as_long_as_the_budget_is_a_pack_alone():
    sampler = PackedBatchSampler(np.array([4096, 1, 4095, 2, 4094]), 4096, 16, seed=0)
    assert sorted(sampler.epoch_batches(0)) == [[0], [1, 2], [3, 4]]


def test_summary_lines():
    sampler = PackedBatchSampler(users_mix(), BUDGET, MAX_BS, seed=0)
    lines = sampler.summary().splitlines()
    assert lines[0] == f"3,000 samples, {int(sampler.lengths.sum()):,} tokens; 169 packed batches per epoch " \
                       "(data.packing), 99.7% of the token budget used"
    assert lines[1].startswith("sequences per batch min ") and lines[1].endswith("(token_budget 49,152, max_batch_size 64)")


# --- the plan that picks them, and dflash-data stats --config ------------------------------------

LENGTHS = [300, 200, 200, 100, 100, 100, 60, 50, 40, 30, 20, 10]  # into 512-token packs: 3 of them, by hand below


def write_dataset(path: Path, lengths: list[int]) -> Path:
    """One real Arrow shard of rows with these lengths, the first third of each its prompt."""
    ids = [[1 + (i + k) % 100 for k in range(n)] for i, n in enumerate(lengths)]
    write_shard(path / "shard-00000.arrow", ids, [[0] * (n // 3) + [1] * (n - n // 3) for n in lengths])
    return path


def lengths_run(tmp_path: Path, **data) -> tuple[dict, Path]:
    """(raw run config, its TOML file): the 12 samples of LENGTHS under a 512-token budget, split over 2 drafter ranks."""
    data_dir = write_dataset(tmp_path / "data", LENGTHS)
    _, raw = run_config(tmp_path, tmp_path / "no-target", data_dir, epochs=6)
    del raw["train"]["max_steps"]  # the steps come from the epochs
    raw["data"] = {**raw["data"], "max_batch_size": 64, **data}
    raw = split_raw(raw)
    return raw, write_toml(raw, tmp_path / "run.toml")


def dflash_data(capsys, *args) -> tuple[int, list[str], list[str]]:
    """(exit code, stdout lines, stderr lines) of the real console entry point, in this process."""
    with pytest.raises(SystemExit) as e:
        data_main([str(a) for a in args])
    out, err = capsys.readouterr()
    return e.value.code, out.splitlines(), err.splitlines()


def test_best_fit_by_hand():
    """Longest first into the fullest pack it fits: 300+200 (12 left), 200+100+100+100 (12 left), 60..20 in a third
    (its 332 free is the only room for them), and 10 into the first pack that has 12 left."""
    packs = sorted(PackedBatchSampler(np.array(LENGTHS), 512, 64, seed=0).epoch_batches(0))
    assert packs == [[0, 1, 11], [2, 3, 4, 5], [6, 7, 8, 9, 10]]


def test_the_plan_picks_packs_for_the_trainer_and_the_held_out_eval(tmp_path):
    from dflash.train.heldout import HeldOut

    raw, _ = lengths_run(tmp_path, packing=True)
    cfg = config_from_dict(raw)
    dataset, sampler, total = schedule(cfg, drafter_ranks=2)
    assert isinstance(sampler, PackedBatchSampler) and sampler.batches_per_epoch == 3
    assert total == 6 * 3 // 2
    assert isinstance(batch_sampler(config_from_dict({}), np.array(LENGTHS)), BucketBatchSampler)
    held = HeldOut(cfg, ShardDataset(cfg.data.path), pad_id=0)
    assert held.batches == sampler.epoch_batches(0)


def test_turning_packing_on_is_a_named_cause_of_a_schedule_change(tmp_path):
    raw, _ = lengths_run(tmp_path)
    old = config_from_dict(raw)
    _, buckets, old_total = schedule(old, 2)
    meta = {"config": old.model_dump(), "dataset": {"samples": len(LENGTHS)}}
    state = {"sampler": buckets.state_dict(), "n_drafters": 2}
    new = config_from_dict({**raw, "data": {**raw["data"], "packing": True}})
    assert old_total == 6 * buckets.batches_per_epoch // 2 == 27
    assert schedule_change(meta, state, new) == "total steps 27 -> 9 (data.packing False -> True, batches per epoch 9 -> 3)"
    assert schedule_change(meta, state, old) is None


def test_stats_of_a_run_config_show_the_packs_batches_fill_and_steps_it_draws(tmp_path, capsys):
    _, toml = lengths_run(tmp_path, packing=True)
    code, lines, err = dflash_data(capsys, "stats", "--config", toml)
    assert code == 0, err
    plan = lines.index(f"plan of {toml}: 12 samples train, batched as packs (data.packing)")
    assert lines[0] == f"{tmp_path / 'data'}: 12 samples, 1210 tokens, length min 10 mean 101 max 300"
    assert lines[plan + 1:plan + 5] == [
        "12 samples, 1,210 tokens; 3 packed batches per epoch (data.packing), 78.8% of the token budget used",
        "sequences per batch min 3 / max 5 / avg 4.0; tokens per batch min 200 / max 510 (token_budget 512, "
        "max_batch_size 64)",
        "3 batches an epoch, 78.8% of the 512-token budget (real tokens / (batches x token_budget))",
        "1.5 steps an epoch of 2 batches (train.grad_accum 1 x 2 drafter ranks); the run: 9 steps (train.epochs 6)"]
    assert lines[-1].startswith("assistant turns per row")  # the shards' stats still close the report

    # the same run bucketed (its own pack_remainders), and its eval holdout taken out of the plan
    code, lines, err = dflash_data(capsys, "stats", "--config", toml, "--set", "data.packing=false",
                                   "--set", "data.pack_remainders=true", "--set", "topology.target_gpus=[]",
                                   "--set", "topology.drafter_gpus=[]", "--set", "eval.holdout=2",
                                   "--set", "train.grad_accum=2")
    assert code == 0, err
    assert f"plan of {toml}: 10 samples train, 2 held out (eval.holdout), batched as length buckets " \
           "(data.num_buckets 2, data.pack_remainders)" in lines
    assert lines[-5:-3] == [  # 710 of the 1,210 tokens train
        "3 batches an epoch, 46.2% of the 512-token budget (real tokens / (batches x token_budget))",
        "1.5 steps an epoch of 2 batches (train.grad_accum 2 x 1 drafter rank); the run: 9 steps (train.epochs 6)"]


def test_stats_of_a_path_alone_keep_their_options_and_say_the_fill(tmp_path, capsys):
    data = write_dataset(tmp_path / "data", LENGTHS)
    code, lines, err = dflash_data(capsys, "stats", data, "--token-budget", 512, "--num-buckets", 2)
    assert code == 0, err
    bucketed = BucketBatchSampler(np.array(LENGTHS), 512, 64, 2, seed=0)
    assert f"{bucketed.batches_per_epoch} batches an epoch, {bucketed.fill:.1%} of the 512-token budget (real tokens " \
           "/ (batches x token_budget))" in lines


def test_stats_bad_input_is_one_line(tmp_path, capsys):
    raw, toml = lengths_run(tmp_path)
    raw["data"]["path"] = str(tmp_path / "nosuch")
    gone = write_toml(raw, tmp_path / "gone.toml")
    for args, code, says in (
        (["--config", tmp_path / "nosuch.toml"], 2, f"{tmp_path / 'nosuch.toml'}: no such config file"),
        (["--config", gone], 2, f"{tmp_path / 'nosuch'}: no such dataset folder; set data.path to a folder of "
                                "*.arrow shards"),
        (["--config", toml, "--set", "data.packing=true", "--set", "data.pack_remainders=true"], 2,
         "set data.pack_remainders = false"),
        (["--config", toml, "--token-budget", 1024], 2, "--token-budget is the run config's data.token_budget with "
                                                        "--config; give --set data.token_budget=N instead"),
        ([tmp_path / "data", "--config", toml], 2, "give a dataset folder PATH or --config RUN.toml, one of them"),
        ([], 2, "give a dataset folder PATH or --config RUN.toml, one of them"),
        ([tmp_path / "data", "--set", "data.packing=true"], 2, "--set overrides a run config field: give --config"),
    ):
        got, out, err = dflash_data(capsys, "stats", *args)
        assert (got, len(err)) == (code, 1) and says in err[0] and err[0].startswith("dflash-data: error: "), err
