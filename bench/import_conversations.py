"""Import speed and memory of `dflash-data import` on a synthetic multi-turn conversation file.

    uv run python bench/import_conversations.py                       # 200,000 conversations, SmolLM2 template
    uv run python bench/import_conversations.py --rows 20000 --clean  # smaller; delete the data afterwards

Writes (once, kept for reruns unless --clean) ``.cache/bench-data/import/conversations.jsonl``: OpenAI-style
rows of 1-4 user/assistant turns, a system prompt in half of them, words drawn from a fixed list
(user turns 5-60 words, replies 20-250). Then runs the real command in its own process group:

    dflash-data import conversations.jsonl --target smollm2 --out <tmp> --no-progress

and samples the memory of every process of the group (parent + tokenizing workers) every 0.1 s.
Prints rows/s, tokens/s, the peak RSS of the largest process and the peak of the group's summed PSS.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
DATA = REPO / ".cache" / "bench-data" / "import"
WORDS = ("the a of to and in is it that for on with as was be by this are or from at an not have but which "
         "model data train token value system answer question function return list number time first new "
         "python error file code test use make each other more some when how what where why can will").split()


def write_conversations(path: Path, rows: int, seed: int = 0) -> None:
    """`rows` conversations, one JSON object a line (written to a temp name, then renamed)."""
    rng = np.random.default_rng(seed)
    words = np.array(WORDS)
    tmp = path.with_suffix(".tmp")
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(tmp, "w") as f:
        for i in range(rows):
            messages = [{"role": "system", "content": "You are a helpful assistant."}] if i % 2 else []
            for _ in range(int(rng.integers(1, 5))):
                messages.append({"role": "user", "content": " ".join(rng.choice(words, int(rng.integers(5, 61))))})
                messages.append({"role": "assistant",
                                 "content": " ".join(rng.choice(words, int(rng.integers(20, 251)))) + "."})
            f.write(json.dumps({"id": f"conv-{i}", "messages": messages}) + "\n")
    tmp.rename(path)


def group_memory(pgid: int) -> tuple[int, int]:
    """(largest RSS, sum of PSS) in bytes over the processes of one process group. PSS splits the pages the
    forked workers share with the parent (the tokenizer, the imported libraries) among them, so the sum is
    the group's real footprint; a sum of RSS would count those pages once per process."""
    rss, pss = [0], [0]
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            fields = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()
            if int(fields[2]) != pgid:
                continue
            rss.append(int(fields[21]) * os.sysconf("SC_PAGE_SIZE"))
            rollup = Path(f"/proc/{entry}/smaps_rollup").read_text().splitlines()
            pss.append(sum(int(line.split()[1]) * 1024 for line in rollup if line.startswith("Pss:")))
        except (OSError, IndexError, ValueError):
            continue
    return max(rss), sum(pss)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=200_000, help="conversations in the synthetic file")
    ap.add_argument("--target", default="smollm2", help="model folder whose chat template and tokenizer are used")
    ap.add_argument("--workers", type=int, default=0, help="tokenizing processes (0: one per core)")
    ap.add_argument("--clean", action="store_true", help="delete the synthetic file afterwards")
    args = ap.parse_args()
    src = DATA / f"conversations-{args.rows}.jsonl"
    if not src.exists():
        t0 = time.perf_counter()
        write_conversations(src, args.rows)
        print(f"wrote {src.relative_to(REPO)} ({src.stat().st_size / 2**20:,.0f} MiB) in "
              f"{time.perf_counter() - t0:.0f} s")
    out = Path(tempfile.mkdtemp(prefix="dflash-bench-import-"))
    cmd = [sys.executable, "-c", "from dflash.commands.data import data_main; data_main()", "import", str(src), "--target",
           args.target, "--out", str(out / "data"), "--no-progress", "--workers", str(args.workers)]
    peak = [0, 0]
    try:
        t0 = time.perf_counter()
        proc = subprocess.Popen(cmd, cwd=REPO, start_new_session=True, stdout=subprocess.PIPE, text=True)

        def sample() -> None:
            while proc.poll() is None:
                largest, total = group_memory(proc.pid)
                peak[0], peak[1] = max(peak[0], largest), max(peak[1], total)
                time.sleep(0.1)

        watcher = threading.Thread(target=sample, daemon=True)
        watcher.start()
        lines = proc.stdout.read().splitlines()
        proc.wait()
        seconds = time.perf_counter() - t0
        watcher.join()
        if proc.returncode:
            sys.exit(f"import failed (exit {proc.returncode})")
        print("\n".join(line for line in lines if not line.startswith("  shard-")))
        totals = json.loads((out / "data" / "manifest.json").read_text())["import"]["totals"]
        print(f"{totals['rows']:,} rows, {totals['tokens']:,} tokens in {seconds:.1f} s (process start included): "
              f"{totals['rows'] / seconds:,.0f} rows/s, {totals['tokens'] / seconds:,.0f} tokens/s; peak RSS "
              f"{peak[0] / 2**20:,.0f} MiB (largest process), {peak[1] / 2**20:,.0f} MiB (PSS of all processes); "
              f"{os.cpu_count()} cores")
    finally:
        shutil.rmtree(out, ignore_errors=True)
        if args.clean:
            src.unlink(missing_ok=True)


if __name__ == "__main__":
    main()
