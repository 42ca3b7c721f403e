"""Conversations with the target's own replies: each assistant turn regenerated through OpenAI-compatible servers.

    uv run dflash-data regenerate --input conv.jsonl --server http://127.0.0.1:30000 --out regen.jsonl

Input: what `dflash-data import` reads, through its reader (dflash.data.conversations: one verdict per row from
both commands): JSONL, a JSON array or Parquet, ShareGPT (`id`, `conversations`: [{from, value}]) or OpenAI (`id`,
`messages`: [{role, content}]) rows, with optional `tools`, read as a stream. Output: JSONL in the OpenAI form,
`{"id", "messages", "tools"?}` (the tool definitions are sent with every request and kept), one line per finished
conversation, appended and flushed as soon as it is done (completion order, not input order); an assistant turn
keeps the server's `reasoning_content` when it returns one. A rerun skips the ids already in the output, so a run
stopped anywhere (a server killed, Ctrl-C) loses nothing and writes nothing twice. What could not be done in this
run (a malformed row, a conversation that failed after every retry) goes to `<out stem>.skipped.jsonl` beside the
output (`regen.jsonl` -> `regen.skipped.jsonl`: never import's `skipped.jsonl` in the same folder), with the row's
line (Parquet: its row number) and the reason; a rerun tries those again. One run writes an output at a time: it
holds an flock on `.<out name>.lock` beside it, and a second run on the same --out is refused in one line naming
the first. Input and output must be regular files (a FIFO, /dev/zero or /dev/stdout is refused before anything is
read).

Requests go to the least-loaded live server (ties in turn); a failed request is retried with exponential
backoff (or the server's Retry-After, up to RETRY_AFTER_MAX_S) on another server when there is one. `--timeout`
bounds each request in total, connection to last byte: a conversation that hits it is sent once more, then
skipped; only refused connections, or a server's requests failing many times in a row, mark a server down. An
answer of any other shape (junk, torn, nested too deeply, wrong types, a lone surrogate, bigger than --max-tokens
allows) is a failed attempt with its reason, never a traceback. The client is plain HTTP (http.client, threads;
no torch, no tokenizer): it runs in the training environment while the server runs in the infer-cu130 profile's.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import random
import threading
import time
from collections import Counter
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from pathlib import Path

from dflash.data.conversations import RowError, SourceRow, count_rows, decode_row, iter_source, row_messages, sniff
from dflash.data.jsonl import JsonLineError, decode_json
from dflash.errors import DflashError, UsageError

SKIPPED_SUFFIX = ".skipped.jsonl"  # <out stem> + this, beside --out: what this run could not do, with the reason
CHAT_PATH = "/v1/chat/completions"
MODELS_PATH = "/v1/models"
PROBE_TIMEOUT_S = 10.0  # the start-of-run reachability check, per server
BACKOFF_BASE_S = 0.5  # first retry waits ~0.5 s, then doubles (with jitter) ...
BACKOFF_MAX_S = 30.0  # ... up to this
FAILED_FIRST_LIMIT = 8  # this many failed conversations before any succeeds stop the run (wrong --model, wrong URL)
TIMEOUT_RETRIES = 1  # a request that hit --timeout is sent once more, then the conversation is skipped
RETRY_AFTER_MAX_S = 60.0  # a server's Retry-After is honoured up to this many seconds
DOWN_AFTER_FAILURES = 16  # a server whose last this many requests all failed (timeouts, junk) is avoided while others answer
REPLY_BYTES_PER_TOKEN = 64  # an answer may hold at most this many bytes per --max-tokens token ...
REPLY_BYTES_SLACK = 1 << 20  # ... plus this much (JSON, reasoning, tool calls): memory stays bounded per reply


class RegenerateError(DflashError):
    """A regeneration that cannot go on (exit 1); the message is one line with the fix."""


class RunStopped(RegenerateError):
    """The run stopped early (every server down, or only failures so far); what is done is kept, a rerun continues."""


class BadRow(ValueError):
    """One input row that is not a conversation we can regenerate; the message is the reason."""


class RowFailed(Exception):
    """One conversation that failed for good (a 4xx answer, or every retry spent); the message is the reason."""


@dataclass(frozen=True)
class Settings:
    """How each reply is asked for."""

    model: str | None = None  # the `model` field of each request; None: the server's own
    temperature: float = 0.0  # 0 = greedy, like `dflash-data prepare`
    max_tokens: int = 4096  # completion tokens per reply
    turns: str = "all"  # all: every assistant turn, in order, on the regenerated history; last: only the final one
    thinking: str = "keep"  # keep: the template's default; off: chat_template_kwargs enable_thinking=false
    seed: int | None = None  # sent with every request when given
    retries: int = 5  # further attempts per reply after a failure
    timeout_s: float = 600.0  # per request, in total: connection, the server's work and the whole answer


@dataclass(frozen=True)
class Conversation:
    """One input row: its id, its messages in the OpenAI form, and its tool definitions (None: none)."""

    id: str
    messages: list[dict]
    tools: list | None = None


@dataclass
class Reply:
    message: dict
    completion_tokens: int
    truncated: bool  # finish_reason == "length": cut by max_tokens


@dataclass
class Summary:
    """What one run did; `stopped` is the reason it ended early (every server down), else None."""

    regenerated: int = 0
    skipped: int = 0
    already_done: int = 0
    completion_tokens: int = 0
    truncated: int = 0
    seconds: float = 0.0
    served: dict = field(default_factory=dict)
    retries: int = 0
    stopped: str | None = None


# ---------------------------------------------------------------- input rows


def normalize_url(url: str) -> str:
    """`http://host:port[/v1][/]` -> `http://host:port`; anything not http(s) is a usage error."""
    base = url.strip().rstrip("/")
    if base.endswith("/v1"):
        base = base[: -len("/v1")]
    if not base.startswith(("http://", "https://")) or len(base.split("://", 1)[1]) == 0:
        raise UsageError(f"--server {url!r} is not an http(s) URL; give e.g. --server http://127.0.0.1:30000")
    return base


def _unwritable(value) -> str | None:
    """Why `value` cannot be written as one UTF-8 JSON line (a lone surrogate such as \\ud800 in a string, nesting
    too deep for the encoder), else None."""
    try:
        json.dumps(value, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError:
        return "a lone surrogate (e.g. \\ud800) that UTF-8 cannot write"
    except RecursionError:
        return "nesting too deep to write"
    except TypeError as e:  # a Parquet binary or timestamp column
        return f"a value JSON cannot hold ({e})"
    return None


def parse_row(row: SourceRow) -> Conversation:
    """One source row -> its Conversation, read by import's reader (dflash.data.conversations: `decode_row`,
    `row_messages`, `row_tools`, so a row regenerate reads is a row import reads, and the other way round); BadRow
    with the reason (and `.rid` when known) otherwise.

    A row without an id (or a null one) gets `line-<line>`, its line (JSONL) or row number (Parquet), or in a JSON
    array `row-<n>`, the element's place (several elements can share a line): stable across reruns of the same input
    file. Regenerate's own rules, on top of import's: an id must be a string
    or an integer (finished ids are matched on it), the row needs an assistant turn to regenerate, and what its output
    line would hold (id, messages, tools) must be writable as UTF-8 JSON.
    """
    try:
        value = decode_row(row)
    except RowError as e:
        raise BadRow(str(e)) from None
    rid = value.get("id")
    if rid is None:
        rid = f"row-{row.index}" if row.index else f"line-{row.line}"
    if not isinstance(rid, (str, int)) or isinstance(rid, bool):
        raise BadRow("`id` is not a string or an integer")
    try:
        _, messages, tools = row_messages(value, "auto")  # row_format's rule: `messages` when a row holds both
        if not any(m["role"] == "assistant" for m in messages):
            raise RowError("no assistant turn to regenerate")
        unwritable = _unwritable([rid, messages, tools])  # what its output would hold
        if unwritable:
            raise RowError(unwritable)
    except RowError as e:
        bad = BadRow(str(e))
        bad.rid = None if _unwritable(rid) else str(rid)
        raise bad from None
    return Conversation(str(rid), messages, tools)


def read_rows(path: Path):
    """Stream (line, id, conversation, reason) for every row of a JSONL file, a JSON array or a Parquet file
    (import's `iter_source`); a bad row has None and a reason."""
    for row in iter_source(path):
        try:
            conv = parse_row(row)
        except BadRow as e:
            yield row.line, getattr(e, "rid", None), None, str(e)
        else:
            yield row.line, conv.id, conv, None


# ---------------------------------------------------------------- output


def skipped_path(out: Path) -> Path:
    out = Path(out)
    return out.with_name(out.stem + SKIPPED_SUFFIX)


def _special(path: Path) -> str | None:
    """'a FIFO', 'a device', 'a socket'... when `path` exists and is not a regular file (nor a folder), else None."""
    import stat

    try:
        mode = path.stat().st_mode
    except OSError:
        return None
    if stat.S_ISREG(mode) or stat.S_ISDIR(mode):
        return None
    return ("a FIFO" if stat.S_ISFIFO(mode) else "a socket" if stat.S_ISSOCK(mode)
            else "a device" if stat.S_ISCHR(mode) or stat.S_ISBLK(mode) else "not a regular file")


def check_paths(input_path: Path, out: Path) -> None:
    """Refuse what is not a regular file (a FIFO, a device, /dev/stdout), an --out that would overwrite the input (or
    make its skipped file do it) or that is a folder, and an input that is no JSONL, JSON array or Parquet file
    (ConversationError, exit 2: its first bytes); before any row is read."""
    input_path, out = Path(input_path), Path(out)
    for path, what in ((input_path, "--input"), (out, "--out"), (skipped_path(out), "its skipped file")):
        kind = _special(path)
        if kind:
            raise UsageError(f"{what} {path} is {kind}, not a regular file; give a .jsonl file path")
    if out.is_dir():
        raise UsageError(f"--out {out} is a folder; give a .jsonl file path")
    for path, what in ((out, "--out"), (skipped_path(out), "the skipped file beside --out")):
        if path.resolve() == input_path.resolve() or (path.exists() and os.path.samefile(path, input_path)):
            raise UsageError(f"{what} {path} is the input file; give another --out (regenerate never overwrites its input)")
    sniff(input_path)


class OutputBusy(UsageError):
    """Another regenerate run writes this --out (exit 2)."""


class OutputLock:
    """The --out's exclusive lock: an flock on ``.<out name>.lock`` beside it, holding the owner (pid, host, time).

    The kernel frees it when the process dies, however it dies; `release` removes the file."""

    def __init__(self, out: Path):
        import fcntl
        import socket

        self.path = Path(out).with_name(f".{Path(out).name}.lock")
        self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            try:
                owner = json.loads(os.pread(self.fd, 4096, 0) or b"{}")
            except ValueError:
                owner = {}
            os.close(self.fd)
            who = (f"pid {owner.get('pid')} on {owner.get('host')} since {owner.get('time')}"
                   if isinstance(owner, dict) and owner.get("pid") else "a run that is still starting")
            raise OutputBusy(f"--out {out} is being written by another dflash-data regenerate ({who}); wait for it "
                             "to finish or stop it (a rerun then continues), or give another --out") from None
        owner = {"pid": os.getpid(), "host": socket.gethostname(), "time": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
        os.ftruncate(self.fd, 0)
        os.pwrite(self.fd, (json.dumps(owner) + "\n").encode(), 0)

    def release(self) -> None:
        if self.fd >= 0:
            try:
                self.path.unlink()
            except OSError:
                pass
            os.close(self.fd)
            self.fd = -1

    def __enter__(self) -> OutputLock:
        return self

    def __exit__(self, *exc) -> None:
        self.release()


def finished_ids(out: Path) -> set[str]:
    """Ids already in the output; a torn last line (a run killed mid-write) is cut off the file."""
    out = Path(out)
    if not out.exists():
        return set()
    ids, good = set(), 0
    with open(out, "rb") as f:
        for lineno, raw in enumerate(f, 1):
            if not raw.endswith(b"\n"):
                break
            try:
                ids.add(str(json.loads(raw)["id"]))
            except (ValueError, KeyError, TypeError, RecursionError):
                raise RegenerateError(f"{out} line {lineno} is not a regenerated conversation; give another --out "
                                      "or move that file aside") from None
            good += len(raw)
    if good < out.stat().st_size:
        os.truncate(out, good)
    return ids


# ---------------------------------------------------------------- servers


class ServerPool:
    """The servers and their requests in flight: each request goes to the least-loaded live server, ties in turn.

    A server whose last request failed to connect is down until a later request succeeds; down servers are used
    only while every server is down, and every server down stops the run. A server whose last DOWN_AFTER_FAILURES
    requests all failed otherwise (timed out, torn, junk) is only avoided while another one answers: slow or odd
    conversations are those rows' failures, never a reason to stop. `stop()` makes every later request raise
    RunStopped at once.
    """

    def __init__(self, urls: list[str]):
        self.urls = list(dict.fromkeys(urls))
        self._lock = threading.Lock()
        self._busy = dict.fromkeys(self.urls, 0)
        self._failing = dict.fromkeys(self.urls, False)  # its last request found no connection
        self._failures = dict.fromkeys(self.urls, 0)  # requests failed in a row on a connection
        self._turn = 0
        self.served: Counter = Counter()
        self.retries = 0  # requests sent again after a failure
        self.stopped: str | None = None

    def acquire(self, avoid: str | None = None) -> str:
        """The server for the next request (not `avoid` when another one is live)."""
        with self._lock:
            live = ([u for u in self.urls if not self._failing[u] and self._failures[u] < DOWN_AFTER_FAILURES]
                    or [u for u in self.urls if not self._failing[u]] or list(self.urls))
            if len(live) > 1 and avoid in live:
                live.remove(avoid)
            self._turn += 1
            order = {u: (i - self._turn) % len(self.urls) for i, u in enumerate(self.urls)}
            url = min(live, key=lambda u: (self._busy[u], order[u]))
            self._busy[url] += 1
            return url

    def release(self, url: str, connected: bool, answered: bool = False) -> None:
        """One request to `url` ended: `connected` False when no connection was made (refused, unreachable),
        `answered` True when it gave a usable reply."""
        with self._lock:
            self._busy[url] -= 1
            self._failures[url] = 0 if answered else self._failures[url] + connected
            self._failing[url] = not connected
            self.served[url] += answered

    def count_retry(self) -> None:
        with self._lock:
            self.retries += 1

    def all_down(self) -> bool:
        with self._lock:
            return all(self._failing.values())

    def stop(self, reason: str) -> None:
        self.stopped = self.stopped or reason


class Unreachable(OSError):
    """No connection to the server (refused, unreachable, no route): the server is down."""


class RequestTimeout(OSError):
    """No whole answer within the request's deadline (a hanging conversation, a server dripping bytes)."""


class HttpAnswer(Exception):
    """An HTTP error answer: its status, the first 200 characters of its body, and its Retry-After in seconds."""

    def __init__(self, code: int, text: str, retry_after: float | None):
        super().__init__(f"HTTP {code}: {text}")
        self.code, self.text, self.retry_after = code, text, retry_after


def retry_after_s(value: str | None) -> float | None:
    """A Retry-After header (seconds, or an HTTP date) as seconds from now, capped at RETRY_AFTER_MAX_S; None if
    absent or unreadable."""
    if not value:
        return None
    value = value.strip()
    try:
        seconds = float(value)
    except ValueError:
        from email.utils import parsedate_to_datetime

        try:
            seconds = parsedate_to_datetime(value).timestamp() - time.time()
        except (TypeError, ValueError, IndexError, OverflowError):
            return None
    if seconds != seconds:  # NaN
        return None
    return min(max(seconds, 0.0), RETRY_AFTER_MAX_S)


def http_request(url: str, body: dict | None, deadline_s: float, max_bytes: int) -> bytes:
    """POST `body` as JSON (GET when None) and return the answer's body, all within `deadline_s` seconds in total.

    A timer cuts the socket at the deadline, so neither a hanging server nor one sending a byte a second outlives
    it (RequestTimeout); an answer over `max_bytes` is refused as it streams in (ValueError); no connection is
    Unreachable; an HTTP error status is HttpAnswer; a torn answer is OSError or http.client.HTTPException.
    """
    import socket
    import urllib.parse

    parts = urllib.parse.urlsplit(url)
    conn_type = http.client.HTTPSConnection if parts.scheme == "https" else http.client.HTTPConnection
    conn = conn_type(parts.hostname, parts.port, timeout=deadline_s)
    expired = threading.Event()

    def cut() -> None:
        expired.set()
        sock = conn.sock
        if sock is not None:
            try:
                sock.shutdown(socket.SHUT_RDWR)  # wakes the read blocked on it
            except OSError:
                pass

    timer = threading.Timer(deadline_s, cut)
    timer.daemon = True
    timer.start()
    try:
        try:
            conn.connect()
        except OSError as e:
            if expired.is_set() or isinstance(e, TimeoutError):
                raise RequestTimeout(f"no connection within --timeout {deadline_s:g} s") from None
            raise Unreachable(_reason(e)) from None
        data = None if body is None else json.dumps(body).encode()
        path = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
        headers = {"Content-Type": "application/json", "Connection": "close"}
        conn.request("GET" if data is None else "POST", path, body=data, headers=headers)
        response = conn.getresponse()
        chunks, size = [], 0
        while chunk := response.read(1 << 16):
            size += len(chunk)
            if size > max_bytes:
                raise ValueError(f"an answer of more than {max_bytes:,} bytes (refused as it arrived: more than "
                                 "--max-tokens can make)")
            chunks.append(chunk)
        if expired.is_set():  # the cut socket reads as the end of the answer
            raise RequestTimeout(f"no whole answer within --timeout {deadline_s:g} s")
        if response.length:  # http.client leaves what Content-Length promised and never came
            raise http.client.IncompleteRead(b"".join(chunks), response.length)
        answer = b"".join(chunks)
        if response.status >= 400:
            text = " ".join(answer[:400].decode("utf-8", "replace").split())[:200]
            raise HttpAnswer(response.status, text, retry_after_s(response.getheader("Retry-After")))
        return answer
    except (OSError, http.client.HTTPException) as e:
        if expired.is_set() or isinstance(e, TimeoutError):  # the timer, or the socket's own timeout, at the deadline
            raise RequestTimeout(f"no whole answer within --timeout {deadline_s:g} s") from None
        raise
    finally:
        timer.cancel()
        conn.close()


def _http_json(url: str, body: dict | None, timeout: float, max_bytes: int = REPLY_BYTES_SLACK):
    """The answer decoded as JSON; ValueError (one line) for one that is not (torn, junk, nested too deeply)."""
    answer = http_request(url, body, timeout, max_bytes)
    try:
        return decode_json(answer)
    except JsonLineError as e:
        raise ValueError(f"an answer that is not JSON ({e})") from None


def _reason(e: BaseException) -> str:
    inner = getattr(e, "reason", None)
    text = str(inner if inner is not None else e) or type(e).__name__
    return " ".join(text.split())[:200]


def probe(urls: list[str], timeout: float = PROBE_TIMEOUT_S) -> list[str]:
    """Check every server answers HTTP (UsageError otherwise); the model ids the first one lists ([] if none)."""
    models: list[str] | None = None
    for url in urls:
        try:
            listed = _http_json(url + MODELS_PATH, None, timeout)
            ids = [m["id"] for m in listed.get("data", []) if isinstance(m, dict) and isinstance(m.get("id"), str)]
        except HttpAnswer:  # it answers; it just lists no models
            ids = []
        except (OSError, http.client.HTTPException) as e:
            raise UsageError(f"server {url} is unreachable ({_reason(e)}); start it (README: Your data) or "
                             "fix --server") from None
        except (ValueError, AttributeError, TypeError):
            ids = []
        models = ids if models is None else models
    return models or []


def request_body(messages: list[dict], settings: Settings, tools: list | None = None) -> dict:
    body = {"messages": messages, "max_tokens": settings.max_tokens, "temperature": settings.temperature,
            "stream": False}
    if tools:
        body["tools"] = tools  # the conversation's tool definitions: the template renders them into the prompt
    if settings.model:
        body["model"] = settings.model
    if settings.seed is not None:
        body["seed"] = settings.seed
    if settings.thinking == "off":
        body["chat_template_kwargs"] = {"enable_thinking": False}
    return body


def parse_reply(data, max_tokens: int | None = None) -> Reply:
    """A chat.completion answer -> the assistant message to keep; ValueError (the reason, one line) for any answer
    that is not that shape: no choices[0].message, fields of the wrong type, a lone surrogate, more completion
    tokens than `max_tokens`."""
    choices = data.get("choices") if isinstance(data, dict) else None
    choice = choices[0] if isinstance(choices, list) and choices else None
    message = choice.get("message") if isinstance(choice, dict) else None
    if not isinstance(message, dict):
        raise ValueError("an answer without choices[0].message")
    content, tool_calls = message.get("content"), message.get("tool_calls")
    if tool_calls is not None and not isinstance(tool_calls, list):
        raise ValueError("an answer whose tool_calls is not a list")
    if not isinstance(content, str) and not tool_calls:
        raise ValueError("an answer whose message has no content")
    out = {"role": "assistant", "content": content if isinstance(content, str) else ""}
    reasoning = message.get("reasoning_content") or message.get("reasoning")
    if reasoning and not isinstance(reasoning, str):
        raise ValueError("an answer whose reasoning_content is not a string")
    if reasoning:
        out["reasoning_content"] = reasoning
    if tool_calls:
        out["tool_calls"] = tool_calls
    unwritable = _unwritable(out)
    if unwritable:
        raise ValueError(f"an answer with {unwritable}")
    usage = data.get("usage") if isinstance(data.get("usage"), dict) else {}
    tokens = usage.get("completion_tokens")
    tokens = tokens if isinstance(tokens, int) and not isinstance(tokens, bool) and tokens >= 0 else 0
    if max_tokens is not None and tokens > max_tokens:
        raise ValueError(f"an answer of {tokens:,} completion tokens > --max-tokens {max_tokens:,}")
    return Reply(out, tokens, choice.get("finish_reason") == "length")


def backoff_s(attempt: int) -> float:
    """Seconds before retry `attempt` (1, 2, ...): doubling from BACKOFF_BASE_S, capped, with jitter."""
    return min(BACKOFF_MAX_S, BACKOFF_BASE_S * 2 ** (attempt - 1)) * random.uniform(0.5, 1.0)


def reply_bytes(max_tokens: int) -> int:
    """The largest answer body accepted for `max_tokens` (bounded memory per reply)."""
    return REPLY_BYTES_SLACK + REPLY_BYTES_PER_TOKEN * max_tokens


def complete(pool: ServerPool, messages: list[dict], settings: Settings, sleep=time.sleep,
             tools: list | None = None) -> Reply:
    """One reply to `messages`, retried with backoff (or the server's Retry-After) over the pool's servers.

    RowFailed: a 4xx answer (the request itself is wrong), --timeout hit twice, or every attempt spent while some
    server lives. RunStopped: every attempt spent and every server down, or the pool stopped.
    """
    body, last, avoid, wait_s, timeouts = request_body(messages, settings, tools), "no attempt", None, None, 0
    for attempt in range(settings.retries + 1):
        if pool.stopped:
            raise RunStopped(pool.stopped)
        if attempt:
            pool.count_retry()
            sleep(backoff_s(attempt) if wait_s is None else wait_s)
        url, wait_s = pool.acquire(avoid), None
        try:
            data = _http_json(url + CHAT_PATH, body, settings.timeout_s, reply_bytes(settings.max_tokens))
            reply = parse_reply(data, settings.max_tokens)
        except HttpAnswer as e:
            pool.release(url, connected=True)
            last, avoid, wait_s = f"{url} answered HTTP {e.code}: {e.text}", url, e.retry_after
            if 400 <= e.code < 500 and e.code not in (408, 429):  # the request itself is wrong: no retry helps
                raise RowFailed(last) from None
        except Unreachable as e:  # refused, no route: this server is down
            pool.release(url, connected=False)
            last, avoid = f"{url}: {_reason(e)}", url
        except RequestTimeout as e:  # this conversation, not the server: sent once more, then skipped
            pool.release(url, connected=True)
            last, avoid, timeouts = f"{url}: {e}", url, timeouts + 1
            if timeouts > TIMEOUT_RETRIES:
                raise RowFailed(f"{last} ({timeouts} times)") from None
        except (OSError, http.client.HTTPException, ValueError) as e:  # a torn or junk answer
            pool.release(url, connected=True)
            last, avoid = f"{url}: {_reason(e)}", url
        else:
            pool.release(url, connected=True, answered=True)
            return reply
    if pool.all_down():
        raise RunStopped(f"every server is down (last: {last}); restart one")
    raise RowFailed(f"failed after {settings.retries + 1} attempts: {last}")


def regenerate(pool: ServerPool, conv: Conversation, settings: Settings) -> tuple[dict, list[Reply]]:
    """The output row: the conversation with its assistant turns (all, or the last) replaced by the servers' replies,
    in order, and its tool definitions kept (import renders them as the server did)."""
    messages = conv.messages
    targets = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
    targets = set(targets[-1:] if settings.turns == "last" else targets)
    out, replies = [], []
    for i, message in enumerate(messages):
        if i in targets:
            replies.append(complete(pool, out, settings, tools=conv.tools))
            message = replies[-1].message
        out.append(message)
    row = {"id": conv.id, "messages": out}
    if conv.tools:
        row["tools"] = conv.tools
    return row, replies


# ---------------------------------------------------------------- the run


class _Run:
    """One regeneration run: reads the input as a stream, keeps at most 2 x concurrency conversations in flight,
    writes each result as it finishes (main thread only)."""

    def __init__(self, out, skipped, pool: ServerPool, settings: Settings, bar):
        self.out, self.skipped, self.pool, self.settings, self.bar = out, skipped, pool, settings, bar
        self.summary = Summary()
        self.pending: dict[Future, tuple[int, str]] = {}
        self.failed = 0  # conversations that failed for good in this run
        self.start = time.monotonic()

    def skip(self, lineno: int, rid: str | None, reason: str) -> None:
        self.skipped.write(json.dumps({"line": lineno, "id": rid, "reason": reason}, ensure_ascii=False) + "\n")
        self.skipped.flush()
        self.summary.skipped += 1
        self.bar.update(1)

    def finish(self, future: Future) -> None:
        lineno, rid = self.pending.pop(future)
        try:
            row, replies = future.result()
        except RowFailed as e:
            self.failed += 1
            if self.failed >= FAILED_FIRST_LIMIT and not self.summary.regenerated:
                self.pool.stop(f"the first {self.failed} conversations all failed (last: {e}); check --model and --server")
            return self.skip(lineno, rid, str(e))
        except RunStopped as e:
            self.pool.stop(str(e))
            return
        self.out.write(json.dumps(row, ensure_ascii=False) + "\n")
        self.out.flush()
        s = self.summary
        s.regenerated += 1
        s.completion_tokens += sum(r.completion_tokens for r in replies)
        s.truncated += sum(r.truncated for r in replies)
        self.bar.update(1)
        self.bar.set_postfix_str(f"{s.completion_tokens / max(time.monotonic() - self.start, 1e-9):.0f} tok/s", refresh=False)

    def drain(self, keep: int) -> None:
        while len(self.pending) > keep:
            finished, _ = wait(list(self.pending), return_when=FIRST_COMPLETED)
            for future in finished:
                self.finish(future)

    def feed(self, executor: ThreadPoolExecutor, rows, done: set[str], concurrency: int) -> None:
        seen: dict[str, int] = {}
        for lineno, rid, conv, reason in rows:
            if self.pool.stopped:
                break
            if reason is not None:
                self.skip(lineno, rid, reason)
            elif rid in seen:
                self.skip(lineno, rid, f"duplicate id (also at line {seen[rid]})")
            elif rid in done:
                seen[rid] = lineno
                self.summary.already_done += 1
                self.bar.update(1)
            else:
                seen[rid] = lineno
                self.drain(2 * concurrency - 1)
                self.pending[executor.submit(regenerate, self.pool, conv, self.settings)] = (lineno, rid)
        self.drain(0)


def run(input_path: Path, out: Path, urls: list[str], settings: Settings, concurrency: int = 64,
        progress: bool | None = None, locked: bool = False) -> Summary:
    """Regenerate every conversation of `input_path` not yet in `out`; see the module docstring. `locked`: the
    caller holds the OutputLock of `out` already (else this takes it)."""
    from tqdm import tqdm

    input_path, out = Path(input_path), Path(out)
    check_paths(input_path, out)
    total = count_rows(input_path)
    out.parent.mkdir(parents=True, exist_ok=True)
    pool = ServerPool(urls)
    with (contextlib.nullcontext() if locked else OutputLock(out),
          open(out, "a", encoding="utf-8") as out_f,
          open(skipped_path(out), "w", encoding="utf-8", errors="backslashreplace") as skip_f,
          tqdm(total=total, unit="conv", desc="regenerate", disable=None if progress is None else not progress,
               dynamic_ncols=True) as bar):
        done = finished_ids(out)  # under the lock: it may cut a torn last line
        job = _Run(out_f, skip_f, pool, settings, bar)
        executor = ThreadPoolExecutor(max_workers=concurrency, thread_name_prefix="regenerate")
        try:
            job.feed(executor, read_rows(input_path), done, concurrency)
        except KeyboardInterrupt:
            pool.stop("interrupted")  # requests in flight end at their next attempt; what is written stays
            raise
        finally:
            executor.shutdown(wait=False, cancel_futures=True)
    summary = job.summary
    summary.seconds = time.monotonic() - job.start
    summary.served, summary.retries, summary.stopped = dict(pool.served), pool.retries, pool.stopped
    return summary
