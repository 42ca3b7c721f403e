"""The probe's own process: on one GPU, load what a run loads and read what it costs outside torch's allocator.

Run only as a subprocess by ``preflight.probe`` (one per GPU, CUDA_VISIBLE_DEVICES set to that GPU's UUID), never
imported by preflight's process: this is the one preflight module that imports torch and creates a CUDA context,
and it exits when done, leaving nothing on the GPU.

    python -m preflight.probe_gpu --uuid GPU-5d1c... --steps context,matmul,attention,nccl

Each step loads one thing, then NVML is read for this process (its pid in the GPU's compute processes; in another
PID namespace, the card's used memory less what it read before this process touched the GPU) beside torch's
reserved bytes:

- context: the CUDA context (``torch.zeros(1, device="cuda")``);
- matmul: a bf16 matmul forward and backward (cuBLAS, cuBLASLt and their workspaces);
- attention: scaled_dot_product_attention forward and backward in bf16 (the fused attention kernels);
- flex: flex attention compiled (Triton and its kernels; compiles, so only when asked);
- fla: fla's chunked gated delta rule forward, no gradient (a hybrid target's linear-attention kernels, as the frozen
  target runs them);
- nccl: a one-rank NCCL communicator and one all-reduce (the buffers of the run's process group).

Prints one JSON object on stdout: {"ok": true, "steps": [{"step", "process_bytes", "device_used_bytes",
"torch_reserved_bytes"}, ...], ...} or {"ok": false, "error": "one line"} (exit 1).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

STEPS = ("context", "matmul", "attention", "flex", "fla", "nccl")


class ProbeFailed(RuntimeError):
    """Why the probe could not measure; one line."""


def _nvml(uuid: str):
    try:
        import pynvml as nvml
    except ImportError:
        raise ProbeFailed("nvidia-ml-py is not installed in this environment") from None
    try:
        nvml.nvmlInit()
    except Exception as e:
        raise ProbeFailed(f"no NVIDIA driver (NVML: {str(e) or type(e).__name__})") from None
    try:
        handle = nvml.nvmlDeviceGetHandleByUUID(uuid.encode() if isinstance(uuid, str) else uuid)
    except Exception as e:
        raise ProbeFailed(f"NVML knows no GPU {uuid} ({str(e) or type(e).__name__})") from None
    return nvml, handle


def _own_bytes(nvml, handle) -> int | None:
    """This process's used bytes on the GPU as NVML lists them; None when NVML does not list this pid."""
    me = os.getpid()
    try:
        for p in nvml.nvmlDeviceGetComputeRunningProcesses(handle):
            used = getattr(p, "usedGpuMemory", None)
            if p.pid == me and isinstance(used, int) and used < 2**63:
                return used
    except Exception:
        return None
    return None


