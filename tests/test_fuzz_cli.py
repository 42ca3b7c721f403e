"""Malformed input to every command: one line on stderr, a non-zero exit, no traceback, nothing touched.

Each case calls a command's entry function in this process (``main(argv)`` ends in SystemExit)
against one world: a tiny target, a dataset, a run dir with checkpoints and a drafter, and a
valid run config. After every case the world must be byte for byte as it was (no checkpoint
moved aside, no preflight report, no new output folder). A few cases run in a fresh interpreter
to show that a usage error is decided before torch is imported.
"""

from __future__ import annotations

import hashlib
import html
import json
import os
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from trainkit import tiny_config

REPO = Path(__file__).resolve().parent.parent
BIG = "1" + "0" * 23  # 10^23


def toml_text(raw: dict) -> str:
    lines = [f"{k} = {json.dumps(v)}" for k, v in raw.items() if not isinstance(v, dict)]
    for key, section in raw.items():
        if isinstance(section, dict):
            lines += [f"[{key}]"] + [f"{k} = {json.dumps(v)}" for k, v in section.items()]
    return "\n".join(lines) + "\n"


def with_line(raw: dict, section: str, line: str) -> str:
    """The config as TOML with one raw TOML line replacing or adding a key of `section`."""
    key = line.split("=")[0].strip()
    text = toml_text({k: ({kk: vv for kk, vv in v.items() if kk != key} if k == section else v)
                      for k, v in raw.items() if k != key})
    if section:
        return text.replace(f"[{section}]\n", f"[{section}]\n{line}\n")
    return f"{line}\n{text}"


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    from dflash.train.trainer import run

    root = tmp_path_factory.mktemp("fuzz")
    cfg, raw = tiny_config(root, max_steps=2, save_every=1)
    run(cfg, None, log=lambda *_: None, progress=False)  # run/ holds checkpoints, metrics and drafter/
    good = root / "run.toml"
    good.write_text(toml_text(raw))
    bad = root / "bad"
    bad.mkdir()
    files = {
        "not-utf8.toml": toml_text(raw).encode().replace(b'"cpu"', b'"c\xffpu"'),
        "binary.toml": bytes(range(256)) * 4,
        "not-toml.toml": b"[train\nlr = \n",
        "datetime.toml": with_line(raw, "", "output_dir = 1979-05-27T07:32:00Z").encode(),
        "unknown-key.toml": with_line(raw, "train", "learning_rate = 1e-3").encode(),
        "section-scalar.toml": with_line(raw, "", "train = 5").encode().replace(b"[train]", b"[unused]"),
        "wd-inf.toml": with_line(raw, "train", "weight_decay = inf").encode(),
        "lr-nan.toml": with_line(raw, "train", "lr = nan").encode(),
        "budget-huge.toml": with_line(raw, "data", f"token_budget = {BIG}").encode(),
        "batch-huge.toml": with_line(raw, "data", f"max_batch_size = {BIG}").encode(),
        "layer-negative.toml": with_line(raw, "drafter", "target_layer_ids = [-1]").encode(),
        "seed-negative.toml": with_line(raw, "train", "seed = -1").encode(),
        "deep.toml": b"a = " + b"[" * 3000 + b"]" * 3000 + b"\n",
        "nul-path.toml": with_line(raw, "target", 'path = "a\\u0000b"').encode(),
        "colocated-split.toml": toml_text(raw).encode(),
        "gpu-numbers.toml": (toml_text(raw) + "[topology]\ncolocated_gpus = [0, 1]\n").encode(),
        "misspelt-key.toml": with_line(raw, "data", "token_budjet = 512").encode(),
        "prompts-not-utf8.txt": b"hello \xff\xfe world\n",
        "prompts-empty.txt": b"\n\n",
        "prompts-bad.jsonl": b'{"prompt": "hi"}\n{not json\n',
        "prompts-deep.jsonl": b'{"prompt": "hi"}\n' + b"[" * 100_000 + b"]" * 100_000 + b"\n",
        "prompts-bigint.jsonl": b'{"prompt": "hi"}\r\n{"prompt": "hi", "n": ' + b"7" * 5000 + b"}\r\n",
        "nvml-garbage.json": b"\x00\x01 not json",
        "gpu-config.toml": with_line(raw, "", 'device = "cuda"').encode(),
        "snap-garbage/snapshot.json": b"\x00\x01 not json",
        "snap-foreign/snapshot.json": b'{"format": "other-tool/3"}',
        "snap-list/snapshot.json": b"[1, 2]",
        "snap-truncated/snapshot.json": b'{"format": "dflash-snapshot/1", "run": {}}',
        "snap-old-config/snapshot.json": json.dumps({"format": "dflash-snapshot/1", "run": {}, "environment": {},
                                                     "config": {"train": {"learning_rate": 1}}}).encode(),
    }
    for name, content in files.items():
        (bad / name).parent.mkdir(exist_ok=True)
        (bad / name).write_bytes(content)
    # drafters: a good one's config.json with broken weights, and the reverse
    drafter = root / "run" / "drafter"
    for name, weights, config in [
        ("garbage-weights", b"\x00garbage" * 64, None),
        ("truncated-weights", (drafter / "model.safetensors").read_bytes()[:500], None),
        ("empty-weights", b"", None),
        ("config-not-json", None, b"{not json"),
        ("config-list", None, b"[1, 2]"),
        ("config-missing-fields", None, b'{"architectures": ["DFlashDraftModel"]}'),
    ]:
        folder = bad / name
        folder.mkdir()
        (folder / "model.safetensors").write_bytes(weights if weights is not None else (drafter / "model.safetensors").read_bytes())
        (folder / "config.json").write_bytes(config if config is not None else (drafter / "config.json").read_bytes())
    (bad / "empty-dir").mkdir()
    (bad / "garbage-shards").mkdir()
    (bad / "garbage-shards" / "shard-00000.arrow").write_bytes(b"not arrow at all")
    (bad / "target-broken").mkdir()
    (bad / "target-broken" / "config.json").write_text("{broken")
    (bad / "target-not-utf8").mkdir()
    (bad / "target-not-utf8" / "config.json").write_bytes(b'{"hidden_size": "\xff"}')
    envs = bad / "envs-not-utf8"
    envs.mkdir()
    (envs / "train-cu128.toml").write_text((REPO / "envs" / "train-cu128.toml").read_text())
    (envs / "train-cu128.lock").write_bytes(b"torch==2.10.0 \\\n    --hash=sha256:\xff\xfe\n")
    envs = bad / "envs-profile-not-utf8"
    envs.mkdir()
    (envs / "train-cu128.toml").write_bytes(b'name = "train-\xff"\n')
    return root


