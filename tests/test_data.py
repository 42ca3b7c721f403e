"""Arrow shards, bucketed batches and collation, on real shard files in tmp_path."""

from __future__ import annotations

import pickle

import numpy as np
import pyarrow as pa
import pytest
import torch

from dflash.data.batching import collate
from dflash.data.buckets import BucketBatchSampler, shard_batches
from dflash.data.identity import DatasetError
from dflash.data.shards import ShardDataset, check_max_length, write_shard, write_shard_arrays


def _rows(rng: np.random.Generator, n: int, lo: int = 1, hi: int = 60):
    ids = [rng.integers(0, 50_000, size=int(k)).tolist() for k in rng.integers(lo, hi, size=n)]
    masks = [rng.integers(0, 2, size=len(r)).tolist() for r in ids]
    return ids, masks


@pytest.fixture
def dataset_dir(tmp_path):
    rng = np.random.default_rng(0)
    rows = []
    for s, n in enumerate([40, 0, 25, 35]):  # an empty shard in the middle is fine
        ids, masks = _rows(rng, n)
        write_shard(tmp_path / f"part-{s:03d}.arrow", ids, masks)
        rows += list(zip(ids, masks))
    return tmp_path, rows


def test_round_trip(dataset_dir):
    path, rows = dataset_dir
    ds = ShardDataset(path)
    assert len(ds) == ds.num_samples == len(rows) == 100
    assert [p.name for p in ds.shards] == ["part-000.arrow", "part-001.arrow", "part-002.arrow", "part-003.arrow"]
    for i, (ids, mask) in enumerate(rows):
        got_ids, got_mask = ds.get(i)
        assert got_ids.dtype == np.int64 and got_ids.tolist() == ids
        assert got_mask.tolist() == mask
    assert ds.get(-1)[0].tolist() == rows[-1][0]
    with pytest.raises(IndexError):
        ds.get(100)
    assert ds.num_tokens == sum(len(r[0]) for r in rows)
    # no temp files left behind by the atomic writes
    assert sorted(p.name for p in path.iterdir()) == [p.name for p in ds.shards]


def test_shards_written_by_other_writers(tmp_path):
    """Several record batches per shard and large_list columns read the same."""
    ids = [[1, 2, 3], [4], [5, 6], [7, 8, 9, 10]]
    masks = [[0, 1, 1], [1], [0, 0], [1, 1, 1, 1]]
    table = pa.table(
        {
            "input_ids": pa.array(ids, type=pa.large_list(pa.int32())),
            "loss_mask": pa.array(masks, type=pa.list_(pa.int8())),
            "extra": pa.array(["a", "b", "c", "d"]),
        }
    )
    with pa.OSFile(str(tmp_path / "x.arrow"), "wb") as sink, pa.ipc.new_file(sink, table.schema) as w:
        for batch in table.to_batches(max_chunksize=3):
            w.write_batch(batch)
    ds = ShardDataset(tmp_path)
    assert ds.lengths.tolist() == [3, 1, 2, 4]
    assert [ds.get(i)[0].tolist() for i in range(4)] == ids
    assert [ds.get(i)[1].tolist() for i in range(4)] == masks


def test_lengths_vectorised_match_rows(dataset_dir):
    path, rows = dataset_dir
    ds = ShardDataset(path)
    assert ds.lengths.dtype == np.int32
    assert ds.lengths.tolist() == [len(ds.get(i)[0]) for i in range(len(ds))] == [len(r[0]) for r in rows]


def test_fingerprint_changes_with_data(dataset_dir):
    path, _ = dataset_dir
    before = ShardDataset(path).fingerprint
    assert ShardDataset(path).fingerprint == before
    write_shard(path / "part-004.arrow", [[1, 2]], [[1, 1]])
    assert ShardDataset(path).fingerprint != before


def test_pickle_reopens(dataset_dir):
    path, rows = dataset_dir
    ds = pickle.loads(pickle.dumps(ShardDataset(path)))
    assert ds.get(7)[0].tolist() == rows[7][0]


def test_write_shard_arrays_matches_write_shard(tmp_path):
    offsets = np.array([0, 2, 2, 5])
    write_shard_arrays(tmp_path / "a.arrow", offsets, np.arange(5), np.array([1, 0, 1, 1, 0]))
    ds = ShardDataset(tmp_path / "a.arrow")
    assert ds.lengths.tolist() == [2, 0, 3]
    assert ds.get(2)[0].tolist() == [2, 3, 4] and ds.get(2)[1].tolist() == [1, 1, 0]


