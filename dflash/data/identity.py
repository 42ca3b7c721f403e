"""What a dataset is: its shard files, fingerprints, the manifest beside the shards and the target it was built for.

Shard format: a folder of Arrow IPC *file* format shards ``*.arrow`` (read in name order), uncompressed, with two
columns: ``input_ids: list<int32>`` (prompt + completion) and ``loss_mask: list<int8>`` (1 on the tokens to learn).

The manifest ``manifest.json`` that ``dflash-data prepare``/``import``/``merge``/``manifest`` write beside the shards::

    {"target": {"vocab_size", "model_type", "num_layers", "hidden", "tokenizer_sha256"} | null,
     "shards": {"shard-00000.arrow": {"bytes": int, "sha256": hex, "samples": int, "tokens": int, ...}},
     ... what wrote it: "settings" (prepare, import), "merged_from" (merge),
     "complete": {"shards", "samples", "tokens", "sha256"}}

``complete`` is the completion record: the last thing a writer puts there, in one atomic write, when every shard is
written (``seal``). Its ``sha256`` covers the totals and every shard's samples, tokens, bytes and sha256. A manifest
of ``import`` or ``prepare`` without it is a dataset whose writer did not finish (killed half-way): ``whole_problem``
says so, and preflight's `dataset` check and the trainer's ``ShardDataset`` both refuse it, and any recorded count
that disagrees with the shards' own row and token counts (read from the Arrow metadata and offsets, no data).

``target_fingerprint`` says what data built for a target must match (its vocabulary and tokenizer files);
``value_stats`` reads a shard's token id range, loss_mask range and learnable positions vectorised, which
preflight's `dataset` check judges. Torch-free.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa

from dflash.errors import DflashError
from dflash.filehash import sha256_files

COLUMNS = ("input_ids", "loss_mask")
SHARD_GLOB = "*.arrow"
MANIFEST_NAME = "manifest.json"
# A tokenizer is whichever of these files its folder holds; their bytes are its identity.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tiktoken.model", "vocab.json", "merges.txt", "vocab.txt")
# Reading an uncompressed shard from a memory map allocates (almost) nothing; more than this
# means Arrow decompressed or copied the shard into RAM.
_MAX_READ_ALLOC = 1 << 20  # bytes


class DatasetError(DflashError):
    """A dataset that cannot be used as is; the message is one line naming the file and the fix."""

    exit_code = 2  # bad input


# ---------------------------------------------------------------------------------------------
# Identity: which shards a data path names, and the fingerprint checkpoints and preflight compare


def shard_files(path: str | Path) -> list[Path]:
    """The shards a data path names, in read order: the path itself if it is one ``*.arrow`` file, else the
    folder's ``*.arrow`` files sorted by name (hidden ones, such as a write in progress, skipped); [] if none."""
    path = Path(path)
    if path.is_file() and path.suffix == ".arrow":
        return [path]
    if not path.is_dir():
        return []
    return sorted(p for p in path.glob(SHARD_GLOB) if not p.name.startswith(".") and p.is_file())


def dataset_fingerprint(shards: Iterable[tuple[str, int, int]]) -> str:
    """Cheap identity of a dataset from (shard name, size in bytes, rows) in read order: 16 hex digits.

    Recorded in every checkpoint's meta.json (``dataset.fingerprint``) and computed by preflight's
    `dataset` facts, so a resume can tell whether the data changed under it.
    """
    described = "\n".join(f"{name}:{size}:{rows}" for name, size, rows in shards)
    return hashlib.sha256(described.encode()).hexdigest()[:16]


def _one_line(err: BaseException) -> str:
    text = str(err).strip().splitlines()
    return text[0] if text else type(err).__name__


def tokenizer_sha256(folder: str | Path) -> str | None:
    """sha256 over the names and contents of the tokenizer files in a model folder; None when it holds none."""
    folder = Path(folder)
    found = [folder / name for name in TOKENIZER_FILES if (folder / name).is_file()]
    if not found:
        return None
    hashes = sha256_files(found)
    h = hashlib.sha256()
    for path in found:
        digest = hashes[path]
        if isinstance(digest, OSError):
            raise digest
        h.update(f"{path.name}\0{digest}\n".encode())
    return h.hexdigest()