@pytest.fixture
def keep_environ():
    """dflash-train sets the profile's variables in os.environ once its input is valid: undo that after a case."""
    saved = dict(os.environ)
    yield
    os.environ.clear()
    os.environ.update(saved)


def snapshot(root: Path) -> dict:
    """Every file and folder under root: size, mtime and content hash."""
    out = {}
    for p in sorted(root.rglob("*")):
        rel = str(p.relative_to(root))
        if p.is_dir():
            out[rel] = "dir"
        else:
            st = p.stat()
            out[rel] = (st.st_size, st.st_mtime_ns, hashlib.sha256(p.read_bytes()).hexdigest())
    return out


def _main(prog: str):
    if prog == "dflash-train":
        from dflash.commands.train import train_main as main
    elif prog == "dflash-data":
        from dflash.commands.data import data_main as main
    elif prog == "dflash-eval":
        from dflash.commands.eval import eval_main as main
    elif prog == "dflash-report":
        from dflash.commands.report import report_main as main
    elif prog == "dflash-preflight":
        from dflash.commands.preflight import main
    elif prog == "dflash-estimate":
        from dflash.commands.estimate import main
    elif prog == "dflash-lock":
        from dflash.commands.lock import main
    elif prog == "dflash-diff":
        from dflash.commands.diff import main
    else:
        from dflash.commands.torchrun import main
    return main


R, G, B = "{root}", "{root}/run.toml", "{root}/bad"  # placeholders, filled in per case
TRAIN = ["--config", G, "--no-progress"]
TORCHRUN = {"RANK": "0", "WORLD_SIZE": "2"}

