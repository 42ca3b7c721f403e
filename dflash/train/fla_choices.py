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

from dflash.models.fla_kept import kept_path, read_kept
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
              "--warm-cache", file=sys.stderr)
        return 2
    out = args.out or kept_path(gpu or "unknown")
    tmp = out.with_name(f".{out.name}.tmp")
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp.write_text(json.dumps({**choices, "gpu_name": gpu}, indent=1) + "\n")
        os.replace(tmp, out)
    except OSError as e:
        if tmp.parent.is_dir():
            tmp.unlink(missing_ok=True)
        print(f"fla_choices: cannot write {out} ({e.strerror or e}); name a writable OUT", file=sys.stderr)
        return 2
    print(f"fla_choices: {len(choices['kernels'])} kernel(s)' choices for {gpu} (Triton {choices.get('triton')}, fla "
          f"{choices.get('fla')}) written to {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
