"""What torch.compile did during a run: graphs built, each recompile with its function and failed guard, and the
rule that a compiled region never falls back to eager code.

Dynamo keeps at most `recompile_limit` graphs per function; past that it runs the function eagerly. For flex
attention eager is the math path, which materialises the whole [queries x keys] score matrix (a 154.5 GiB
allocation at the Qwen3.6-27B preset's shapes): a crash no memory model predicts, minutes into a run. With
`strict()` the limit is a hard error instead, which the trainer turns into one line (`CompileLimitError`) before
anything allocates, its last checkpoint intact.
"""

from __future__ import annotations

import torch

from dflash.data.plan import RunError

LIMIT_FIX = ("earlier checkpoints are intact; report the reason (it names the shape that changed), or set "
             "train.compile = false to train uncompiled, then dflash-train --resume latest")


class CompileLimitError(RunError):
    """torch.compile reached its recompile limit for a function: running on would mean running it eagerly."""


def strict() -> None:
    """Make dynamo's recompile limit a hard error (FailOnRecompileLimitHit) instead of a silent eager fallback."""
    torch._dynamo.config.fail_on_recompile_limit_hit = True


def is_limit_hit(e: BaseException) -> bool:
    from torch._dynamo.exc import FailOnRecompileLimitHit

    return isinstance(e, FailOnRecompileLimitHit)


def graphs() -> int:
    """Graphs torch.compile has built in this process so far (a number that grows with every recompile)."""
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


def compile_phases() -> dict[str, float]:
    """Seconds torch.compile spent in this process so far, by phase (torch's own timers; {} when nothing compiled).

    frames: each compiled frame's whole compile, in order (Dynamo's trace through Inductor, forward graphs);
    dynamo_s: tracing the bytecode into graphs; aot_s: AOTAutograd's joint trace and partition; inductor_s:
    Inductor's lowering and codegen, forward and backward; cache_load_s: compiled graphs loaded from a warm cache
    (instead of AOTAutograd + Inductor); kernel_wait_s: waiting on the parallel kernel compiles (Triton); backward_s:
    the backward graphs where compiled lazily at the first backward (AOTAutograd and Inductor; counted in those);
    total_s: all of it; fla_autotune_s, fla_kernels_tuned: fla's Triton autotuning, outside torch.compile
    (dflash.models.fla_tuning; 0 where its choices were kept or cached).
    What the first step spends beyond total_s and fla_autotune_s runs the kernels (their Triton JIT included) and
    the step itself."""
    from torch._dynamo.utils import calculate_time_spent, compile_times

    spent = calculate_time_spent()
    if not spent.get("entire_frame_compile"):
        return {}
    names, values = compile_times(repr="csv", aggregate=False)
    per_call = dict(zip(names, values, strict=False))
    frames = [round(float(v), 1) for v in str(per_call.get("_compile.compile_inner", "")).split(",") if v.strip()]
    loads = sum(float(v) for v in str(per_call.get("AOTAutogradCache.inductor_load", "")).split(",") if v.strip())
    frame, backend = spent.get("entire_frame_compile", 0.0), spent.get("backend_compile", 0.0)
    backward, inductor = spent.get("entire_backward_compile", 0.0), spent.get("inductor_compile", 0.0)
    phases = {"dynamo_s": frame - backend, "aot_s": backend + backward - inductor - loads, "inductor_s": inductor,
              "cache_load_s": loads, "kernel_wait_s": spent.get("async_compile.wait", 0.0), "backward_s": backward,
              "total_s": spent.get("total_wall_time", frame + backward)}
    from dflash.models.fla_tuning import tuning_seconds

    phases["fla_autotune_s"], tuned = tuning_seconds()
    return {"frames": frames, **{k: round(max(v, 0.0), 1) for k, v in phases.items()}, "fla_kernels_tuned": tuned}


def phases_line(phases: dict) -> str:
    """torch.compile's time so far by phase, one line: "compile: 92.1 s in this process (7 frames): dynamo ..."."""
    if not phases:
        return "compile: nothing compiled"
    return (f"compile: {phases['total_s']:.1f} s in this process ({len(phases['frames'])} frame(s)): "
            f"dynamo {phases['dynamo_s']:.1f}, aot {phases['aot_s']:.1f}, "
            f"inductor {phases['inductor_s']:.1f} (waiting on kernel compiles {phases['kernel_wait_s']:.1f}; "
            f"backward graphs {phases['backward_s']:.1f}), loaded from the cache {phases['cache_load_s']:.1f}"
            f"{fla_text(phases)}; the rest ran the kernels")


def fla_text(phases: dict) -> str:
    """"; fla's autotuning 41.3 s (9 kernels)" where fla tuned in this process, else ""."""
    if not phases.get("fla_kernels_tuned"):
        return ""
    return f"; fla's autotuning {phases.get('fla_autotune_s', 0.0):.1f} s ({phases['fla_kernels_tuned']} kernel(s))"


class RecompileWatch:
    """The recompiles since the last look: [(function, where, failed guard)], read from dynamo's own record of guard
    failures (kept whatever TORCH_LOGS says)."""

    def __init__(self):
        self.seen = self._counts()

    @staticmethod
    def _failures() -> dict:
        from torch._dynamo.utils import guard_failures

        return guard_failures

    def _counts(self) -> dict:
        return {code: len(reasons) for code, reasons in self._failures().items()}

    def new(self) -> list[tuple[str, str, str]]:
        out = []
        for code, reasons in list(self._failures().items()):
            for reason in reasons[self.seen.get(code, 0):]:
                where = f"{code.co_filename.rsplit('/', 1)[-1]}:{code.co_firstlineno}"
                out.append((code.co_name, where, first_guard(reason)))
        self.seen = self._counts()
        return out


def first_guard(reason: str) -> str:
    """The first failed guard of a dynamo reason ('0/3: tensor 'x' size mismatch ...'), without its compile id."""
    line = next((s.strip() for s in str(reason).splitlines() if s.strip()), "")
    head, sep, rest = line.partition(": ")
    return " ".join((rest if sep and "/" in head else line).split())[:300]


def limit_error(step: int, watch: RecompileWatch) -> CompileLimitError:
    """The one line for a recompile limit hit at `step` (the function and the guard that failed last)."""
    recent = watch.new()
    what = f"{recent[-1][0]} ({recent[-1][1]}): {recent[-1][2]}" if recent else "a compiled function"
    limit = torch._dynamo.config.recompile_limit
    return CompileLimitError(f"step {step}: torch.compile reached its recompile limit ({limit}) for {what}; the run "
                             f"stopped instead of running it eagerly (eager flex attention materialises every score); "
                             f"{LIMIT_FIX}")