# (prog, argv, a piece of the error line, exit code, extra environment)
CASES = [
    # ---- dflash-train: config files
    ("dflash-train", ["--config", f"{R}/nosuch.toml"], "no such config file", 2, None),
    ("dflash-train", ["--config", f"{B}/not-utf8.toml"], "not UTF-8 text (byte ff", 2, None),
    ("dflash-train", ["--config", f"{B}/binary.toml"], "not UTF-8 text", 2, None),
    ("dflash-train", ["--config", f"{B}/not-toml.toml"], "not valid TOML", 2, None),
    ("dflash-train", ["--config", f"{B}/datetime.toml"], "output_dir: Input should be a valid string", 2, None),
    ("dflash-train", ["--config", f"{B}/unknown-key.toml"], "train.learning_rate: unknown key", 2, None),
    ("dflash-train", ["--config", f"{B}/misspelt-key.toml"], "misspelt-key.toml: data.token_budjet: unknown key; did you "
     "mean data.token_budget?", 2, None),
    ("dflash-train", ["--config", f"{B}/gpu-numbers.toml"], 'gpu-numbers.toml: topology.colocated_gpus: GPU names are '
     'strings, got 0; quote each GPU name: colocated_gpus = ["0", "1"]', 2, None),
    ("dflash-train", ["--config", f"{B}/section-scalar.toml"], "train: Input should be a valid dictionary", 2, None),
    ("dflash-train", ["--config", f"{B}/wd-inf.toml", "--fresh"], "train.weight_decay: Input should be a finite number", 2, None),
    ("dflash-train", ["--config", f"{B}/lr-nan.toml"], "train.lr: Input should be a finite number", 2, None),
    ("dflash-train", ["--config", f"{B}/budget-huge.toml"], "data.token_budget: Input should be less than or equal to", 2, None),
    ("dflash-train", ["--config", f"{B}/batch-huge.toml"], "data.max_batch_size: Input should be less than or equal", 2, None),
    ("dflash-train", ["--config", f"{B}/layer-negative.toml"], "drafter.target_layer_ids.0: Input should be greater", 2, None),
    ("dflash-train", ["--config", f"{B}/seed-negative.toml"], "train.seed: Input should be greater than or equal to 0", 2, None),
    ("dflash-train", ["--config", f"{B}/deep.toml"], "nested too deeply", 2, None),
    ("dflash-train", ["--config", f"{B}/nul-path.toml"], "target.path: contains a NUL character", 2, None),
    ("dflash-train", ["--config", B], "is a directory", 2, None),
    # ---- dflash-train: flags (a valid config whose run dir holds checkpoints)
    ("dflash-train", [*TRAIN, "--fresh", "--set", "train.lr.x=1"], "cannot set train.lr.x: train.lr is a value", 2, None),
    ("dflash-train", [*TRAIN, "--fresh", "--set", "train={lr=1}"], "a table would replace all of train", 2, None),
    ("dflash-train", [*TRAIN, "--fresh", "--set", "train..lr=1"], "empty name", 2, None),
    ("dflash-train", [*TRAIN, "--fresh", "--set", "=1"], "expected SECTION.KEY=VALUE", 2, None),
    # a --set value is blamed on that --set, not on the file
    ("dflash-train", [*TRAIN, "--fresh", "--set", "train.weight_decay=inf"],
     "error: --set train.weight_decay=inf: train.weight_decay: Input should be a finite", 2, None),
    ("dflash-train", [*TRAIN, "--fresh", "--set", "topology.colocated_gpus=[0,1]"], "error: --set topology.colocated_gpus="
     "[0,1]: topology.colocated_gpus: GPU names are strings, got 0; quote each GPU name: --set "
     "'topology.colocated_gpus=[\"0\",\"1\"]'", 2, None),
    ("dflash-train", [*TRAIN, "--fresh", "--set", "trian.lr=1"], "error: --set trian.lr=1: trian: unknown key; did you "
     "mean train?", 2, None),
    ("dflash-train", [*TRAIN, "--fresh", "--set", "train.token_budget=1"], "error: --set train.token_budget=1: "
     "train.token_budget: unknown key; did you mean data.token_budget?", 2, None),
    ("dflash-train", [*TRAIN, "--fresh", "--set", f"data.token_budget={BIG}"], "data.token_budget: Input should be less", 2, None),
    ("dflash-train", [*TRAIN, "--fresh", "--set", "nosuch.key=1"], "nosuch: unknown key", 2, None),
    ("dflash-train", [*TRAIN, "--fresh", "--waive", "nosuch", "--reason", "x"], "--waive nosuch: unknown check id", 2, None),
    ("dflash-train", [*TRAIN, "--fresh", "--waive", "env-drift"], "give one --reason for each --waive", 2, None),
    ("dflash-train", [*TRAIN, "--fresh", "--waive", "env-drift", "--reason", " "], "give a non-empty --reason", 2, None),
    ("dflash-train", [*TRAIN, "--resume", "latest", "--fresh"], "--resume and --fresh exclude each other", 2, None),
    ("dflash-train", [*TRAIN], "already holds checkpoints", 2, None),
    ("dflash-train", [*TRAIN, "--resume", f"{R}/nosuch-checkpoint"], "nosuch-checkpoint", 2, None),
    ("dflash-train", [*TRAIN, "--fresh", "--resume", ""], "--resume needs `latest` or a checkpoint folder", 2, None),
    ("dflash-train", [*TRAIN, "--fresh", "--max-steps", "0"], "--max-steps", 2, None),
    ("dflash-train", [*TRAIN, "--fresh", "--max-steps", "many"], "--max-steps", 2, None),
    ("dflash-train", [*TRAIN, "--fresh", "--target-gpus", ",", "--drafter-gpus", "1"], "GPU list is empty", 2, None),
    ("dflash-train", [*TRAIN, "--fresh", "--target-gpus", "0"], "give both target_gpus and drafter_gpus", 2, None),
    ("dflash-train", [*TRAIN, "--fresh", "--target-gpus", "0", "--drafter-gpus", "0"], "in both target_gpus and drafter_gpus", 2, None),
    ("dflash-train", [*TRAIN, "--fresh", "--output-dir", ""], "output_dir: String should have at least 1 character", 2, None),
    ("dflash-train", [*TRAIN, "--fresh", "--bogus"], "No such option '--bogus'", 2, None),
    ("dflash-train", [], "give --config RUN.toml", 2, None),
    ("dflash-train", [*TRAIN, "--fresh", "--init-from", f"{R}/nosuch"], "not a drafter folder", 2, None),
    ("dflash-train", [*TRAIN, "--fresh", "--init-from", f"{B}/config-not-json"], "config.json: not readable JSON", 2, None),
    ("dflash-train", [*TRAIN, "--fresh", "--init-from", f"{B}/config-list"], "config.json: not a JSON object", 2, None),
    ("dflash-train", [*TRAIN, "--resume", "latest", "--init-from", f"{R}/run/drafter"], "give one of them", 2, None),
    ("dflash-train", [*TRAIN, "--fresh", "--report-to", "mlflow"], "--report-to mlflow: unknown tracker", 2, None),
    ("dflash-train", [*TRAIN, "--fresh", "--report-to", ","], "unknown tracker", 2, None),
    ("dflash-train", [*TRAIN, "--fresh", "--set", "eval.holdout=4", "--set", "eval.path=x"], "not both", 2, None),
    ("dflash-train", [*TRAIN, "--fresh", "--set", "eval.every=-1"], "eval.every: Input should be greater than", 2, None),
    ("dflash-train", [*TRAIN, "--fresh", "--set", "eval.holdout=4", "--target-gpus", "0", "--drafter-gpus", "1"],
     "[eval] works in co-located runs only", 2, None),
    ("dflash-train", ["--config"], "Option '--config' requires an argument", 2, None),
    # ---- dflash-data
    ("dflash-data", [], "missing command; give one of import, manifest, merge, prepare, regenerate, stats", 2, None),
    ("dflash-data", ["bogus"], "No such command 'bogus'", 2, None),
    ("dflash-data", ["stats", f"{R}/nosuch"], "does not exist", 2, None),
    ("dflash-data", ["stats", G], "is a file", 2, None),
    ("dflash-data", ["stats", f"{B}/empty-dir"], "empty-dir: no *.arrow shards in this folder; write them with "
     "dflash-data import (conversations) or dflash-data prepare (prompts)", 2, None),
    ("dflash-data", ["stats", f"{B}/garbage-shards"], "shard-00000.arrow: not a readable Arrow IPC file", 2, None),
    ("dflash-data", ["stats", f"{R}/data", "--token-budget", BIG], "--token-budget", 2, None),
    ("dflash-data", ["stats", f"{R}/data", "--num-buckets", "0"], "--num-buckets", 2, None),
    ("dflash-data", ["prepare", "--device", "tpu", "--out", f"{R}/new", "--prompts", f"{B}/prompts-empty.txt"],
     "--device 'tpu': use auto, cpu or cuda", 2, None),
    ("dflash-data", ["prepare", "--engine", "vllm", "--out", f"{R}/new"], "--engine", 2, None),
    ("dflash-data", ["prepare", "--prompts", f"{R}/nosuch.txt", "--out", f"{R}/new"], "no such prompt file", 2, None),
    ("dflash-data", ["prepare", "--prompts", f"{B}/prompts-not-utf8.txt", "--out", f"{R}/new"], "cannot read it as UTF-8", 2, None),
    ("dflash-data", ["prepare", "--prompts", f"{B}/prompts-empty.txt", "--out", f"{R}/new"], "holds no prompts", 2, None),
    ("dflash-data", ["prepare", "--prompts", f"{B}/prompts-bad.jsonl", "--out", f"{R}/new"], "prompts-bad.jsonl:2: not valid JSON", 2, None),
    ("dflash-data", ["prepare", "--prompts", f"{B}/prompts-bad.jsonl", "--limit", "0", "--out", f"{R}/new"], "--limit", 2, None),
    ("dflash-data", ["prepare", "--prompts", f"{B}/prompts-deep.jsonl", "--out", f"{R}/new"],
     "prompts-deep.jsonl:2: not valid JSON (nested too deeply", 2, None),
    ("dflash-data", ["prepare", "--prompts", f"{B}/prompts-bigint.jsonl", "--out", f"{R}/new"],
     "prompts-bigint.jsonl:2: not valid JSON (Exceeds the limit (4300 digits)", 2, None),
    ("dflash-data", ["prepare", "--target", f"{R}/nosuch", "--prompts", G, "--out", f"{R}/new"], "no config.json there", 2, None),
    ("dflash-data", ["prepare", "--target", f"{B}/target-broken", "--prompts", G, "--out", f"{R}/new"], "not valid JSON", 2, None),
    ("dflash-data", ["prepare", "--target", f"{B}/target-not-utf8", "--prompts", G, "--out", f"{R}/new"], "not UTF-8 JSON", 2, None),
    ("dflash-data", ["prepare", "--target", f"{R}/tiny-target", "--prompts", G, "--out", f"{R}/new"], "tokenizer has no vocabulary", 2, None),
    ("dflash-data", ["prepare", "--prompts", G], "Missing option '--out'", 2, None),
    ("dflash-data", ["prepare", "--prompts", G, "--out", G], "is a file", 2, None),
    ("dflash-data", ["merge", "--out", f"{R}/new"], "Missing argument 'INPUTS...'", 2, None),
    ("dflash-data", ["merge", f"{R}/nosuch", "--out", f"{R}/new"], "does not exist", 2, None),
    ("dflash-data", ["merge", f"{R}/data", "--out", f"{R}/data"], "which merge never writes to", 2, None),
    ("dflash-data", ["merge", f"{R}/data", "--out", f"{R}/run"], "already exists", 2, None),
    ("dflash-data", ["merge", f"{B}/empty-dir", "--out", f"{R}/new"], "empty-dir", 2, None),
    # ---- dflash-eval
    ("dflash-eval", ["--drafter", f"{R}/nosuch"], "does not exist", 2, None),
    ("dflash-eval", ["--drafter", f"{B}/empty-dir"], "not a drafter folder", 2, None),
    ("dflash-eval", ["--drafter", f"{B}/garbage-weights"], "not a complete safetensors file", 2, None),
    ("dflash-eval", ["--drafter", f"{B}/truncated-weights"], "not a complete safetensors file", 2, None),
    ("dflash-eval", ["--drafter", f"{B}/empty-weights"], "not a complete safetensors file", 2, None),
    ("dflash-eval", ["--drafter", f"{B}/config-not-json"], "not a readable JSON file", 2, None),
    ("dflash-eval", ["--drafter", f"{B}/config-list"], "not a JSON object", 2, None),
    ("dflash-eval", ["--drafter", f"{B}/config-missing-fields", "--prompts", G], "not a drafter this version can load", 2, None),
    ("dflash-eval", ["--drafter", f"{R}/run", "--target", f"{R}/tiny-target", "--prompts", G], "tokenizer has no vocabulary", 2, None),
    ("dflash-eval", ["--drafter", f"{R}/run", "--device", "tpu"], "--device 'tpu': use cpu or cuda", 2, None),
    ("dflash-eval", ["--drafter", f"{R}/run", "--block-size", BIG], "--block-size", 2, None),
    ("dflash-eval", ["--drafter", f"{R}/run", "--limit", "0"], "--limit", 2, None),
    ("dflash-eval", ["--drafter", f"{R}/run", "--prompts", f"{R}/nosuch.txt"], "no such prompt file", 2, None),
    ("dflash-eval", ["--drafter", f"{R}/run", "--prompts", f"{B}/prompts-not-utf8.txt"], "cannot read it as UTF-8", 2, None),
    ("dflash-eval", ["--drafter", f"{R}/run", "--prompts", f"{B}/prompts-deep.jsonl"], "prompts-deep.jsonl:2: not valid JSON", 2,
     None),
    ("dflash-eval", ["--drafter", f"{R}/run", "--prompts", f"{B}/prompts-bigint.jsonl"], "prompts-bigint.jsonl:2: not valid", 2,
     None),
    ("dflash-eval", ["--drafter", f"{R}/run", "--target", f"{R}/nosuch", "--prompts", G], "no config.json there", 2, None),
    ("dflash-eval", ["--drafter", f"{R}/run", "--json", f"{R}/nosuch/report.json", "--prompts", G], "does not exist", 2, None),
    ("dflash-eval", ["--drafter", f"{R}/run", "--json", R], "is a directory", 2, None),
    ("dflash-eval", [], "Missing option '--drafter'", 2, None),
    # ---- dflash-report
    ("dflash-report", [], "Missing argument 'RUN_DIRS...'", 2, None),
    ("dflash-report", [f"{R}/nosuch"], "no such run dir", 2, None),
    ("dflash-report", [f"{B}/empty-dir"], "not a run dir", 2, None),
    ("dflash-report", [f"{R}/run", f"{R}/run", f"{R}/run"], "give one run dir, or two to compare", 2, None),
    ("dflash-report", [f"{R}/run", "--out", G], "is a file", 2, None),
    ("dflash-report", [G], "run.toml: not a folder", 2, None),
    # ---- dflash-preflight (the checks themselves failing is exit 1 with a report; these are usage errors)
    ("dflash-preflight", [], "Missing option '--profile'", 2, None),
    ("dflash-preflight", ["--profile", "nosuch"], "unknown profile 'nosuch'", 2, None),
    ("dflash-preflight", ["--profile", "../nosuch"], "unknown profile", 2, None),
    ("dflash-preflight", ["--profile", "train-cu128", "--config", f"{B}/not-utf8.toml"], "not UTF-8 text", 2, None),
    ("dflash-preflight", ["--profile", "train-cu128", "--config", f"{B}/datetime.toml"], "output_dir: Input should be", 2, None),
    ("dflash-preflight", ["--profile", "train-cu128", "--config", f"{B}/wd-inf.toml"], "train.weight_decay: Input should be a finite", 2, None),
    ("dflash-preflight", ["--profile", "train-cu128", "--config", f"{R}/nosuch.toml"], "no such config file", 2, None),
    ("dflash-preflight", ["--profile", "train-cu128", "--waive", "nosuch", "--reason", "x"], "unknown check id", 2, None),
    ("dflash-preflight", ["--profile", "train-cu128", "--waive", "env-drift"], "1 --waive but 0 --reason", 2, None),
    ("dflash-preflight", ["--profile", "train-cu128", "--resume", "--fresh"], "exclude each other", 2, None),
    ("dflash-preflight", ["--profile", "train-cu128", "--nvml-fake", f"{R}/nosuch.json"], "--nvml-fake", 2, None),
    ("dflash-preflight", ["--profile", "train-cu128", "--nvml-fake", f"{B}/nvml-garbage.json"], "--nvml-fake", 2, None),
    ("dflash-preflight", ["--profile", "train-cu128", "--nvml-fake", G], "--nvml-fake", 2, None),
    # ---- dflash-estimate
    ("dflash-estimate", ["--config", G, "--gpu-memory", "99999999999999999999999999TiB"], "far above any GPU", 2, None),
    ("dflash-estimate", ["--config", G, "--gpu-memory", "1" + "0" * 400 + "GiB"], "far above any GPU", 2, None),
    ("dflash-estimate", ["--config", G, "--gpu-memory", "95"], "write a number and a unit", 2, None),
    ("dflash-estimate", ["--config", G, "--gpu-memory", "0GiB"], "must be positive", 2, None),
    ("dflash-estimate", ["--config", G, "--gpu-memory", "nanGiB"], "write a number and a unit", 2, None),
    ("dflash-estimate", ["--config", G, "--gpu-memory", "95GiB", "--from-nvml"], "not both", 2, None),
    ("dflash-estimate", ["--config", G, "--cuda", "abc"], "CUDA version must look like", 2, None),
    ("dflash-estimate", ["--config", G, "--set", "train={lr=1}"], "a table would replace", 2, None),
    ("dflash-estimate", ["--config", f"{B}/not-utf8.toml"], "not UTF-8 text", 2, None),
    ("dflash-estimate", ["--config", f"{B}/budget-huge.toml", "--gpu-memory", "95GiB"], "data.token_budget", 2, None),
    ("dflash-estimate", ["--config", G, "--set", f"target.path={B}/target-not-utf8"], "not UTF-8 JSON", 2, None),
    ("dflash-estimate", [], "Missing option '--config'", 2, None),
    # ---- dflash-lock
    ("dflash-lock", [], "missing command; give one of check, diff, write", 2, None),
    ("dflash-lock", ["diff", "nosuch", "train-cu128"], "unknown profile 'nosuch'", 2, None),
    ("dflash-lock", ["diff", "train-cu128"], "Missing argument 'B'", 2, None),
    ("dflash-lock", ["check", "--envs-dir", f"{R}/nosuch"], "does not exist", 2, None),
    ("dflash-lock", ["check", "--envs-dir", G], "is a file", 2, None),
    ("dflash-lock", ["write", "extra"], "unexpected extra argument", 2, None),
    # ---- dflash-diff (the world's run dir was made without the gate: it has no snapshot.json)
    ("dflash-diff", [], "Missing argument 'A'", 2, None),
    # A alone, no snapshot: that line, not a suggestion (--here A) that fails the same way
    ("dflash-diff", [f"{R}/run"], "run: no snapshot.json (not a run dir, or a run started before snapshots were "
     "written); give a run dir a dflash-train run wrote", 2, None),
    ("dflash-diff", ["--here", f"{R}/run", f"{R}/run"], "give one run dir with --here", 2, None),
    ("dflash-diff", [f"{R}/nosuch", f"{R}/run"], "nosuch: no such run dir", 2, None),
    ("dflash-diff", [f"{R}/run", f"{R}/run"], "run: no snapshot.json", 2, None),
    ("dflash-diff", ["--here", f"{R}/run"], "run: no snapshot.json", 2, None),
    ("dflash-diff", [f"{B}/snap-garbage", f"{R}/run"], "snapshot.json: not a readable snapshot", 2, None),
    ("dflash-diff", [G, G], "run.toml: not a readable snapshot", 2, None),
    ("dflash-diff", [f"{B}/snap-foreign", f"{R}/run"], "not a dflash-snapshot/1 snapshot (format 'other-tool/3')", 2, None),
    ("dflash-diff", [f"{B}/snap-list", f"{R}/run"], "(format 'list')", 2, None),
    ("dflash-diff", [f"{B}/snap-truncated", f"{R}/run"], "without its 'environment' section", 2, None),
    ("dflash-diff", ["--here", f"{B}/snap-old-config"], "its config does not validate in this version", 2, None),
    ("dflash-diff", [f"{R}/run", "--bogus"], "No such option '--bogus'", 2, None),
    # ---- python -m dflash.commands.torchrun (a rank under torchrun)
    ("dflash.commands.torchrun", ["--config", G], "run under torchrun", 2, None),
    ("dflash.commands.torchrun", [], "give --config RUN.toml", 2, TORCHRUN),
    ("dflash.commands.torchrun", ["--config", G, "--resume", "latest", "--fresh"], "exclude each other", 2, TORCHRUN),
    ("dflash.commands.torchrun", ["--config", G, "--waive", "env-drift"], "give one --reason for each --waive", 2, TORCHRUN),
    ("dflash.commands.torchrun", ["--config", f"{B}/not-utf8.toml"], "not UTF-8 text", 2, TORCHRUN),
    ("dflash.commands.torchrun", ["--config", G, "--set", "train={lr=1}"], "a table would replace", 2, TORCHRUN),
    ("dflash.commands.torchrun", ["--config", G], "topology.target_gpus / drafter_gpus are empty", 2, TORCHRUN),
]


