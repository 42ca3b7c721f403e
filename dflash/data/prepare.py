"""Training data from the target's own completions: prompts -> greedy completions -> Arrow shards.

    uv run dflash-data prepare --target smollm2 --prompts chitchat --out data/chitchat --limit 512
    uv run dflash-data merge data/a data/b --out data/ab
    uv run dflash-data manifest data/from-elsewhere --target models/qwen3-8b   # record target + hashes

Each prompt goes through the target's chat template; the target completes it greedily (batched,
left padding); a sample is the prompt's token ids followed by the completion's token ids (up to
and including the end-of-turn token), and its loss mask is 1 exactly on the completion. The
generated ids are stored as generated (not decoded and re-tokenized), so the data is exactly
what the target produces.

Shard i holds prompts [i*K, (i+1)*K) of the (limited) prompt list. ``manifest.json`` records the
settings and, per finished shard, the prompt range it holds; a rerun with the same settings
skips finished shards, so an interrupted prepare resumes without duplicating any sample. A
rerun with other settings (prompts, target, max_new_tokens, shard size) is refused. The manifest
also records the target's fingerprint and each shard's size and sha256 (``dflash.data`` owns that
format), which preflight's `dataset` check compares with the run's target and the shards on disk.

``merge`` copies shards into a new folder and never writes into an input: an --out inside an input
(or an input inside --out) is refused, as are the same folder twice, shards with the same content
(sha256) and inputs built for different targets; an output it replaces (--overwrite) is moved aside,
never deleted. ``manifest`` records the target and the shard hashes of data written by other tools.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import re
import shutil
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from dflash.config import ConfigError
from dflash.data.identity import (
    COMPLETE,
    MANIFEST_NAME,
    SHARD_GLOB,
    DatasetError,
    ValueStats,
    compare_targets,
    read_manifest,
    seal,
    shard_records,
    target_fingerprint,
    unfinished_writer,
    value_stats,
)
from dflash.data.identity import write_manifest as write_manifest
from dflash.data.prompts import load_prompts, prompts_within, source_fingerprint
from dflash.data.shards import ShardDataset, open_shard, write_shard
from dflash.errors import DflashError
from dflash.filehash import CHUNK

MANIFEST = MANIFEST_NAME
SHARD_NAME = "shard-{:05d}.arrow"
ENGINES = ("transformers", "sglang")
INFER_PROFILE_CMD = "uv run --no-default-groups --group infer-cu130 --group dev dflash-data prepare ..."


class PrepareError(DflashError):
    """Bad input for prepare/merge; the message is one line naming the problem and the fix."""

    exit_code = 2  # bad input


@dataclass
class PrepareSettings:
    target: str  # what the user gave (--target)
    prompts: str  # what the user gave (--prompts)
    out: Path
    max_new_tokens: int = 256  # completion tokens per prompt, at most
    limit: int | None = None  # first N prompts only
    batch_size: int = 16  # prompts per generate call
    shard_size: int = 64  # samples per shard (the unit of resume)
    engine: str = "transformers"
    device: str = "auto"  # auto = cuda if available, else cpu


# ---------------------------------------------------------------------------------------------
# Manifest: the target it was built for


def _fingerprint(target: str) -> dict:
    try:
        return target_fingerprint(target)
    except ConfigError as e:
        raise PrepareError(f"--target {target}: {e.one_line()}") from None


def _settings_key(s: PrepareSettings, fingerprint: str, tokenizer) -> dict:
    return {
        "target": s.target,
        "prompts": s.prompts,
        "prompts_fingerprint": fingerprint,
        "max_new_tokens": s.max_new_tokens,
        "shard_size": s.shard_size,
        "chat_template_sha": source_fingerprint([getattr(tokenizer, "chat_template", None) or ""]),
    }


def _check_resumable(out: Path, manifest: dict | None, key: dict) -> dict:
    """The manifest to continue from: the existing one when its settings match, else a fresh one."""
    if manifest is None:
        stray = [p.name for p in out.glob(SHARD_GLOB)] if out.is_dir() else []
        if stray:
            raise PrepareError(f"{out}: holds {len(stray)} shard(s) but no {MANIFEST}, so a resume cannot tell which "
                               f"prompts they hold; use another --out")
        return {"settings": key, "shards": {}}
    old = manifest.get("settings", {})
    differ = [k for k in key if old.get(k) != key[k]]
    if differ:
        what = ", ".join(f"{k} {old.get(k)!r} -> {key[k]!r}" for k in differ)
        raise PrepareError(
            f"{out}: prepared with other settings ({what}); resume with the same ones or use another --out"
        )
    return manifest


def _check_target(out: Path, manifest: dict, target: dict) -> None:
    """A resumed prepare must complete the same target it started with (a model folder replaced under its path)."""
    recorded = manifest.get("target")
    if isinstance(recorded, dict):
        bad, _ = compare_targets(recorded, target)
        if bad:
            raise PrepareError(f"{out}: prepared for another target ({', '.join(bad)}); use another --out")
    manifest["target"] = target


def plan_shards(num_prompts: int, shard_size: int) -> list[tuple[str, int, int]]:
    """(file name, first prompt, end prompt) for every shard of the list."""
    return [(SHARD_NAME.format(i), start, min(start + shard_size, num_prompts))
            for i, start in enumerate(range(0, num_prompts, shard_size))]


def _done(out: Path, manifest: dict, name: str, start: int, end: int) -> bool:
    entry = manifest["shards"].get(name)
    return bool(entry) and entry["start"] == start and entry["end"] >= end and (out / name).is_file()


# ---------------------------------------------------------------------------------------------
# Generation engines


def _pick_device(device: str):
    import torch

    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def eos_ids_of(model, tokenizer) -> list[int]:
    eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    if eos is None:
        eos = tokenizer.eos_token_id
    eos = [eos] if isinstance(eos, int) else list(eos or [])
    if not eos:
        raise PrepareError("the target defines no end-of-sequence token (generation_config.eos_token_id)")
    return eos


def trim_completion(ids: list[int], eos_ids: list[int]) -> list[int]:
    """The completion up to and including its first end-of-sequence token."""
    for i, t in enumerate(ids):
        if t in eos_ids:
            return ids[: i + 1]
    return ids


class TransformersEngine:
    """Batched greedy generation with transformers (left padding), on CPU or one GPU."""

    def __init__(self, model_path: Path, device: str):
        import torch

        from dflash.models.target import load_target

        self.device = _pick_device(device)
        dtype = torch.bfloat16 if self.device.type == "cuda" else torch.float32
        self.model = load_target(model_path, dtype, self.device)

    def generate(
        self, prompts_ids: list[list[int]], max_new: list[int], pad_id: int, eos_ids: list[int]
    ) -> list[list[int]]:
        import torch

        width = max(map(len, prompts_ids))
        ids = torch.full((len(prompts_ids), width), pad_id, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for row, p in enumerate(prompts_ids):
            ids[row, width - len(p):] = torch.tensor(p)
            mask[row, width - len(p):] = 1
        out = self.model.generate(input_ids=ids.to(self.device), attention_mask=mask.to(self.device),
                                  max_new_tokens=max(max_new), do_sample=False, pad_token_id=pad_id,
                                  eos_token_id=eos_ids)
        new = out[:, width:].tolist()
        return [trim_completion(row[:n], eos_ids) for row, n in zip(new, max_new)]


class SglangEngine:
    """Greedy generation with sglang's offline engine (infer-cu130 profile, GPU)."""

    def __init__(self, model_path: Path, device: str):
        import sglang

        self.engine = sglang.Engine(model_path=str(model_path), skip_tokenizer_init=True)

    def generate(self, prompts_ids, max_new, pad_id, eos_ids):
        params = [{"temperature": 0.0, "max_new_tokens": n, "stop_token_ids": eos_ids} for n in max_new]
        outs = self.engine.generate(input_ids=prompts_ids, sampling_params=params)
        return [trim_completion(list(o["output_ids"]), eos_ids)[:n] for o, n in zip(outs, max_new)]


