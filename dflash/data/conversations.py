"""Conversation files -> the target's chat template -> token ids with an exact assistant loss mask.

    from dflash.data.conversations import iter_source, decode_row, row_messages, Renderer
    renderer = Renderer(tokenizer, thinking="keep")
    for row in iter_source(Path("chats.jsonl")):          # streams: one row in memory at a time
        rid, messages, tools = row_messages(decode_row(row), "auto")
        text, spans = renderer.spans(renderer.prepare(messages), tools)

The one reader of conversation files: `dflash-data import` and `dflash-data regenerate` both read rows through
`iter_source` -> `decode_row` -> `row_messages` (with `row_format` and `row_tools`), so a row gets one verdict from
both commands, in every container, and a new container or row format is added in this file only.

Formats (the container from a file's first bytes, the row format from each row alone, ``fmt`` forces one):

- ShareGPT: ``{"id", "conversations": [{"from": "human"|"gpt"|"system"|"tool", "value": str}]}``;
- OpenAI messages: ``{"id", "messages": [{"role": "system"|"user"|"assistant"|"tool", "content": str,
  "reasoning_content"?: str, "tool_calls"?: [...]}], "tools"?: [...]}``;

each as JSONL (one row a line), a JSON array (streamed element by element) or Parquet (either column,
streamed by record batch).

The mask rule: for every assistant turn (only the last with ``last_turn_only``), the characters of
the rendered text from the end of its role header (what ``add_generation_prompt`` emits) to the end
of its end-of-turn marker (what the template writes after an assistant reply, trailing whitespace
excluded) are masked, and a token is masked when its character span (the fast tokenizer's offsets)
overlaps them. So the reasoning block the template keeps, the reply, its tool calls and the
end-of-turn token are learned; role headers, system, user and tool text never are.

Where a reply sits is found in the text itself, not from special-token ids: every text field
(content, reasoning_content, tool-call names) is replaced by a numbered private-use sentinel, the
conversation is rendered once with the sentinels and once as is, and the template text between the
sentinels is aligned with the real render (a field may be stripped by the template). When the
template changes a field in another way, each field is located by rendering with that field alone
replaced and diffing the two texts (exact, one render per field).

Reasoning: templates that render ``reasoning_content`` (the Qwen3 family) get ``enable_thinking``
and decide themselves which turns keep it (Qwen3 keeps the current turn's, drops earlier turns');
``thinking="drop"`` removes every reasoning and renders with ``enable_thinking=False``. For such
templates a ``<think>...</think>`` prefix inside an assistant's content is moved to reasoning_content
first, as the template itself would. Templates that do not render reasoning get the content as is.

No torch here: the tokenizer is passed in.
"""

from __future__ import annotations

import copy
import json
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from dflash.data.jsonl import JsonLineError, binary_lines, decode_json
from dflash.errors import DflashError

FORMATS = ("auto", "sharegpt", "messages")
THINKING = ("keep", "drop")
SHAREGPT_ROLES = {
    "human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant", "model": "assistant",
    "chatgpt": "assistant", "function_call": "assistant", "system": "system", "tool": "tool", "function": "tool",
    "observation": "tool", "function_response": "tool", "tool_response": "tool", "ipython": "tool",
}  # fmt: skip
ROLES = ("system", "user", "assistant", "tool")
_SENTINEL = re.compile("\ue000(\\d+)\ue001")
_READ_CHUNK = 1 << 20  # bytes read at a time from a JSON array
_PARQUET_BATCH = 1024  # rows decoded at a time from a Parquet file


class ConversationError(DflashError):
    """A conversation file that cannot be read at all; one line naming the file and the fix (exit 2)."""

    exit_code = 2


class RowError(ValueError):
    """One malformed row: the reason, one line (the row goes to skipped.jsonl)."""


@dataclass
class SourceRow:
    """One row of a source file: its line (JSONL, JSON array) or row number (Parquet), and either the raw
    text (JSONL), the decoded value (JSON array, Parquet) or why it could not be read. `index`: an element's
    1-based place in a JSON array (several can start on one line), 0 for the other containers."""

    line: int
    raw: str | None = None
    value: object = None
    error: str | None = None
    index: int = 0


# ---------------------------------------------------------------------------------------------
# Reading files, streamed


