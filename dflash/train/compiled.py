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
