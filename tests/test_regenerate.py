"""dflash-data regenerate: conversations in, the target's own replies out, against a real OpenAI-compatible server.

The slow tests run the real `dflash-data regenerate` command against `transformers serve` (the dev group's
fastapi/uvicorn/openai) with the embedded SmolLM2 target on a free loopback port: conftest's `server`, one for the
session; one of them starts a second server and kills it mid-run. The fast tests judge the pure parts and a closed port.
"""

from __future__ import annotations

import http.server
import json
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from dflash.data import regenerate as rg
from dflash.data.conversations import ConversationError, SourceRow
from dflash.errors import UsageError
from trainkit import Server, free_port, stand_in_server

REPO = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent
ORIGINAL = "ORIGINAL REPLY"  # every assistant turn of the inputs; a regenerated one never says it


def _write_jsonl(path: Path, rows: list) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def _regenerate(*args, timeout: float = 120) -> subprocess.CompletedProcess:
    cmd = [str(BIN / "dflash-data"), "regenerate", "--no-progress", *map(str, args)]
    return subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=timeout)


def _parse(line: str, lineno: int = 1) -> rg.Conversation:
    """regenerate's reading of one JSONL line (rg.parse_row of the row import's reader yields for it)."""
    return rg.parse_row(SourceRow(lineno, raw=line))


def _rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def _chat(i: int, turns: int = 1) -> dict:
    """Conversation `conv-i`: each assistant turn says ORIGINAL and its number (a tiny model may copy an earlier one)."""
    messages = []
    for t in range(turns):
        messages += [{"role": "user", "content": f"Give me fact number {i + t} about the sea."},
                     {"role": "assistant", "content": f"{ORIGINAL} {t}"}]
    return {"id": f"conv-{i}", "messages": messages}


# ---------------------------------------------------------------- a real server (conftest's `server`)


@pytest.mark.slow
def test_every_assistant_turn_regenerated_and_a_rerun_does_nothing_twice(server, tmp_path):
    conv = _write_jsonl(tmp_path / "conv.jsonl", [
        {"id": "share", "conversations": [{"from": "system", "value": "You answer in one sentence."},
                                          {"from": "human", "value": "What is the capital of France?"},
                                          {"from": "gpt", "value": ORIGINAL},
                                          {"from": "human", "value": "And of Italy?"},
                                          {"from": "gpt", "value": ORIGINAL}]},
        _chat(1),
        "{not json",
        {"conversations": [{"from": "human", "value": "Say hello."}, {"from": "gpt", "value": ORIGINAL}]},
        {"id": "no-reply", "messages": [{"role": "user", "content": "Hi"}]},
        _chat(1),
    ])
    out = tmp_path / "regen.jsonl"
    p = _regenerate("--input", conv, "--server", server.url + "/v1", "--out", out, "--max-tokens", 6, "--concurrency", 2)
    assert p.returncode == 0, p.stderr
    assert "regenerated 3 conversations" in p.stdout and "0 already done, 3 skipped" in p.stdout
    assert "lists no model; requests name none" in p.stderr
    rows = {r["id"]: r["messages"] for r in _rows(out)}
    assert sorted(rows) == ["conv-1", "line-4", "share"]
    assert [m["role"] for m in rows["share"]] == ["system", "user", "assistant", "user", "assistant"]
    assert rows["share"][:2] == [{"role": "system", "content": "You answer in one sentence."},
                                 {"role": "user", "content": "What is the capital of France?"}]
    replies = [m["content"] for msgs in rows.values() for m in msgs if m["role"] == "assistant"]
    assert len(replies) == 4 and all(r and not r.startswith(ORIGINAL) for r in replies)
    skipped = _rows(rg.skipped_path(out))
    assert [(s["line"], s["id"]) for s in skipped] == [(3, None), (5, "no-reply"), (6, "conv-1")]
    assert skipped[0]["reason"].startswith("not valid JSON") and skipped[1]["reason"] == "no assistant turn to regenerate"
    assert skipped[2]["reason"] == "duplicate id (also at line 2)"

    before = out.read_bytes()
    again = _regenerate("--input", conv, "--server", server.url, "--out", out, "--max-tokens", 6)
    assert again.returncode == 0, again.stderr
    assert "regenerated 0 conversations" in again.stdout and "3 already done, 3 skipped" in again.stdout
    assert out.read_bytes() == before and _rows(rg.skipped_path(out)) == skipped


