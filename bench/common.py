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

from dflash.data.synthetic import target_config

REPO = Path(__file__).resolve().parents[1]

# A Qwen3-shaped target small enough for a CPU smoke run (--tiny): 6 layers, hidden 64, vocabulary 512.
# Written as config.json alone (dflash.data.synthetic.write_target, weights=False): random_init builds it.
TINY_TARGET = target_config(
    "qwen3", vocab_size=512, num_hidden_layers=6, max_position_embeddings=4096, rms_norm_eps=1e-6,
    rope_theta=1000000.0, torch_dtype="float32", pad_token_id=0,
)


def parse_sets(pairs: list[str], config: str | Path, prog: str) -> dict:
    """--set pairs read exactly as dflash-train reads them: its parser (``dflash.config.parse_overrides``, TOML
    values) and its validation against the run config, so an unknown key or a bad value stops the script before
    it measures anything, with dflash-train's one-line message and exit code (2). Returns the dotted overrides."""
    from dflash.config import ConfigError, load_config, parse_overrides

    try:
        overrides = parse_overrides(pairs)
        load_config(config, overrides)
    except ConfigError as e:
        print(f"{prog}: error: {e.one_line()}", file=sys.stderr)
        raise SystemExit(e.exit_code) from None
    return overrides


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


def cpu_name() -> str:
    """The CPU's model and widest vector instructions ("AMD EPYC, AVX2"): the same commit ran the CPU demo in 3 min 53 s
    with 1.63 accepted on one 2-core VM and in 8 min 20 s with 1.69 on another, so CPU figures name the CPU."""
    fields = {}
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():  # the first processor's fields
            key, _, value = line.partition(":")
            fields.setdefault(key.strip(), value.strip())
    except OSError:
        pass
    model, flags = fields.get("model name") or platform.machine(), set(fields.get("flags", "").split())
    widest = next((name for flag, name in (("amx_tile", "AMX"), ("avx512f", "AVX-512"), ("avx2", "AVX2"))
                   if flag in flags), None)
    return f"{model}, {widest}" if widest else model


def environment(torch, device: str) -> dict:
    """What produced the numbers: versions, GPU, command line."""
    env = {
        "command": " ".join([Path(sys.executable).name] + sys.argv),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "device": device,
        "cpu": cpu_name(),
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


def bench_device(torch, name: str, text: str):
    """(torch.device, None) for --device cuda|cpu, or (None, (exit code, one-line error)) for anything else."""
    try:
        device = torch.device(text)
    except RuntimeError:
        return None, (2, f"{name}: --device {text!r} is not a torch device; use cuda or cpu")
    if device.type not in ("cuda", "cpu"):
        return None, (2, f"{name}: --device {text!r}: use cuda or cpu")
    if device.type == "cuda" and not torch.cuda.is_available():
        return None, (1, f"{name}: --device cuda but torch sees no GPU; use --device cpu --tiny for a smoke run")
    return device, None


def median_ms(torch, device, fn, repeat: int, warmup: int = 1) -> float:
    """Median ms of fn() over `repeat` runs after `warmup` untimed ones (CUDA events on a GPU, wall clock on CPU)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeat):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return sorted(times)[len(times) // 2]


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
