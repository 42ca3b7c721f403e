"""`dflash-data import` as users run it: exit codes and exact lines, skipped rows, resume, and the output read
by stats, merge, preflight's `dataset` check and the trainer unchanged.

The target is the tiny random Qwen3 with the word-level tokenizer (its template: ``<user> ... <assistant> ...``,
no end-of-turn token), so tokenizing costs nothing and a few training steps run in seconds.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pyarrow as pa
import pytest

from dflash.commands.data import data_main
from dflash.data.identity import DatasetError, read_manifest
from dflash.data.regenerate import skipped_path
from dflash.data.shards import ShardDataset
from dflash.data.synthetic import word_text
from trainkit import chat_target, stand_in_server, tiny_config

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def target(tmp_path_factory) -> Path:
    return chat_target(tmp_path_factory.mktemp("target"), "qwen3")


def conversation(i: int, turns: int = 2) -> list[dict]:
    out = []
    for t in range(turns):
        out += [{"role": "user", "content": word_text(3, i + t)}, {"role": "assistant", "content": word_text(4, i + 9)}]
    return out


def write_rows(path: Path, n: int, extra: list[str] = ()) -> Path:
    lines = [json.dumps({"id": f"c{i}", "messages": conversation(i, 1 + i % 3)}) for i in range(n)]
    path.write_text("\n".join([*lines, *extra]) + "\n")
    return path


def dflash_data(capsys, *args: str) -> tuple[int, list[str], list[str]]:
    """(exit code, stdout lines, stderr lines) of the real console entry point, in this process."""
    with pytest.raises(SystemExit) as e:
        data_main([str(a) for a in args])
    out, err = capsys.readouterr()
    return e.value.code, out.splitlines(), err.splitlines()


def test_import_writes_shards_masks_skipped_rows_and_stats(tmp_path, target, capsys):
    src = write_rows(tmp_path / "chats.jsonl", 30, ['{"messages": [', '{"messages": [{"role": "user", "content": "w1"}]}',
                                                    '{"messages": [{"role": "robot", "content": "w1"}]}'])
    share = tmp_path / "share.json"
    share.write_text(json.dumps([{"conversations": [{"from": "human", "value": "w1 w2"}, {"from": "gpt", "value": "w3"}]}]))
    out = tmp_path / "out"
    code, lines, err = dflash_data(capsys, "import", src, share, "--target", target, "--out", out, "--shard-size", 12,
                                   "--workers", 1, "--no-progress")
    assert code == 0, err
    assert lines[0] == f"import: 2 file(s) (messages, sharegpt) -> {out}, 12 rows per shard; template of {target}"
    assert lines[1:4] == ["  shard-00000.arrow: rows 0-11, 12 samples, 216 tokens",
                          "  shard-00001.arrow: rows 12-23, 12 samples, 216 tokens",
                          "  shard-00002.arrow: rows 24-33, 7 samples, 113 tokens"]
    assert lines[5] == f"  2 malformed; 1 without an assistant token; reasons in {out / 'skipped.jsonl'}"
    skipped = [json.loads(line) for line in (out / "skipped.jsonl").read_text().splitlines()]
    assert [(s["line"], s["kind"], s["reason"]) for s in skipped] == [
        (31, "malformed", "not valid JSON (Expecting value at column 15)"),
        (32, "no_assistant", "no assistant message"),
        (33, "malformed", "message 0: unknown role 'robot' (use system, user, assistant, tool)")]
    ds = ShardDataset(out)
    ids, mask = ds.get(1)  # c1: two turns; the mask is exactly the two replies (4 words each)
    from dflash.data.synthetic import word_tokenizer

    tok = word_tokenizer()
    assert tok.decode(ids[mask == 1].tolist()) == " ".join([word_text(4, 10)] * 2)
    assert tok.decode(ids[mask == 0].tolist()) == f"<user> {word_text(3, 1)} <assistant> <user> {word_text(3, 2)} <assistant>"
    table = pa.ipc.open_file(pa.memory_map(str(out / "shard-00002.arrow"))).read_all()
    assert table.column("id").to_pylist()[-1] == "share.json:1" and table.column("turns").to_pylist()[:2] == [1, 2]
    manifest, _ = read_manifest(out)
    assert [s["name"] for s in manifest["sources"]] == ["chats.jsonl", "share.json"]
    assert manifest["target"]["vocab_size"] == 64 and set(manifest["shards"]) == {f"shard-0000{i}.arrow" for i in range(3)}

    code, lines, _ = dflash_data(capsys, "stats", out)
    assert code == 0 and lines[-3:] == ["masked (learned) tokens: 44.2% (241 of 545)",
                                        "assistant tokens per row: mean 8, median 8, max 12",
                                        "assistant turns per row: mean 2.0, median 2, max 3"]
    # the same numbers after a merge (shards copied whole: their turns column too)
    code, _, err = dflash_data(capsys, "merge", out, "--out", tmp_path / "merged")
    assert code == 0, err
    assert dflash_data(capsys, "stats", tmp_path / "merged")[1][-3:] == lines[-3:]

    # a rerun with the same settings has nothing left; other settings are refused with one line
    code, lines, _ = dflash_data(capsys, "import", src, share, "--target", target, "--out", out, "--shard-size", 12,
                                 "--workers", 1, "--no-progress")
    assert code == 0 and "3 shard(s) already done (resuming)" in lines[0]
    assert len((out / "skipped.jsonl").read_text().splitlines()) == 3  # nothing twice
    code, _, err = dflash_data(capsys, "import", src, share, "--target", target, "--out", out, "--shard-size", 12,
                               "--last-turn-only")
    assert code == 2 and err == [f"dflash-data: error: {out}: imported with other settings (last_turn_only); rerun "
                                 "with the same sources and options to resume, or use another --out"]


def test_max_length_truncates_or_drops_and_counts(tmp_path, target, capsys):
    src = write_rows(tmp_path / "c.jsonl", 9)
    common = ["import", src, "--target", target, "--workers", 1, "--no-progress", "--max-length", 12]
    code, lines, _ = dflash_data(capsys, *common, "--out", tmp_path / "t")
    assert code == 0 and lines[-1] == "  6 truncated to --max-length (kept)"
    assert ShardDataset(tmp_path / "t").lengths.max() == 12
    code, lines, _ = dflash_data(capsys, *common, "--out", tmp_path / "d", "--overlong", "drop")
    assert code == 0 and lines[-1] == f"  6 longer than --max-length (dropped); reasons in {tmp_path / 'd/skipped.jsonl'}"
    assert ShardDataset(tmp_path / "d").num_samples == 3


def test_a_file_that_is_not_json_is_one_line_exit_2(tmp_path, target, capsys):
    bad = tmp_path / "notes.txt"
    bad.write_text("hello\nworld\n")
    code, out, err = dflash_data(capsys, "import", bad, "--target", target, "--out", tmp_path / "o")
    assert code == 2 and out == []
    assert err == [f"dflash-data: error: {bad}: neither JSON/JSONL nor Parquet (it starts with b'hello\\nworld\\n'); "
                   "give conversation files as .jsonl, .json (an array) or .parquet"]
    assert not (tmp_path / "o").exists()


def test_parquet_with_messages_column(tmp_path, target, capsys):
    import pyarrow.parquet as pq

    rows = [{"id": f"p{i}", "messages": conversation(i)} for i in range(5)]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "m.parquet")
    code, _, err = dflash_data(capsys, "import", tmp_path / "m.parquet", "--target", target, "--out", tmp_path / "o",
                               "--workers", 1, "--no-progress", "--last-turn-only")
    assert code == 0, err
    ids, mask = ShardDataset(tmp_path / "o").get(0)
    assert int(mask.sum()) == 4 and mask[-4:].all()  # the last reply only


def _import_cmd(src: Path, target: Path, out: Path, *extra: str) -> list[str]:
    """The real console entry point in its own process."""
    return [sys.executable, "-c", "from dflash.commands.data import data_main; data_main()", "import", str(src), "--target",
            str(target), "--out", str(out), "--shard-size", "40", "--no-progress", *extra]


def _alive(pid: int) -> bool:
    """Running (a zombie waiting for its reaper is dead)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@pytest.mark.slow