def _fill(argv: list[str], root: Path) -> list[str]:
    return [a.replace("{root}", str(root)) for a in argv]


@pytest.mark.parametrize("prog, argv, says, code, env", CASES,
                         ids=[f"{c[0]}:{' '.join(c[1])[:60]}" for c in CASES])
def test_malformed_input_is_one_line_and_touches_nothing(world, capsys, monkeypatch, keep_environ, prog, argv, says, code,
                                                        env):
    for key, value in (env or {}).items():
        monkeypatch.setenv(key, value)
    before = snapshot(world)
    capsys.readouterr()
    with pytest.raises(SystemExit) as e:
        _main(prog)(_fill(argv, world))
    out, err = capsys.readouterr()
    lines = err.strip().splitlines()
    assert "Traceback" not in out + err, err
    assert len(lines) == 1, f"{len(lines)} lines on stderr:\n{err}"
    assert lines[0].startswith(f"{prog}: error: "), lines[0]
    assert says.replace("{root}", str(world)) in lines[0], lines[0]
    assert e.value.code == code, (e.value.code, lines[0])
    assert snapshot(world) == before, "the command changed files it must not touch"


def test_there_are_enough_cases_for_every_command():
    progs = [c[0] for c in CASES]
    assert len(CASES) >= 50
    assert {p: progs.count(p) >= 5 for p in set(progs)} == {p: True for p in set(progs)}