def sniff(path: Path) -> str:
    """'jsonl', 'json' (a top-level array) or 'parquet' from the first bytes; ConversationError otherwise."""
    try:
        with open(path, "rb") as f:
            head = f.read(4096)
    except FileNotFoundError:
        raise ConversationError(f"{path}: no such file; give .jsonl, .json or .parquet conversation files") from None
    except OSError as e:
        raise ConversationError(f"{path}: cannot read it ({e.strerror}); check the path and its permissions") from None
    if head.startswith(b"PAR1"):
        return "parquet"
    text = head.lstrip(b"\xef\xbb\xbf \t\r\n")
    if text[:1] == b"[":
        return "json"
    if text[:1] == b"{" or not text:
        return "jsonl"
    raise ConversationError(f"{path}: neither JSON/JSONL nor Parquet (it starts with {head[:16]!r}); give "
                            "conversation files as .jsonl, .json (an array) or .parquet")


def iter_source(path: Path) -> Iterator[SourceRow]:
    """Every row of one file in order, streamed (a JSONL line, a JSON array element, a Parquet row)."""
    kind = sniff(path)
    if kind == "parquet":
        yield from _iter_parquet(path)
    elif kind == "json":
        yield from _iter_json_array(path)
    else:
        with open(path, "rb") as f:
            for lineno, raw in binary_lines(f):  # lines end at "\n" only
                if raw.strip():
                    try:
                        yield SourceRow(lineno, raw=raw.decode("utf-8"))
                    except UnicodeDecodeError as e:
                        yield SourceRow(lineno, error=f"not UTF-8 text (byte {raw[e.start]:02x} at offset {e.start} "
                                                      "of the line); save the file as UTF-8")


_NOT_UTF8_ARRAY = "not UTF-8 text from here on; save the file as UTF-8 (the rest of the file is not read)"


def _read_text(f) -> str | None:
    """The next chunk of a text file opened strictly as UTF-8, or None where its bytes are not UTF-8."""
    try:
        return f.read(_READ_CHUNK)
    except UnicodeDecodeError:
        return None


def _iter_json_array(path: Path) -> Iterator[SourceRow]:
    """Elements of a top-level JSON array, decoded one at a time from a sliding buffer (bounded memory:
    one element plus one read chunk). A syntax error ends the file with one error row at its line."""
    decoder = json.JSONDecoder()
    with open(path, encoding="utf-8-sig") as f:
        buf, pos, line, eof = "", 0, 1, False
        opened, index = False, 0
        while True:
            while pos < len(buf) and (buf[pos] in " \t\r\n" or (opened and buf[pos] == ",")):
                line += buf[pos] == "\n"
                pos += 1
            if pos >= len(buf) and not eof:
                chunk = _read_text(f)
                if chunk is None:
                    yield SourceRow(line, error=_NOT_UTF8_ARRAY)
                    return
                buf, pos, eof = buf[pos:] + chunk, 0, not chunk
                continue
            if pos >= len(buf):
                if opened:
                    yield SourceRow(line, error="the JSON array is not closed (truncated file?)")
                return
            if not opened:
                opened, pos = True, pos + 1  # the '['
                continue
            if buf[pos] == "]":
                return
            try:
                value, end = decoder.raw_decode(buf, pos)
            except json.JSONDecodeError as e:
                if not eof:  # maybe an element cut by the read chunk: read more
                    chunk = _read_text(f)
                    if chunk is None:
                        yield SourceRow(line, error=_NOT_UTF8_ARRAY)
                        return
                    buf, pos, eof = buf[pos:] + chunk, 0, not chunk
                    continue
                yield SourceRow(line + buf.count("\n", pos, e.pos),
                                error=f"not valid JSON ({e.msg}); the rest of the file is not read")
                return
            except (RecursionError, ValueError) as e:  # nested too deeply, an integer of too many digits
                why = "nested too deeply" if isinstance(e, RecursionError) else str(e).split(";")[0][:120]
                yield SourceRow(line, error=f"not valid JSON ({why}); the rest of the file is not read")
                return
            index += 1
            yield SourceRow(line, value=value, index=index)
            line += buf.count("\n", pos, end)
            pos = end