def test_a_killed_import_resumes_with_nothing_lost_or_twice(tmp_path, target, capsys):
    src = write_rows(tmp_path / "c.jsonl", 4000, ["not json"] * 3)
    ref = tmp_path / "ref"
    assert dflash_data(capsys, "import", src, "--target", target, "--out", ref, "--shard-size", 40, "--workers", 1,
                       "--no-progress")[0] == 0
    out = tmp_path / "out"
    stderr = open(tmp_path / "stderr.txt", "w")
    proc = subprocess.Popen(_import_cmd(src, target, out, "--workers", "2"), cwd=REPO, stdout=subprocess.DEVNULL,
                            stderr=stderr, start_new_session=True)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and proc.poll() is None:
        manifest, _ = read_manifest(out) if out.is_dir() else (None, None)
        if manifest and len(manifest.get("import", {}).get("done", {})) >= 3:
            break
        time.sleep(0.05)
    workers = [int(c) for t in os.listdir(f"/proc/{proc.pid}/task")
               for c in Path(f"/proc/{proc.pid}/task/{t}/children").read_text().split()]
    os.kill(proc.pid, signal.SIGKILL)  # the parent alone, as the OOM killer does: its workers must not linger
    proc.wait()
    deadline = time.monotonic() + 10
    while any(map(_alive, workers)) and time.monotonic() < deadline:
        time.sleep(0.05)
    alive = [w for w in workers if _alive(w)]
    if alive:
        os.killpg(proc.pid, signal.SIGKILL)
    stderr.close()
    assert workers and not alive, f"orphaned workers {alive} outlived the import"
    assert "Traceback" not in (tmp_path / "stderr.txt").read_text()
    done = len(read_manifest(out)[0]["import"]["done"])
    assert 3 <= done < 101, "the import finished before it could be killed"
    # the half dataset never trains: the trainer's reader and preflight's dataset check refuse it, naming the fix
    with pytest.raises(DatasetError, match=r"dflash-data import did not finish writing .* rerun the same dflash-data "
                       r"import command: it resumes and finishes"):
        ShardDataset(out)
    refused = _check(tmp_path, target, out)
    assert refused.status == "fail" and "dflash-data import did not finish writing" in refused.summary, refused.summary
    assert "rerun the same dflash-data import command" in refused.fix
    run = subprocess.run(_import_cmd(src, target, out), cwd=REPO, capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    assert f"{done} shard(s) already done (resuming)" in run.stdout
    for name in read_manifest(ref)[0]["shards"]:
        assert (out / name).read_bytes() == (ref / name).read_bytes(), name
    assert (out / "skipped.jsonl").read_text() == (ref / "skipped.jsonl").read_text()
    assert read_manifest(out)[0]["import"]["totals"] == read_manifest(ref)[0]["import"]["totals"]
    assert ShardDataset(out).num_samples == ShardDataset(ref).num_samples == 4000
    assert _check(tmp_path, target, out).status == "pass"


def _check(tmp_path: Path, target: Path, data: Path, deep: bool = False):
    """Preflight's `dataset` check on `data` for a run on `target` (facts gathered from the real folder)."""
    from preflight.checks.dataset import check_dataset
    from preflight.facts.dataset import dataset
    from preflight.facts.run import target_shape

    cfg, _ = tiny_config(tmp_path, max_steps=3, save_every=3)
    cfg = cfg.model_copy(update={"target": cfg.target.model_copy(update={"path": str(target)}),
                                 "data": cfg.data.model_copy(update={"path": str(data)})})
    shape, error = target_shape(cfg)
    return check_dataset(SimpleNamespace(config=cfg, config_path="run.toml", dataset=dataset(cfg, deep=deep),
                                         target_shape=shape, target_error=error))


def test_edited_manifest_counts_are_refused_by_preflight_and_the_trainer(tmp_path, target, capsys):
    from dflash.data.identity import seal, write_manifest

    out = tmp_path / "out"
    assert dflash_data(capsys, "import", write_rows(tmp_path / "c.jsonl", 30), "--target", target, "--out", out,
                       "--shard-size", 12, "--workers", 1, "--no-progress")[0] == 0
    good = read_manifest(out)[0]
    assert good["complete"]["samples"] == 30 and _check(tmp_path, target, out).status == "pass"
    assert "complete; shard sizes match manifest.json" in _check(tmp_path, target, out).summary
    edited = json.loads(json.dumps(good))
    edited["shards"]["shard-00001.arrow"]["samples"] = 1200  # by hand: the checksum no longer matches
    write_manifest(out, edited)
    with pytest.raises(DatasetError, match=r"manifest.json was edited after it was written .*; restore manifest.json, "
                       r"or recount it from the shards with dflash-data manifest"):
        ShardDataset(out)
    r = _check(tmp_path, target, out)
    assert r.status == "fail" and "manifest.json was edited after it was written" in r.summary
    write_manifest(out, seal(edited))  # edited and resealed: the counts still disagree with the shards' own
    with pytest.raises(DatasetError, match=r"shard-00001.arrow holds 12 samples but manifest.json records 1200"):
        ShardDataset(out)
    assert "shard-00001.arrow holds 12 samples but manifest.json records 1200" in _check(tmp_path, target, out).summary
    edited["complete"] = dict(good["complete"], tokens=good["complete"]["tokens"] + 1)  # the totals alone
    edited["shards"] = good["shards"]
    write_manifest(out, edited)
    assert "completion checksum differs" in _check(tmp_path, target, out).summary
    code, lines, err = dflash_data(capsys, "manifest", out, "--target", target)  # the fix the message names
    assert code == 0, err
    assert ShardDataset(out).num_samples == 30 and _check(tmp_path, target, out).status == "pass"


def test_an_import_manifest_without_its_completion_record_is_refused(tmp_path, target, capsys):
    """What a kill between the last shard and the record leaves (and what an import of an older version left)."""
    from dflash.data.identity import write_manifest

    out = tmp_path / "out"
    assert dflash_data(capsys, "import", write_rows(tmp_path / "c.jsonl", 30), "--target", target, "--out", out,
                       "--workers", 1, "--no-progress")[0] == 0
    manifest = read_manifest(out)[0]
    del manifest["complete"]
    write_manifest(out, manifest)
    with pytest.raises(DatasetError, match="dflash-data import did not finish writing"):
        ShardDataset(out)
    code, _, err = dflash_data(capsys, "manifest", out, "--target", target)  # never stamps a half import whole
    assert code == 2 and "rerun the same dflash-data import command" in err[-1], err
    code, lines, err = dflash_data(capsys, "import", tmp_path / "c.jsonl", "--target", target, "--out", out,
                                   "--workers", 1, "--no-progress")  # the fix: resumes, nothing to redo, seals
    assert code == 0 and "1 shard(s) already done (resuming)" in lines[0], err
    assert ShardDataset(out).num_samples == 30


@pytest.mark.slow
def test_preflight_dataset_check_and_training_accept_imported_data(tmp_path, target, capsys):
    from dflash.train.trainer import run
    from preflight.checks.dataset import check_dataset
    from preflight.facts.dataset import dataset
    from preflight.facts.run import target_shape

    src = write_rows(tmp_path / "c.jsonl", 64)
    assert dflash_data(capsys, "import", src, "--target", target, "--out", tmp_path / "imported", "--workers", 2,
                       "--no-progress")[0] == 0
    cfg, _ = tiny_config(tmp_path, max_steps=3, save_every=3)
    cfg = cfg.model_copy(update={"target": cfg.target.model_copy(update={"path": str(target)}),
                                 "data": cfg.data.model_copy(update={"path": str(tmp_path / "imported")})})
    shape, error = target_shape(cfg)
    ctx = SimpleNamespace(config=cfg, config_path="run.toml", dataset=dataset(cfg, deep=True),
                          target_shape=shape, target_error=error)
    result = check_dataset(ctx)
    assert result.status == "pass", result.summary
    assert "sizes and sha256 match manifest.json; built for this target" in result.summary
    assert run(cfg, None, log=lambda *_: None, progress=False) == 0
    assert np.isfinite(json.loads((Path(cfg.output_dir) / "metrics.jsonl").read_text().splitlines()[-1])["loss"])


def _pool_workers() -> list[int]:
    """Pids of the import's tokenizing workers while it runs in this process: children forked from it (they carry its
    command line), never another child of the test session (a fixture's server, multiprocessing's resource tracker)."""
    pids, mine = [], Path("/proc/self/cmdline").read_bytes()
    for task in os.listdir("/proc/self/task"):
        try:
            children = [int(p) for p in Path(f"/proc/self/task/{task}/children").read_text().split()]
        except OSError:
            continue
        for pid in children:
            try:
                if Path(f"/proc/{pid}/cmdline").read_bytes() == mine:
                    pids.append(pid)
            except OSError:
                pass
    return pids


class _WorkerKiller:
    """Kills the import's workers with SIGKILL, as the OOM killer does: `times` kills, one every `every_s` once the
    first shard is written (`out`'s manifest lists it)."""

    def __init__(self, out: Path, times: int, every_s: float):
        import threading

        self.out, self.times, self.every_s, self.killed = out, times, every_s, 0
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self.stop.is_set() and self.killed < self.times:
            manifest = read_manifest(self.out)[0] if self.out.is_dir() else None
            workers = _pool_workers()
            if manifest and manifest.get("import", {}).get("done") and workers:
                try:
                    os.kill(workers[0], signal.SIGKILL)
                    self.killed += 1
                except ProcessLookupError:
                    pass
                self.stop.wait(self.every_s)
            self.stop.wait(0.01)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.stop.set()
        self.thread.join()


@pytest.mark.slow
@pytest.mark.e2e  # the import forks its workers
def test_a_killed_worker_is_replaced_and_repeated_deaths_end_the_import_in_one_line(tmp_path, target, capsys):
    src = write_rows(tmp_path / "c.jsonl", 6000)
    args = ("import", src, "--target", target, "--shard-size", 40, "--workers", 2, "--no-progress")
    with _WorkerKiller(tmp_path / "once", times=1, every_s=0) as killer:  # one death: its chunks go again
        code, lines, err = dflash_data(capsys, *args, "--out", tmp_path / "once")
    assert killer.killed == 1, "the import finished before a worker could be killed"
    assert code == 0, err
    assert any(line.startswith("  a tokenizing worker died") for line in lines)
    assert ShardDataset(tmp_path / "once").num_samples == 6000

    out = tmp_path / "out"
    with _WorkerKiller(out, times=50, every_s=0.05):  # the same chunks in flight at two deaths: the import ends
        code, lines, err = dflash_data(capsys, *args, "--out", out)
    assert code == 1 and len(err) == 1, err
    assert err[0].startswith("dflash-data: error: a tokenizing worker died twice while c.jsonl lines ") and \
        err[0].endswith("rerun the same command to resume (fewer --workers use less memory)"), err
    assert not _pool_workers()  # no worker left behind
    code, lines, err = dflash_data(capsys, *args, "--out", out)  # the fix: resumes, nothing twice
    assert code == 0, err
    for name in read_manifest(tmp_path / "once")[0]["shards"]:
        assert (out / name).read_bytes() == (tmp_path / "once" / name).read_bytes(), name


def test_a_fifo_or_a_device_as_a_source_is_one_line_exit_2_before_any_read(tmp_path, target, capsys):
    fifo = tmp_path / "chats.jsonl"
    os.mkfifo(fifo)  # opening it would block until a writer comes: the import must not open it
    for source in (fifo, Path("/dev/zero")):
        code, out, err = dflash_data(capsys, "import", source, "--target", target, "--out", tmp_path / "o")
        assert code == 2 and out == []
        assert err == [f"dflash-data: error: {source}: not a regular file (a FIFO, a device or a socket); give a "
                       ".jsonl, .json or .parquet file"]
    assert not (tmp_path / "o").exists()


def test_a_corrupt_parquet_page_is_one_line_naming_the_file(tmp_path, target, capsys):
    import pyarrow.parquet as pq

    rows = [{"id": f"p{i}", "messages": conversation(i)} for i in range(3000)]
    path = tmp_path / "m.parquet"
    pq.write_table(pa.Table.from_pylist(rows), path, compression="snappy", row_group_size=1024)
    meta = pq.ParquetFile(path).metadata
    column = meta.row_group(1).column(1)  # the messages of rows 1,025-2,048: a data page in the middle
    data = bytearray(path.read_bytes())
    start = column.data_page_offset + 64
    data[start:start + 256] = bytes(256)  # the footer stays intact: the file opens, the page does not decode
    path.write_bytes(bytes(data))
    code, out, err = dflash_data(capsys, "import", path, "--target", target, "--out", tmp_path / "o", "--workers", 1,
                                 "--shard-size", 500, "--no-progress")
    assert code == 2 and len(err) == 1, err
    assert err[0].startswith(f"dflash-data: error: {path}: corrupt Parquet data after row 1,024 (")
    assert err[0].endswith("restore or re-export the file (finished shards are kept: rerun to resume)")
    with pytest.raises(DatasetError, match="did not finish"):  # the two shards before it never train alone
        ShardDataset(tmp_path / "o")


def test_each_row_is_read_by_its_own_format_and_a_malformed_row_keeps_its_id(tmp_path, target, capsys):
    both = {"id": "both", "messages": conversation(0), "conversations": [{"from": "human", "value": "w1"}]}
    share = {"id": "share", "conversations": [{"from": "human", "value": "w1 w2"}, {"from": "gpt", "value": "w3"}]}
    bad = {"id": "bad-1", "messages": [{"role": "robot", "content": "w1"}]}
    src = tmp_path / "c.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in (both, share, {"id": "m1", "messages": conversation(1)}, bad)))
    code, _, err = dflash_data(capsys, "import", src, "--target", target, "--out", tmp_path / "o", "--workers", 1,
                               "--no-progress")
    assert code == 0, err
    ids = pa.ipc.open_file(str(tmp_path / "o" / "shard-00000.arrow")).read_all().column("id").to_pylist()
    assert ids == ["both", "share", "m1"]  # the first row held both keys: the rest are not judged by it
    skipped = [json.loads(line) for line in (tmp_path / "o" / "skipped.jsonl").read_text().splitlines()]
    assert [(s["id"], s["kind"]) for s in skipped] == [("bad-1", "malformed")]


def test_a_lone_surrogate_in_a_row_is_a_malformed_row_not_a_traceback(tmp_path, target, capsys):
    src = tmp_path / "c.jsonl"
    src.write_text('{"id": "s1", "messages": [{"role": "user", "content": "w1 \\ud800"}, {"role": "assistant", '
                   '"content": "w3"}]}\n{"id": "s\\udc00", "messages": [{"role": "user", "content": "w1"}, {"role": '
                   '"assistant", "content": "w3"}]}\n' + json.dumps({"id": "ok", "messages": conversation(0)}) + "\n")
    code, _, err = dflash_data(capsys, "import", src, "--target", target, "--out", tmp_path / "o", "--workers", 1,
                               "--no-progress")
    assert code == 0, err
    skipped = [json.loads(line) for line in (tmp_path / "o" / "skipped.jsonl").read_text().splitlines()]
    assert [(s["id"], s["reason"]) for s in skipped] == [
        ("s1", "its text holds a lone surrogate ('\\ud800'), not valid Unicode"),
        ("s\udc00", "its id holds a lone surrogate ('\\udc00'), not valid Unicode")]
    assert ShardDataset(tmp_path / "o").num_samples == 1


def _parts(*texts: str) -> list[dict]:
    return [{"type": "text", "text": t} for t in texts]


# The awkward rows, every content a list of parts (so one Parquet schema holds them all): (row, import's verdict).
AWKWARD = [
    ({"id": "both", "messages": [{"role": "user", "content": _parts("w1 w2")}, {"role": "assistant", "content": _parts("w3")}],
      "conversations": [{"from": "robot", "value": "w4"}]}, None),  # both keys: read as `messages`
    ({"id": "both-bad", "messages": [{"role": "developer", "content": _parts("w1")}, {"role": "assistant", "content": _parts("w3")}],
      "conversations": [{"from": "human", "value": "w1"}, {"from": "gpt", "value": "w3"}]},
     "message 0: unknown role 'developer' (use system, user, assistant, tool)"),
    ({"id": "image", "messages": [{"role": "user", "content": [*_parts("w1"), {"type": "image_url", "image_url": {"url": "x"}}]},
                                  {"role": "assistant", "content": _parts("w3")}]},
     "message 0: content part 'image_url' is not text (only text parts are imported)"),
    ({"id": "tool", "tools": [{"type": "function", "function": {"name": "moon", "parameters": {"type": "object"}}}],
      "messages": [{"role": "user", "content": _parts("w1")},
                   {"role": "assistant", "content": _parts(), "tool_calls": [
                       {"id": "c1", "type": "function", "function": {"name": "moon", "arguments": '{"day": 3}'}}]},
                   {"role": "tool", "tool_call_id": "c1", "content": _parts("w5")},
                   {"role": "assistant", "content": _parts("w6 w7")}]}, None),
    ({"id": "developer", "messages": [{"role": "developer", "content": _parts("w1")}, {"role": "user", "content": _parts("w2")},
                                      {"role": "assistant", "content": _parts("w3")}]},
     "message 0: unknown role 'developer' (use system, user, assistant, tool)"),
    ({"id": "share", "conversations": [{"from": "human", "value": "w1 w2"}, {"from": "gpt", "value": "w3"}]}, None),
]


def _awkward_file(path: Path) -> Path:
    rows = [row for row, _ in AWKWARD]
    if path.suffix == ".parquet":
        import pyarrow.parquet as pq

        pq.write_table(pa.table({k: [r.get(k) for r in rows] for k in ("id", "messages", "conversations", "tools")}), path)
    elif path.suffix == ".json":
        path.write_text(json.dumps(rows, indent=1))
    else:
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.mark.parametrize("name", ["rows.jsonl", "rows.json", "rows.parquet"])
def test_import_and_regenerate_give_every_row_one_verdict(tmp_path, target, capsys, name):
    """Both commands read the same file through the one reader (dflash.data.conversations): the same rows kept, the
    same rows refused with the same reason, in each container import accepts; regenerate's output imports whole."""
    src = _awkward_file(tmp_path / name)
    code, _, err = dflash_data(capsys, "import", src, "--target", target, "--out", tmp_path / "o", "--workers", 1,
                               "--no-progress")
    assert code == 0, err
    kept = pa.ipc.open_file(str(tmp_path / "o" / "shard-00000.arrow")).read_all().column("id").to_pylist()
    refused = {s["id"]: s["reason"] for s in map(json.loads, (tmp_path / "o" / "skipped.jsonl").read_text().splitlines())}
    assert kept == [row["id"] for row, verdict in AWKWARD if verdict is None]
    assert refused == {row["id"]: verdict for row, verdict in AWKWARD if verdict is not None}

    regen = tmp_path / "regen.jsonl"
    with stand_in_server() as (url, bodies):
        code, out, err = dflash_data(capsys, "regenerate", "--input", src, "--server", url, "--out", regen, "--turns",
                                     "last", "--no-progress")
    assert code == 0, err
    assert out[0].startswith(f"regenerated {len(kept)} conversations") and f"{len(refused)} skipped" in out[0]
    rows = {r["id"]: r for r in map(json.loads, regen.read_text().splitlines())}
    assert sorted(rows) == sorted(kept)
    assert {s["id"]: s["reason"] for s in map(json.loads, skipped_path(regen).read_text().splitlines())} == refused
    [tool] = [b for b in bodies if b.get("tools")]  # the tool call goes out as the server's API has it
    assert tool["messages"][1]["tool_calls"][0]["function"]["arguments"] == '{"day": 3}'
    assert [m["role"] for m in tool["messages"]] == ["user", "assistant", "tool"]

    code, _, err = dflash_data(capsys, "import", regen, "--target", target, "--out", tmp_path / "again", "--workers", 1,
                               "--no-progress")
    assert code == 0 and not (tmp_path / "again" / "skipped.jsonl").exists(), err
    assert ShardDataset(tmp_path / "again").num_samples == len(kept)
