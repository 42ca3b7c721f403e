"""`dflash-data regenerate` against a loopback server that misbehaves on purpose: does the run finish, and when?

    uv run python bench/regenerate_faults.py                                  # 1,000 conversations, the defaults
    uv run python bench/regenerate_faults.py --rows 100 --timeout 1 --retries 1   # the smoke run (test_bench_smoke.py)

The server answers each conversation by its index i: i % 50 == 1 hangs (never answers: 2%), i % 50 == 2 gets junk
(2%, in turn: not JSON, a string `message`, JSON nested 100,000 deep, a lone surrogate, a body cut short), i % 100 == 3
drips one byte a second (1%); every other one gets a good reply. The real command runs in its own process with
`--timeout T --concurrency C`. Passes when it exits 0, every good id is in the output exactly once, every bad id is
in the skipped file with a reason, and the wall time is within (rows / concurrency) x timeout (the issue's bound;
a hanging conversation costs 2 x T: it is sent once more).
"""

from __future__ import annotations

import argparse
import http.server
import json
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

JUNK = ("not-json", "string-message", "nested", "surrogate", "torn")


def kind(i: int) -> str:
    if i % 50 == 1:
        return "hang"
    if i % 50 == 2:
        return JUNK[(i // 50) % len(JUNK)]
    if i % 100 == 3:
        return "drip"
    return "good"


class Faulty(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def _send(self, body: bytes, length: int | None = None) -> None:
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body) if length is None else length))
        self.end_headers()
        self.wfile.write(body)
        self.wfile.flush()

    def do_GET(self):  # /v1/models
        self._send(json.dumps({"data": [{"id": "faulty"}]}).encode())

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        what = kind(int(body["messages"][-1]["content"].split()[-1]))
        good = json.dumps({"choices": [{"finish_reason": "stop", "message": {"role": "assistant", "content": "ok"}}],
                           "usage": {"completion_tokens": 1}}).encode()
        try:
            if what == "hang":
                time.sleep(600)
            elif what == "drip":
                self.send_response(200)
                self.send_header("Content-Length", "100000")
                self.end_headers()
                for _ in range(600):
                    self.wfile.write(b" ")
                    self.wfile.flush()
                    time.sleep(1)
            elif what == "not-json":
                self._send(b"<html>502 Bad Gateway</html>")
            elif what == "string-message":
                self._send(json.dumps({"choices": [{"message": "ok"}], "usage": "n/a"}).encode())
            elif what == "nested":
                self._send(b"[" * 100_000 + b"]" * 100_000)
            elif what == "surrogate":
                self._send(good.replace(b'"ok"', b'"\\ud800"'))
            elif what == "torn":
                self._send(good[: len(good) // 2], length=len(good))
                self.close_connection = True
            else:
                self._send(good)
        except (BrokenPipeError, ConnectionResetError):  # the client gave up on it: what --timeout does
            pass

    def log_message(self, *args):
        pass


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=1000)
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--timeout", type=float, default=2.0, help="regenerate's --timeout, seconds")
    ap.add_argument("--retries", type=int, default=5, help="regenerate's --retries (its default: 5)")
    ap.add_argument("--json", type=Path, help="write the figures here")
    args = ap.parse_args()

    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Faulty)
    httpd.daemon_threads = True
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    with tempfile.TemporaryDirectory() as tmp:
        conv, out = Path(tmp) / "conv.jsonl", Path(tmp) / "regen.jsonl"
        conv.write_text("".join(json.dumps({"id": f"c{i}", "messages": [
            {"role": "user", "content": f"question {i}"}, {"role": "assistant", "content": "old"}]}) + "\n"
            for i in range(args.rows)))
        cmd = [sys.executable, "-c", "from dflash.commands.data import data_main; data_main()", "regenerate",
               "--no-progress", "--input", str(conv), "--out", str(out), "--server",
               f"http://127.0.0.1:{httpd.server_port}", "--timeout", str(args.timeout),
               "--concurrency", str(args.concurrency), "--retries", str(args.retries)]
        t0 = time.monotonic()
        proc = subprocess.run(cmd, capture_output=True, text=True)
        seconds = time.monotonic() - t0
        written = [json.loads(line)["id"] for line in out.read_text().splitlines()] if out.exists() else []
        skipped_file = out.with_name(out.stem + ".skipped.jsonl")
        skipped = [json.loads(line) for line in skipped_file.read_text().splitlines()] if skipped_file.exists() else []
        stdout = proc.stdout.replace(tmp, "<tmp>").splitlines()
    httpd.shutdown()
    good = {f"c{i}" for i in range(args.rows) if kind(i) == "good"}
    bad = {f"c{i}" for i in range(args.rows) if kind(i) != "good"}
    bound = args.rows / args.concurrency * args.timeout
    reasons: dict[str, int] = {}
    examples: dict[str, str] = {}
    for s in skipped:
        what = kind(int(s["id"][1:]))
        reasons[what] = reasons.get(what, 0) + 1
        examples.setdefault(what, s["reason"].replace(f"127.0.0.1:{httpd.server_port}", "127.0.0.1:PORT"))
    checks = {
        "exit 0": proc.returncode == 0,
        "every good id once": sorted(written) == sorted(good),
        "every bad id skipped with a reason": sorted(s["id"] for s in skipped) == sorted(bad)
        and all(s["reason"] for s in skipped),
        f"within (rows / concurrency) x timeout = {bound:.1f} s": seconds <= bound,
        "no traceback": "Traceback" not in proc.stderr,
    }
    figures = {"rows": args.rows, "concurrency": args.concurrency, "timeout_s": args.timeout, "retries": args.retries,
               "good": len(good), "bad": len(bad), "written": len(written), "skipped": len(skipped),
               "skipped_by_kind": reasons, "reasons": examples, "seconds": round(seconds, 2), "bound_s": round(bound, 2),
               "exit": proc.returncode, "checks": checks, "stdout": stdout}
    for name, ok in checks.items():
        print(f"{'pass' if ok else 'FAIL'}  {name}")
    print(f"{args.rows} conversations ({len(bad)} bad: {reasons}) in {seconds:.1f} s at --concurrency "
          f"{args.concurrency} --timeout {args.timeout:g}; bound {bound:.1f} s; exit {proc.returncode}")
    if proc.returncode:
        print(proc.stderr[-2000:], file=sys.stderr)
    if args.json:
        args.json.write_text(json.dumps(figures, indent=2) + "\n")
    return 0 if all(checks.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