def check_engine(engine: str) -> None:
    if engine not in ENGINES:
        raise PrepareError(f"--engine {engine!r}: choose one of {', '.join(ENGINES)}")
    if engine == "sglang" and importlib.util.find_spec("sglang") is None:
        raise PrepareError(f"--engine sglang needs the infer-cu130 profile (sglang is not installed here); "
                           f"run: {INFER_PROFILE_CMD}")


# ---------------------------------------------------------------------------------------------
# Prepare


def context_length(model_path: Path) -> int | None:
    cfg = json.loads((model_path / "config.json").read_text())
    return cfg.get("max_position_embeddings")


def prepare(s: PrepareSettings, log=print, progress: bool | None = None) -> dict:
    """Generate, tokenize and write the missing shards of `s.out`; returns the final manifest.

    Every setting, the prompts and the target folder are checked before torch or the target loads.
    """
    import sys

    from dflash.memory.shape import load_target_shape
    from dflash.models import smollm2
    from dflash.models.smollm2_convert import resolve_target

    check_engine(s.engine)
    if not re.fullmatch(r"auto|cpu|cuda(:\d+)?", s.device):
        raise PrepareError(f"--device {s.device!r}: use auto, cpu or cuda (cuda:N for one GPU)")
    source = load_prompts(s.prompts)
    fingerprint = source_fingerprint(source)  # of the whole source, so a resume may raise --limit
    prompts = source[: s.limit]
    if not prompts:
        raise PrepareError(f"--prompts {s.prompts} --limit {s.limit}: no prompts selected")
    problem = smollm2.target_problem(s.target)  # TargetNotFound, one line, when the package is missing
    if problem:
        raise PrepareError(problem)
    if not smollm2.is_embedded(s.target):
        load_target_shape(s.target)  # a broken config.json is one line here
    out = Path(s.out)
    if out.exists() and not out.is_dir():
        raise PrepareError(f"--out {out}: is a file; give a folder (new, or one prepared with the same settings)")
    existing, problem = read_manifest(out)
    if problem:
        raise PrepareError(f"{out / MANIFEST}: {problem}; move the folder aside or use another --out")

    from tqdm import tqdm

    from dflash.models.target import load_target_tokenizer

    model_path = resolve_target(s.target, log=log)
    tokenizer = load_target_tokenizer(model_path)  # TargetError (one line) for custom code, missing or broken files
    manifest = _check_resumable(out, existing, _settings_key(s, fingerprint, tokenizer))
    _check_target(out, manifest, _fingerprint(s.target))
    context = context_length(model_path)
    prompt_ids = prompts_within(tokenizer, prompts, context)  # PromptError: a prompt with no room for a reply

    plan = plan_shards(len(prompts), s.shard_size)
    todo = [p for p in plan if not _done(out, manifest, *p)]
    done_prompts = sum(end - start for _, start, end in plan) - sum(end - start for _, start, end in todo)
    if not todo:
        if unfinished_writer(manifest):  # every shard written, the record not (killed at the very end, or older)
            write_manifest(out, seal(manifest))
        log(f"{out}: all {len(plan)} shard(s) already prepared ({len(prompts)} prompts); nothing to do")
        return manifest
    log(f"prepare: {len(prompts)} prompts from {s.prompts}, {len(plan)} shard(s) of {s.shard_size}"
        + (f", {len(plan) - len(todo)} already done (resuming)" if len(todo) < len(plan) else "")
        + f"; greedy completions of up to {s.max_new_tokens} tokens with {s.engine}")
    out.mkdir(parents=True, exist_ok=True)
    manifest.pop(COMPLETE, None)  # not whole until every shard is written
    write_manifest(out, manifest)
    engine = (SglangEngine if s.engine == "sglang" else TransformersEngine)(model_path, s.device)
    eos_ids = eos_ids_of(getattr(engine, "model", None), tokenizer)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos_ids[0]

    progress = sys.stderr.isatty() if progress is None else progress
    bar = tqdm(total=len(prompts), initial=done_prompts, unit="prompt", desc="generate", disable=not progress,
               dynamic_ncols=True)
    new_tokens, t0 = 0, time.perf_counter()
    try:
        for name, start, end in todo:
            ids, masks, n_new = _generate_shard(engine, prompt_ids[start:end], s, context, pad_id, eos_ids, bar)
            write_shard(out / name, ids, masks)
            manifest["shards"][name] = {"start": start, "end": end, "samples": len(ids),
                                        "tokens": sum(map(len, ids)), "completion_tokens": n_new,
                                        **shard_records([out / name])[name]}
            write_manifest(out, manifest)
            new_tokens += n_new
            rate = new_tokens / max(time.perf_counter() - t0, 1e-9)
            bar.set_postfix_str(f"{rate:.0f} tok/s")
            if not progress:
                log(f"  {name}: prompts {start}-{end - 1}, {n_new} completion tokens ({rate:.0f} tok/s)")
    finally:
        bar.close()
    write_manifest(out, seal(manifest))  # the completion record, last
    total = sum(e["samples"] for e in manifest["shards"].values())
    log(f"{out}: {total} samples in {len(manifest['shards'])} shard(s); "
        f"{new_tokens} tokens generated in {time.perf_counter() - t0:.0f} s")
    return manifest


