"""The one conversion of the embedded SmolLM2 target: its GGUF (dequantized to float32 by transformers + gguf) saved
once as a Hugging Face folder in the cache (dflash.models.smollm2 names where); every later run reuses it.

    from dflash.models.smollm2_convert import resolve_target
    path = resolve_target("smollm2")         # -> the converted folder; another value -> its folder
"""

from __future__ import annotations

import importlib.metadata
import os
import shutil
from pathlib import Path

from dflash.models.smollm2 import DISTRIBUTION, DONE_MARKER, FOLDER, cached_folder, gguf_file, is_converted, is_embedded, local_folder


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
        tokenizer = AutoTokenizer.from_pretrained(str(src.parent), gguf_file=src.name, trust_remote_code=False)
        model = AutoModelForCausalLM.from_pretrained(str(src.parent), gguf_file=src.name, dtype=torch.float32,
                                                     trust_remote_code=False)
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
    """'smollm2' -> the converted cache folder (converted on first use); any other value -> its folder, found as
    target.path is (dflash.config.resolve_target_dir)."""
    if is_embedded(path_or_name):
        return ensure_converted(log)
    return local_folder(path_or_name)
