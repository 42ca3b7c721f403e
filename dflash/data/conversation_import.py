"""Import conversation files into Arrow shards: streamed, tokenized in parallel, resumable.

    uv run dflash-data import chats.jsonl more.parquet --target models/qwen3-8b --out data/chats

The source rows (every file in the order given, every row counted, malformed ones too) are cut
into a fixed plan: shard i holds source rows [i*K, (i+1)*K) that survive. A pool of worker
processes renders and tokenizes chunks of rows (dflash.data.conversations); the parent streams the files
(bounded memory: a few chunks in flight plus the shard being filled), writes each shard atomically,
appends its rejected rows to ``skipped.jsonl`` and records the shard in ``manifest.json``. A rerun
with the same sources (sha256) and settings keeps the finished shards and continues: no row twice
(skipped.jsonl is cut back to the length the manifest recorded). Other settings are refused. The manifest gets its
completion record (``dflash.data.identity.seal``) only at the very end: until then preflight and the trainer refuse
the folder, so a kill half-way never trains on part of the data.

Shards carry two optional columns after input_ids/loss_mask: ``id`` (the row's id, or
``<file>:<line>`` when it has none) and ``turns`` (assistant turns of the conversation). Readers
select columns by name, and ``merge`` copies shard files whole, so both survive a merge; ``stats``
reads ``turns`` from them.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import time
from collections import deque
from collections.abc import Iterator
from concurrent.futures import Future
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from dflash.data.conversations import FORMATS, Renderer, RowError, SourceRow, decode_row, detect_format, iter_source, row_messages
from dflash.data.identity import (
    COMPLETE,
    MANIFEST_NAME,
    SHARD_GLOB,
    compare_targets,
    read_manifest,
    seal,
    shard_records,
    write_manifest,
)
from dflash.errors import DflashError

SHARD_NAME = "shard-{:05d}.arrow"
SKIPPED = "skipped.jsonl"
OVERLONG = ("truncate", "drop")
COUNTS = ("rows", "samples", "tokens", "masked_tokens", "turns", "malformed", "no_assistant", "truncated", "too_long")


class ConversationImportError(DflashError):
    """Bad input for import; one line naming the problem and the fix (exit 2)."""

    exit_code = 2


@dataclass
class ImportSettings:
    sources: list[Path]
    target: str  # what the user gave (--target): a model folder or "smollm2"
    out: Path
    fmt: str = "auto"  # auto | sharegpt | messages
    thinking: str = "keep"  # keep | drop (templates that render reasoning_content)
    last_turn_only: bool = False  # mask only the last assistant turn of each row
    max_length: int | None = None  # tokens per row, at most
    overlong: str = "truncate"  # what a longer row gets: truncate | drop
    shard_size: int = 10_000  # source rows per shard (the unit of resume)
    workers: int = 0  # tokenizing processes; 0 = one per core
    chunk_size: int = 64  # rows per task handed to a worker


@dataclass
class Result:
    """What one source row became: a sample (ids, mask, id, turns) or why it was left out."""

    line: int
    file: int
    ids: np.ndarray | None = None
    mask: np.ndarray | None = None
    rid: str | None = None
    turns: int = 0
    kind: str = ""  # "" kept (maybe truncated: see `truncated`), else malformed | no_assistant | too_long
    reason: str = ""
    truncated: bool = False


# ---------------------------------------------------------------------------------------------
# The work of one chunk (in a worker process, or in this one with workers=1)

_WORKER: dict = {}


def _init_worker(tokenizer_dir: str, settings: dict, formats: list[str]) -> None:
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # the pool is the parallelism
    from dflash.models.target import load_target_tokenizer

    tok = load_target_tokenizer(tokenizer_dir)  # the parent loaded it first: checked there
    _WORKER.update(renderer=Renderer(tok, settings["thinking"], settings["last_turn_only"]),
                   settings=settings, formats=formats, names=[Path(p).name for p in settings["sources"]])


def _init_pool_worker(parent: int, *args) -> None:
    """A worker process of the pool: it dies with the import (Linux: PR_SET_PDEATHSIG), so a kill -9 of the parent
    leaves no orphan printing BrokenPipeError tracebacks, and leaves Ctrl-C to the parent."""
    import signal
    import sys

    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if sys.platform == "linux":
        import ctypes

        try:
            ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # 1 = PR_SET_PDEATHSIG
        except (OSError, AttributeError):
            pass
    if os.getppid() != parent:  # the import died before the line above took effect
        os._exit(1)
    _init_worker(*args)


def _row_messages(row: SourceRow, file: int, res: Result) -> tuple[list[dict], list | None]:
    """The row's messages and tools; its id lands in `res` first, so a malformed row is logged under it too."""
    value = decode_row(row)
    rid = value.get("id")
    res.rid = str(rid) if rid is not None else f"{_WORKER['names'][file]}:{row.line}"
    _, messages, tools = row_messages(value, _WORKER["formats"][file])  # "auto": this row's own format
    return messages, tools


