"""preflight/checks/dataset.py: dataset, fed facts (pass and fail paths)."""

from __future__ import annotations

from dflash.data.identity import ValueStats
from preflight.checks.dataset import check_dataset
from preflight.facts.dataset import Dataset, Shard
from preflight_ctx import make_ctx

# ---------------------------------------------------------------- dataset


def test_dataset_sample_over_budget_fails_naming_shard_row_length(tmp_path):
    ctx = make_ctx(tmp_path)
    ctx.dataset.shards[1] = Shard("b.arrow", rows=400, tokens=600_000, max_len=52_000, max_row=12, first_row=600,
                                  over=[(12, 52_000), (30, 5_000)], over_count=2)
    r = check_dataset(ctx)
    assert r.status == "fail"
    assert "b.arrow row 12 (sample 612) with 52,000 tokens > token_budget 4,096" in r.summary
    assert "2 sample(s) can never fit a batch" in r.summary
    assert r.data["over_limit"][0] == {"shard": "b.arrow", "row": 12, "index": 612, "length": 52_000}


def test_dataset_corrupt_shard_and_missing_folder_fail(tmp_path):
    ctx = make_ctx(tmp_path)
    ctx.dataset.shards.append(Shard("c.arrow", error="not a readable Arrow IPC file: Not an Arrow file"))
    r = check_dataset(ctx)
    assert r.status == "fail" and "c.arrow: not a readable Arrow IPC file" in r.summary
    ctx.dataset = Dataset(ctx.config.data.path, 4096, error="data does not exist")
    assert check_dataset(ctx).status == "fail"


def test_dataset_pass_reports_counts(tmp_path):
    r = check_dataset(make_ctx(tmp_path))
    assert r.status == "pass" and "1,000 samples" in r.summary and r.data["longest"]["index"] == 612
    assert ("shard sizes match manifest.json; built for this target (vocab 49,152, same tokenizer files); ids "
            "0..49,000 < vocab 49,152; "
            "loss_mask 0/1 with 1,100,000 learnable positions") in r.summary
    assert r.data["values"] == {"min_id": 0, "max_id": 49_000, "vocab": 49_152, "mask_min": 0, "mask_max": 1,
                                "learnable_positions": 1_100_000}


def test_dataset_token_ids_outside_the_vocabulary_fail(tmp_path):
    """ids >= vocab crash the embedding in step 1 (a device-side assert on CUDA); negative ids too."""
    ctx = make_ctx(tmp_path)
    ctx.dataset.shards[1].values = ValueStats(0, 151_000, 0, 1, 400_000)
    ctx.dataset.manifest = None  # nothing recorded: the range check alone catches it
    r = check_dataset(ctx)
    assert r.status == "fail"
    assert ("token ids up to 151,000 (b.arrow) but the target's vocabulary is 49,152 (ids must be < 49,152; 1 "
            "shard(s): b.arrow)") in r.summary
    assert "dflash-data prepare --target smollm2" in r.fix and r.data["values"]["max_id"] == 151_000
    ctx.dataset.shards[1].values = ValueStats(-7, 100, 0, 1, 400_000)
    r = check_dataset(ctx)
    assert r.status == "fail" and "negative token ids (down to -7) in b.arrow" in r.summary


def test_dataset_built_for_another_target_fails(tmp_path):
    ctx = make_ctx(tmp_path)
    ctx.dataset.manifest["target"] = dict(ctx.dataset.target, vocab_size=151_936, tokenizer_sha256="cd" * 32)
    r = check_dataset(ctx)
    assert r.status == "fail"
    assert ("built for another target than smollm2: vocab_size 151936 -> 49152, tokenizer files differ (sha256 "
            "cdcdcdcdcdcd -> abababababab)") in r.summary
    assert "rebuild the data for this target" in r.fix
    ctx.dataset.manifest["target"] = dict(ctx.dataset.target, num_layers=12)  # same tokenizer, other model: warn
    r = check_dataset(ctx)
    assert r.status == "warn" and "completions of another model with the same tokenizer (num_layers 12 -> 30)" \
        in r.summary


def test_dataset_loss_mask_values_and_nothing_to_learn_fail(tmp_path):
    ctx = make_ctx(tmp_path)
    ctx.dataset.shards[0].values = ValueStats(3, 49_000, 0, 2, 700_000)
    r = check_dataset(ctx)
    assert r.status == "fail" and "loss_mask values outside 0/1 (from 0 to 2) in a.arrow" in r.summary
    for s in ctx.dataset.shards:
        s.values = ValueStats(3, 49_000, 0, 0, 0)
    r = check_dataset(ctx)
    assert r.status == "fail" and "nothing to learn: loss_mask is 0 everywhere" in r.summary
    for s in ctx.dataset.shards:
        s.values = ValueStats(3, 49_000, 1, 1, 0)  # 1-token samples: a block needs two learnable tokens
    r = check_dataset(ctx)
    assert r.status == "fail" and "nothing to learn: no sample has two consecutive loss_mask = 1 tokens" in r.summary
    assert "keep samples of 2 or more tokens" in r.fix


def test_dataset_shards_that_differ_from_the_manifest_fail(tmp_path):
    ctx = make_ctx(tmp_path)
    ctx.dataset.shards[0].size_bytes -= 64
    r = check_dataset(ctx)
    assert r.status == "fail" and "a.arrow is 5,399,936 bytes, manifest.json recorded 5,400,000" in r.summary
    ctx.dataset.shards[0].size_bytes += 64
    ctx.dataset.shards[1].sha256 = "ff" * 32  # 64 flipped bytes: same size, other content
    assert check_dataset(ctx).status == "pass"  # sizes only: the quick look cannot see it
    ctx.dataset.deep = True
    r = check_dataset(ctx)
    assert r.status == "fail" and "b.arrow content differs from its sha256 in manifest.json" in r.summary
    assert r.data["verified_by"] == "sizes and sha256"
    ctx.dataset.shards.append(Shard("c.arrow", rows=1, tokens=5, max_len=5, values=ValueStats(1, 5, 1, 1, 4)))
    r = check_dataset(ctx)
    assert "c.arrow not in manifest.json" in r.summary


def test_dataset_without_manifest_warns_with_the_command_that_records_one(tmp_path):
    ctx = make_ctx(tmp_path)
    ctx.dataset.manifest = None
    r = check_dataset(ctx)
    assert r.status == "warn" and "no manifest.json: the target the data was built for and the shard hashes are " \
        "unknown" in r.summary
    assert r.fix == f"dflash-data manifest {ctx.dataset.path} --target smollm2"
    ctx.dataset.manifest_error = "manifest.json unreadable (Expecting value: line 1 column 1 (char 0))"
    assert check_dataset(ctx).status == "fail"
