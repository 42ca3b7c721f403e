"""One rank of a split or co-located data-parallel run: `python -m dflash.commands.torchrun`, under torchrun or
spawned by dflash-train.

    torchrun --nproc-per-node 8 -m dflash.commands.torchrun --config RUN.toml --fresh        # or --resume latest

Under torchrun every rank goes through the preflight gate first (rank 0 applies the resume/fresh rule, each rank
checks its own GPU and environment, all refuse together); a rank spawned by dflash-train's launcher trains only
after finding that run's passing preflight.json. The rank's work itself is dflash.train.ranks.worker.
"""

from __future__ import annotations

import json
import os
import socket
import sys
from pathlib import Path

import click
import torch.distributed as dist

from dflash.config import RunConfig, config_from_dict, config_sha256
from dflash.errors import DflashError, run_cli
from dflash.train.launch import GATE_ENV
from dflash.train.layout import Rank
from dflash.train.ranks import worker
from preflight.gate import provenance


def require_fresh_gate(cfg: RunConfig) -> None:
    """A launched worker trains only after this run's gate passed: preflight.json with our gate id and config."""
    from dflash.runs.rundir import PREFLIGHT_NAME

    path = Path(cfg.output_dir) / PREFLIGHT_NAME
    want = os.environ.get(GATE_ENV)
    try:
        report = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        report = None
    run = (report or {}).get("run") or {}
    if not want or not report or run.get("gate_id") != want or run.get("config_sha256") != config_sha256(cfg) \
            or not report.get("ok"):
        raise DflashError(f"{path}: no passing preflight report of this run; start split runs with dflash-train "
                          "--config RUN.toml, or under torchrun with python -m dflash.commands.torchrun --config RUN.toml")


def _hold_lock(cfg: RunConfig) -> None:
    """Rank 0 takes the run dir's lock (dflash.runs.lock.lock_run_dir) for the rest of its life; the other ranks
    never ask for it, so none waits on it. RunDirBusyError when another trainer holds it."""
    import atexit

    from dflash.runs.lock import lock_run_dir

    lock = lock_run_dir(cfg.output_dir, log=print)
    atexit.register(lock.release)  # removed on a clean exit; a kill leaves it with the pid, which the next run reports


def collective_gate(cfg: RunConfig, me: Rank, local_rank: int, gate: dict) -> Path | None | bool:
    """The preflight gate under torchrun: rank 0 applies the resume/fresh rule and decides, every rank checks
    its own GPU and environment, all refuse together. Returns the checkpoint to resume from (or None),
    False when the run must not start."""
    from preflight.gate import check_run

    group = dist.new_group(backend="gloo")
    verdict: list = [None, None]  # [error line, resume path]
    if me.rank == 0:
        try:
            from dflash.runs.resume import prepare_output_dir

            _hold_lock(cfg)  # one trainer per run dir: rank 0 locks it before the resume/fresh rule looks at it
            resume = prepare_output_dir(cfg, gate.get("resume"), gate.get("fresh", False), log=print,
                                        allow_schedule_change=gate.get("allow_schedule_change", False), apply=False)
            from dflash.data.plan import schedule

            schedule(cfg, me.n_drafters)  # a dataset too small for one step is refused here
            verdict = [None, str(resume) if resume else None]
        except (DflashError, ValueError, OSError) as e:  # refused on rank 0: every rank refuses
            verdict = [" ".join(str(e).split()), None]
    dist.broadcast_object_list(verdict, src=0, group=group)
    if verdict[0] is not None:
        if me.rank == 0:
            print(f"dflash.commands.torchrun: error: {verdict[0]}", file=sys.stderr, flush=True)
        return False
    intent = "resume" if gate.get("resume") else "fresh" if gate.get("fresh") else None
    own = {str(local_rank): me.role} if cfg.device == "cuda" else None
    report, facts = check_run(cfg.profile, cfg, gate.get("waivers", {}), intent, gpu_override=own,
                              verify_data=gate.get("verify_data", False))
    mine = {"rank": me.rank, "role": me.role, "gpu": str(local_rank), "host": socket.gethostname(),
            "failed": [f"{c.id}: {c.summary}" + (f"  fix: {c.fix}" if c.fix else "")
                       for c in report.checks if c.status == "fail"]}
    everyone: list = [None] * me.world
    dist.all_gather_object(everyone, mine, group=group)
    ok = not any(r["failed"] for r in everyone)
    if me.rank == 0:
        from preflight.gate import write_report, write_snapshot

        write_report(cfg, report, ranks=everyone, ok=ok)
        for line in write_snapshot(cfg, report, facts) if ok else []:  # rank 0's facts: this node, every GPU
            print(line, file=sys.stderr, flush=True)
        for r in everyone:
            for line in r["failed"]:
                print(f"preflight: FAIL rank {r['rank']} ({r['role']}, GPU {r['gpu']} on {r['host']}) {line}",
                      file=sys.stderr, flush=True)
        if not ok:
            print(f"refusing to start: preflight failed on {sum(bool(r['failed']) for r in everyone)} of "
                  f"{me.world} ranks (report: {Path(cfg.output_dir) / 'preflight.json'}); fix them or waive with "
                  "--waive ID --reason TEXT", file=sys.stderr, flush=True)
        else:
            print(f"preflight: ok on all {me.world} ranks", flush=True)
            from dflash.runs.resume import make_room

            make_room(cfg, Path(verdict[1]) if verdict[1] else None, gate.get("fresh", False), log=print)
    dist.barrier(group=group)
    if not ok:
        return False
    return Path(verdict[1]) if verdict[1] else None


