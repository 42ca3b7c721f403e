"""Does the target folder hold weights, and may the run build its target with random ones? The one rule.

The presets' targets (``configs/targets/...``) hold a config.json alone: the shapes of a model, no weights.
``target.random_init = true`` builds such a target with random weights, which is right for memory and speed
measurements and useless for a drafter (it learns to predict noise). So a run gets:

- random_init and weights in the folder: refused (the weights would be ignored, days of training thrown away);
- no weights and random_init off: refused (nothing to load), naming both ways out;
- random_init and no weights: allowed, with RANDOM_WEIGHTS_WARNING in the gate and at every start of the trainer.

Torch-free: preflight's `config` check asks it, the loader (dflash.models.target) reads WEIGHT_FILES from here.
"""

from __future__ import annotations

from pathlib import Path

from dflash.models import smollm2

# Where transformers looks for a folder's weights, in its order (an index names the shard files).
WEIGHT_FILES = ("model.safetensors.index.json", "model.safetensors", "pytorch_model.bin.index.json", "pytorch_model.bin")

RANDOM_WEIGHTS_WARNING = "the target has random weights: the drafter learns nothing useful"
RANDOM_INIT_FLAG = "--set target.random_init=true"  # how a shape-only measurement asks for random weights


def weights_in(path: str) -> list[str]:
    """The weight files target.path holds: WEIGHT_FILES present, then any other *.safetensors (a shard without its
    index); the embedded default holds its GGUF. [] for a folder of shapes only (or none at all)."""
    if smollm2.is_embedded(path):
        return [f"{smollm2.NAME}'s GGUF"]
    folder = smollm2.local_folder(path)
    try:
        found = [name for name in WEIGHT_FILES if (folder / name).is_file()]
        found += sorted(p.name for p in Path(folder).glob("*.safetensors") if p.name not in found)
    except OSError:
        return []
    return found


def weights_problem(random_init: bool, path: str, weights: list[str], where: str) -> tuple[str, str, str] | None:
    """(status, finding, fix) of the rule above for target.path holding `weights` (weights_in), `where` the config
    the fix names; None when the run loads real weights as it should."""
    if random_init and weights:
        shown = ", ".join(weights[:3]) + (f" (+{len(weights) - 3} more)" if len(weights) > 3 else "")
        return ("fail", f"target.random_init = true but target.path {path} holds weights ({shown}): the run would "
                f"ignore them and train against random weights",
                f"drop target.random_init (from {where} or the --set that gives it) to train against those weights")
    if not random_init and not weights:
        return ("fail", f"target.path {path} holds no weights ({' or '.join(WEIGHT_FILES[1::2])}), only the model's "
                "shapes", f"set target.path in {where} to the folder of your model's weights; for memory and speed "
                f"measurements on these shapes alone, add {RANDOM_INIT_FLAG}")
    if random_init:
        return ("warn", f"{RANDOM_WEIGHTS_WARNING} (target.random_init = true; {path} holds no weights)",
                f"for a drafter worth training, set target.path in {where} to your model's weights and drop "
                "target.random_init")
    return None