def _generate_shard(engine, prompts_ids, s: PrepareSettings, context, pad_id, eos_ids, bar):
    """Completions for one shard, batched by similar prompt length; samples keep prompt order."""
    order = sorted(range(len(prompts_ids)), key=lambda i: len(prompts_ids[i]))
    completions: list[list[int] | None] = [None] * len(prompts_ids)
    for b in range(0, len(order), s.batch_size):
        rows = order[b : b + s.batch_size]
        batch = [prompts_ids[i] for i in rows]
        room = [s.max_new_tokens if context is None else min(s.max_new_tokens, context - len(p)) for p in batch]
        for i, c in zip(rows, engine.generate(batch, room, pad_id, eos_ids)):
            completions[i] = c
        bar.update(len(rows))
    ids = [p + c for p, c in zip(prompts_ids, completions)]
    masks = [[0] * len(p) + [1] * len(c) for p, c in zip(prompts_ids, completions)]
    return ids, masks, sum(map(len, completions))


# ---------------------------------------------------------------------------------------------
# Merge


def _aside(path: Path, stem: str) -> Path:
    """An unused sibling name for `path` moved out of the way: <name>.<stem>-<time>[.n]."""
    base = path.with_name(f"{path.name}.{stem}-{time.strftime('%Y%m%d-%H%M%S')}")
    aside, n = base, 1
    while aside.exists():
        aside, n = base.with_name(f"{base.name}.{n}"), n + 1
    return aside