def main(argv: list[str] | None = None) -> None:
    """`python -m dflash.commands.torchrun`: a split-run rank under torchrun (or spawned by dflash-train)."""


    @click.command(context_settings={"help_option_names": ["-h", "--help"]})
    @click.option("--config", "config_path", type=click.Path(dir_okay=False, path_type=Path),
                  help="run config TOML (under torchrun)")
    @click.option("--config-json", type=click.Path(dir_okay=False, path_type=Path), hidden=True,
                  help="resolved config written by the dflash-train launcher")
    @click.option("--resume", help="continue from `latest` or a checkpoint folder")
    @click.option("--fresh", is_flag=True, help="start over; existing checkpoints are moved aside, not deleted")
    @click.option("--set", "sets", multiple=True, metavar="KEY=VALUE", help="override a config field")
    @click.option("--waive", multiple=True, metavar="CHECK_ID", help="waive a failing preflight check (needs --reason)")
    @click.option("--reason", multiple=True, help="why the matching --waive is acceptable (kept in the report)")
    @click.option("--allow-schedule-change", is_flag=True, help="resume even though the lr schedule changes")
    @click.option("--verify-data", is_flag=True, help="the gate also compares shards and checkpoint with their sha256")
    def command(config_path, config_json, resume, fresh, sets, waive, reason, allow_schedule_change, verify_data) -> int:
        """One rank of a split run: `torchrun --nproc-per-node N -m dflash.commands.torchrun --config RUN.toml --fresh`."""
        from dflash.config import load_config, parse_overrides

        if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
            raise click.UsageError("run under torchrun (RANK/WORLD_SIZE unset), or start the run with dflash-train")
        if config_json:
            try:
                raw = json.loads(config_json.read_text())
            except (OSError, UnicodeDecodeError, ValueError) as e:
                raise click.UsageError(f"--config-json {config_json}: unreadable ({' '.join(str(e).split())[:120]}); "
                                       "it is written by dflash-train's launcher, start the run with dflash-train") from None
            if not isinstance(raw, dict):
                raise click.UsageError(f"--config-json {config_json}: not a JSON object; start the run with dflash-train")
            cfg = config_from_dict(raw, source=str(config_json))
            require_fresh_gate(cfg)
            return worker(cfg, Path(resume) if resume else None, provenance=provenance(cfg.profile))
        if config_path is None:
            raise click.UsageError("give --config RUN.toml")
        if resume and fresh:
            raise click.UsageError("--resume and --fresh exclude each other; pick one")
        if len(waive) != len(reason):
            raise click.UsageError("give one --reason for each --waive")
        cfg = load_config(config_path, parse_overrides(sets))
        if cfg.topology.layout == "colocated":
            raise click.UsageError(f"{config_path}: topology.target_gpus / drafter_gpus are empty, and so is "
                                   "colocated_gpus; a one-device co-located run is started with dflash-train --config")
        from preflight.gate import apply_profile_env, resolve_compile_cache

        apply_profile_env(cfg.profile, log=print if os.environ["RANK"] == "0" else (lambda *_: None))
        cfg = resolve_compile_cache(cfg)  # train.compile_cache as dflash-train resolves it
        options = {"resume": resume, "fresh": fresh, "waivers": dict(zip(waive, reason)),
                   "allow_schedule_change": allow_schedule_change, "verify_data": verify_data}
        return worker(cfg, None, gate=lambda me, local_rank: collective_gate(cfg, me, local_rank, options),
                      provenance=provenance(cfg.profile))

    run_cli(command, "dflash.commands.torchrun", argv)


if __name__ == "__main__":
    main()