@pytest.mark.slow
def test_turns_last_keeps_the_earlier_replies(server, smollm2_path, tmp_path):
    conv = _write_jsonl(tmp_path / "conv.jsonl", [_chat(0, turns=2)])
    out = tmp_path / "regen.jsonl"
    p = _regenerate("--input", conv, "--server", server.url, "--out", out, "--max-tokens", 6, "--turns", "last",
                    "--thinking", "off", "--seed", 7, "--temperature", 0.7, "--model", smollm2_path)
    assert p.returncode == 0, p.stderr
    [row] = _rows(out)
    given = _chat(0, turns=2)["messages"]
    assert row["messages"][:3] == given[:3] and row["messages"][3]["role"] == "assistant"
    assert row["messages"][3]["content"] not in ("", given[3]["content"])


@pytest.mark.slow
def test_a_server_killed_mid_run_loses_nothing(server, smollm2_path, tmp_path):
    doomed = Server(smollm2_path, tmp_path).wait_ready()
    conv = _write_jsonl(tmp_path / "conv.jsonl", [_chat(i) for i in range(8)])
    out = tmp_path / "regen.jsonl"
    cmd = [str(BIN / "dflash-data"), "regenerate", "--no-progress", "--input", str(conv), "--server", doomed.url,
           "--server", server.url, "--out", str(out), "--max-tokens", "8", "--concurrency", "4"]
    run = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 60
        while not (out.exists() and out.read_text().count("\n") >= 1) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert run.poll() is None, "the run finished before the server could be killed"
        doomed.stop()
        stdout, stderr = run.communicate(timeout=120)
    finally:
        run.kill()
        doomed.stop()
    assert run.returncode == 0, stderr
    ids = [r["id"] for r in _rows(out)]
    assert sorted(ids) == sorted(f"conv-{i}" for i in range(8)), stdout  # nothing lost, nothing twice
    assert not rg.skipped_path(out).read_text()

    dead = _regenerate("--input", conv, "--server", server.url, "--server", doomed.url, "--out", out)
    assert dead.returncode == 2 and dead.stderr.startswith(f"dflash-data: error: server {doomed.url} is unreachable")
    again = _regenerate("--input", conv, "--server", server.url, "--out", out)
    assert again.returncode == 0 and "regenerated 0 conversations" in again.stdout and "8 already done" in again.stdout
    assert [r["id"] for r in _rows(out)] == ids


@pytest.mark.slow
def test_a_run_whose_first_conversations_all_fail_stops(server, tmp_path):
    """A wrong --model: the server refuses every request (HTTP 4xx); the run stops instead of skipping the whole file."""
    conv = _write_jsonl(tmp_path / "conv.jsonl", [_chat(i) for i in range(rg.FAILED_FIRST_LIMIT + 4)])
    out = tmp_path / "regen.jsonl"
    p = _regenerate("--input", conv, "--server", server.url, "--out", out, "--model", "no-such-model", "--concurrency", 1)
    assert p.returncode == 1
    assert p.stderr.splitlines()[-1].startswith(f"dflash-data: error: stopped: the first {rg.FAILED_FIRST_LIMIT} "
                                                f"conversations all failed (last: {server.url} answered HTTP 4")
    assert "check --model and --server" in p.stderr and not out.read_text()
    skipped = _rows(rg.skipped_path(out))
    assert rg.FAILED_FIRST_LIMIT <= len(skipped) <= rg.FAILED_FIRST_LIMIT + 2  # and those already in flight
    assert all("answered HTTP 400" in s["reason"] for s in skipped)


# ---------------------------------------------------------------- no server


