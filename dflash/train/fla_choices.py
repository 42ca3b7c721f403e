"""Keep the fla autotuning choices a compile cache artifact recorded (dflash.models.fla_tuning).

    python -m dflash.train.fla_choices ARTIFACT          # dflash/models/fla_tuned/<its GPU>.json: every cold start
    python -m dflash.train.fla_choices ARTIFACT OUT      # OUT: DFLASH_FLA_TUNED=OUT for the runs that want it
    python -m dflash.train.fla_choices RUN/fla_choices.json   # what a run's first step tuned

`dflash-train --warm-cache` on a GPU records fla's choices in the artifact's manifest, and a run whose first step
tuned fla writes them to its run dir; they hold for any data mix of that target on that GPU model, Triton and fla.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from dflash.models.fla_kept import kept_path, read_kept, unusable
from dflash.runs.compile_artifact import read_header


def recorded(artifact: Path) -> tuple[dict | None, str | None, str | None]:
    """(fla's choices the artifact (or a run's fla_choices.json) recorded, its GPU's name, None) or (None, None, why
    not)."""
    if artifact.suffix == ".json":
        choices, problem = read_kept(artifact)
        if choices is None:
            return None, None, problem
        return choices, choices.get("gpu_name"), None
    header, problem = read_header(artifact)
    if header is None:
        return None, None, problem or "no such file"
    manifest = header["manifest"]
    choices = manifest.get("fla_choices")
    if not isinstance(choices, dict) or not isinstance(choices.get("kernels"), dict):
        return None, None, "it recorded no fla choices (made on a CPU, for a target without fla's kernels, or by an " \
                           "older dflash)"
    return choices, choices.get("gpu_name") or manifest.get("gpu_name"), None


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m dflash.train.fla_choices",
                                description="Keep the fla choices a compile cache artifact recorded, for every cold "
                                            "start on its GPU model (dflash/models/fla_tuned/<GPU>.json) or in OUT.")
    p.add_argument("artifact", type=Path, help="a compile cache artifact (dflash-train --warm-cache on a GPU), or a "
                   "run's fla_choices.json")
    p.add_argument("out", type=Path, nargs="?", help="where to write the choices (default: the kept file of its GPU)")
    args = p.parse_args(argv)
    choices, gpu, problem = recorded(args.artifact)
    if choices is None:
        print(f"fla_choices: {args.artifact}: {problem}; make one on the GPU with dflash-train --config RUN.toml "
              "--warm-cache, or name a run's fla_choices.json", file=sys.stderr)
        return 2
    out = args.out or kept_path(gpu or "unknown")
    choices, added = merged(out, {**choices, "gpu_name": gpu})
    tmp = out.with_name(f".{out.name}.tmp")
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp.write_text(json.dumps(choices, indent=1) + "\n")
        os.replace(tmp, out)
    except OSError as e:
        if tmp.parent.is_dir():
            tmp.unlink(missing_ok=True)
        print(f"fla_choices: cannot write {out} ({e.strerror or e}); name a writable OUT", file=sys.stderr)
        return 2
    print(f"fla_choices: {len(choices['kernels'])} kernel(s)' choices for {gpu} (Triton {choices.get('triton')}, fla "
          f"{choices.get('fla')}) written to {out}{f' ({added} kept there before, kept with them)' if added else ''}")
    return 0


def merged(out: Path, choices: dict) -> tuple[dict, int]:
    """`choices` with the entries `out` already keeps for the same GPU model, Triton and fla (a run that loaded other
    kernels or met other shapes adds to the file, never drops from it); (the merge, entries kept from `out`)."""
    if not out.is_file():
        return choices, 0
    kept, problem = read_kept(out)
    if kept is None or unusable(kept, choices.get("gpu_name"), choices.get("triton"), choices.get("fla")):
        return choices, 0  # another machine state's choices: replaced
    kernels, added = {name: dict(k, entries=list(k["entries"])) for name, k in choices["kernels"].items()}, 0
    for name, kernel in kept["kernels"].items():
        mine = kernels.setdefault(name, {"tuned_s": kernel.get("tuned_s"), "entries": []})
        keys = {tuple(e["key"]) for e in mine["entries"]}
        new = [e for e in kernel["entries"] if tuple(e["key"]) not in keys]
        mine["entries"] += new
        added += len(new)
    return {**choices, "kernels": kernels}, added


if __name__ == "__main__":
    raise SystemExit(main())
