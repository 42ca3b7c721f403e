"""The compile cache artifact: one file that carries a run's compiled kernels to another machine or container.

`dflash-train --warm-cache` writes it; every compiled run loads it before its first compile when it matches
(dflash.train.compile_cache); preflight's `compile-cache` check reads its manifest only. This module is the only
place that knows the file's layout and fields (torch-free: preflight imports it).

Layout: MAGIC, then the header's length (8 bytes, big-endian), the header (JSON: the manifest and, per section, its
name, size and sha256), then the sections back to back. A reader checks the magic (a foreign file), the header
and the file's size (a truncated copy) before anything else, and each section's sha256 before its bytes go
anywhere. Sections: "torch" (torch.compiler.save_cache_artifacts(): AOTAutograd, Inductor, Triton kernels
inductor built, autotuning) and, when the run filled one, "triton" (a tar of Triton's cache dir, where fla's
kernels and autotuning results live).

    write(path, manifest, {"torch": blob, "triton": tar})
    header, problem = read_header(path)           # (None, None): no file; (None, "truncated: ...") and so on
    manifest, sections = read_sections(path)      # ArtifactError(one line) unless every sha256 checks out
    differences(manifest, now)                    # ["torch 2.10.0+cu128 -> 2.11.0+cu130", "shape classes ..."]
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
from collections.abc import Mapping
from pathlib import Path

from dflash.errors import DflashError

MAGIC = b"DFLASH-COMPILE-CACHE\n"
FORMAT = 1  # the header's "format": a reader refuses any other
SUFFIX = ".dfcache"
_LENGTH = struct.Struct(">Q")
MAX_HEADER = 1 << 20  # a header longer than this is no header of ours

# What the compiled kernels depend on, from the machine: a change in any of them makes the artifact cold.
MACHINE_FIELDS = (
    "torch",  # torch version with local label, e.g. 2.11.0+cu130
    "triton",  # triton version (None without triton)
    "gpu_name",  # the GPU's name as CUDA reports it ("cpu" on a CPU run)
    "compute_capability",  # major.minor, e.g. 9.0 (None on a CPU run)
)
# ... and from the run (run_facts): the compiled graphs and the batch shapes warmed, no path of this machine.
RUN_FIELDS = (
    "target",  # the target's architecture (model_type, num_layers, hidden, vocab_size), dtype and target.compile
    "drafter",  # the [drafter] section, train.fp8 and train.recompute
    "shape_classes",  # dflash.data.plan.shape_classes: [[class, rows, tokens], ...]
)


class ArtifactError(DflashError):
    """A compile cache artifact that cannot be used (truncated, foreign, corrupted); the message is one line."""


def default_path(cfg, cache_dir: str | Path) -> Path:
    """Where --warm-cache writes and a run looks when train.compile_cache is empty: a folder beside the profile's
    compile cache dir (cleaning that dir keeps it), one file per run shape (its target and drafter hashes)."""
    cache_dir = Path(cache_dir).expanduser()
    return cache_dir.with_name(f"{cache_dir.name}.artifacts") / f"{cfg.target_hash()[:8]}-{cfg.drafter_hash()[:8]}{SUFFIX}"


def artifact_path(cfg, cache_dir: str | Path) -> Path:
    """train.compile_cache when set (a carried file), else default_path."""
    return Path(cfg.train.compile_cache).expanduser() if cfg.train.compile_cache else default_path(cfg, cache_dir)


def resolve(cfg, cache_dir: str | Path):
    """cfg with train.compile_cache set to artifact_path (what the commands hand to the trainer and its ranks)."""
    path = str(artifact_path(cfg, cache_dir))
    return cfg.model_copy(update={"train": cfg.train.model_copy(update={"compile_cache": path})})


def run_facts(cfg, target: Mapping[str, object], shape_classes: list) -> dict:
    """The run part of a manifest: `target` is dflash.data.identity.target_fingerprint(cfg.target.path), the shape
    classes dflash.data.plan.shape_classes(cfg, lengths). Paths are left out, so a copied artifact matches where the
    same model and data live elsewhere."""
    return {
        "target": {**{k: target.get(k) for k in ("model_type", "num_layers", "hidden", "vocab_size")},
                   "dtype": cfg.target.dtype, "precision": cfg.target.precision, "compile": cfg.target.compile},
        "drafter": {**cfg.drafter.model_dump(), "fp8": cfg.train.fp8, "recompute": cfg.train.recompute},
        "shape_classes": [list(c) for c in shape_classes],
    }


def classes_text(classes) -> str:
    """'rows >= 2 8 x 63, 7 x 45; one row 1 x 48' (packed: 'packed 5 x 512': sequences x tokens)."""
    by: dict[str, list[str]] = {}
    for name, rows, tokens in classes or []:
        by.setdefault(name, []).append(f"{rows} x {tokens}")
    return "; ".join(f"{name} {', '.join(shapes)}" for name, shapes in by.items()) or "none"


def differences(manifest: Mapping[str, object], now: Mapping[str, object]) -> list[str]:
    """One entry per field of `now` the manifest records differently: "torch 2.10.0 -> 2.11.0", "shape classes
    rows >= 2 8 x 63 -> rows >= 2 8 x 70", "drafter block_size 16 -> 32"."""
    out = []
    for k, v in now.items():
        old = manifest.get(k)
        if k == "shape_classes":
            if [list(c) for c in old or []] != [list(c) for c in v or []]:
                out.append(f"shape classes {classes_text(old)} -> {classes_text(v)}")
        elif isinstance(v, Mapping):
            old = old if isinstance(old, Mapping) else {}
            out += [f"{k} {f} {old[f]!s} -> {v[f]!s}" if f in old else f"{k} {f} not recorded (an older dflash "
                    f"made it) -> {v[f]!s}" for f in v if f not in old or str(old[f]) != str(v[f])]
            out += [f"{k} {f} {old[f]!s} -> None" for f in old if f not in v]
        elif str(old) != str(v):
            out.append(f"{k} {old!s} -> {v!s}")
    return out