@pytest.mark.parametrize("cmd, says", [
    (["-m", "dflash.commands.train", "--config", "{root}/run.toml", "--set", "train.lr.x=1"], "train.lr is a value"),
    (["-m", "dflash.commands.train", "--config", "{root}/run.toml", "--fresh", "--waive", "nosuch", "--reason", "x"], "unknown check id"),
    (["-c", "from dflash.commands.data import data_main; data_main()", "prepare", "--device", "tpu", "--out", "{root}/new"],
     "--device 'tpu'"),
    (["-c", "from dflash.commands.eval import eval_main; eval_main()", "--drafter", "{root}/bad/garbage-weights"],
     "not a complete safetensors file"),
    (["-m", "dflash.commands.estimate", "--config", "{root}/run.toml", "--gpu-memory", "99999999999999999999999999TiB"],
     "far above any GPU"),
    (["-m", "dflash.commands.diff", "--here", "{root}/bad/snap-old-config"], "does not validate in this version"),
])
def test_usage_errors_are_decided_before_torch_is_imported(world, cmd, says):
    """In a fresh interpreter: the error line comes out and torch was never imported (seconds, not minutes)."""
    probe = "import atexit, sys; atexit.register(lambda: print('torch' in sys.modules, file=sys.stderr)); "
    if cmd[0] == "-m":
        code = probe + f"import runpy; sys.argv = [{cmd[1]!r}] + sys.argv[1:]; runpy.run_module({cmd[1]!r}, run_name='__main__')"
        args = cmd[2:]
    else:
        code, args = probe + cmd[1], cmd[2:]
    res = subprocess.run([sys.executable, "-c", code, *_fill(args, world)], cwd=REPO, capture_output=True, text=True,
                         timeout=120)
    lines = res.stderr.strip().splitlines()
    assert res.returncode == 2 and len(lines) == 2, res.stderr
    assert says in lines[0] and "Traceback" not in res.stderr, lines[0]
    assert lines[1] == "False", "torch was imported before the usage error was decided"


