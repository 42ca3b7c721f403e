"""What an evaluation returns (torch-free): the per-drafter report and the error for bad input."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field

from dflash.errors import DflashError


class EvalError(DflashError):
    """Bad input to dflash-eval (paths, shapes that do not match); one line."""

    exit_code = 2  # bad input


@dataclass
class TreeReport:
    """DDTree decoding at one node budget (dflash.eval.ddtree) on the same prompts as the linear report."""

    budget: int
    mode: str  # "verified" (one target forward per round under a tree mask) or "computed" (the walk by greedy decoding)
    rounds: int = 0
    mean_accept_len: float = 0.0
    histogram: dict = field(default_factory=dict)  # acceptance length -> rounds
    nodes_per_round: float = 0.0
    tok_s: float = 0.0  # verified only: a computed walk's speed means nothing
    speedup: float = 0.0
    lossless: bool = True
    mismatches: list = field(default_factory=list)
    ties: list = field(default_factory=list)


@dataclass
class EvalReport:
    name: str
    prompts: int
    block_size: int
    max_new_tokens: int
    verify_steps: int = 0
    new_tokens: int = 0
    mean_accept_len: float = 0.0
    histogram: dict = field(default_factory=dict)  # acceptance length -> verify steps
    spec_tok_s: float = 0.0
    target_tok_s: float = 0.0
    speedup: float = 0.0
    lossless: bool = True
    mismatches: list = field(default_factory=list)  # one line per prompt whose output differs
    ties: list = field(default_factory=list)  # prompts that differ, every token still a greedy choice within one ulp
    ddtree: list = field(default_factory=list)  # one TreeReport (as a dict) per --ddtree budget, same prompts
    linear_mode: str = "verified"  # computed on targets whose cache cannot roll back (hybrids): dflash.eval.ddtree
    target_precision: str = "bf16"  # the verifying target's matmuls: bf16 (its dtype) or fp8 (--target-precision)
    target_fp8_linears: int = 0  # its decoder linears running e4m3 matmuls (dflash.models.target_fp8)

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2)