def size_text(n: int) -> str:
    """'353.0 MB', '0.6 MB', '1,000 bytes'."""
    return f"{n / 1e6:,.1f} MB" if n >= 100_000 else f"{n:,} bytes"


def start_text(manifest: Mapping[str, object]) -> str:
    """'about 45 s to step 1 warm; cold about 120 s' from the starts --warm-cache measured (launch to the end of the
    warm-up, its first process cold-ish and a fresh one from this artifact with empty caches)."""
    warm, cold = (manifest.get(k) or {} for k in ("warm", "cold"))
    parts = []
    if isinstance(warm, Mapping) and warm.get("seconds") is not None:
        parts.append(f"warm: about {warm['seconds']:.0f} s to step 1")
    if isinstance(cold, Mapping) and cold.get("seconds") is not None:
        parts.append(f"cold about {cold['seconds']:.0f} s")
    return "; ".join(parts) or "start not measured"


def write(path: str | Path, manifest: Mapping[str, object], sections: Mapping[str, bytes]) -> Path:
    """Write the artifact atomically (temp file + rename): `sections` in their order, each with its sha256."""
    path = Path(path)
    header = {"format": FORMAT, "manifest": dict(manifest),
              "sections": [{"name": name, "size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
                           for name, data in sections.items()]}
    blob = json.dumps(header, indent=1).encode()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with open(tmp, "wb") as f:
            f.write(MAGIC + _LENGTH.pack(len(blob)) + blob)
            for data in sections.values():
                f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return path


def read_header(path: str | Path) -> tuple[dict | None, str | None]:
    """(header, None) for a whole artifact; (None, None) when there is no file; (None, why) for a foreign,
    unreadable or truncated one. Reads the header and the file's size only (no section is read or hashed)."""
    path = Path(path)
    try:
        with open(path, "rb") as f:
            magic, length = f.read(len(MAGIC)), f.read(_LENGTH.size)
            if magic != MAGIC:
                return None, (f"truncated: {len(magic)} bytes" if MAGIC.startswith(magic)
                              else "not a dflash compile cache artifact")
            if len(length) < _LENGTH.size:
                return None, f"truncated: {len(magic) + len(length)} bytes, its header's length cut"
            (n,) = _LENGTH.unpack(length)
            if n > MAX_HEADER:
                return None, f"not a dflash compile cache artifact (header length {n:,})"
            blob = f.read(n)
            size = os.fstat(f.fileno()).st_size
    except FileNotFoundError:
        return None, None
    except OSError as e:
        return None, f"unreadable ({e.strerror or e})"
    if len(blob) < n:
        return None, f"truncated: {size:,} bytes, its header alone is {len(MAGIC) + _LENGTH.size + n:,}"
    try:
        header = json.loads(blob)
        sections = header["sections"]
        expected = len(MAGIC) + _LENGTH.size + n + sum(int(s["size"]) for s in sections)
        manifest = header["manifest"]
        if not isinstance(manifest, dict) or not all(isinstance(s["name"], str) and s["sha256"] for s in sections):
            raise ValueError("manifest or sections")
    except (ValueError, KeyError, TypeError):
        return None, "header unreadable (not the JSON object --warm-cache writes)"
    if header.get("format") != FORMAT:
        return None, f"format {header.get('format')!r}, this dflash reads format {FORMAT}"
    if size < expected:
        return None, f"truncated: {size:,} of {expected:,} bytes"
    if size > expected:
        return None, f"{size - expected:,} bytes more than its sections hold ({expected:,})"
    header["size"] = size
    return header, None


def read_sections(path: str | Path) -> tuple[dict, dict[str, bytes]]:
    """(manifest, {section name: bytes}) of a whole artifact whose every section matches its sha256; else
    ArtifactError naming what is wrong. Nothing is returned before every byte is checked."""
    header, problem = read_header(path)
    if header is None:
        raise ArtifactError(problem or "no such file")
    out = {}
    with open(path, "rb") as f:
        f.seek(header["size"] - sum(int(s["size"]) for s in header["sections"]))
        for s in header["sections"]:
            data = f.read(int(s["size"]))
            if len(data) != int(s["size"]):
                raise ArtifactError(f"truncated in section {s['name']!r}")
            if hashlib.sha256(data).hexdigest() != s["sha256"]:
                raise ArtifactError(f"section {s['name']!r} does not match its sha256 (the file changed after it was "
                                    "written)")
            out[s["name"]] = data
    return header["manifest"], out