@pytest.mark.parametrize("change, says", [
    ({"drafter": {"target_layer_ids": [1, 99], "mask_token_id": 10**6}},
     ["drafter.target_layer_ids [99] outside 0..3 of the 4-layer target", "drafter.mask_token_id 1000000 outside 0..127",
      "fix: set drafter.target_layer_ids"]),
    ({"drafter": {"num_layers": 8}}, ["cannot spread 8 distinct layers over [1, 1] of a 4-layer target"]),
    ({"target": {"path": "{root}/nosuch-model"}}, ["target.path", "nosuch-model/config.json: not found"]),
    ({"target": {"path": "{root}/bad/target-broken"}}, ["target-broken/config.json: not valid JSON"]),
])
def test_gate_refuses_a_config_that_does_not_fit_the_target(world, tmp_path, capsys, keep_environ, change, says):
    """Values that validate but cannot work with this target: the gate's `config` check refuses (exit 1) before a
    model loads; the run dir gets only its preflight report."""
    from dflash.commands.train import train_main

    raw = tomllib.loads((world / "run.toml").read_text())
    raw["output_dir"] = str(tmp_path / "run")
    for section, values in change.items():
        raw[section].update({k: v.replace("{root}", str(world)) if isinstance(v, str) else v for k, v in values.items()})
    config = tmp_path / "run.toml"
    config.write_text(toml_text(raw))
    with pytest.raises(SystemExit) as e:
        train_main(["--config", str(config), "--no-progress", "--waive", "model-source", "--reason", "tests"])
    err = capsys.readouterr().err
    assert e.value.code == 1 and "Traceback" not in err
    fail = next(line for line in err.splitlines() if line.startswith("preflight: FAIL config"))
    assert all(s in fail for s in says), fail
    assert sorted(p.name for p in (tmp_path / "run").iterdir()) == ["preflight.json"]


def test_lock_and_profile_files_that_are_not_utf8_are_findings_not_tracebacks(world, capsys):
    """A lock or profile manifest with stray bytes: `dflash-lock check` lists the problem (exit 1), and preflight's
    `profile` check fails instead of crashing the gather."""
    from dflash.commands.lock import main
    from preflight.checks.environment import check_profile
    from preflight.facts.gather import gather

    for envs, says in [("envs-not-utf8", "train-cu128: "), ("envs-profile-not-utf8", "train-cu128.toml: not UTF-8 text")]:
        with pytest.raises(SystemExit) as e:
            main(["check", "--no-export", "--envs-dir", str(world / "bad" / envs)])
        out, err = capsys.readouterr()
        assert e.value.code == 1 and says in out and "Traceback" not in out + err, out + err
        r = check_profile(gather("train-cu128", envs_dir=world / "bad" / envs))
        assert r.status == "fail", r.summary


# ---------------------------------------------------------------- dflash-report on crafted run files

BAD_ROWS = [  # (a metrics line put between two good rows, the reason the report gives for skipping it)
    ('{"step": "abc", "loss": 1.0}', 'step "abc" is not an integer in 0..2^53'),
    ('{"step": null, "loss": 1.0}', "step null is not an integer"),
    ('{"step": 1e999, "loss": 1.0}', "step inf is not an integer"),
    ('{"step": -3, "loss": 1.0}', "step -3 is not an integer"),
    ('{"step": ' + "9" * 50 + ', "loss": 1.0}', "step " + "9" * 37 + "... is not an integer"),
    ('{"step": 1, "nvml_used_gib": [1, 2]}', "nvml_used_gib [1, 2] is not {GPU: GiB}"),
    ('{"step": 1, "nvml_used_gib": {"GPU0": "x"}}', 'nvml_used_gib {"GPU0": "x"} is not {GPU: GiB}'),
    ('{"step": 1, "acc_slot": [0.5, null]}', "acc_slot [0.5, null] is not a list of finite numbers"),
    ("[1, 2]", "a list, not a JSON object"),
    ("[" * 100_000 + "]" * 100_000, "not JSON (nested too deeply"),
    ('{"step": ' + "7" * 5000 + "}", "not JSON (Exceeds the limit"),
]