def test_an_unreachable_server_is_one_line_exit_2(tmp_path):
    conv = _write_jsonl(tmp_path / "conv.jsonl", [_chat(0)])
    url = f"http://127.0.0.1:{free_port()}"
    p = _regenerate("--input", conv, "--server", url, "--out", tmp_path / "out.jsonl")
    assert p.returncode == 2
    assert p.stderr.splitlines() == [f"dflash-data: error: server {url} is unreachable ([Errno 111] Connection refused); "
                                     "start it (README: Your data) or fix --server"]
    assert not (tmp_path / "out.jsonl").exists()


def test_the_input_is_never_the_output(tmp_path):
    conv = _write_jsonl(tmp_path / "conv.jsonl", [_chat(0)])
    p = _regenerate("--input", conv, "--server", "http://127.0.0.1:9", "--out", tmp_path / "." / "conv.jsonl")
    assert p.returncode == 2 and "is the input file; give another --out" in p.stderr
    with pytest.raises(UsageError, match="the skipped file beside --out .*out.skipped.jsonl is the input file"):
        rg.check_paths(_write_jsonl(tmp_path / "out.skipped.jsonl", []), tmp_path / "out.jsonl")
    with pytest.raises(UsageError, match="is a folder"):
        rg.check_paths(conv, tmp_path)
    notes = tmp_path / "notes.txt"
    notes.write_text("hello\n")
    with pytest.raises(ConversationError, match="notes.txt: neither JSON/JSONL nor Parquet"):  # before any server
        rg.check_paths(notes, tmp_path / "out.jsonl")
    assert conv.read_text() == json.dumps(_chat(0)) + "\n"


def test_every_server_down_mid_run_stops_and_keeps_what_is_done(tmp_path):
    """A closed port stands for servers that died after the start check: the run stops at once, skips nothing."""
    conv = _write_jsonl(tmp_path / "conv.jsonl", [_chat(i) for i in range(5)])
    out = _write_jsonl(tmp_path / "out.jsonl", [{"id": "conv-0", "messages": []}])
    settings = rg.Settings(retries=1, timeout_s=5)
    summary = rg.run(conv, out, [f"http://127.0.0.1:{free_port()}"], settings, concurrency=2, progress=False)
    assert summary.stopped.startswith("every server is down (last: http://127.0.0.1:") and summary.stopped.endswith("restart one")
    assert (summary.regenerated, summary.already_done, summary.skipped) == (0, 1, 0)
    assert len(_rows(out)) == 1 and not rg.skipped_path(out).read_text()