def process_chunk(chunk: list[tuple[int, SourceRow]]) -> list[Result]:
    """Render, tokenize and mask a chunk of (file index, row); every row gives one Result, in order."""
    renderer: Renderer = _WORKER["renderer"]
    results, texts, spans, kept = [], [], [], []
    for file, row in chunk:
        res = Result(row.line, file)
        results.append(res)
        try:
            messages, tools = _row_messages(row, file, res)
            messages = renderer.prepare(messages)
            res.turns = sum(m["role"] == "assistant" for m in messages)
            if not res.turns:
                res.kind, res.reason = "no_assistant", "no assistant message"
                continue
            text, row_spans = renderer.spans(messages, tools)
            _check_unicode(text, res.rid)
        except RowError as e:
            res.kind, res.reason = "malformed", str(e)
            continue
        texts.append(text)
        spans.append(row_spans)
        kept.append(res)
    if texts:
        for res, (ids, mask) in zip(kept, renderer.encode_batch(texts, spans)):
            _finish(res, ids, mask, _WORKER["settings"])
    return results


def _check_unicode(text: str, rid: str) -> None:
    """RowError for a lone surrogate (JSON's "\\ud800" decodes to one): no tokenizer or Arrow string takes it."""
    for what, value in (("text", text), ("id", rid)):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as e:
            raise RowError(f"its {what} holds a lone surrogate ({value[e.start]!a}), not valid Unicode") from None


def _finish(res: Result, ids: np.ndarray, mask: np.ndarray, s: dict) -> None:
    limit = s["max_length"]
    if limit is not None and ids.size > limit:
        if s["overlong"] == "drop":
            res.kind, res.reason = "too_long", f"{ids.size} tokens > --max-length {limit}"
            return
        ids, mask, res.truncated = ids[:limit], mask[:limit], True
    if not mask.any():
        res.kind, res.reason = "no_assistant", "no assistant token" + (" left after truncation" if res.truncated else "")
        return
    res.ids, res.mask = ids, mask


# ---------------------------------------------------------------------------------------------
# Sources, settings, resume


def source_records(paths: list[Path], formats: list[str]) -> list[dict]:
    """{path, bytes, sha256, format} of every source file (hashed in parallel threads)."""
    from dflash.filehash import sha256_files

    hashes = sha256_files(paths)
    out = []
    for p, fmt in zip(paths, formats):
        if isinstance(hashes[p], OSError):
            raise ConversationImportError(f"{p}: cannot read it ({hashes[p].strerror})")
        out.append({"path": str(p), "name": p.name, "bytes": p.stat().st_size, "sha256": hashes[p], "format": fmt})
    return out


def _settings_key(s: ImportSettings, sources: list[dict], template_sha: str) -> dict:
    return {"target": s.target, "chat_template_sha256": template_sha,
            "sources": [{k: r[k] for k in ("name", "sha256", "format")} for r in sources],
            "thinking": s.thinking, "last_turn_only": s.last_turn_only, "max_length": s.max_length,
            "overlong": s.overlong, "shard_size": s.shard_size}