def report_run(world: Path, where: Path, metrics: list[str] | None = None, **files: str) -> Path:
    """A copy of the world's run dir (config, preflight report, metrics) with some files replaced."""
    where.mkdir(parents=True)
    for name in ("config.json", "metrics.jsonl"):
        (where / name).write_bytes((world / "run" / name).read_bytes())
    if metrics is not None:
        (where / "metrics.jsonl").write_text("".join(line + "\n" for line in metrics))
    for name, text in files.items():
        (where / name.replace("_", ".")).write_text(text)
    return where


def run_report(capsys, *dirs: Path) -> tuple[int, list[str], str]:
    from dflash.commands.report import report_main

    capsys.readouterr()
    with pytest.raises(SystemExit) as e:
        report_main([str(d) for d in dirs])
    out, err = capsys.readouterr()
    return e.value.code, out.splitlines(), err


@pytest.mark.parametrize("line, reason", BAD_ROWS, ids=[b[1][:40] for b in BAD_ROWS])
def test_report_skips_and_counts_bad_metrics_rows(world, tmp_path, capsys, line, reason):
    good = (world / "run" / "metrics.jsonl").read_text().splitlines()
    run = report_run(world, tmp_path / "r", [good[0], line, *good[1:]])
    code, out, err = run_report(capsys, run)
    assert code == 0 and "Traceback" not in err, err
    assert out[0].startswith(f"note: skipped 1 bad metrics row(s) in {run / 'metrics.jsonl'} (first: line 2, {reason}"), out[0]
    page = Path(out[-1].removeprefix("report: "))
    assert page.is_file() and f"{len(good)}" in page.read_text() and "skipped 1 bad metrics row(s)" in page.read_text()


def test_report_draws_a_run_own_text_as_is(world, tmp_path, capsys):
    """Dollar signs in a run's name, a GPU name or a value are text, not mathtext; odd non-finite values and odd
    config/preflight/running files are drawn around, not raised."""
    import socket

    rows = [json.loads(line) for line in (world / "run" / "metrics.jsonl").read_text().splitlines()]
    for i, row in enumerate(rows):
        row["nvml_used_gib"] = {"$\\alpha^$ GPU 0": 1.0 + i, "GPU_$1": float("inf")}
        row["loss"] = float("nan") if i == 0 else row["loss"]
        row["tok_per_s"] = float("inf")
    odd = report_run(world, tmp_path / "lr_$LR_$BS", [json.dumps(r) for r in rows],
                     config_json=json.dumps({"topology": "x", "target": [1], "drafter": 5, "device": "$x_$"}),
                     preflight_json=json.dumps({"host": [1], "checks": "x"}),
                     running_json=json.dumps({"pid": 10**30, "host": socket.gethostname()}))
    with open(odd / "metrics.jsonl", "a") as f:
        f.write('{"step": 9, "lo')  # cut by a kill
    base = report_run(world, tmp_path / "base")
    code, out, err = run_report(capsys, odd, base)
    assert code == 0 and err == "", err
    page = Path(out[-1].removeprefix("report: "))
    text = page.read_text()
    assert page.is_file() and html.escape("lr_$LR_$BS vs base") in text and "1 torn line(s) skipped" in text
    code, out, err = run_report(capsys, odd)
    assert code == 0 and err == "", err


# ---------------------------------------------------------------- dflash-diff on snapshots mutated one field at a time

REMOVED = object()
MUTATIONS = [REMOVED, None, "a string", -1, [], {}, 1e308, 10**30, float("nan")]
# fields a snapshot of this format always has: without them a file is one line and exit 2, never "absent"
REQUIRED = {("format",), ("run",), ("environment",), ("config",)}
DEVICE_REQUIRED = ("uuid", "name", "total_bytes", "free_bytes")


@pytest.fixture(scope="module")
def run_records(tmp_path_factory):
    """A split run's snapshot (the recorded 8x H200 NVML fake: devices with roles, the memory model per role) as the
    gate writes it, and the outcome the trainer keeps: the real layout, every section filled."""
    from dflash.config import config_from_dict
    from dflash.runs import records
    from preflight.facts.gather import gather
    from preflight.nvml import FakeGpuInfo
    from preflight.snapshot import stamp, take

    root = tmp_path_factory.mktemp("records")
    _, raw = tiny_config(root)
    cfg = config_from_dict(dict(raw, device="cuda", topology={"target_gpus": ["0"], "drafter_gpus": ["1"]}))
    ctx = gather("train-cu128", cfg, "resume", FakeGpuInfo.from_json(REPO / "tests/data/nvml_fake_8gpu.json"))
    snap = stamp(take(ctx), {"gate_id": "g" * 32, "config_sha256": "c" * 64, "time_utc": "2026-12-01T10:00:00Z"})
    snap["run"]["resume"] = {"step": 2, "checkpoint": "step_00000002"}
    snap["code"] = {"mode": "git", "commit": "a" * 40, "error": None,
                    "dirty": {"dflash/models/drafter.py": {"state": "modified", "sha256": "e" * 64}}}
    snap["compile_cache"].update(exists=True, size_bytes=300_000, manifest={"torch": "2.10.0+cu128", "triton": "3.6.0",
                                                                            "gpu_name": "NVIDIA H200"})
    snap["preflight"] = {"ok": True, "failed": [], "warned": ["disk"], "waived": {"model-source": "tests"}}
    assert snap["gpus"]["devices"] and snap["memory"]["roles"] and snap["data"]["length"] and snap["target"]["shape"]
    out = root / "A"
    records.write_snapshot(out, snap)
    o = records.Outcome(out, 2)
    o.first_step(1.5, 3)
    for step in (3, 4):
        o.row({"step": step, "loss": 2.0, "accept_len": 1.5, "tok_per_s": 100.0 * step, "target_tok_s_per_gpu": 50.0,
               "drafter_wait_frac": 0.25, "compiled_graphs": 3 + step, "mem_gib": 1.0})
    o.data["peak"]["gpus"] = {d["uuid"]: 10**10 for d in snap["gpus"]["devices"][:2]}
    o.end("crashed", 4, "CUDA out of memory")
    o.data["ended"].update(rank=1, role="drafter", gpu="1")
    o.write()
    outcome = json.loads((out / records.OUTCOME_NAME).read_text())
    return root, json.loads((out / records.SNAPSHOT_NAME).read_text()), outcome