def test_both_formats_become_openai_messages():
    share = {"id": 7, "conversations": [{"from": "system", "value": "s"}, {"from": "human", "value": "q"},
                                        {"from": "gpt", "value": "a"}, {"from": "observation", "value": "t"}]}
    assert _parse(json.dumps(share)) == rg.Conversation("7", [
        {"role": "system", "content": "s"}, {"role": "user", "content": "q"},
        {"role": "assistant", "content": "a"}, {"role": "tool", "content": "t"}])
    openai = {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a", "reasoning_content": "r"}]}
    assert _parse(json.dumps(openai), 9) == rg.Conversation("line-9", openai["messages"])


def test_a_row_regenerate_reads_is_a_row_import_reads():
    """One role table: every speaker import knows is read, `developer` (which import refuses) is refused up front."""
    from dflash.data.conversations import SHAREGPT_ROLES, row_messages

    for who, role in SHAREGPT_ROLES.items():
        row = {"conversations": [{"from": who, "value": "x"}, {"from": "gpt", "value": "a"}]}
        assert _parse(json.dumps(row)).messages[0]["role"] == role
        assert row_messages(row, "sharegpt")[1][0]["role"] == role
    with pytest.raises(rg.BadRow, match="message 0: unknown role 'developer' \\(use system, user, assistant, tool\\)"):
        _parse(json.dumps({"messages": [{"role": "developer", "content": "d"}, {"role": "assistant", "content": "a"}]}))


def test_rows_without_an_id_get_one_each_whatever_the_container(tmp_path):
    """A compact JSON array holds every element on line 1: its rows are row-1, row-2, ... (never one duplicate id);
    JSONL rows are line-N. A line that is not UTF-8 is that row's reason, as import gives it."""
    rows = [{"messages": [{"role": "user", "content": f"q{i}"}, {"role": "assistant", "content": "a"}]}
            for i in range(3)]
    arr = tmp_path / "compact.json"
    arr.write_text(json.dumps(rows))
    assert [(line, rid, why) for line, rid, _, why in rg.read_rows(arr)] == [(1, f"row-{i}", None) for i in (1, 2, 3)]
    jl = tmp_path / "rows.jsonl"
    jl.write_bytes(json.dumps(rows[0]).encode() + b"\n" + json.dumps(rows[1]).encode().replace(b"q1", b"q\xe9")
                   + b"\n")
    got = [(line, rid, why) for line, rid, _, why in rg.read_rows(jl)]
    assert got[0] == (1, "line-1", None) and got[1][:2] == (2, None) and got[1][2].startswith("not UTF-8 text (byte e9")


def test_tool_definitions_are_sent_and_kept(tmp_path):
    """A row's `tools` (a list, or ShareGPT's JSON string) reach the server with every request and stay in the
    output, so import renders the prompt the server saw; a `tools` that is neither is a skipped row."""
    from dflash.data.conversations import row_messages

    tools = [{"type": "function", "function": {"name": "moon_phase", "parameters": {"type": "object"}}}]
    conv = _write_jsonl(tmp_path / "conv.jsonl", [
        {**_chat(0, turns=2), "tools": tools},
        {"id": "share", "tools": json.dumps(tools), "conversations": [{"from": "human", "value": "q"},
                                                                       {"from": "gpt", "value": ORIGINAL}]},
        {**_chat(1), "tools": "{not json"},
        _chat(2)])
    out = tmp_path / "regen.jsonl"
    with stand_in_server() as (url, bodies):
        summary = rg.run(conv, out, [url], rg.Settings(max_tokens=4), concurrency=1, progress=False)
    assert (summary.regenerated, summary.skipped) == (3, 1)
    assert _rows(rg.skipped_path(out))[0]["reason"] == "`tools` is a string that is not JSON"
    asked = {b["messages"][0]["content"]: b.get("tools") for b in bodies}
    assert len(bodies) == 4 and asked == {"Give me fact number 0 about the sea.": tools, "q": tools,
                                                   "Give me fact number 2 about the sea.": None}
    rows = {r["id"]: r for r in _rows(out)}
    assert rows["conv-0"]["tools"] == rows["share"]["tools"] == tools and "tools" not in rows["conv-2"]
    _, messages, read_tools = row_messages(rows["conv-0"], "auto")
    assert read_tools == tools and [m["content"] for m in messages if m["role"] == "assistant"] == ["fresh", "fresh"]


@pytest.mark.parametrize("line, reason", [
    ("[1, 2]", "a row must be a JSON object, got list"),
    ('{"id": "x", "text": "hi"}', "no 'messages' (OpenAI) or 'conversations' (ShareGPT) list"),
    ('{"conversations": [{"from": "bot", "value": "a"}]}', "turn 0: unknown 'from' 'bot' (use human, gpt, system or tool)"),
    ('{"messages": [{"role": "user", "content": 3}]}', "message 0: 'content' must be a string or a list of text parts"),
    ('{"messages": [{"role": "user", "content": "q"}]}', "no assistant turn to regenerate"),
    ('{"id": [1], "messages": []}', "`id` is not a string or an integer"),
])
def test_a_malformed_row_names_its_reason(line, reason):
    with pytest.raises(rg.BadRow) as e:
        _parse(line)
    assert str(e.value).startswith(reason)


def test_a_torn_last_output_line_is_cut_off(tmp_path):
    out = tmp_path / "out.jsonl"
    out.write_text('{"id": "a", "messages": []}\n{"id": "b", "mess')
    assert rg.finished_ids(out) == {"a"}
    assert out.read_text() == '{"id": "a", "messages": []}\n'
    out.write_text("garbage\n")
    with pytest.raises(rg.RegenerateError, match="line 1 is not a regenerated conversation"):
        rg.finished_ids(out)


def test_requests_go_to_the_least_loaded_live_server():
    pool = rg.ServerPool(["http://a", "http://b", "http://c"])
    first = [pool.acquire() for _ in range(3)]
    assert sorted(first) == ["http://a", "http://b", "http://c"]  # one each before any gets a second
    pool.release("http://b", connected=True, answered=True)
    assert pool.acquire() == "http://b"  # b is the only idle one
    pool.release("http://a", connected=False)  # a stopped answering: skipped while others live
    assert "http://a" not in {pool.acquire() for _ in range(4)}
    assert pool.acquire(avoid="http://c") == "http://b"
    assert not pool.all_down()


def test_request_and_reply_fields():
    body = rg.request_body([{"role": "user", "content": "q"}], rg.Settings(model="m", seed=3, thinking="off", max_tokens=9))
    assert body == {"messages": [{"role": "user", "content": "q"}], "max_tokens": 9, "temperature": 0.0, "stream": False,
                    "model": "m", "seed": 3, "chat_template_kwargs": {"enable_thinking": False}}
    reply = rg.parse_reply({"choices": [{"finish_reason": "length", "message": {"content": "a", "reasoning_content": "r"}}],
                            "usage": {"completion_tokens": 9}})
    assert reply == rg.Reply({"role": "assistant", "content": "a", "reasoning_content": "r"}, 9, True)
    with pytest.raises(ValueError, match="without choices"):
        rg.parse_reply({"error": "x"})
    assert rg.normalize_url(" http://h:1/v1/ ") == "http://h:1"
    with pytest.raises(UsageError, match="not an http"):
        rg.normalize_url("h:1")


def test_the_client_loads_without_torch():
    code = ("import sys, dflash.data.regenerate, dflash.commands.data_regenerate; "
            "print([m for m in ('torch', 'transformers') if m in sys.modules])")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


# ---------------------------------------------------------------- a loopback server that misbehaves on purpose


class _Faulty(http.server.BaseHTTPRequestHandler):
    """Answers each chat request by what its last user message asks for: `hang` (never answers), `drip` (a byte a
    second), `junk` (not JSON), `string-message`, `string-usage`, `nested` (JSON nested 100,000 deep), `surrogate`
    (a lone \\ud800 in the reply), `big` (a 50 MB reply), `busy` (429 with Retry-After: 1, then fine), else fine."""

    protocol_version = "HTTP/1.1"
    busy_seen: set = set()

    def _send(self, body: bytes, status: int = 200, headers: dict | None = None) -> None:
        self.send_response(status)
        for k, v in {"Content-Type": "application/json", "Content-Length": str(len(body)), **(headers or {})}.items():
            self.send_header(k, v)
        self.end_headers()
        self.wfile.write(body)

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        ask = body["messages"][-1]["content"].split()[0]
        ok = {"choices": [{"finish_reason": "stop", "message": {"role": "assistant", "content": f"fresh {ask}"}}],
              "usage": {"completion_tokens": 2}}
        try:
            if ask == "hang":
                time.sleep(30)
            elif ask == "drip":
                self.send_response(200)
                self.send_header("Content-Length", "100000")
                self.end_headers()
                for _ in range(30):
                    self.wfile.write(b" ")
                    self.wfile.flush()
                    time.sleep(1)
            elif ask == "junk":
                self._send(b'{"choices": [{"mess')
            elif ask == "string-message":
                self._send(json.dumps({"choices": [{"message": "fresh"}], "usage": "none"}).encode())
            elif ask == "string-usage":
                self._send(json.dumps({**ok, "usage": "none"}).encode())
            elif ask == "nested":
                self._send(b"[" * 100_000 + b"]" * 100_000)
            elif ask == "surrogate":
                self._send(json.dumps(ok).replace("fresh", "\\ud800fresh").encode())
            elif ask == "big":
                self._send(json.dumps({**ok, "pad": "x" * 50_000_000}).encode())
            elif ask == "busy" and body["messages"][-1]["content"] not in self.busy_seen:
                self.busy_seen.add(body["messages"][-1]["content"])
                self._send(b'{"error": "busy"}', 429, {"Retry-After": "1"})
            else:
                self._send(json.dumps(ok).encode())
        except (BrokenPipeError, ConnectionResetError):  # the client cut it: what a timeout does
            pass

    def log_message(self, *args):
        pass


@pytest.fixture
def faulty():
    _Faulty.busy_seen = set()
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Faulty)
    httpd.daemon_threads = True
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{httpd.server_port}"
    httpd.shutdown()
    httpd.server_close()