def target_fingerprint(target: str) -> dict:
    """What data built for `target` (a model folder, or "smollm2") must match: its vocabulary and tokenizer.

    ``{"vocab_size", "model_type", "num_layers", "hidden", "tokenizer_sha256"}`` from the target's
    config.json (``dflash.memory.shape.load_target_shape``) and tokenizer files; ``tokenizer_sha256`` is None
    when there are none (the embedded smollm2 before its first conversion). Raises ConfigError.
    """
    from dflash.memory.shape import load_target_shape
    from dflash.models import smollm2

    shape = load_target_shape(target)
    folder = smollm2.local_folder(target)
    tok = tokenizer_sha256(folder) if folder.is_dir() and (not smollm2.is_embedded(target) or smollm2.is_converted()) else None
    return {"vocab_size": shape.vocab, "model_type": shape.model_type, "num_layers": shape.num_layers,
            "hidden": shape.hidden, "tokenizer_sha256": tok}


def compare_targets(recorded: dict, current: dict) -> tuple[list[str], list[str]]:
    """(mismatches, notes) between the target a dataset was built for and the run's target.

    A mismatch makes the token ids mean other tokens or crash the embedding (another vocabulary size,
    other tokenizer files); a note is a difference the ids survive (completions of another model
    with the same tokenizer). Tokenizers are compared when both sides have tokenizer files.
    """
    bad, notes = [], []
    if recorded.get("vocab_size") != current.get("vocab_size"):
        bad.append(f"vocab_size {recorded.get('vocab_size')} -> {current.get('vocab_size')}")
    a, b = recorded.get("tokenizer_sha256"), current.get("tokenizer_sha256")
    if a and b and a != b:
        bad.append(f"tokenizer files differ (sha256 {a[:12]} -> {b[:12]})")
    model = [f"{k} {recorded.get(k)} -> {current.get(k)}" for k in ("model_type", "num_layers", "hidden")
             if recorded.get(k) != current.get(k)]
    if model and not bad:
        notes.append(f"completions of another model with the same tokenizer ({', '.join(model)})")
    return bad, notes


# ---------------------------------------------------------------------------------------------
# The manifest


def read_manifest(folder: str | Path, name: str = MANIFEST_NAME) -> tuple[dict | None, str | None]:
    """(the JSON object in `folder`/`name`, None); (None, None) when there is none; (None, why) when unreadable.

    The one reader of the manifests beside what they describe: a dataset's manifest.json and the compile cache's
    (``dflash.runs.compile_artifact`` keeps its own in the artifact); each caller words the refusal for its own command."""
    path = Path(folder) / name
    try:
        manifest = json.loads(path.read_text())
    except FileNotFoundError:
        return None, None
    except (OSError, UnicodeDecodeError, ValueError) as e:
        return None, f"{name} unreadable ({_one_line(e)})"
    if not isinstance(manifest, dict):
        return None, f"{name} unreadable (not a JSON object)"
    return manifest, None


def write_manifest(folder: str | Path, manifest: dict) -> None:
    """Write manifest.json atomically (temp file + rename)."""
    folder = Path(folder)
    tmp = folder / f".{MANIFEST_NAME}.{os.getpid()}.tmp"
    tmp.write_text(json.dumps(manifest, indent=2) + "\n")
    os.replace(tmp, folder / MANIFEST_NAME)


COMPLETE = "complete"  # the key of the completion record
_SEALED = ("samples", "tokens", "bytes", "sha256")  # what the record's checksum covers, per shard


def _seal_sha256(manifest: dict, totals: dict) -> str:
    shards = manifest.get("shards") if isinstance(manifest.get("shards"), dict) else {}
    covered = {"totals": totals, "shards": {n: {k: r.get(k) for k in _SEALED} if isinstance(r, dict) else r
                                            for n, r in sorted(shards.items())}}
    return hashlib.sha256(json.dumps(covered, sort_keys=True).encode()).hexdigest()


def seal(manifest: dict) -> dict:
    """Set the completion record: shard count, samples, tokens over ``manifest["shards"]`` (each shard records
    samples, tokens, bytes, sha256) and the checksum over them. Writers call it last, then write_manifest."""
    shards = manifest["shards"]
    totals = {"shards": len(shards), "samples": sum(int(r["samples"]) for r in shards.values()),
              "tokens": sum(int(r["tokens"]) for r in shards.values())}
    manifest[COMPLETE] = {**totals, "sha256": _seal_sha256(manifest, totals)}
    return manifest


def unfinished_writer(manifest: dict) -> str | None:
    """'import' or 'prepare' when that command wrote this manifest and has not sealed it, else None."""
    if isinstance(manifest.get(COMPLETE), dict):
        return None
    return "import" if "import" in manifest else "prepare" if "settings" in manifest else None