def _step(name: str, torch, cleanups: list) -> str | None:
    """Load what step `name` stands for (what must outlive its reading goes to cleanups); a note when skipped."""
    dev = torch.device("cuda", 0)
    if name == "context":
        torch.zeros(1, device=dev)
    elif name == "matmul":
        a = torch.randn(1024, 1024, device=dev, dtype=torch.bfloat16, requires_grad=True)
        (a @ a.t()).float().sum().backward()
    elif name == "attention":
        import torch.nn.functional as F

        q, k, v = (torch.randn(1, 8, 256, 128, device=dev, dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
        F.scaled_dot_product_attention(q, k, v, is_causal=True).float().sum().backward()
    elif name == "flex":
        from torch.nn.attention.flex_attention import flex_attention

        q, k, v = (torch.randn(1, 8, 256, 128, device=dev, dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
        torch.compile(flex_attention)(q, k, v).float().sum().backward()
    elif name == "fla":
        try:
            from fla.ops.gated_delta_rule import chunk_gated_delta_rule
        except ImportError as e:
            return f"fla not importable ({e}); its kernels not loaded"
        from dflash.models.fla_tuning import first_configs_only

        first_configs_only()  # load each kernel once: autotuning would compile every config (tens of seconds cold)
        shape = (1, 64, 2, 64)  # [batch, tokens, heads, head dim]
        q, k, v = (torch.randn(*shape, device=dev, dtype=torch.bfloat16) for _ in range(3))
        g = torch.randn(1, 64, 2, device=dev, dtype=torch.float32).sigmoid().log()
        beta = torch.rand(1, 64, 2, device=dev, dtype=torch.bfloat16)
        with torch.no_grad():  # the frozen target runs fla forward only (fla 0.6 refuses its backward on Hopper
            chunk_gated_delta_rule(q, k, v, g, beta, use_qk_l2norm_in_kernel=True)  # under Triton < 3.7.1)
    elif name == "nccl":
        import torch.distributed as dist

        tmp = tempfile.TemporaryDirectory()
        cleanups.append(tmp.cleanup)
        store = dist.FileStore(os.path.join(tmp.name, "store"), 1)
        dist.init_process_group("nccl", store=store, rank=0, world_size=1, device_id=dev)
        cleanups.append(dist.destroy_process_group)  # read with the communicator alive, then torn down
        t = torch.ones(1 << 20, device=dev)
        dist.all_reduce(t)
    else:
        raise ProbeFailed(f"unknown step {name!r} (known: {', '.join(STEPS)})")
    return None


def probe(uuid: str, steps: list[str]) -> dict:
    nvml, handle = _nvml(uuid)
    cleanups: list = []
    try:
        baseline = int(nvml.nvmlDeviceGetMemoryInfo(handle).used)
        import torch

        if not torch.cuda.is_available():
            raise ProbeFailed(f"torch {torch.__version__} sees no CUDA device (CUDA_VISIBLE_DEVICES="
                              f"{os.environ.get('CUDA_VISIBLE_DEVICES')!r})")
        torch.cuda.set_device(0)
        out = {"ok": True, "pid": os.getpid(), "uuid": uuid, "torch": torch.__version__, "cuda": torch.version.cuda,
               "device": torch.cuda.get_device_name(0), "baseline_device_used_bytes": baseline, "steps": [],
               "skipped": {}}
        for name in steps:
            try:
                note = _step(name, torch, cleanups)
            except ProbeFailed:
                raise
            except Exception as e:  # the step that broke, named: the run would break there too
                raise ProbeFailed(f"step {name} failed: {type(e).__name__}: {' '.join(str(e).split())[:240]}") from None
            if note:
                out["skipped"][name] = note
                continue
            torch.cuda.synchronize()
            out["steps"].append({"step": name, "process_bytes": _own_bytes(nvml, handle),
                                 "device_used_bytes": int(nvml.nvmlDeviceGetMemoryInfo(handle).used),
                                 "torch_reserved_bytes": int(torch.cuda.memory_reserved(0)),
                                 "torch_allocated_bytes": int(torch.cuda.memory_allocated(0))})
            if name == "nccl":
                out["nccl"] = ".".join(str(x) for x in torch.cuda.nccl.version())
        return out
    finally:
        for fn in reversed(cleanups):
            try:
                fn()
            except Exception:
                pass
        try:
            nvml.nvmlShutdown()
        except Exception:
            pass


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m preflight.probe_gpu", description=__doc__.split("\n\n")[0])
    parser.add_argument("--uuid", required=True, help="NVML UUID of the GPU (CUDA_VISIBLE_DEVICES should name it)")
    parser.add_argument("--steps", default="context,matmul,attention", help=f"comma list of {', '.join(STEPS)}")
    args = parser.parse_args(argv)
    try:
        steps = [s.strip() for s in args.steps.split(",") if s.strip()]
        bad = [s for s in steps if s not in STEPS]
        if bad:
            raise ProbeFailed(f"unknown step(s) {', '.join(bad)} (known: {', '.join(STEPS)})")
        out = probe(args.uuid, steps)
    except Exception as e:  # the parent reads one JSON line whatever happened
        text = " ".join(str(e).split())[:300] or type(e).__name__
        out = {"ok": False, "error": text if isinstance(e, ProbeFailed) else f"{type(e).__name__}: {text}"}
    sys.stdout.write(json.dumps(out) + "\n")
    sys.stdout.flush()
    return 0 if out["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