def _resumable(out: Path, key: dict, target: dict) -> dict:
    """The manifest to continue from: the existing one when its settings and target match, else a new one."""
    manifest, problem = read_manifest(out)
    if problem:
        raise ConversationImportError(f"{out / MANIFEST_NAME}: {problem}; move the folder aside or use another --out")
    if manifest is None:
        stray = [p.name for p in out.glob(SHARD_GLOB)] if out.is_dir() else []
        if stray:
            raise ConversationImportError(f"{out}: holds {len(stray)} shard(s) but no {MANIFEST_NAME}, so a resume cannot tell "
                               "which rows they hold; use another --out")
        if out.is_dir() and (out / SKIPPED).is_file() and (out / SKIPPED).stat().st_size:
            raise ConversationImportError(f"{out / SKIPPED}: already there, not written by an import into {out} (an older "
                                          "regenerate's?); import never rewrites a file it did not create: move it "
                                          "aside or use another --out")
        return {"target": target, "settings": key, "sources": [], "shards": {}, "import": {"done": {}}}
    old = manifest.get("settings") or {}
    differ = [k for k in key if old.get(k) != key[k]]
    if differ or "import" not in manifest:
        what = ", ".join(differ) or "not written by import"
        raise ConversationImportError(f"{out}: imported with other settings ({what}); rerun with the same sources and options "
                           "to resume, or use another --out")
    bad, _ = compare_targets(manifest.get("target") or {}, target)
    if bad:
        raise ConversationImportError(f"{out}: imported for another target ({', '.join(bad)}); use another --out")
    return manifest


def _cut_skipped(out: Path, manifest: dict) -> None:
    """Drop skipped.jsonl lines of shards that were not finished (a killed run wrote them)."""
    path = out / SKIPPED
    keep = int(manifest["import"].get("skipped_bytes", 0))
    if path.exists() and path.stat().st_size > keep:
        with open(path, "r+b") as f:
            f.truncate(keep)


# ---------------------------------------------------------------------------------------------
# The run


def plan_rows(sources: list[Path], shard_size: int) -> Iterator[tuple[int, int, SourceRow]]:
    """(shard index, file index, row) for every source row, in order."""
    n = 0
    for file, path in enumerate(sources):
        for row in iter_source(path):
            yield n // shard_size, file, row
            n += 1


def _chunks(rows, done: set, chunk_size: int) -> Iterator[tuple[int, list]]:
    """(shard, chunk of rows) of the shards still to do; rows of finished shards are read past."""
    current, chunk = None, []
    for shard, file, row in rows:
        if shard in done:
            continue
        if chunk and (shard != current or len(chunk) >= chunk_size):
            yield current, chunk
            chunk = []
        current = shard
        chunk.append((file, row))
    if chunk:
        yield current, chunk


class WorkerLost(DflashError):
    """A tokenizing worker died (killed: the OOM killer, a signal) twice while one chunk was in flight (exit 1)."""


class _Workers:
    """The tokenizing processes (concurrent.futures, so a worker that dies breaks the pool instead of hanging it:
    its chunk would never come back from a multiprocessing.Pool). A broken pool is replaced and every chunk in
    flight sent again; a chunk in flight at two deaths ends the import (WorkerLost, naming its rows)."""

    def __init__(self, workers: int, initargs: tuple, log):
        import sys
        from concurrent.futures import ProcessPoolExecutor

        self._make = lambda: ProcessPoolExecutor(workers, multiprocessing.get_context(
            "fork" if sys.platform == "linux" else "spawn"), initializer=_init_pool_worker,
            initargs=(os.getpid(), *initargs))
        self.executor, self.log = self._make(), log

    def submit(self, chunk: list) -> Future:
        """The chunk's future; one holding BrokenProcessPool when the pool broke already (seen at its result)."""
        from concurrent.futures.process import BrokenProcessPool

        try:
            return self.executor.submit(process_chunk, chunk)
        except BrokenProcessPool as e:
            broken: Future = Future()
            broken.set_exception(e)
            return broken

    def restart(self) -> None:
        self.executor.shutdown(wait=True, cancel_futures=True)
        self.executor = self._make()

    def close(self) -> None:
        """Stop at once (the end, an error or Ctrl-C): chunks still queued are dropped, the workers killed."""
        processes = dict(getattr(self.executor, "_processes", None) or {})  # no public handle on them
        self.executor.shutdown(wait=False, cancel_futures=True)
        for proc in processes.values():
            if proc.is_alive():
                proc.kill()
            proc.join()


