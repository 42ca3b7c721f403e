"""Gather every fact once: ``gather`` fills one ``Context``, and every check (``preflight.checks``) is a pure
function of it."""

from __future__ import annotations

import os
import platform
import socket
import sys
import time
from pathlib import Path

from dflash.config import RunConfig
from dflash.models.weights import weights_in
from preflight.envs import locate
from preflight.facts.context import Context
from preflight.facts.dataset import dataset
from preflight.facts.environment import EnvIdentity, record_verified, sync_record, torch_build, verify_records
from preflight.facts.gpus import GpuFacts, gpu_facts
from preflight.facts.paths import ld_cache, path_entries, scan_lib_dir
from preflight.facts.run import disk, run_dir, target_custom_code, target_shape
from preflight.facts.source import compile_cache, git_commit, model_source
from preflight.nvml import GpuInfo
from preflight.profiles import ENVS_DIR, REPO_ROOT, ProfileError, load_profile, lock_path
from preflight.pyenv import installed_distributions


def host_info(gpus: GpuFacts, root: Path = REPO_ROOT) -> dict:
    snap = gpus.snapshot
    return {
        "hostname": socket.gethostname(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "executable": sys.executable,
        "prefix": sys.prefix,
        "cpus": os.cpu_count(),
        "pid": os.getpid(),
        "git_commit": git_commit(root),
        "nvidia_driver": snap.driver_version if snap else None,
        "cuda_driver": snap.cuda_driver_version if snap else None,
        "gpus": len(snap.gpus) if snap else 0,
        "time_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }


def gather(
    profile_name: str,
    config: RunConfig | None = None,
    resume_intent: str | None = None,
    gpu_info: GpuInfo | None = None,
    config_path: str | None = None,
    envs_dir: Path = ENVS_DIR,
    root: Path = REPO_ROOT,
    environ: dict[str, str] | None = None,
    verify_data: bool = False,
) -> Context:
    """Collect every fact. ``gpu_info`` None = do not query NVML (use it when device = cpu).

    ``verify_data``: also hash every shard and the checkpoint a resume loads (reads every byte).
    """
    env = dict(os.environ if environ is None else environ)
    ctx = Context(profile_name=profile_name, config=config, config_path=config_path, resume_intent=resume_intent, env=env)
    try:
        ctx.profile = load_profile(profile_name, envs_dir)
        where = locate(profile_name, envs_dir)
        ctx.env_identity = EnvIdentity(sys.prefix, str(where.path), where.default)
    except ProfileError as e:
        ctx.profile_error = str(e)
    lock = lock_path(profile_name, envs_dir)
    ctx.lock_file = f"{envs_dir.name}/{lock.name}"
    try:
        ctx.lock_text = lock.read_text(encoding="utf-8", errors="replace")  # stray bytes fail the profile check
    except OSError:
        ctx.lock_text = None
    ctx.distributions = installed_distributions()
    ctx.records = verify_records([n for n in ctx.distributions if record_verified(n)])
    ctx.sync_record = sync_record(sys.prefix)
    ctx.torch = torch_build()
    ctx.path_entries = path_entries(env.get("PATH", ""), sys.prefix)
    ctx.ld_dirs = [scan_lib_dir(p) for p in env.get("LD_LIBRARY_PATH", "").split(os.pathsep) if p]
    ctx.ld_cache = ld_cache()
    ctx.gpus = gpu_facts(gpu_info, env)
    ctx.model_source = model_source(root)
    if config is not None:
        ctx.target_shape, ctx.target_error = target_shape(config)
        ctx.target_custom_code = target_custom_code(config)
        ctx.target_weights = weights_in(config.target.path)
        resuming = resume_intent == "resume"
        ctx.run_dir = run_dir(config.output_dir, deep=verify_data and resuming, config=config if resuming else None)
        ctx.dataset = dataset(config, deep=verify_data)
        ctx.disk = disk(config.output_dir)
    if ctx.profile is not None:
        ctx.compile_cache = compile_cache(ctx.profile, env, config, ctx.dataset)
    ctx.host = host_info(ctx.gpus, root)
    return ctx
