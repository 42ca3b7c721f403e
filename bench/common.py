"""Helpers shared by the GPU measurement scripts (bench/train_step.py, bench/memory_calibration.py).

Imported with the repository root on sys.path (the scripts put it there), so both run from a
source tree with plain ``python3`` and no install. Nothing here imports torch at module level:
the calibration driver process must stay off the GPU while its workers measure.
"""

from __future__ import annotations

import json
import os
import platform
import sys
import threading
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]

# A Qwen3-shaped target small enough for a CPU smoke run (--tiny): 6 layers, hidden 64.
TINY_TARGET = {
    "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "vocab_size": 512, "hidden_size": 64,
    "intermediate_size": 128, "num_hidden_layers": 6, "num_attention_heads": 4, "num_key_value_heads": 2,
    "head_dim": 16, "max_position_embeddings": 4096, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0,
    "tie_word_embeddings": False, "torch_dtype": "float32", "pad_token_id": 0,
}  # fmt: skip


def tiny_target_dir(root: Path) -> Path:
    """Write TINY_TARGET's config.json (random_init builds the model from it) and return the folder."""
    path = Path(root) / "tiny-qwen3"
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(TINY_TARGET, indent=2))
    return path


def parse_sets(pairs: list[str]) -> dict:
    """--set key=value pairs into dotted overrides; values parse as JSON when they can (numbers, bools, lists)."""
    out = {}
    for pair in pairs:
        if "=" not in pair:
            raise SystemExit(f"--set {pair!r}: expected key=value, e.g. --set train.max_anchors=1024")
        key, raw = pair.split("=", 1)
        try:
            out[key.strip()] = json.loads(raw)
        except json.JSONDecodeError:
            out[key.strip()] = raw
    return out


def write_uniform_dataset(path: Path, samples: int, length: int, vocab: int, prompt_share: float = 0.1,
                          seed: int = 0) -> Path:
    """One Arrow shard of `samples` rows of exactly `length` tokens; loss_mask 0 on the first prompt_share."""
    from dflash.data import write_shard_arrays

    path = Path(path)
    shard = path / "shard-00000.arrow"
    meta = path / "shape.json"
    want = {"samples": samples, "length": length, "vocab": vocab, "prompt_share": prompt_share, "seed": seed}
    if shard.is_file() and meta.is_file() and json.loads(meta.read_text()) == want:
        return path
    rng = np.random.default_rng(seed)
    ids = rng.integers(1, vocab - 1, size=samples * length, dtype=np.int64)
    mask_row = np.ones(length, dtype=np.int64)
    mask_row[: int(length * prompt_share)] = 0
    mask = np.tile(mask_row, samples)
    offsets = np.arange(samples + 1, dtype=np.int64) * length
    path.mkdir(parents=True, exist_ok=True)
    write_shard_arrays(shard, offsets, ids, mask)
    meta.write_text(json.dumps(want))
    return path


# --------------------------------------------------------------------------- NVML


class Nvml:
    """Used memory of the GPU torch calls cuda:0, matched by UUID; every method returns None without NVML.

    Without a UUID it is the first GPU of CUDA_VISIBLE_DEVICES (an index or a UUID there), else GPU 0,
    so a process that never touches CUDA still watches the GPU its workers will use.
    """

    def __init__(self, uuid: str | None = None, index: int | None = None, enabled: bool = True):
        self.handle = None
        if not enabled:
            return
        try:
            import pynvml

            pynvml.nvmlInit()
            self._nv = pynvml
            handle = None
            if uuid is None and index is None:
                uuid, index = _first_visible()
            if uuid:
                for i in range(pynvml.nvmlDeviceGetCount()):
                    h = pynvml.nvmlDeviceGetHandleByIndex(i)
                    u = pynvml.nvmlDeviceGetUUID(h)
                    u = u.decode() if isinstance(u, bytes) else u
                    if u.replace("GPU-", "") == uuid.replace("GPU-", ""):
                        handle = h
            self.handle = handle or pynvml.nvmlDeviceGetHandleByIndex(index or 0)
        except Exception:  # no driver, no GPU, no pynvml: memory numbers stay null
            self.handle = None

    def used(self) -> int | None:
        if self.handle is None:
            return None
        return int(self._nv.nvmlDeviceGetMemoryInfo(self.handle).used)

    def total(self) -> int | None:
        if self.handle is None:
            return None
        return int(self._nv.nvmlDeviceGetMemoryInfo(self.handle).total)

    def process_used(self, pid: int | None = None) -> int | None:
        """This process's used memory as the driver reports it (None inside some containers)."""
        if self.handle is None:
            return None
        pid = os.getpid() if pid is None else pid
        try:
            for p in self._nv.nvmlDeviceGetComputeRunningProcesses(self.handle):
                if p.pid == pid and p.usedGpuMemory is not None:
                    return int(p.usedGpuMemory)
        except Exception:
            return None
        return None


def _first_visible() -> tuple[str | None, int | None]:
    """(uuid, index) of the first entry of CUDA_VISIBLE_DEVICES; (None, None) when unset or empty."""
    first = os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",")[0].strip()
    if first.isdigit():
        return None, int(first)
    return (first, None) if first.startswith(("GPU-", "MIG-")) else (None, None)


class NvmlPeak:
    """Samples NVML used memory every `interval` s in a thread; .peak is the largest seen."""

    def __init__(self, nvml: Nvml, interval: float = 0.005):
        self.nvml, self.interval = nvml, interval
        self.peak: int | None = None
        self._stop = threading.Event()
        self._thread = None

    def __enter__(self):
        if self.nvml.handle is not None:
            self._thread = threading.Thread(target=self._run, daemon=True)
            self._thread.start()
        return self

    def _run(self):
        while not self._stop.is_set():
            self.sample()
            time.sleep(self.interval)

    def sample(self) -> None:
        used = self.nvml.used()
        if used is not None and (self.peak is None or used > self.peak):
            self.peak = used

    def __exit__(self, *exc):
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        self.sample()
        return False


def gpu_uuid(torch) -> str | None:
    try:
        return str(torch.cuda.get_device_properties(0).uuid)
    except Exception:
        return None


def environment(torch, device: str) -> dict:
    """What produced the numbers: versions, GPU, command line."""
    env = {
        "command": " ".join([Path(sys.executable).name] + sys.argv),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "device": device,
        "gpu": None,
        "gpu_total_bytes": None,
        "time_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    try:
        import transformers

        env["transformers"] = transformers.__version__
    except ImportError:
        pass
    try:
        import triton

        env["triton"] = triton.__version__
    except ImportError:
        pass
    if device == "cuda" and torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        env["gpu"] = props.name
        env["gpu_total_bytes"] = int(props.total_memory)
    return env


def write_json(path: Path, obj) -> None:
    """Atomic JSON write (the scripts rewrite their output after every measurement)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(obj, indent=2) + "\n")
    os.replace(tmp, path)


def gib(n: int | float | None) -> str:
    return "-" if n is None else f"{n / 2**30:.2f}"


def is_oom(err: BaseException | str) -> bool:
    text = str(err)
    return "out of memory" in text.lower() or type(err).__name__ == "OutOfMemoryError"
