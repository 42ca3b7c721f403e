"""The one helper module of the tests: the tiny training preset and chat target (over dflash.data.synthetic), the
ways a test runs the trainer: in this process (`run`), or as the real command in a child process (`train_cmd`,
`train_main_here`; `start_run` for a long multi-process run a test then kills or stops), and a real
OpenAI-compatible server of a target (`Server`; conftest's `server` fixture holds one with the embedded SmolLM2 for
the session), and a loopback stand-in for one inside the test process (`stand_in_server`)."""

from __future__ import annotations

import contextlib
import http.server
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import pytest

from dflash.config import config_from_dict
from dflash.data.synthetic import WORD_TOKENIZER_IDS, target_config, write_pattern_dataset, write_target

# The tiny training target: vocabulary 128, pad id 0, weights drawn wider than HF's 0.02 default.
TRAIN_TARGET = target_config("qwen3", pad_token_id=0, initializer_range=0.15)


def tiny_config(root: Path, **train):
    """(run config, raw dict) of the tiny CPU preset under root; `train` overrides [train] fields."""
    target = write_target(root / "tiny-target", TRAIN_TARGET)
    return run_config(root, target, write_pattern_dataset(root / "data"), **train)


def run_config(root: Path, target: Path, data: Path, drafter: dict | None = None, **train):
    """(run config, raw dict) of the tiny preset's settings for another target and dataset: the run goes to
    root/run; `drafter` replaces the [drafter] section, `train` overrides [train] fields."""
    raw = {
        "output_dir": str(root / "run"),
        "device": "cpu",
        "target": {"path": str(target), "dtype": "float32"},
        "drafter": drafter or {"num_layers": 1, "block_size": 4},
        "data": {"path": str(data), "token_budget": 512, "max_batch_size": 8, "num_buckets": 2},
        "train": {"max_anchors": 16, "gamma": 4.0, "lr": 1e-2, "warmup_ratio": 0.1, "max_steps": 30,
                  "loss_chunk": 64, "log_every": 1, "save_every": 10, "keep_last": 2, "compile": False,
                  **train},
    }
    return config_from_dict(raw), raw


def split_raw(raw: dict, targets=("0",), drafters=("1", "2")) -> dict:
    """A copy of a raw run config with a [topology] of split ranks: the target on GPUs `targets`, the drafter on
    `drafters` (on CPU, one process each over gloo)."""
    raw = json.loads(json.dumps(raw))
    raw["topology"] = {"target_gpus": list(targets), "drafter_gpus": list(drafters), "timeout_s": 30}
    return raw


def chat_target(root: Path, arch: str = "llama", context: int = 256) -> Path:
    """A random-weight Llama or Qwen3 (4 layers, hidden 64) with the word-level tokenizer, under root.

    The lm_head is scaled by 8 so greedy decoding wanders instead of repeating one token forever.
    """
    config = target_config(arch, max_position_embeddings=context, **WORD_TOKENIZER_IDS)
    return write_target(Path(root) / f"tiny-{arch}-{context}", config, tokenizer=True, head_scale=8.0)


def write_toml(raw: dict, path: Path) -> Path:
    """A run config dict (one level of sections) as a TOML file, for the tests that run the real commands."""
    lines = [f"{k} = {json.dumps(v)}" for k, v in raw.items() if not isinstance(v, dict)]
    for key, value in raw.items():
        if isinstance(value, dict):
            lines += [f"[{key}]", *(f"{k} = {json.dumps(v)}" for k, v in value.items())]
    path.write_text("\n".join(lines) + "\n")
    return path


REPO = Path(__file__).resolve().parent.parent
WAIVE_SOURCE = ("--waive", "model-source", "--reason", "tests run on a working tree")


def metrics(run_dir: Path) -> list[dict]:
    """The rows of a run's metrics.jsonl."""
    return [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]


def train_cmd(config: Path, *extra: str) -> list[str]:
    """argv of the real dflash-train in a child process (model-source waived: tests run on a working tree)."""
    return [sys.executable, "-m", "dflash.commands.train", "--config", str(config), "--no-progress", *WAIVE_SOURCE,
            *extra]


def start_run(root: Path, layout, save_every: int, rows: int,
              env: dict | None = None) -> tuple[subprocess.Popen, Path, list[dict]]:
    """A long multi-process run of the tiny preset (`layout(raw)`: its raw config with a [topology]), written to
    root/run.toml and started by dflash-train --fresh: (the launcher's process, the run dir, ranks.json's rows) once
    it logged `rows` steps."""
    cfg, raw = tiny_config(root, max_steps=100000, save_every=save_every)
    config = write_toml(layout(raw), root / "run.toml")
    proc, ranks = start_train(config, Path(cfg.output_dir), rows, "--fresh", env=env)
    return proc, Path(cfg.output_dir), ranks