def _check_merge_paths(inputs: list[Path], out: Path) -> None:
    """No input twice, no --out inside an input (it would be written into), no input inside --out (replacing
    --out would move it)."""
    seen: dict[Path, Path] = {}
    o = out.resolve()
    for src in inputs:
        r = src.resolve()
        if r in seen:
            raise PrepareError(f"merge: {src} is given twice (the same folder as {seen[r]}); give each input once")
        seen[r] = src
        if o == r or r in o.parents:
            raise PrepareError(f"merge: --out {out} is inside the input {src}, which merge never writes to; "
                               "pick an --out outside every input")
        if o in r.parents:
            raise PrepareError(f"merge: the input {src} is inside --out {out}, which --overwrite would move aside; "
                               "pick another --out")


def _copy_hashed(src: Path, dst: Path) -> str:
    """Copy a file, returning the sha256 of the bytes copied (one read of the input)."""
    h = hashlib.sha256()
    with open(src, "rb", buffering=0) as fi, open(dst, "wb") as fo:
        buf = bytearray(CHUNK)
        view = memoryview(buf)
        while n := fi.readinto(buf):
            h.update(view[:n])
            fo.write(view[:n])
        fo.flush()
        os.fsync(fo.fileno())
    return h.hexdigest()


def _duplicates(hashes: dict[str, list[str]]) -> list[str]:
    """'a/x.arrow = b/x.arrow' for every content (sha256) held by more than one shard."""
    return [" = ".join(where) for where in hashes.values() if len(where) > 1]


