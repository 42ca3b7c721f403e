"""Shared fixtures (a tiny random Qwen3 target built in memory, no download) and the session's process settings.

One thread per process (OMP_NUM_THREADS, unless set): the shapes are tiny and the tests' processes
share the cores. One bytecode cache: where bytecode writing is off (PYTHONDONTWRITEBYTECODE, as on
CI), every child process the tests start (dflash-train, split ranks, torchrun workers, benches)
would compile torch and transformers from source again, ~5 s of CPU each. The session then writes
bytecode into one temporary folder instead, shared by every process it starts (xdist workers
included) and removed at its end; nothing is written into the repository or the environment.
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile

import pytest

_PYCACHE: str | None = None  # the bytecode folder this process made (removed at the end), if any


def pytest_configure(config):
    global _PYCACHE
    # One thread per process unless the user says otherwise: the tests' shapes are tiny (more threads buy nothing)
    # and their processes share the cores (split ranks, a run beside the test process), where more threads than
    # free cores make every step wait on the busiest core.
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    if not sys.dont_write_bytecode or os.environ.get("PYTHONPYCACHEPREFIX"):
        return  # bytecode is written already (or goes where the user said): nothing to share
    _PYCACHE = tempfile.mkdtemp(prefix="dflash-tests-pycache-")
    sys.pycache_prefix, sys.dont_write_bytecode = _PYCACHE, False
    os.environ["PYTHONPYCACHEPREFIX"] = _PYCACHE  # child processes read and write the same folder
    os.environ.pop("PYTHONDONTWRITEBYTECODE", None)


def pytest_unconfigure(config):
    if _PYCACHE is not None:
        shutil.rmtree(_PYCACHE, ignore_errors=True)


@pytest.fixture(scope="session")
def tiny_target():
    """A frozen random Qwen3ForCausalLM: 6 layers, hidden 64, 4 heads / 2 kv heads, head_dim 16, vocab 256."""
    from dflash.synthetic import random_target, target_config
    from dflash.target import freeze

    # initializer_range larger than HF's 0.02 so the random lm_head can express confident predictions.
    config = target_config("qwen3", vocab_size=256, num_hidden_layers=6, initializer_range=0.1)
    return freeze(random_target(config, seed=0))


def pytest_addoption(parser):
    parser.addoption("--update-golden", action="store_true", help="rewrite tests/data/golden_tiny_loss.json")