def start_train(config: Path, run_dir: Path, rows: int, *args: str,
                env: dict | None = None) -> tuple[subprocess.Popen, list[dict]]:
    """dflash-train `args` on a multi-process run config in a child process: (the launcher's process, ranks.json's
    rows) once its launcher wrote ranks.json and run_dir/metrics.jsonl holds `rows` rows. (A resumed run's rows
    count from 1: an earlier run's rows past the checkpoint are moved aside before its launcher starts.)"""
    started = time.time_ns()
    proc = subprocess.Popen(train_cmd(config, *args), cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, env=env)
    ranks, path = run_dir / "ranks.json", run_dir / "metrics.jsonl"

    def ready() -> bool:  # an earlier run's ranks.json and rows do not count
        return (ranks.exists() and ranks.stat().st_mtime_ns >= started and path.exists()
                and len(path.read_text().splitlines()) >= rows)

    deadline = time.time() + 180
    while time.time() < deadline and not ready():
        assert proc.poll() is None, proc.stdout.read()
        time.sleep(0.1)
    return proc, json.loads(ranks.read_text())


def cancel_run(proc: subprocess.Popen, ranks: list[dict], timeout: float = 90) -> str:
    """SIGTERM to the launcher and every rank at once, as a scheduler's cancel sends it: the launcher's output once
    it exited."""
    for pid in [proc.pid] + [r["pid"] for r in ranks]:
        os.kill(pid, signal.SIGTERM)
    return proc.communicate(timeout=timeout)[0]


def assert_ranks_gone(ranks: list[dict]) -> None:
    """No rank of ranks.json is left alive."""
    for r in ranks:
        with pytest.raises(ProcessLookupError):
            os.kill(r["pid"], 0)


def train_main_here(config: Path, *args: str) -> int:
    """dflash-train in this process (torch imported once); the profile variables it sets are undone after."""
    from dflash.commands.train import train_main

    environ = dict(os.environ)
    try:
        with pytest.raises(SystemExit) as e:
            train_main(["--config", str(config), "--no-progress", *args])
    finally:
        os.environ.clear()
        os.environ.update(environ)
    return e.value.code


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def stand_in_server(reply: str = "fresh"):
    """A loopback OpenAI-compatible stand-in, a thread of this process: lists one model (`stand-in`) and answers
    every chat request with `reply`; yields (its URL, the request bodies it got, in order)."""
    bodies: list[dict] = []

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self._answer({"object": "list", "data": [{"id": "stand-in", "object": "model"}]})

        def do_POST(self):
            bodies.append(json.loads(self.rfile.read(int(self.headers["Content-Length"]))))
            self._answer({"choices": [{"finish_reason": "stop", "message": {"role": "assistant", "content": reply}}],
                          "usage": {"completion_tokens": 1}})

        def _answer(self, value: dict) -> None:
            answer = json.dumps(value).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(answer)))
            self.end_headers()
            self.wfile.write(answer)

        def log_message(self, *args):
            pass

    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{httpd.server_port}", bodies
    finally:
        httpd.shutdown()
        httpd.server_close()


class Server:
    """`transformers serve MODEL` (the dev group's fastapi/uvicorn/openai) on a free loopback port, in its own
    process, on CPU in float32."""

    def __init__(self, model: Path, tmp: Path):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = tmp / f"serve-{self.port}.log"
        (tmp / "hf-cache").mkdir(exist_ok=True)  # /v1/models scans the hub cache: an empty one lists no model
        env = {**os.environ, "HF_HUB_CACHE": str(tmp / "hf-cache"), "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
        cmd = [str(Path(sys.executable).parent / "transformers"), "serve", str(model), "--host", "127.0.0.1",
               "--port", str(self.port), "--device", "cpu", "--dtype", "float32"]
        with open(self.log, "wb") as log:
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)

    def wait_ready(self, timeout: float = 120.0) -> Server:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                pytest.fail(f"transformers serve exited {self.proc.returncode}: {self.log.read_text()[-2000:]}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2) as r:
                    if r.status == 200:
                        return self
            except OSError:
                time.sleep(0.3)
        self.stop()
        pytest.fail(f"transformers serve not ready after {timeout:.0f} s: {self.log.read_text()[-2000:]}")

    def chat(self, body: dict) -> dict:
        """One chat completion asked directly (no dflash code): the server's JSON answer."""
        request = urllib.request.Request(self.url + "/v1/chat/completions", data=json.dumps(body).encode(),
                                         headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=120) as r:
            return json.loads(r.read())

    def stop(self) -> None:
        self.proc.kill()
        self.proc.wait(timeout=30)