def _ask(rid: str, what: str) -> dict:
    return {"id": rid, "messages": [{"role": "user", "content": f"{what} {rid}"}, {"role": "assistant", "content": ORIGINAL}]}


def test_a_hanging_and_a_dripping_conversation_are_skipped_not_a_server_down(faulty, tmp_path):
    """--timeout bounds the whole request: a server sending a byte a second is cut too; each is sent once more,
    then skipped with its reason, and the run goes on to exit 0."""
    conv = _write_jsonl(tmp_path / "conv.jsonl", [_ask("h", "hang"), _ask("d", "drip"),
                                                   *[_ask(f"g{i}", "fine") for i in range(6)]])
    out = tmp_path / "regen.jsonl"
    t0 = time.monotonic()
    summary = rg.run(conv, out, [faulty], rg.Settings(timeout_s=1.0, retries=3), concurrency=4, progress=False)
    seconds = time.monotonic() - t0
    assert summary.stopped is None and (summary.regenerated, summary.skipped) == (6, 2)
    assert seconds < 6, f"{seconds:.1f} s: the deadline is not per request"
    assert sorted(r["id"] for r in _rows(out)) == [f"g{i}" for i in range(6)]
    skipped = {r["id"]: r["reason"] for r in _rows(rg.skipped_path(out))}
    assert set(skipped) == {"h", "d"}
    for reason in skipped.values():
        assert reason.endswith("no whole answer within --timeout 1 s (2 times)"), reason