def merge(inputs: list[Path], out: Path, overwrite: bool = False, log=print) -> dict:
    """Copy the shards of every input into a new folder `out`, in input order; inputs are never written.

    Refused: an input twice (same folder, or shards with the same content), --out inside an input or an
    input inside --out, inputs built for different targets, an existing --out without `overwrite`. With
    `overwrite` the old --out is moved aside (``<out>.replaced-<time>``), never deleted.
    """
    out = Path(out)
    inputs = [Path(src) for src in inputs]
    if len(inputs) < 1:
        raise PrepareError("merge: give at least one input folder")
    _check_merge_paths(inputs, out)
    if out.exists() and not overwrite:
        raise PrepareError(f"merge: {out} already exists; pick another --out or pass --overwrite")
    sources, targets, recorded = [], [], {}
    for src in inputs:
        try:
            ds = ShardDataset(src)
        except DatasetError as e:
            raise PrepareError(f"merge: {e}") from None
        manifest, problem = read_manifest(src)
        if problem:
            raise PrepareError(f"merge: {src / MANIFEST}: {problem}; restore it or move it aside")
        target = (manifest or {}).get("target")
        targets.append(target if isinstance(target, dict) else None)
        for name, rec in ((manifest or {}).get("shards") or {}).items():
            if isinstance(rec, dict) and rec.get("sha256"):
                recorded.setdefault(rec["sha256"], []).append(str(src / name))
        sources.append((src, ds))
    known = [(src, t) for (src, _), t in zip(sources, targets) if t is not None]
    for src, t in known[1:]:
        bad, _ = compare_targets(known[0][1], t)
        if bad:
            raise PrepareError(f"merge: {src} was built for another target than {known[0][0]} ({', '.join(bad)}); "
                               "merge data of one target")
    dup = _duplicates(recorded)
    if dup:
        raise PrepareError(f"merge: the same shard content twice ({'; '.join(dup[:3])}); give each input once")
    tmp = out.with_name(f".{out.name}.{os.getpid()}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        jobs = [(src, shard, tmp / f"part{j:03d}-{shard.name}") for j, (src, ds) in enumerate(sources)
                for shard in ds.shards]
        with ThreadPoolExecutor(min(8, os.cpu_count() or 1)) as pool:
            digests = list(pool.map(lambda job: _copy_hashed(job[1], job[2]), jobs))
        by_content: dict[str, list[str]] = {}
        for (_, shard, _), digest in zip(jobs, digests):
            by_content.setdefault(digest, []).append(str(shard))
        dup = _duplicates(by_content)
        if dup:
            raise PrepareError(f"merge: the same shard content twice ({'; '.join(dup[:3])}); give each input once")
        entries = [{"path": str(src), "samples": ds.num_samples, "tokens": ds.num_tokens,
                    "fingerprint": ds.fingerprint, "target": t} for (src, ds), t in zip(sources, targets)]
        manifest = {
            "merged_from": entries,
            "target": known[0][1] if known and len(known) == len(sources) else None,
            "shards": {dst.name: {"bytes": dst.stat().st_size, "sha256": digest, "from": str(shard),
                                  "samples": ds.counts[shard.name][0], "tokens": ds.counts[shard.name][1]}
                       for (_, shard, dst), digest, ds in zip(jobs, digests, (ds for _, ds in sources
                                                                             for _ in ds.shards))},
        }
        write_manifest(tmp, seal(manifest))
        merged = ShardDataset(tmp)  # the result must open as one dataset
        if out.exists() or out.is_symlink():
            aside = _aside(out, "replaced")
            out.rename(aside)
            log(f"merge: the previous {out} moved to {aside} (nothing deleted)")
        tmp.rename(out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    if manifest["target"] is None:
        log(f"merge: {len(sources) - len(known)} input(s) do not record their target, so {out} does not either; "
            "record it with: dflash-data manifest " + f"{out} --target TARGET")
    log(f"{out}: {merged.num_samples} samples, {merged.num_tokens} tokens from "
        + " + ".join(f"{e['path']} ({e['samples']})" for e in entries))
    return manifest


# ---------------------------------------------------------------------------------------------
# Manifest of data written elsewhere


def shard_values(path: Path) -> ValueStats:
    """Token id / loss_mask ranges and learnable positions of one shard (memory-mapped, vectorised). Raises
    ShardError when the reader (open_shard) refuses it."""
    opened = open_shard(path)
    try:
        return value_stats(opened.column("input_ids"), opened.column("loss_mask"))
    finally:
        opened.close()


def record_manifest(path: Path, target: str, log=print) -> dict:
    """Record in `path`/manifest.json the target the data was built for and every shard's size, sha256, samples
    and tokens (counted from the shards), sealed with the completion record (``dflash.data.identity.seal``).

    For data written by other tools (or by an older version). Refused when a token id does not fit the
    target's vocabulary, when the manifest already names another target, or when a shard differs from
    the sha256 the manifest recorded (restore it, or move manifest.json aside to record the new content), or
    when import or prepare wrote the folder and did not finish (rerun that command instead).
    """
    path = Path(path)
    try:
        ds = ShardDataset(path, whole=False)  # this command recounts what the manifest says
    except DatasetError as e:
        raise PrepareError(f"manifest: {e}") from None
    fp = _fingerprint(target)
    manifest, problem = read_manifest(path)
    if problem:
        raise PrepareError(f"{path / MANIFEST}: {problem}; move the folder aside or use another --out")
    manifest = manifest or {}
    writer = unfinished_writer(manifest)
    if writer:
        raise PrepareError(f"manifest: dflash-data {writer} did not finish writing {path} (no completion record); "
                           f"rerun the same dflash-data {writer} command: it resumes and finishes")
    recorded_target = manifest.get("target")
    if isinstance(recorded_target, dict):
        bad, _ = compare_targets(recorded_target, fp)
        if bad:
            raise PrepareError(f"manifest: {path} is recorded as built for another target ({', '.join(bad)}); "
                               "give that target, or move manifest.json aside")
    stats = ValueStats()
    for shard in ds.shards:
        stats = stats.merge(shard_values(shard))
    if stats.max_id is not None and (stats.max_id >= fp["vocab_size"] or stats.min_id < 0):
        raise PrepareError(f"manifest: {path} holds token ids {stats.min_id:,}..{stats.max_id:,}, outside the "
                           f"vocabulary of {target} ({fp['vocab_size']:,}): it was not built for this target")
    records = shard_records(ds.shards)
    old = manifest.get("shards") if isinstance(manifest.get("shards"), dict) else {}
    changed = [n for n, r in records.items() if isinstance(old.get(n), dict) and old[n].get("sha256")
               and old[n]["sha256"] != r["sha256"]]
    if changed:
        raise PrepareError(f"manifest: {', '.join(changed)} differ(s) from the sha256 {MANIFEST} recorded; restore "
                           f"the shard(s), or move {MANIFEST} aside to record the new content")
    manifest["target"] = fp
    manifest["shards"] = {n: {**(old.get(n) if isinstance(old.get(n), dict) else {}), **r,
                              "samples": ds.counts[n][0], "tokens": ds.counts[n][1]} for n, r in records.items()}
    write_manifest(path, seal(manifest))
    log(f"{path / MANIFEST}: {len(records)} shard(s), {ds.num_samples} samples, {ds.num_tokens} tokens; target "
        f"{target} (vocab {fp['vocab_size']:,}); token ids {stats.min_id}..{stats.max_id}")
    return manifest