def _rows_of(chunk: list, sources: list[Path]) -> str:
    (first_file, first), (last_file, last) = chunk[0], chunk[-1]
    if first_file == last_file:
        return f"{sources[first_file].name} lines {first.line}-{last.line}"
    return f"{sources[first_file].name} line {first.line} to {sources[last_file].name} line {last.line}"


def _ordered(pool: _Workers | None, chunks: Iterator, depth: int,
             sources: list[Path]) -> Iterator[tuple[int, int, list[Result]]]:
    """(shard, rows in the chunk, results) in order; at most `depth` chunks in flight (bounded memory).

    A worker lost (BrokenProcessPool) restarts the pool and sends every chunk in flight again, once per chunk."""
    from concurrent.futures.process import BrokenProcessPool

    if pool is None:
        for shard, chunk in chunks:
            yield shard, len(chunk), process_chunk(chunk)
        return
    pending: deque = deque()  # [shard, chunk, future, deaths seen while in flight]

    def result_of_first() -> tuple[int, int, list[Result]]:
        while True:
            shard, chunk, future, _ = pending[0]
            try:
                results = future.result()
            except BrokenProcessPool:
                for job in pending:
                    job[3] += 1
                worst = next((job for job in pending if job[3] > 1), None)
                if worst is not None:
                    raise WorkerLost(f"a tokenizing worker died twice while {_rows_of(worst[1], sources)} were in "
                                     "flight (killed: out of memory?); the finished shards are kept: rerun the same "
                                     "command to resume (fewer --workers use less memory)") from None
                pool.log(f"  a tokenizing worker died (killed: out of memory?); restarting the workers and sending "
                         f"{len(pending)} chunk(s) in flight again")
                pool.restart()
                for job in pending:
                    job[2] = pool.submit(job[1])
                continue
            pending.popleft()
            return shard, len(chunk), results

    for shard, chunk in chunks:
        pending.append([shard, chunk, pool.submit(chunk), 0])
        while len(pending) > depth:
            yield result_of_first()
    while pending:
        yield result_of_first()


@dataclass
class _Shard:
    index: int
    start: int
    results: list[Result] = field(default_factory=list)
    rows: int = 0