def count_rows(path: Path) -> int:
    """The rows `iter_source` yields for `path` (a progress bar's total), read as a stream: the non-blank lines of a
    JSONL file, the elements of a JSON array (decoded one at a time), a Parquet file's row count (its footer)."""
    kind = sniff(path)
    if kind == "parquet":
        return _parquet_file(path)[0].metadata.num_rows
    if kind == "json":
        return sum(1 for _ in _iter_json_array(path))
    with open(path, "rb") as f:
        return sum(1 for _, raw in binary_lines(f) if raw.strip())


def _parquet_file(path: Path):
    """(the open pyarrow ParquetFile, the columns read); ConversationError for an unreadable file or one without a
    `conversations` or `messages` column."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        pf = pq.ParquetFile(path)
    except (pa.ArrowException, OSError) as e:
        raise ConversationError(f"{path}: not a readable Parquet file ({str(e).splitlines()[0][:160]})") from None
    names = pf.schema_arrow.names
    columns = [c for c in ("id", "conversations", "messages", "tools") if c in names]
    if "conversations" not in columns and "messages" not in columns:
        raise ConversationError(f"{path}: no 'conversations' or 'messages' column (columns: {', '.join(names)}); "
                                "give ShareGPT or OpenAI-messages rows")
    return pf, columns


def _iter_parquet(path: Path) -> Iterator[SourceRow]:
    import pyarrow as pa

    pf, columns = _parquet_file(path)
    row = 0
    batches = pf.iter_batches(batch_size=_PARQUET_BATCH, columns=columns)
    while True:
        try:
            batch = next(batches, None)
        except (pa.ArrowException, OSError) as e:  # a corrupt page behind an intact footer
            raise ConversationError(f"{path}: corrupt Parquet data after row {row:,} ({str(e).splitlines()[0][:160]}); "
                                    "restore or re-export the file (finished shards are kept: rerun to resume)") from None
        if batch is None:
            return
        for value in batch.to_pylist():
            row += 1
            yield SourceRow(row, value=value)


# ---------------------------------------------------------------------------------------------
# Rows -> messages


def row_format(value: object) -> str | None:
    """'messages', 'sharegpt' or None (neither column) for one decoded row, judged on that row alone.

    The rule for a row holding both keys, the one place it is written: it reads as OpenAI `messages` (the richer
    form: reasoning, tool calls, content parts) and its `conversations` is ignored, in import and regenerate alike;
    a null key (a Parquet row's empty column) counts as absent."""
    if isinstance(value, dict):
        if value.get("messages") is not None:
            return "messages"
        if value.get("conversations") is not None:
            return "sharegpt"
    return None


def detect_format(path: Path, forced: str) -> str:
    """The row format of one file as recorded and logged: `forced`, else the first decodable row's ('messages' when
    none tells). Rows are read by their own format all the same (import passes "auto" to the workers)."""
    if forced != "auto":
        return forced
    for n, row in enumerate(iter_source(path)):
        if n >= 100:
            break
        try:
            fmt = row_format(decode_row(row))
        except RowError:
            continue
        if fmt:
            return fmt
    return "messages"


def decode_row(row: SourceRow) -> dict:
    """The row as a dict (JSONL text decoded here); RowError when it is not a JSON object."""
    if row.error:
        raise RowError(row.error)
    value = row.value
    if row.raw is not None:
        try:
            value = decode_json(row.raw)
        except JsonLineError as e:
            raise RowError(f"not valid JSON ({e})") from None
    if not isinstance(value, dict):
        raise RowError(f"a row must be a JSON object, got {type(value).__name__}")
    return value


def row_messages(value: dict, fmt: str) -> tuple[str | None, list[dict], list | None]:
    """(id or None, messages in OpenAI form, tools or None) of one row of format `fmt` ('auto': `row_format`);
    RowError with the reason for a row that is not a conversation (unknown role, a non-text content part...).

    The messages are as an OpenAI-compatible server takes them (what regenerate sends): text content (text parts
    joined), `name` / `tool_call_id` / `reasoning_content` / `tool_calls` kept, tool-call arguments as given;
    `Renderer.prepare` turns them into what a chat template renders."""
    if fmt == "auto":
        fmt = row_format(value)
        if fmt is None:
            raise RowError("no 'messages' (OpenAI) or 'conversations' (ShareGPT) list")
    key = "conversations" if fmt == "sharegpt" else "messages"
    turns = value.get(key)
    if not isinstance(turns, list) or not turns:
        raise RowError(f"no '{key}' list (a {fmt} row needs one)")
    messages = [(_sharegpt_message if fmt == "sharegpt" else _openai_message)(m, i) for i, m in enumerate(turns)]
    rid = value.get("id")
    return (None if rid is None else str(rid)), messages, row_tools(value)


def row_tools(row: dict) -> list | None:
    """A row's tool definitions (a list, or a JSON string of one as some ShareGPT files write it), else None; the one
    rule import and regenerate read them by (RowError for anything else)."""
    tools = row.get("tools")
    if isinstance(tools, str):
        try:
            tools = decode_json(tools)
        except JsonLineError:
            raise RowError("`tools` is a string that is not JSON") from None
    if tools is not None and not isinstance(tools, list):
        raise RowError("`tools` is not a list")
    return tools or None


def _sharegpt_message(m: object, i: int) -> dict:
    if not isinstance(m, dict):
        raise RowError(f"turn {i} is not an object")
    who = m.get("from")
    role = SHAREGPT_ROLES.get(str(who).lower()) if who is not None else None
    if role is None:
        raise RowError(f"turn {i}: unknown 'from' {who!r} (use human, gpt, system or tool)")
    value = m.get("value")
    if not isinstance(value, str):
        raise RowError(f"turn {i}: 'value' must be a string, got {type(value).__name__}")
    return {"role": role, "content": value}


def _openai_message(m: object, i: int) -> dict:
    if not isinstance(m, dict):
        raise RowError(f"message {i} is not an object")
    role = m.get("role")
    if role not in ROLES:
        raise RowError(f"message {i}: unknown role {role!r} (use {', '.join(ROLES)})")
    out = {"role": role, "content": _text(m.get("content"), i)}
    for key in ("name", "tool_call_id"):
        if isinstance(m.get(key), str):
            out[key] = m[key]
    if role == "assistant":
        reasoning = m.get("reasoning_content")
        if reasoning is not None and not isinstance(reasoning, str):
            raise RowError(f"message {i}: 'reasoning_content' must be a string")
        if reasoning:
            out["reasoning_content"] = reasoning
        if m.get("tool_calls"):
            out["tool_calls"] = _tool_calls(m["tool_calls"], i)
    return out


def _text(content: object, i: int) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # OpenAI content parts: text only
        parts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise RowError(f"message {i}: content part {kind!r} is not text (only text parts are imported)")
            parts.append(part["text"])
        return "".join(parts)
    raise RowError(f"message {i}: 'content' must be a string or a list of text parts")


def _tool_calls(calls: object, i: int) -> list[dict]:
    if not isinstance(calls, list):
        raise RowError(f"message {i}: 'tool_calls' must be a list")
    out = []
    for call in calls:
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
            raise RowError(f"message {i}: a tool call without function.name")
        out.append({**call, "type": call.get("type", "function"), "function": dict(fn)})
    return out


def _template_calls(calls: list[dict]) -> list[dict]:
    """Tool calls with JSON-string arguments decoded: templates write arguments themselves (tojson)."""
    out = []
    for call in calls:
        args = call["function"].get("arguments", {})
        if isinstance(args, str):
            try:
                args = decode_json(args)
            except JsonLineError:
                pass
        out.append({**call, "function": {**call["function"], "arguments": args}})
    return out


# ---------------------------------------------------------------------------------------------
# Rendering and the mask


def _sentinel(k: int) -> str:
    return f"\ue000{k}\ue001"


def _fields(messages: list[dict]) -> list[tuple[int, tuple, str]]:
    """(message index, path to the value, value) of every non-empty text field a sentinel can stand for."""
    out = []
    for i, m in enumerate(messages):
        for key in ("reasoning_content", "content"):
            if m.get(key):
                out.append((i, (key,), m[key]))
        for c, call in enumerate(m.get("tool_calls") or []):
            out.append((i, ("tool_calls", c, "function", "name"), call["function"]["name"]))
    return out


def _put(messages: list[dict], field: tuple, value: str) -> None:
    i, path, _ = field
    node = messages[i]
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = value


def _strip_variants(value: str) -> list[str]:
    out = []
    for v in (value, value.strip(), value.lstrip(), value.rstrip(), value.strip("\n"), value.lstrip("\n"),
              value.rstrip("\n")):
        if v not in out:
            out.append(v)
    return out


def _align(text: str, templated: str, fields: list) -> dict[int, tuple[int, int]] | None:
    """{field k: (start, end) in text} by matching the sentinel render's template pieces against `text`;
    None when the template changed a field beyond stripping (or rendered one twice)."""
    parts = _SENTINEL.split(templated)  # [T0, k0, T1, k1, ..., Tm]
    pieces, keys = parts[0::2], [int(k) for k in parts[1::2]]
    if len(set(keys)) != len(keys) or not text.startswith(pieces[0]):
        return None
    pos, spans = len(pieces[0]), {}
    for k, after in zip(keys, pieces[1:]):
        for v in _strip_variants(fields[k][2]):
            if text.startswith(v, pos) and text.startswith(after, pos + len(v)):
                spans[k] = (pos, pos + len(v))
                pos += len(v) + len(after)
                break
        else:
            return None
    return spans if pos == len(text) else None


def _diff_span(text: str, other: str) -> tuple[int, int]:
    """(start, end) in `text` of what differs from `other` (common prefix and suffix removed)."""
    n = min(len(text), len(other))
    p = 0
    while p < n and text[p] == other[p]:
        p += 1
    s = 0
    while s < n - p and text[-1 - s] == other[-1 - s]:
        s += 1
    return p, len(text) - s


class Renderer:
    """Renders conversations with a tokenizer's chat template and masks the assistant replies."""

    def __init__(self, tokenizer, thinking: str = "keep", last_turn_only: bool = False):
        if thinking not in THINKING:
            raise ValueError(f"thinking {thinking!r}: use keep or drop")
        if not getattr(tokenizer, "chat_template", None):
            raise ConversationError("the target's tokenizer has no chat_template; give a model folder whose "
                                    "tokenizer_config.json carries one")
        if not getattr(tokenizer, "is_fast", False):
            raise ConversationError("the target's tokenizer is not a fast tokenizer (no offsets mapping); give a "
                                    "model folder with tokenizer.json")
        self.tokenizer, self.thinking, self.last_turn_only = tokenizer, thinking, last_turn_only
        self.kwargs = {"enable_thinking": thinking == "keep"}  # templates without the switch ignore it
        self.reasoning = self._renders_reasoning()
        self.headers = list(dict.fromkeys(h for h in (self._header(self.kwargs), self._header({})) if h))
        self.end_marker = self._end_marker()

    def render(self, messages: list[dict], tools: list | None = None, **extra) -> str:
        return self.tokenizer.apply_chat_template(messages, tools=tools, tokenize=False, **self.kwargs, **extra)

    # probes of the template: which text a header and an end-of-turn are, whether reasoning is rendered
    def _probe(self, messages: list[dict], **kw) -> str | None:
        try:
            return self.tokenizer.apply_chat_template(messages, tokenize=False, **kw)
        except Exception:  # a template may refuse a probe (raise_exception): then it tells nothing
            return None

    def _header(self, kwargs: dict) -> str:
        user = [{"role": "user", "content": _sentinel(0)}]
        with_gen = self._probe(user, add_generation_prompt=True, **kwargs)
        without = self._probe(user, add_generation_prompt=False, **kwargs)
        if with_gen is None or without is None or not with_gen.startswith(without):
            return ""
        return with_gen[len(without):]

    def _end_marker(self) -> str:
        text = self._probe([{"role": "user", "content": _sentinel(0)},
                            {"role": "assistant", "content": _sentinel(1)}], **self.kwargs)
        if not text or _sentinel(1) not in text:
            return ""
        return text.split(_sentinel(1), 1)[1].rstrip()

    def _renders_reasoning(self) -> bool:
        text = self._probe([{"role": "user", "content": "q"},
                            {"role": "assistant", "content": "a", "reasoning_content": _sentinel(0)}],
                           enable_thinking=True)
        return bool(text) and _sentinel(0) in text

    def prepare(self, messages: list[dict]) -> list[dict]:
        """The messages as rendered: tool-call arguments given as a JSON string decoded, inline <think> moved to
        reasoning_content (templates that render it), every reasoning removed with thinking='drop'."""
        out = []
        for m in messages:
            m = dict(m)
            if m.get("tool_calls"):
                m["tool_calls"] = _template_calls(m["tool_calls"])
            if m["role"] == "assistant" and self.reasoning:
                content = m.get("content") or ""
                if not m.get("reasoning_content") and "</think>" in content:
                    head, _, tail = content.partition("</think>")
                    m["reasoning_content"] = head.split("<think>")[-1].strip("\n")
                    m["content"] = tail.lstrip("\n")
                if self.thinking == "drop":
                    m.pop("reasoning_content", None)
            out.append(m)
        return out

    def spans(self, messages: list[dict], tools: list | None = None) -> tuple[str, list[tuple[int, int]]]:
        """(rendered text, masked character spans, one per masked assistant turn). RowError when the template
        refuses the conversation."""
        fields = _fields(messages)
        text = self._render_checked(messages, tools)
        if "\ue000" in text:
            raise RowError("the text holds U+E000, the private-use character the mask locates fields with")
        marked = copy.deepcopy(messages)
        for k, field in enumerate(fields):
            _put(marked, field, _sentinel(k))
        where = _align(text, self._render_checked(marked, tools), fields)
        if where is None:
            where = self._diff_fields(text, messages, fields, tools)
        assistant = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
        if self.last_turn_only:
            assistant = assistant[-1:]
        found = sorted(where.values())
        return text, [s for i in assistant if (s := self._turn_span(text, i, fields, where, found))]

    def _render_checked(self, messages: list[dict], tools) -> str:
        try:
            return self.render(messages, tools)
        except Exception as e:  # jinja errors, raise_exception in the template
            raise RowError(f"the chat template refused it ({' '.join(str(e).split())[:160]})") from None

    def _diff_fields(self, text: str, messages: list[dict], fields: list, tools) -> dict[int, tuple[int, int]]:
        """Each field's span by rendering with that field alone replaced (exact whatever the template does)."""
        where = {}
        for k, field in enumerate(fields):
            marked = copy.deepcopy(messages)
            _put(marked, field, _sentinel(k))
            other = self._render_checked(marked, tools)
            if _sentinel(k) in other:
                where[k] = _diff_span(text, other)
        return where

    def _turn_span(self, text: str, i: int, fields: list, where: dict, found: list) -> tuple[int, int] | None:
        """Assistant message i: from the end of its header to the end of its end-of-turn marker."""
        own = [where[k] for k, f in enumerate(fields) if f[0] == i and k in where]
        if not own:
            return None
        p, q = min(s for s, _ in own), max(e for _, e in own)
        lo = max((e for s, e in found if e <= p), default=0)
        start = p
        for header in self.headers:
            j = text.rfind(header, lo, p)
            if j >= 0:
                start = j + len(header)
                break
        hi = min((s for s, e in found if s >= q), default=len(text))
        j = text.find(self.end_marker, q, hi) if self.end_marker else -1
        return start, (j + len(self.end_marker) if j >= 0 else q)

    def encode_batch(self, texts: list[str], spans: list[list[tuple[int, int]]]) -> list[tuple[np.ndarray, np.ndarray]]:
        """(input_ids int32, loss_mask int8) per text: a token is masked when its offsets overlap a span."""
        enc = self.tokenizer(texts, add_special_tokens=False, return_offsets_mapping=True)
        out = []
        for text, row_spans, ids, offsets in zip(texts, spans, enc["input_ids"], enc["offset_mapping"]):
            chars = np.zeros(len(text) + 1, dtype=np.int32)
            for a, b in row_spans:
                chars[a:b] = 1
            covered = np.concatenate([[0], np.cumsum(chars)])
            off = np.asarray(offsets, dtype=np.int64).reshape(-1, 2)
            a, b = off[:, 0], off[:, 1]
            mask = (covered[b] - covered[a] > 0) | ((a == b) & (chars[np.minimum(a, len(text))] > 0))
            out.append((np.asarray(ids, dtype=np.int32), mask.astype(np.int8)))
        return out