def test_write_rejects_bad_rows(tmp_path):
    with pytest.raises(DatasetError, match="row 1 has 2 input_ids but 1 loss_mask"):
        write_shard(tmp_path / "a.arrow", [[1], [2, 3]], [[1], [1]])
    with pytest.raises(DatasetError, match="0 or 1"):
        write_shard(tmp_path / "a.arrow", [[1, 2]], [[1, 2]])
    assert not list(tmp_path.iterdir())


# --- errors ------------------------------------------------------------------------------------


def test_empty_or_missing_folder(tmp_path):
    with pytest.raises(DatasetError, match=r"no \*\.arrow shards"):
        ShardDataset(tmp_path)
    with pytest.raises(DatasetError, match="no such dataset folder"):
        ShardDataset(tmp_path / "nope")
    write_shard(tmp_path / "a.arrow", [], [])
    with pytest.raises(DatasetError, match="no samples"):
        ShardDataset(tmp_path)


def test_truncated_shard_names_file(dataset_dir):
    path, _ = dataset_dir
    shard = path / "part-002.arrow"
    data = shard.read_bytes()
    shard.write_bytes(data[: len(data) // 2])
    with pytest.raises(DatasetError) as e:
        ShardDataset(path)
    msg = str(e.value)
    assert str(shard) in msg and "regenerate" in msg and "\n" not in msg


def test_garbage_shard_names_file(dataset_dir):
    path, _ = dataset_dir
    shard = path / "part-001.arrow"
    shard.write_bytes(b"this is not arrow" * 100)
    with pytest.raises(DatasetError, match="part-001.arrow: not a readable Arrow IPC file"):
        ShardDataset(path)


def _write_table(path, table, **options):
    opts = pa.ipc.IpcWriteOptions(**options)
    with pa.OSFile(str(path), "wb") as sink, pa.ipc.new_file(sink, table.schema, options=opts) as w:
        w.write_table(table)


def test_missing_column_names_column(tmp_path):
    _write_table(tmp_path / "a.arrow", pa.table({"input_ids": pa.array([[1, 2]], type=pa.list_(pa.int32()))}))
    with pytest.raises(DatasetError, match=r"a\.arrow: missing column 'loss_mask' \(has: input_ids\)"):
        ShardDataset(tmp_path)


def test_wrong_column_type(tmp_path):
    _write_table(tmp_path / "a.arrow", pa.table({"input_ids": ["1 2"], "loss_mask": pa.array([[1]])}))
    with pytest.raises(DatasetError, match="column 'input_ids' is string, expected a list of integers"):
        ShardDataset(tmp_path)


def test_mismatched_row_lengths(tmp_path):
    _write_table(
        tmp_path / "a.arrow",
        pa.table({"input_ids": pa.array([[1, 2], [3]]),
                  "loss_mask": pa.array([[1, 1], [1, 0]], type=pa.list_(pa.int8()))}),
    )
    with pytest.raises(DatasetError, match="row 1 has 1 input_ids but 2 loss_mask values"):
        ShardDataset(tmp_path)


def test_compressed_shard_refused(tmp_path):
    """A compressed shard would be decompressed into RAM: refuse it and say how to fix it."""
    n = 2000
    table = pa.table(
        {
            "input_ids": pa.array([list(range(300))] * n, type=pa.list_(pa.int32())),
            "loss_mask": pa.array([[1] * 300] * n, type=pa.list_(pa.int8())),
        }
    )
    _write_table(tmp_path / "z.arrow", table, compression="zstd")
    with pytest.raises(DatasetError, match="into RAM.*rewrite it uncompressed"):
        ShardDataset(tmp_path)


# --- sampler -----------------------------------------------------------------------------------


def _random_lengths(seed: int, n: int = 3000, budget: int = 4096) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return np.clip(rng.lognormal(5.5, 1.0, size=n).astype(np.int64), 1, budget)


@pytest.mark.parametrize("pack", [False, True])
@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_budget_invariants_and_coverage(seed, pack):
    budget, max_bs = 4096, 16
    lengths = _random_lengths(seed, budget=budget)
    sampler = BucketBatchSampler(lengths, budget, max_bs, num_buckets=8, seed=seed, pack_remainders=pack)
    for epoch in range(2):
        batches = sampler.epoch_batches(epoch)
        assert len(batches) == sampler.batches_per_epoch == len(sampler)
        for b in batches:
            assert 1 <= len(b) <= max_bs
            assert lengths[b].max() * len(b) <= budget
        flat = np.concatenate(batches)
        assert np.array_equal(np.sort(flat), np.arange(lengths.size))  # each sample exactly once
    assert sampler.epoch_batches(0) != sampler.epoch_batches(1)  # reshuffled per epoch


def test_packed_remainders_fill_the_budget_with_the_same_batches_every_epoch():
    """data.pack_remainders: the part-full batch at each (bucket, batch size) group's end is gone; those samples are
    packed longest first under the same rule. On the users' length mix (lognormal around 2,826 tokens, sigma 0.6, the
    27B preset's budget) 142 batches an epoch become 97, filled 94% instead of 64%; the packed batches are the same in
    every epoch (so the count is) and resuming mid-epoch walks the same batches."""
    rng = np.random.default_rng(0)
    mu = np.log(2826) - 0.6 ** 2 / 2
    lengths = np.clip(rng.lognormal(mu, 0.6, size=1600), 16, 16384).astype(np.int64)
    plain = BucketBatchSampler(lengths, 49152, 64, 16, seed=0)
    packed = BucketBatchSampler(lengths, 49152, 64, 16, seed=0, pack_remainders=True)

    def fill(sampler):
        return lengths.sum() / (sampler.batches_per_epoch * 49152)

    assert packed.batches_per_epoch < 0.75 * plain.batches_per_epoch, (plain.batches_per_epoch, packed.batches_per_epoch)
    assert fill(plain) < 0.7 < 0.9 < fill(packed), (fill(plain), fill(packed))
    assert packed.batches_per_epoch >= -(-lengths.sum() // 49152)  # never above the budget
    first, second = packed.epoch_batches(0), packed.epoch_batches(1)
    assert first != second and len(first) == len(second) == packed.batches_per_epoch
    assert all(p.tolist() in first and p.tolist() in second for p in packed._packed)
    assert "packed from the buckets remainders" in packed.summary()
    state = {"epoch": 1, "index": 7, "seed": 0, "batches_per_epoch": packed.batches_per_epoch}
    again = BucketBatchSampler(lengths, 49152, 64, 16, seed=0, pack_remainders=True)
    again.load_state_dict(state)
    assert next(iter(again)) == (1, 7, second[7])


def test_batches_are_length_homogeneous():
    lengths = _random_lengths(5)
    sampler = BucketBatchSampler(lengths, 4096, 16, num_buckets=8, seed=0)
    table = sampler.bucket_table()
    edges = [(r["lo"], r["hi"]) for r in table]
    for b in sampler.epoch_batches(0):
        lo, hi = lengths[b].min(), lengths[b].max()
        assert any(e_lo <= lo and hi <= e_hi for e_lo, e_hi in edges)  # one bucket per batch
    assert sum(r["samples"] for r in table) == lengths.size
    assert sum(r["batches"] for r in table) == sampler.batches_per_epoch
    assert sum(r["token_share"] for r in table) == pytest.approx(1.0)


def test_deterministic_across_instances():
    lengths = _random_lengths(7)
    a = BucketBatchSampler(lengths, 4096, 16, 8, seed=11)
    b = BucketBatchSampler(lengths.copy(), 4096, 16, 8, seed=11)
    assert a.epoch_batches(3) == b.epoch_batches(3)
    assert a.epoch_batches(0) != BucketBatchSampler(lengths, 4096, 16, 8, seed=12).epoch_batches(0)


def test_resume_mid_epoch():
    lengths = _random_lengths(9, n=500)
    a = BucketBatchSampler(lengths, 4096, 16, 4, seed=3)
    per_epoch = a.batches_per_epoch
    it = iter(a)
    k = per_epoch + 5  # into the second epoch
    for _ in range(k):
        next(it)
    state = a.state_dict()
    assert (state["epoch"], state["index"]) == (1, 5)
    expected = [next(it) for _ in range(per_epoch)]  # crosses into epoch 2

    b = BucketBatchSampler(lengths, 4096, 16, 4, seed=3)
    b.load_state_dict(state)
    got = [x for _, x in zip(range(per_epoch), b)]
    assert got == expected
    assert got[0][:2] == (1, 5) and got[-1][:2] == (2, 4)


def test_resume_at_epoch_end_moves_to_next_epoch():
    sampler = BucketBatchSampler(_random_lengths(1, n=200), 4096, 16, 4, seed=0)
    sampler.load_state_dict({"epoch": 2, "index": sampler.batches_per_epoch})
    epoch, index, batch = next(iter(sampler))
    assert (epoch, index) == (3, 0) and batch == sampler.epoch_batches(3)[0]


def test_sample_longer_than_budget():
    lengths = np.array([10, 20, 5000, 30, 6000])
    with pytest.raises(DatasetError, match=r"sample 2 has 5,000 tokens > data.token_budget 4,096 \(and 1 more\)"):
        BucketBatchSampler(lengths, 4096, 16, 4, seed=0)
    with pytest.raises(DatasetError, match="sample 4 has 6,000 tokens > data.max_length 5,500"):
        check_max_length(lengths, 5500)


def test_empty_sample_refused():
    with pytest.raises(DatasetError, match="sample 1 is empty"):
        BucketBatchSampler(np.array([3, 0, 4]), 4096, 16, 4, seed=0)


def test_summary_lines():
    sampler = BucketBatchSampler(_random_lengths(2), 4096, 16, 8, seed=0)
    lines = sampler.summary().splitlines()
    assert lines[0].split() == ["bucket", "tokens", "samples", "batches", "seq/batch", "share"]
    assert len(lines) == len(sampler.bucket_table()) + 2
    assert f"{sampler.batches_per_epoch:,} batches per epoch" in lines[-1]
    assert "sequences per batch min" in lines[-1] and "max 16" in lines[-1]


@pytest.mark.parametrize("world", [1, 2, 3, 8])
def test_shard_batches(world):
    lengths = _random_lengths(4, n=1000)
    batches = BucketBatchSampler(lengths, 4096, 16, 8, seed=0).epoch_batches(0)
    per_rank = [shard_batches(batches, r, world) for r in range(world)]
    assert len({len(p) for p in per_rank}) == 1 and len(per_rank[0]) == len(batches) // world
    seen = np.concatenate([np.concatenate(p) for p in per_rank])
    dropped = batches[len(batches) // world * world :]
    assert len(seen) == len(set(seen.tolist())) == lengths.size - sum(map(len, dropped))
    with pytest.raises(ValueError, match="rank 2 is not in"):
        shard_batches(batches, 2, 2)


# --- collate -----------------------------------------------------------------------------------


def test_collate_pads_right(dataset_dir):
    path, rows = dataset_dir
    ds = ShardDataset(path)
    idx = [3, 0, 50]
    out = collate(ds, idx, pad_id=-7)
    lens = [len(rows[i][0]) for i in idx]
    s = max(lens)
    assert out["input_ids"].shape == out["loss_mask"].shape == out["attention_mask"].shape == (3, s)
    assert out["input_ids"].dtype == torch.int64
    assert out["lengths"].tolist() == lens
    for r, i in enumerate(idx):
        n = lens[r]
        assert out["input_ids"][r, :n].tolist() == rows[i][0]
        assert out["loss_mask"][r, :n].tolist() == rows[i][1]
        assert (out["input_ids"][r, n:] == -7).all()
        assert (out["loss_mask"][r, n:] == 0).all()
        assert out["attention_mask"][r].tolist() == [1] * n + [0] * (s - n)


# ---------------------------------------------------------------- read-ahead


def test_prefetch_keeps_order_and_bounds_the_read_ahead():
    import time

    from dflash.data.batching import prefetch

    produced = []

    def items():
        for i in range(50):
            produced.append(i)
            yield i

    stream = prefetch(items(), depth=3)
    assert next(stream) == 0
    time.sleep(0.3)  # let the producer run as far as it may
    assert len(produced) <= 1 + 3 + 1  # the one handed out, a full queue, one blocked in put
    assert list(stream) == list(range(1, 50))


def test_prefetch_raises_the_producers_error_in_the_consumer():
    from dflash.data.batching import prefetch

    def items():
        yield 1
        raise DatasetError("shard-00003.arrow: truncated")

    stream = prefetch(items(), depth=2)
    assert next(stream) == 1
    with pytest.raises(DatasetError, match="shard-00003.arrow"):
        next(stream)


def test_closing_a_prefetch_stops_its_thread():
    import threading
    import time

    from dflash.data.batching import prefetch

    def forever():
        i = 0
        while True:
            yield i
            i += 1

    stream = prefetch(forever(), depth=2)
    assert [next(stream) for _ in range(5)] == [0, 1, 2, 3, 4]
    stream.close()
    deadline = time.time() + 5
    while time.time() < deadline and any(t.name == "dflash-prefetch" and t.is_alive() for t in threading.enumerate()):
        time.sleep(0.05)
    assert not any(t.name == "dflash-prefetch" and t.is_alive() for t in threading.enumerate())


# ---------------------------------------------------------------------------------------------
# Values and identity: what preflight's dataset check judges


def test_value_stats_ranges_and_learnable_positions():
    from dflash.data.identity import ValueStats, value_stats

    ids = pa.array([[5, 2, 9], [7], [1, 3], [], [4, 4, 4]], type=pa.list_(pa.int32()))
    mask = pa.array([[0, 1, 1], [1], [1, 1], [], [1, 0, 1]], type=pa.list_(pa.int8()))
    # learnable: (1,2) of row 0 and (0,1) of row 2; the 1-token row and pairs across rows do not count
    assert value_stats(ids, mask) == ValueStats(1, 9, 0, 1, 2)
    assert value_stats(ids.slice(1, 2), mask.slice(1, 2)) == ValueStats(1, 7, 1, 1, 1)  # offsets not at 0
    chunked = value_stats(pa.chunked_array([ids, ids.slice(2)]), pa.chunked_array([mask, mask.slice(2)]))
    assert chunked == ValueStats(1, 9, 0, 1, 3)
    only_one_token = value_stats(pa.array([[3], [4]], type=pa.list_(pa.int32())), pa.array([[1], [1]], pa.list_(pa.int8())))
    assert only_one_token.anchors == 0 and only_one_token.mask_max == 1
    empty = value_stats(pa.array([[]], type=pa.list_(pa.int32())), pa.array([[]], type=pa.list_(pa.int8())))
    assert empty == ValueStats()


def test_compare_targets_fails_on_vocabulary_or_tokenizer_only():
    from dflash.data.identity import compare_targets

    qwen8b = {"vocab_size": 151_936, "model_type": "qwen3", "num_layers": 36, "hidden": 4096, "tokenizer_sha256": "a" * 64}
    assert compare_targets(qwen8b, dict(qwen8b)) == ([], [])
    qwen27b = {"vocab_size": 248_320, "model_type": "qwen3_5", "num_layers": 64, "hidden": 5120, "tokenizer_sha256": "b" * 64}
    bad, _ = compare_targets(qwen8b, qwen27b)
    assert bad == ["vocab_size 151936 -> 248320", "tokenizer files differ (sha256 aaaaaaaaaaaa -> bbbbbbbbbbbb)"]
    qwen14b = dict(qwen8b, num_layers=40, hidden=5120)  # same tokenizer, another model: ids stay valid
    assert compare_targets(qwen8b, qwen14b) == ([], ["completions of another model with the same tokenizer "
                                                     "(num_layers 36 -> 40, hidden 4096 -> 5120)"])
    assert compare_targets(dict(qwen8b, tokenizer_sha256=None), qwen8b) == ([], [])  # only the vocabulary to compare


def test_tokenizer_sha256_covers_the_tokenizer_files(tmp_path):
    from dflash.data.identity import tokenizer_sha256

    assert tokenizer_sha256(tmp_path) is None
    (tmp_path / "tokenizer.json").write_text('{"model": 1}')
    (tmp_path / "config.json").write_text("{}")
    first = tokenizer_sha256(tmp_path)
    (tmp_path / "config.json").write_text('{"other": 1}')  # not a tokenizer file
    assert tokenizer_sha256(tmp_path) == first
    (tmp_path / "tokenizer.json").write_text('{"model": 2}')
    assert tokenizer_sha256(tmp_path) != first