def test_retry_after_is_honoured_up_to_a_cap(faulty):
    slept: list[float] = []
    pool = rg.ServerPool([faulty])
    reply = rg.complete(pool, [{"role": "user", "content": "busy 1"}], rg.Settings(), sleep=slept.append)
    assert reply.message["content"] == "fresh busy" and slept == [1.0]
    assert rg.retry_after_s("99999") == rg.RETRY_AFTER_MAX_S and rg.retry_after_s("soon") is None
    assert rg.retry_after_s("Wed, 21 Oct 2015 07:28:00 GMT") == 0.0  # a date in the past: now


def test_odd_replies_are_per_row_reasons_never_a_traceback(faulty, tmp_path):
    rows = [_ask(w, w) for w in ("junk", "string-message", "string-usage", "nested", "surrogate", "big", "fine")]
    conv = _write_jsonl(tmp_path / "conv.jsonl", [*rows, '{"id": "in-sur", "messages": [{"role": "user", "content": '
                                                  '"\\ud800 q"}, {"role": "assistant", "content": "a"}]}'])
    out = tmp_path / "regen.jsonl"
    p = _regenerate("--input", conv, "--server", faulty, "--out", out, "--retries", 1, "--max-tokens", 64,
                    "--concurrency", 4)
    assert p.returncode == 0 and "Traceback" not in p.stderr, p.stderr
    assert sorted(r["id"] for r in _rows(out)) == ["fine", "string-usage"]
    skipped = {r["id"]: r["reason"] for r in _rows(rg.skipped_path(out))}
    assert skipped["junk"].startswith("failed after 2 attempts: ") and "an answer that is not JSON (Unterminated" \
        in skipped["junk"]
    assert skipped["string-message"].endswith("an answer without choices[0].message")
    assert skipped["nested"].endswith("an answer that is not JSON (nested too deeply for the JSON parser)")
    assert skipped["surrogate"].endswith("an answer with a lone surrogate (e.g. \\ud800) that UTF-8 cannot write")
    assert "an answer of more than 1,052,672 bytes" in skipped["big"]
    assert skipped["in-sur"] == "a lone surrogate (e.g. \\ud800) that UTF-8 cannot write"