def import_conversations(s: ImportSettings, log=print, progress: bool | None = None) -> dict:
    """Import the sources into `s.out`; returns the final manifest. Every input is checked before any work."""
    import sys

    from tqdm import tqdm

    if s.fmt not in FORMATS:
        raise ConversationImportError(f"--format {s.fmt!r}: use {', '.join(FORMATS)}")
    if s.overlong not in OVERLONG:
        raise ConversationImportError(f"--overlong {s.overlong!r}: use truncate or drop")
    sources = [Path(p) for p in s.sources]
    for p in sources:
        if not p.is_file():  # a FIFO would block, /dev/zero never end: refused before anything is read
            raise ConversationImportError(f"{p}: not a regular file (a FIFO, a device or a socket); give a .jsonl, "
                                          ".json or .parquet file")
    formats = [detect_format(p, s.fmt) for p in sources]  # a file that is no JSON/Parquet fails here
    out = Path(s.out)
    if out.exists() and not out.is_dir():
        raise ConversationImportError(f"--out {out}: is a file; give a folder (new, or one imported with the same settings)")
    tokenizer_dir, tokenizer, fp = _load_target(s.target, log)
    renderer = Renderer(tokenizer, s.thinking, s.last_turn_only)  # no chat template / no fast tokenizer: one line
    records = source_records(sources, formats)
    key = _settings_key(s, records, _sha(tokenizer.chat_template))
    manifest = _resumable(out, key, fp)
    manifest["sources"] = records
    manifest.pop(COMPLETE, None)  # not whole again until this run seals it (a kill from here on leaves it unsealed)
    out.mkdir(parents=True, exist_ok=True)
    _cut_skipped(out, manifest)
    write_manifest(out, manifest)
    done = {int(k) for k in manifest["import"]["done"]}
    log(f"import: {len(sources)} file(s) ({', '.join(sorted(set(formats)))}) -> {out}, {s.shard_size} rows per shard"
        + (f", {len(done)} shard(s) already done (resuming)" if done else "")
        + f"; template of {s.target}" + (" (renders reasoning)" if renderer.reasoning else ""))
    settings = {**asdict(s), "sources": [str(p) for p in sources], "out": str(out)}
    formats = [s.fmt] * len(sources) if s.fmt == "auto" else formats  # each row judged on its own
    workers = s.workers or os.cpu_count() or 1
    progress = sys.stderr.isatty() if progress is None else progress
    bar = tqdm(unit=" rows", desc="import", disable=not progress, dynamic_ncols=True)
    t0, tokens = time.perf_counter(), 0
    pool = None
    try:
        if workers > 1:
            pool = _Workers(workers, (str(tokenizer_dir), settings, formats), log)
        else:
            _init_worker(str(tokenizer_dir), settings, formats)
        chunks = _chunks(plan_rows(sources, s.shard_size), done, s.chunk_size)
        current: _Shard | None = None
        for shard, n, results in _ordered(pool, chunks, 4 * workers, sources):
            if current is None or shard != current.index:
                if current is not None:
                    tokens += _commit(out, manifest, current, sources, log, progress)
                current = _Shard(shard, shard * s.shard_size)
            current.results += results
            current.rows += n
            bar.update(n)
            bar.set_postfix_str(f"{tokens / max(time.perf_counter() - t0, 1e-9):,.0f} tok/s")
        if current is not None:
            tokens += _commit(out, manifest, current, sources, log, progress)
    finally:
        bar.close()
        if pool is not None:
            pool.close()
    return _summary(out, manifest, time.perf_counter() - t0, log)


def _sha(text: str | None) -> str:
    import hashlib

    return hashlib.sha256((text or "").encode()).hexdigest()


def _load_target(target: str, log):
    """(tokenizer folder, tokenizer, target fingerprint); one-line errors for a missing or broken target."""
    from dflash.config import ConfigError
    from dflash.data.identity import target_fingerprint
    from dflash.models import smollm2, smollm2_convert
    from dflash.models.target import load_target_tokenizer

    problem = smollm2.target_problem(target)
    if problem:
        raise ConversationImportError(problem)
    folder = smollm2_convert.resolve_target(target, log=log)
    tokenizer = load_target_tokenizer(folder)  # TargetError (one line) for custom code, missing or broken files
    try:
        fp = target_fingerprint(target)
    except ConfigError as e:
        raise ConversationImportError(f"--target {target}: {e.one_line()}") from None
    return folder, tokenizer, fp