def whole_problem(folder: str | Path, manifest: dict, counted: dict[str, tuple[int, int]]) -> tuple[str, str] | None:
    """(why the dataset in `folder` is not whole, the fix); None when it is.

    `counted`: {shard name: (rows, tokens)} as the reader counted them from the shards themselves. Refused: a
    manifest of import/prepare without its completion record, a record whose checksum does not match (edited), and
    any shard or total whose recorded samples/tokens differ from the counted ones.
    """
    writer = unfinished_writer(manifest)
    if writer:
        return (f"dflash-data {writer} did not finish writing {folder} (no completion record in {MANIFEST_NAME}: "
                "killed half-way?)", f"rerun the same dflash-data {writer} command: it resumes and finishes")
    recount = (f"restore {MANIFEST_NAME}, or recount it from the shards with dflash-data manifest {folder} "
               "--target TARGET")
    record = manifest.get(COMPLETE)
    if record is not None:
        totals = {k: record.get(k) for k in ("shards", "samples", "tokens")} if isinstance(record, dict) else {}
        if not isinstance(record, dict) or record.get("sha256") != _seal_sha256(manifest, totals):
            return f"{folder}/{MANIFEST_NAME} was edited after it was written (its completion checksum differs)", recount
    shards = manifest.get("shards") if isinstance(manifest.get("shards"), dict) else {}
    for name, (rows, tokens) in counted.items():
        rec = shards.get(name)
        for what, have in (("samples", rows), ("tokens", tokens)):
            if isinstance(rec, dict) and what in rec and rec[what] != have:
                return f"{folder}/{name} holds {have:,} {what} but {MANIFEST_NAME} records {rec[what]!r}", recount
    if record is not None:
        rows, tokens = sum(r for r, _ in counted.values()), sum(t for _, t in counted.values())
        if (totals["samples"], totals["tokens"]) != (rows, tokens):
            return (f"the shards of {folder} hold {rows:,} samples and {tokens:,} tokens but {MANIFEST_NAME} records "
                    f"{totals['samples']:,} and {totals['tokens']:,}", recount)
    return None


def shard_records(paths: Iterable[str | Path]) -> dict[str, dict]:
    """{shard name: {"bytes": size, "sha256": hex}}, hashed in parallel threads. Raises OSError."""
    paths = [Path(p) for p in paths]
    hashes = sha256_files(paths)
    out = {}
    for p in paths:
        if isinstance(hashes[p], OSError):
            raise hashes[p]
        out[p.name] = {"bytes": p.stat().st_size, "sha256": hashes[p]}
    return out


# ---------------------------------------------------------------------------------------------
# Values: what the trainer will index with, vectorised


@dataclass
class ValueStats:
    """Token id and loss_mask ranges of a shard and how many positions it can learn from (None: no tokens)."""

    min_id: int | None = None
    max_id: int | None = None
    mask_min: int | None = None
    mask_max: int | None = None
    anchors: int = 0  # positions a with loss_mask[a] and loss_mask[a+1] in one sample: where blocks can start

    def merge(self, other: ValueStats) -> ValueStats:
        def pick(f, a, b):
            return b if a is None else a if b is None else f(a, b)

        return ValueStats(pick(min, self.min_id, other.min_id), pick(max, self.max_id, other.max_id),
                          pick(min, self.mask_min, other.mask_min), pick(max, self.mask_max, other.mask_max),
                          self.anchors + other.anchors)


def value_stats(input_ids, loss_mask) -> ValueStats:
    """Ranges and learnable positions of two list<int> columns (Array or ChunkedArray), without a Python loop
    over rows: pyarrow min/max over the flattened values, one numpy pass over loss_mask for the anchors."""
    import pyarrow.compute as pc

    ids_chunks = input_ids.chunks if isinstance(input_ids, pa.ChunkedArray) else [input_ids]
    mask_chunks = loss_mask.chunks if isinstance(loss_mask, pa.ChunkedArray) else [loss_mask]
    out = ValueStats()
    for ids, mask in zip(ids_chunks, mask_chunks):
        flat_ids, flat_mask = ids.flatten(), mask.flatten()
        if len(flat_ids) == 0:
            continue
        ids_mm, mask_mm = pc.min_max(flat_ids), pc.min_max(flat_mask)
        part = ValueStats(ids_mm["min"].as_py(), ids_mm["max"].as_py(), mask_mm["min"].as_py(), mask_mm["max"].as_py())
        m = flat_mask.to_numpy(zero_copy_only=False)
        if m.size > 1:
            part.anchors = int(np.count_nonzero(m[:-1] & m[1:]))
            starts = np.unique(mask.offsets.to_numpy() - mask.offsets[0].as_py())  # each sample's first position
            starts = starts[(starts > 0) & (starts < m.size)]
            part.anchors -= int(np.count_nonzero(m[starts - 1] & m[starts]))  # pairs across two samples
        out = out.merge(part)
    return out
