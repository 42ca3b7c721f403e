"""Training data from the target's own completions: prompts -> greedy completions -> Arrow shards.

    uv run dflash-data prepare --target smollm2 --prompts chitchat --out data/chitchat --limit 512
    uv run dflash-data merge data/a data/b --out data/ab

Each prompt goes through the target's chat template; the target completes it greedily (batched,
left padding); a sample is the prompt's token ids followed by the completion's token ids (up to
and including the end-of-turn token), and its loss mask is 1 exactly on the completion. The
generated ids are stored as generated (not decoded and re-tokenized), so the data is exactly
what the target produces.

Shard i holds prompts [i*K, (i+1)*K) of the (limited) prompt list. ``manifest.json`` records the
settings and, per finished shard, the prompt range it holds; a rerun with the same settings
skips finished shards, so an interrupted prepare resumes without duplicating any sample. A
rerun with other settings (prompts, target, max_new_tokens, shard size) is refused.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

from dflash.data import SHARD_GLOB, DatasetError, ShardDataset, write_shard
from dflash.errors import DflashError
from dflash.prompts import chat_prompt_ids, load_prompts, source_fingerprint

MANIFEST = "manifest.json"
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
# Manifest


def read_manifest(out: Path) -> dict | None:
    path = out / MANIFEST
    if not path.exists():
        return None
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise PrepareError(f"{path}: unreadable manifest ({e}); move the folder aside or use another --out") from None


def write_manifest(out: Path, manifest: dict) -> None:
    tmp = out / f".{MANIFEST}.{os.getpid()}.tmp"
    tmp.write_text(json.dumps(manifest, indent=2) + "\n")
    os.replace(tmp, out / MANIFEST)


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

        from dflash.target import load_target

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


def tokenize_prompts(prompts: list[str], tokenizer, context: int | None, max_new_tokens: int) -> list[list[int]]:
    """Chat-templated ids per prompt; a prompt that leaves no room for a completion is an error."""
    out = []
    for i, text in enumerate(prompts):
        ids = chat_prompt_ids(tokenizer, text)
        if context is not None and len(ids) >= context:
            raise PrepareError(f"prompt {i} is {len(ids)} tokens with the chat template, the target's context is "
                               f"{context} (max_position_embeddings); shorten or drop it")
        out.append(ids)
    return out


def prepare(s: PrepareSettings, log=print, progress: bool | None = None) -> dict:
    """Generate, tokenize and write the missing shards of `s.out`; returns the final manifest.

    Every setting, the prompts and the target folder are checked before torch or the target loads.
    """
    import sys

    from dflash import smollm2
    from dflash.memory import load_target_shape

    check_engine(s.engine)
    if not re.fullmatch(r"auto|cpu|cuda(:\d+)?", s.device):
        raise PrepareError(f"--device {s.device!r}: use auto, cpu or cuda (cuda:N for one GPU)")
    source = load_prompts(s.prompts)
    fingerprint = source_fingerprint(source)  # of the whole source, so a resume may raise --limit
    prompts = source[: s.limit]
    if not prompts:
        raise PrepareError(f"--prompts {s.prompts} --limit {s.limit}: no prompts selected")
    if s.target == smollm2.NAME:
        if not smollm2.is_converted():
            smollm2.gguf_file()  # one line when the package is missing, before a conversion starts
    elif not (Path(s.target) / "config.json").is_file():
        raise PrepareError(
            f"--target {s.target}: no config.json there (expected a Hugging Face model folder or 'smollm2')"
        )
    else:
        load_target_shape(s.target)  # a broken config.json is one line here
    out = Path(s.out)
    if out.exists() and not out.is_dir():
        raise PrepareError(f"--out {out}: is a file; give a folder (new, or one prepared with the same settings)")
    existing = read_manifest(out)

    from tqdm import tqdm
    from transformers import AutoTokenizer

    model_path = smollm2.resolve_target(s.target, log=log)
    try:
        tokenizer = AutoTokenizer.from_pretrained(model_path)
    except (OSError, ValueError, KeyError) as e:
        raise PrepareError(f"--target {s.target}: cannot load its tokenizer ({' '.join(str(e).split())[:200]}); give a "
                           "Hugging Face model folder with tokenizer files") from None
    if len(tokenizer) < 2:  # transformers builds an empty tokenizer when the folder has no tokenizer files
        raise PrepareError(f"--target {s.target}: its tokenizer has no vocabulary (tokenizer files missing); give a "
                           "Hugging Face model folder with tokenizer files")
    manifest = _check_resumable(out, existing, _settings_key(s, fingerprint, tokenizer))
    context = context_length(model_path)
    prompt_ids = tokenize_prompts(prompts, tokenizer, context, s.max_new_tokens)

    plan = plan_shards(len(prompts), s.shard_size)
    todo = [p for p in plan if not _done(out, manifest, *p)]
    done_prompts = sum(end - start for _, start, end in plan) - sum(end - start for _, start, end in todo)
    if not todo:
        log(f"{out}: all {len(plan)} shard(s) already prepared ({len(prompts)} prompts); nothing to do")
        return manifest
    log(f"prepare: {len(prompts)} prompts from {s.prompts}, {len(plan)} shard(s) of {s.shard_size}"
        + (f", {len(plan) - len(todo)} already done (resuming)" if len(todo) < len(plan) else "")
        + f"; greedy completions of up to {s.max_new_tokens} tokens with {s.engine}")
    out.mkdir(parents=True, exist_ok=True)
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
                                        "tokens": sum(map(len, ids)), "completion_tokens": n_new}
            write_manifest(out, manifest)
            new_tokens += n_new
            rate = new_tokens / max(time.perf_counter() - t0, 1e-9)
            bar.set_postfix_str(f"{rate:.0f} tok/s")
            if not progress:
                log(f"  {name}: prompts {start}-{end - 1}, {n_new} completion tokens ({rate:.0f} tok/s)")
    finally:
        bar.close()
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


def merge(inputs: list[Path], out: Path, overwrite: bool = False, log=print) -> dict:
    """Copy the shards of every input into `out` (inputs untouched), in input order."""
    out = Path(out)
    if len(inputs) < 1:
        raise PrepareError("merge: give at least one input folder")
    for src in inputs:
        if Path(src).resolve() == out.resolve() or out.resolve() in Path(src).resolve().parents:
            raise PrepareError(f"merge: --out {out} is (inside) the input {src}; inputs stay untouched")
    if out.exists() and not overwrite:
        raise PrepareError(f"merge: {out} already exists; pick another --out or pass --overwrite")
    sources = []
    for src in inputs:
        try:
            ds = ShardDataset(src)
        except DatasetError as e:
            raise PrepareError(f"merge: {e}") from None
        sources.append((Path(src), ds))
    tmp = out.with_name(f".{out.name}.{os.getpid()}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        entries = []
        for j, (src, ds) in enumerate(sources):
            for shard in ds.shards:
                name = f"part{j:03d}-{shard.name}"
                shutil.copyfile(shard, tmp / name)
            entries.append({"path": str(src), "samples": ds.num_samples, "tokens": ds.num_tokens,
                            "fingerprint": ds.fingerprint})
        manifest = {"merged_from": entries}
        write_manifest(tmp, manifest)
        merged = ShardDataset(tmp)  # the result must open as one dataset
        if out.exists():
            shutil.rmtree(out)
        tmp.rename(out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    log(f"{out}: {merged.num_samples} samples, {merged.num_tokens} tokens from "
        + " + ".join(f"{e['path']} ({e['samples']})" for e in entries))
    return manifest