def _commit(out: Path, manifest: dict, shard: _Shard, sources: list[Path], log, progress: bool) -> int:
    """Write one finished shard, its skipped rows and its manifest records; returns its tokens."""
    import pyarrow as pa

    from dflash.data.shards import write_shard_arrays

    name = SHARD_NAME.format(shard.index)
    kept = [r for r in shard.results if r.kind == ""]
    counts = {k: 0 for k in COUNTS}
    counts["rows"] = shard.rows
    for r in shard.results:
        if r.kind:
            counts[r.kind] += 1
    if kept:
        lengths = np.fromiter((r.ids.size for r in kept), dtype=np.int64, count=len(kept))
        offsets = np.concatenate([[0], np.cumsum(lengths)])
        ids = np.concatenate([r.ids for r in kept])
        mask = np.concatenate([r.mask for r in kept])
        extra = {"id": pa.array([r.rid for r in kept], pa.string()),
                 "turns": pa.array(np.fromiter((r.turns for r in kept), np.int16, len(kept)))}
        write_shard_arrays(out / name, offsets, ids, mask, extra)
        counts.update(samples=len(kept), tokens=int(ids.size), masked_tokens=int(mask.sum()),
                      turns=sum(r.turns for r in kept), truncated=sum(r.truncated for r in kept))
        manifest["shards"][name] = {"samples": len(kept), "tokens": int(ids.size),
                                    **shard_records([out / name])[name]}
    skipped = [r for r in shard.results if r.kind]
    if skipped:
        with open(out / SKIPPED, "a", encoding="utf-8") as f:
            for r in skipped:
                f.write(json.dumps({"file": str(sources[r.file]), "line": r.line, "id": r.rid, "kind": r.kind,
                                    "reason": r.reason}) + "\n")
    end = shard.start + shard.rows
    manifest["import"]["done"][str(shard.index)] = {"name": name if kept else None, "start": shard.start,
                                                    "end": end, **counts}
    manifest["import"]["skipped_bytes"] = (out / SKIPPED).stat().st_size if (out / SKIPPED).exists() else 0
    write_manifest(out, manifest)
    if not progress:
        log(f"  {name}: rows {shard.start}-{end - 1}, {counts['samples']} samples, {counts['tokens']} tokens")
    return counts["tokens"]


def totals(manifest: dict) -> dict:
    """Every count summed over the finished shards."""
    done = manifest["import"]["done"].values()
    return {k: sum(d.get(k, 0) for d in done) for k in COUNTS}


def duplicate_ids(out: Path, manifest: dict) -> tuple[int, list[str]]:
    """(ids held by more than one sample, a few of them), over every shard's ``id`` column."""
    import pyarrow as pa
    import pyarrow.compute as pc

    columns = []
    for name in sorted(manifest["shards"]):
        with pa.memory_map(str(out / name)) as source:
            columns.append(pa.ipc.open_file(source).read_all().column("id").combine_chunks())
    if not columns:
        return 0, []
    counts = pc.value_counts(pa.chunked_array(columns).combine_chunks())
    dup = counts.filter(pc.greater(counts.field("counts"), 1))
    return len(dup), [str(v) for v in dup.field("values")[:3].to_pylist()]


def _summary(out: Path, manifest: dict, seconds: float, log) -> dict:
    t = totals(manifest)
    n_dup, examples = duplicate_ids(out, manifest)
    manifest["import"]["totals"] = {**t, "duplicate_ids": n_dup}
    write_manifest(out, seal(manifest))  # the completion record, last: only now may preflight and the trainer use it
    log(f"{out}: {t['samples']:,} samples, {t['tokens']:,} tokens ({t['masked_tokens'] / max(t['tokens'], 1):.1%} "
        f"masked) from {t['rows']:,} rows in {len(manifest['shards'])} shard(s), {seconds:.0f} s")
    left_out = [f"{t[k]:,} {what}" for k, what in (("malformed", "malformed"), ("no_assistant", "without an assistant "
                "token"), ("too_long", "longer than --max-length (dropped)")) if t[k]]
    if t["truncated"]:
        left_out.append(f"{t['truncated']:,} truncated to --max-length (kept)")
    if left_out:
        log(f"  {'; '.join(left_out)}" + (f"; reasons in {out / SKIPPED}" if (out / SKIPPED).exists() else ""))
    if n_dup:
        log(f"  {n_dup:,} duplicate id(s), e.g. {', '.join(examples)} (rows kept; make ids unique to trace samples)")
    return manifest