def test_special_files_are_refused_before_anything_is_read(tmp_path):
    import os

    conv = _write_jsonl(tmp_path / "conv.jsonl", [_chat(0)])
    fifo = tmp_path / "fifo.jsonl"
    os.mkfifo(fifo)
    for args, says in (
        (("--input", fifo, "--out", tmp_path / "o.jsonl"), f"--input {fifo} is a FIFO"),
        (("--input", "/dev/zero", "--out", tmp_path / "o.jsonl"), "--input /dev/zero is a device"),
        (("--input", conv, "--out", fifo), f"--out {fifo} is a FIFO"),
        (("--input", conv, "--out", "/dev/stdout"), "--out /dev/stdout is a"),  # a pipe or a terminal: never written
    ):
        p = _regenerate(*args, "--server", "http://127.0.0.1:9", timeout=20)
        assert p.returncode == 2 and len(p.stderr.splitlines()) == 1, p.stderr
        assert p.stderr.startswith(f"dflash-data: error: {says}") and "not a regular file" in p.stderr, p.stderr
    assert not (tmp_path / "o.jsonl").exists()


def test_a_second_run_on_the_same_out_is_refused_naming_the_first(faulty, tmp_path):
    conv = _write_jsonl(tmp_path / "conv.jsonl", [_ask("h", "hang"), *[_ask(f"g{i}", "fine") for i in range(3)]])
    out = tmp_path / "regen.jsonl"
    cmd = [str(BIN / "dflash-data"), "regenerate", "--no-progress", "--input", str(conv), "--server", faulty,
           "--out", str(out), "--timeout", "20", "--retries", "0"]
    first = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 30
        while not (out.exists() and len(_rows(out)) == 3) and time.monotonic() < deadline:
            time.sleep(0.05)  # the first run is then waiting on the hanging conversation, holding the lock
        p = _regenerate("--input", conv, "--server", faulty, "--out", out)
        assert p.returncode == 2 and len(p.stderr.splitlines()) == 1, p.stderr
        assert p.stderr.startswith(f"dflash-data: error: --out {out} is being written by another dflash-data "
                                   f"regenerate (pid {first.pid} on ")
        assert sorted(r["id"] for r in _rows(out)) == ["g0", "g1", "g2"]  # nothing written twice
    finally:
        first.kill()
        first.wait()
    summary = rg.run(conv, out, [faulty], rg.Settings(timeout_s=1, retries=0), concurrency=2, progress=False)
    assert (summary.already_done, summary.skipped) == (3, 1)  # the lock of a killed run is free again


def test_the_readme_workflow_in_one_folder_keeps_both_skipped_files(faulty, tmp_path, capsys):
    """regenerate --out DIR/regen.jsonl, then import DIR/regen.jsonl --out DIR: each command's skipped file stays."""
    from dflash.commands.data import data_main
    from trainkit import chat_target

    target = chat_target(tmp_path / "target", "qwen3")
    folder = tmp_path / "data"
    folder.mkdir()
    conv = _write_jsonl(tmp_path / "conv.jsonl", [_ask("j", "junk"), *[_ask(f"g{i}", "fine") for i in range(3)]])
    out = folder / "regen.jsonl"
    summary = rg.run(conv, out, [faulty], rg.Settings(retries=0), concurrency=2, progress=False)
    assert (summary.regenerated, summary.skipped) == (3, 1)
    regen_skipped = rg.skipped_path(out).read_bytes()
    assert rg.skipped_path(out) == folder / "regen.skipped.jsonl" and b'"id": "j"' in regen_skipped
    with pytest.raises(SystemExit) as e:
        data_main(["import", str(out), "--target", str(target), "--out", str(folder), "--workers", "1", "--no-progress"])
    assert e.value.code == 0, capsys.readouterr().err
    assert rg.skipped_path(out).read_bytes() == regen_skipped
    from dflash.data.shards import ShardDataset

    assert ShardDataset(folder).num_samples == 3