LONG = {"distributions", "records", "path", "devices", "env"}  # of these maps and lists, the first two entries


def field_paths(node, prefix=()):
    """Every field at every depth (of the long maps and lists, their first two entries)."""
    if prefix:
        yield prefix
    items = list(node.items()) if isinstance(node, dict) else list(enumerate(node)) if isinstance(node, list) else []
    for key, value in items[:2] if prefix[-1:] and prefix[-1] in LONG else items:
        yield from field_paths(value, (*prefix, key))


def mutated(doc: dict, path: tuple, value) -> dict:
    doc = json.loads(json.dumps(doc))
    parent = doc
    for key in path[:-1]:
        parent = parent[key]
    if value is REMOVED:
        del parent[path[-1]]
    else:
        parent[path[-1]] = value
    return doc


def test_diff_of_a_snapshot_or_outcome_mutated_one_field_at_a_time_is_never_a_traceback(run_records, capsys):
    """Each field of a real snapshot and outcome, at every depth: removed, null, a string, -1, [], {}, 1e308, 10^30,
    NaN. dflash-diff exits 0 or 1 with its report, or 2 with one line naming the file and the field; a field
    removed (what a snapshot one format version older lacks) reads as absent unless the format requires it."""
    from dflash.commands.diff import main
    from dflash.runs import records

    root, snap, outcome = run_records
    a, b = root / "A", root / "B"
    b.mkdir(exist_ok=True)
    cases = [("snapshot", p, v) for p in field_paths(snap) for v in MUTATIONS]
    cases += [("outcome", p, v) for p in field_paths(outcome) for v in MUTATIONS]
    assert len(cases) > 1500, len(cases)
    failures, refused = [], 0
    for n, (which, path, value) in enumerate(cases):
        s = mutated(snap, path, value) if which == "snapshot" else snap
        o = mutated(outcome, path, value) if which == "outcome" else outcome
        (b / records.SNAPSHOT_NAME).write_text(json.dumps(s))
        (b / records.OUTCOME_NAME).write_text(json.dumps(o))
        capsys.readouterr()
        try:
            main([str(a), str(b)] if n % 2 else [str(b), str(a)])  # the mutated run as A, then as B
            code = None
        except SystemExit as e:
            code = e.code
        except Exception as e:  # noqa: BLE001 - what this test hunts
            failures.append(f"{which} {'.'.join(map(str, path))} = {value!r}: {type(e).__name__}: {e}")
            continue
        out, err = capsys.readouterr()
        lines = err.strip().splitlines()
        name = records.SNAPSHOT_NAME if which == "snapshot" else records.OUTCOME_NAME
        required = path in REQUIRED or (path[:2] == ("gpus", "devices") and path[-1] in DEVICE_REQUIRED)
        if code in (0, 1) and not err and out:
            if value is REMOVED and which == "snapshot" and required and path != ("format",):
                failures.append(f"{which} {'.'.join(map(str, path))} removed: exit {code}, expected a refusal")
            continue
        if code == 2 and len(lines) == 1 and lines[0].startswith("dflash-diff: error: ") and name in lines[0] \
                and str(path[-1]) in lines[0] and not (value is REMOVED and not required):
            refused += 1
            continue
        failures.append(f"{which} {'.'.join(map(str, path))} = {value!r}: exit {code}, stderr {err.strip()[:300]!r}")
    assert not failures, f"{len(failures)} of {len(cases)} cases:\n" + "\n".join(failures[:40])
    assert refused > 100, refused  # the schema does refuse values of the wrong kind


def test_diff_of_a_snapshot_one_format_version_older_shows_absent_fields(run_records, capsys):
    """A snapshot written before a section or key existed: the diff runs, the missing parts shown as absent."""
    from dflash.commands.diff import main
    from dflash.runs import records

    root, snap, _ = run_records
    old = json.loads(json.dumps(snap))
    for section in ("gpus", "code", "compile_cache", "data", "target", "memory", "preflight"):
        del old[section]
    del old["environment"]["records"], old["run"]["resume"]
    (root / "old").mkdir()
    (root / "old" / records.SNAPSHOT_NAME).write_text(json.dumps(old))
    capsys.readouterr()
    with pytest.raises(SystemExit) as e:
        main([str(root / "old"), str(root / "A")])
    out, err = capsys.readouterr()
    assert e.value.code == 1 and err == "", err
    assert "compile cache  absent -> warm (300 kB; torch 2.10.0+cu128" in out, out


def test_regenerate_reply_parser_on_a_reply_mutated_one_field_at_a_time_is_never_a_traceback():
    """Each field of a real chat.completion answer (sglang's shape, with reasoning and a tool call), at every depth:
    removed, null, a string, a lone surrogate, -1, True, 10^30, [], {}, deep nesting. `parse_reply` gives a Reply
    that writes as UTF-8 JSON, or ValueError with a one-line reason: the per-row reason regenerate logs."""
    from dflash.data import regenerate as rg

    reply = {"id": "chatcmpl-1", "object": "chat.completion", "model": "m",
             "choices": [{"index": 0, "finish_reason": "stop", "message": {
                 "role": "assistant", "content": "4.", "reasoning_content": "2+2",
                 "tool_calls": [{"id": "t1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}}],
             "usage": {"prompt_tokens": 5, "completion_tokens": 3, "total_tokens": 8}}
    nested: list = []
    for _ in range(5000):
        nested = [nested]
    odd = [REMOVED, None, "x", "\ud800", -1, True, 10**30, [], {}, nested]
    judged = 0
    for path in field_paths(reply):
        for value in odd:
            try:
                got = rg.parse_reply(mutated(reply, path, value), max_tokens=64)
            except ValueError as e:
                assert str(e) and "\n" not in str(e), (path, value)
            else:
                json.dumps(got.message, ensure_ascii=False).encode("utf-8")
                assert isinstance(got.completion_tokens, int) and got.completion_tokens >= 0
            judged += 1
    assert judged > 200
