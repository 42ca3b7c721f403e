"""Shared fixtures (a tiny random Qwen3 target built in memory, no download; the embedded SmolLM2 target and one
real server of it) and the session's process settings.

One thread per process (OMP_NUM_THREADS, unless set): the shapes are tiny and the tests' processes
share the cores. One bytecode cache: where bytecode writing is off (PYTHONDONTWRITEBYTECODE, as on
CI), every child process the tests start (dflash-train, split ranks, torchrun workers, benches)
would compile torch and transformers from source again, ~5 s of CPU each. The session then writes
bytecode into one temporary folder instead, shared by every process it starts (xdist workers
included) and removed at its end; nothing is written into the repository or the environment.
"""

from __future__ import annotations

import inspect
import os
import re
import shutil
import sys
import tempfile

import pytest

# What starts another process. A test is marked e2e when its source, a helper of its module it calls or a fixture it
# uses does this, so `pytest -m "not e2e"` is the inner loop (every in-process test, a fraction of the wall time).
# (trainkit's train_cmd, train_main_here, start_run, start_train and Server count.)
SPAWNS = re.compile(r"subprocess\.|Popen\(|torchrun|mp\.spawn|multiprocessing\.|train_cmd\(|train_main_here\(|"
                    r"\bstart_run\(|\bstart_train\(|\bServer\(")


def _source(obj) -> str:
    try:
        return inspect.getsource(obj)
    except (OSError, TypeError):
        return ""


def _spawning_helpers(module) -> set[str]:
    """Names of the module's functions (fixtures included) that start a process, directly or through each other."""
    funcs = {n: _source(getattr(f, "__wrapped__", f)) for n, f in vars(module).items()
             if inspect.isfunction(getattr(f, "__wrapped__", f))}  # a fixture wraps its function
    found = {n for n, src in funcs.items() if SPAWNS.search(src)}
    while True:
        more = {n for n, src in funcs.items() if n not in found and any(re.search(rf"\b{h}\b", src) for h in found)}
        if not more:
            return found
        found |= more


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


def pytest_collection_modifyitems(config, items):
    helpers: dict = {}
    shared = _spawning_helpers(sys.modules[__name__])  # this file's fixtures that start a process (server)
    for item in items:
        module, fn = getattr(item, "module", None), getattr(item, "function", None)
        if module is None or fn is None:
            continue
        if module not in helpers:
            helpers[module] = _spawning_helpers(module)
        source = _source(fn)
        if SPAWNS.search(source) or (helpers[module] | shared) & set(item.fixturenames) or \
                any(re.search(rf"\b{h}\(", source) for h in helpers[module]):
            item.add_marker(pytest.mark.e2e)


def pytest_unconfigure(config):
    if _PYCACHE is not None:
        shutil.rmtree(_PYCACHE, ignore_errors=True)


@pytest.fixture(scope="session")
def tiny_target():
    """A frozen random Qwen3ForCausalLM: 6 layers, hidden 64, 4 heads / 2 kv heads, head_dim 16, vocab 256."""
    from dflash.data.synthetic import random_target, target_config
    from dflash.models.target import freeze

    # initializer_range larger than HF's 0.02 so the random lm_head can express confident predictions.
    config = target_config("qwen3", vocab_size=256, num_hidden_layers=6, initializer_range=0.1)
    return freeze(random_target(config, seed=0))


def pytest_addoption(parser):
    parser.addoption("--update-golden", action="store_true", help="rewrite tests/data/golden_tiny_loss.json")


@pytest.fixture(scope="session")
def smollm2_path():
    """The embedded SmolLM2-135M-Instruct as a Hugging Face folder (converted from its GGUF once, then cached)."""
    from dflash.models.smollm2_convert import resolve_target

    return resolve_target("smollm2")


@pytest.fixture(scope="session")
def server(smollm2_path, tmp_path_factory):
    """One real OpenAI-compatible server of SmolLM2 (`transformers serve`, CPU) for the session: ~10 s to start, so
    every test that needs one shares it (per xdist worker: each worker is a session)."""
    from trainkit import Server

    srv = Server(smollm2_path, tmp_path_factory.mktemp("serve")).wait_ready()
    yield srv
    srv.stop()
