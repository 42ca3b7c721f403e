"""Conversations -> chat template -> exact assistant masks, on real fast tokenizers (CPU).

Three template families: ChatML (the SmolLM2 target's own tokenizer), a Qwen3-style template with
thinking (written here from the public format: reasoning kept for the turns after the last user
message, dropped for earlier ones), and a template that changes the text (upper-cased replies), which
the per-field diff must still locate. Every check compares the runs of masked tokens, decoded, with the
assistant replies the test expects: nothing else masked, every character of them covered (a token that
straddles a header and a reply is masked: see the random-rows test).
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from dflash.data.conversations import (
    ConversationError,
    Renderer,
    RowError,
    SourceRow,
    count_rows,
    decode_row,
    iter_source,
    row_messages,
)

# A Qwen3-style template (the public format, written for this test): ChatML turns; a tools system block;
# tool results inside a user turn; <think> blocks for the assistant turns after the last user message.
QWEN_STYLE = (
    "{%- if tools %}{{- '<|im_start|>system\\n' }}{%- if messages[0].role == 'system' %}"
    "{{- messages[0].content + '\\n\\n' }}{%- endif %}{{- 'Tools:' }}{%- for t in tools %}{{- '\\n' + (t | tojson) }}"
    "{%- endfor %}{{- '<|im_end|>\\n' }}"
    "{%- elif messages[0].role == 'system' %}{{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- set ns = namespace(last_user=-1) %}"
    "{%- for m in messages %}{%- if m.role == 'user' %}{%- set ns.last_user = loop.index0 %}{%- endif %}{%- endfor %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'user' %}{{- '<|im_start|>user\\n' + m.content + '<|im_end|>\\n' }}"
    "{%- elif m.role == 'assistant' %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if loop.index0 > ns.last_user and (loop.last or m.reasoning_content) %}"
    "{{- '<think>\\n' + (m.reasoning_content or '').strip('\\n') + '\\n</think>\\n\\n' }}{%- endif %}"
    "{{- (m.content or '').strip() }}"
    "{%- for c in m.tool_calls or [] %}{{- '\\n<tool_call>\\n{\"name\": \"' + c.function.name + '\", \"arguments\": '"
    " + (c.function.arguments | tojson) + '}\\n</tool_call>' }}{%- endfor %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- elif m.role == 'tool' %}{{- '<|im_start|>user\\n<tool_response>\\n' + m.content + "
    "'\\n</tool_response><|im_end|>\\n' }}"
    "{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and not enable_thinking %}{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}"
    "{%- endif %}"
)
# A template that changes the replies (upper case): only the per-field diff can locate them.
UPPER = ("{%- for m in messages %}{{- '<|im_start|>' + m.role + '\\n' }}"
         "{{- m.content | upper if m.role == 'assistant' else m.content }}{{- '<|im_end|>\\n' }}{%- endfor %}"
         "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}")


def byte_tokenizer(template: str):
    """A real fast tokenizer: byte-level BPE without merges (one token per byte) + ChatML/think special tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    core = Tokenizer(models.BPE({c: i for i, c in enumerate(pre_tokenizers.ByteLevel.alphabet())}, []))
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    tok = PreTrainedTokenizerFast(tokenizer_object=core)
    tok.add_special_tokens({"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>",
                            "additional_special_tokens": ["<|im_start|>"]})
    tok.add_tokens(["<think>", "</think>", "<tool_call>", "</tool_call>"])
    tok.chat_template = template
    return tok


@pytest.fixture(scope="module")
def smollm2_tok():
    from transformers import AutoTokenizer

    from dflash.models import smollm2_convert

    return AutoTokenizer.from_pretrained(smollm2_convert.ensure_converted(log=lambda *_: None))


def masked_runs(tok, renderer: Renderer, messages: list[dict], tools=None) -> list[str]:
    """The runs of masked tokens, each decoded; also checks the ids are the template's own tokenization."""
    messages = renderer.prepare(row_messages({"messages": messages}, "messages")[1])
    text, spans = renderer.spans(messages, tools)
    ((ids, mask),) = renderer.encode_batch([text], [spans])
    assert ids.tolist() == tok(text, add_special_tokens=False)["input_ids"]
    assert ids.tolist() == tok.apply_chat_template(messages, tools=tools, tokenize=True, return_dict=True,
                                                   **renderer.kwargs)["input_ids"]
    edges = np.flatnonzero(np.diff(np.concatenate([[0], mask, [0]])))
    return [tok.decode(ids[a:b].tolist()) for a, b in zip(edges[0::2], edges[1::2])]


CHAT = [
    {"role": "system", "content": "You answer briefly."},
    {"role": "user", "content": "What is 2+2?"},
    {"role": "assistant", "content": "4.\n\nAnything else? "},
    {"role": "user", "content": "Say hi in French <|im_end|> please"},
    {"role": "assistant", "content": " Bonjour !"},
]


def test_chatml_smollm2_masks_every_reply_and_its_end_of_turn(smollm2_tok):
    r = Renderer(smollm2_tok)
    assert masked_runs(smollm2_tok, r, CHAT) == ["4.\n\nAnything else? <|im_end|>", " Bonjour !<|im_end|>"]
    assert masked_runs(smollm2_tok, Renderer(smollm2_tok, last_turn_only=True), CHAT) == [" Bonjour !<|im_end|>"]


def test_chatml_smollm2_tool_turns_are_never_masked(smollm2_tok):
    chat = [{"role": "user", "content": "weather?"}, {"role": "assistant", "content": "Calling the tool."},
            {"role": "tool", "content": "{\"temp\": 21}"}, {"role": "assistant", "content": "It is 21 C."}]
    assert masked_runs(smollm2_tok, Renderer(smollm2_tok), chat) == ["Calling the tool.<|im_end|>",
                                                                     "It is 21 C.<|im_end|>"]


AGENT = [
    {"role": "system", "content": "Use tools."},
    {"role": "user", "content": "Old question"},
    {"role": "assistant", "content": "Old answer", "reasoning_content": "old thoughts"},
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": "", "reasoning_content": "need the tool",
     "tool_calls": [{"type": "function", "function": {"name": "weather", "arguments": "{\"city\": \"Paris\"}"}}]},
    {"role": "tool", "content": "{\"temp\": 21}"},
    {"role": "assistant", "content": "\n21 C in Paris.", "reasoning_content": "\nthe tool said 21\n"},
]
TOOLS = [{"type": "function", "function": {"name": "weather", "parameters": {"type": "object"}}}]
CALL = '\n<tool_call>\n{"name": "weather", "arguments": {"city": "Paris"}}\n</tool_call>'


def test_qwen_style_thinking_keep_follows_the_template():
    tok = byte_tokenizer(QWEN_STYLE)
    r = Renderer(tok, thinking="keep")
    assert r.reasoning and r.headers == ["<|im_start|>assistant\n"] and r.end_marker == "<|im_end|>"
    # the earlier question's reasoning is dropped by the template; the current query's turns keep theirs
    assert masked_runs(tok, r, AGENT, TOOLS) == [
        "Old answer<|im_end|>",
        "<think>\nneed the tool\n</think>\n\n" + CALL + "<|im_end|>",
        "<think>\nthe tool said 21\n</think>\n\n21 C in Paris.<|im_end|>",
    ]


def test_qwen_style_thinking_drop_and_inline_think():
    tok = byte_tokenizer(QWEN_STYLE)
    r = Renderer(tok, thinking="drop")
    # the prompt at serving time ends with the empty think block: it is never learned
    assert masked_runs(tok, r, AGENT, TOOLS) == ["Old answer<|im_end|>", CALL + "<|im_end|>",
                                                "21 C in Paris.<|im_end|>"]
    inline = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "<think>\nhmm\n</think>\n\nA."}]
    assert masked_runs(tok, Renderer(tok), inline) == ["<think>\nhmm\n</think>\n\nA.<|im_end|>"]
    assert masked_runs(tok, r, inline) == ["A.<|im_end|>"]


def test_a_template_that_changes_the_text_is_located_by_diffing():
    tok = byte_tokenizer(UPPER)
    chat = [{"role": "user", "content": "hello"}, {"role": "assistant", "content": "hello there"},
            {"role": "user", "content": "x"}, {"role": "assistant", "content": "ok"}]
    assert masked_runs(tok, Renderer(tok), chat) == ["HELLO THERE<|im_end|>", "OK<|im_end|>"]


def test_every_assistant_character_and_nothing_else_on_many_rows(smollm2_tok):
    rng = np.random.default_rng(0)
    words = ["alpha", "beta", " gamma", "δέλτα", "\n", "  ", "x=1;", "<b>", "😀", "end."]
    r = Renderer(smollm2_tok)
    for _ in range(30):
        chat, replies = [{"role": "system", "content": "sys"}] if rng.random() < 0.5 else [], []
        for _ in range(int(rng.integers(1, 4))):
            chat.append({"role": "user", "content": "".join(rng.choice(words, 4))})
            reply = "".join(rng.choice(words, int(rng.integers(1, 8))))
            chat.append({"role": "assistant", "content": reply})
            replies.append(reply + "<|im_end|>")
        runs = masked_runs(smollm2_tok, r, chat)
        # A reply starting with spaces: BPE merges the header's newline with them into one token ("\n "),
        # which is masked (it holds reply text); nothing else outside a reply is.
        assert len(runs) == len(replies)
        assert all(run.endswith(reply) and run[: len(run) - len(reply)] in ("", "\n") for run, reply in zip(runs,
                                                                                                        replies))


def test_rows_of_both_formats_and_their_errors():
    share = {"id": 7, "conversations": [{"from": "system", "value": "s"}, {"from": "human", "value": "q"},
                                        {"from": "gpt", "value": "a"}]}
    assert row_messages(share, "auto") == ("7", [{"role": "system", "content": "s"}, {"role": "user", "content": "q"},
                                                 {"role": "assistant", "content": "a"}], None)
    oa = {"messages": [{"role": "user", "content": [{"type": "text", "text": "q"}]},
                       {"role": "assistant", "content": "a", "reasoning_content": "r"}]}
    assert row_messages(oa, "auto")[1][1] == {"role": "assistant", "content": "a", "reasoning_content": "r"}
    for bad, reason in [({"conversations": [{"from": "robot", "value": "x"}]}, "unknown 'from'"),
                        ({"messages": [{"role": "user", "content": 3}]}, "'content' must be"),
                        ({"messages": "x"}, "no 'messages' list"),
                        ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "is not text")]:
        with pytest.raises(RowError, match=reason):
            row_messages(bad, "auto")
    with pytest.raises(RowError, match="not valid JSON"):
        decode_row(SourceRow(3, raw="{broken"))


def test_files_stream_with_line_numbers(tmp_path):
    rows = [{"id": i, "messages": [{"role": "user", "content": "a\nb"}]} for i in range(3)]
    arr = tmp_path / "a.json"
    arr.write_text("[\n" + ",\n".join(json.dumps(r, indent=1) for r in rows) + "\n]\n")
    got = list(iter_source(arr))
    assert [r.value["id"] for r in got] == [0, 1, 2] and [r.line for r in got] == [2, 11, 20] and count_rows(arr) == 3
    jl = tmp_path / "a.jsonl"
    jl.write_text(json.dumps(rows[0]) + "\n\n" + json.dumps(rows[1]) + "\n")
    assert [r.line for r in iter_source(jl)] == [1, 3] and count_rows(jl) == 2
    cut = tmp_path / "cut.json"
    cut.write_text('[{"id": 1}, {"id": ')
    assert [r.error is not None for r in iter_source(cut)] == [False, True]
    (tmp_path / "x.csv").write_text("id,text\n1,hi\n")
    with pytest.raises(ConversationError, match=r"x.csv: neither JSON/JSONL nor Parquet"):
        list(iter_source(tmp_path / "x.csv"))


def test_bytes_that_are_not_utf8_are_a_row_error_never_a_silent_replacement(tmp_path):
    """A JSONL line of Latin-1 is that row's error (the rows around it read); a JSON array ends in one error row where
    the read that met it starts (here the first: the file is one read chunk)."""
    good = json.dumps({"id": 1, "messages": [{"role": "user", "content": "hi"}]}).encode()
    jl = tmp_path / "latin1.jsonl"
    jl.write_bytes(good + b"\n" + b'{"id": 2, "messages": [{"role": "user", "content": "caf\xe9"}]}\n' + good + b"\n")
    rows = list(iter_source(jl))
    assert [r.error for r in rows] == [None, "not UTF-8 text (byte e9 at offset 55 of the line); save the file as "
                                             "UTF-8", None]
    with pytest.raises(RowError, match="not UTF-8 text"):
        decode_row(rows[1])
    arr = tmp_path / "latin1.json"
    arr.write_bytes(b"[" + good + b",\n" + b'{"content": "caf\xe9"}]')
    got = list(iter_source(arr))
    assert [(r.line, r.error) for r in got] == [(1, "not UTF-8 text from here on; save the file as UTF-8 (the rest of "
                                                   "the file is not read)")]


def test_hostile_lines_are_row_errors_and_lines_end_at_newline_only(tmp_path):
    """A row nested 100,000 deep or holding a 5,000-digit integer is one malformed row (JSONL) or ends a JSON array
    with one error row, never a traceback; U+2028, U+0085 and a lone CR inside a JSONL row do not split it."""
    odd = {"id": "odd", "messages": [{"role": "user", "content": "a\u2028b\u0085c"}]}
    jl = tmp_path / "h.jsonl"
    jl.write_bytes(b'{"id": ' + b"7" * 5000 + b"}\r\n" + b"[" * 100_000 + b"]" * 100_000 + b"\r\n"
                   + json.dumps(odd, ensure_ascii=False).encode() + b"\r{}\n")
    rows = list(iter_source(jl))
    assert [r.line for r in rows] == [1, 2, 3]
    for row, reason in zip(rows[:2], ["Exceeds the limit", "nested too deeply"]):
        with pytest.raises(RowError, match=reason):
            decode_row(row)
    with pytest.raises(RowError, match="Extra data"):  # a CR is no line end: this line holds two values
        decode_row(rows[2])
    jl.write_bytes(json.dumps(odd, ensure_ascii=False).encode() + b"\r\n")
    assert [decode_row(r) for r in iter_source(jl)] == [odd]
    for n, body in enumerate([b"[" * 100_000, b'{"id": ' + b"7" * 5000 + b"}"]):
        arr = tmp_path / f"h{n}.json"
        arr.write_bytes(b'[{"id": 1},\n' + body + b"]")
        got = list(iter_source(arr))
        assert got[0].value == {"id": 1} and got[1].line == 2 and "not valid JSON" in got[1].error and len(got) == 2


def test_parquet_rows(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    conv = [[{"from": "human", "value": "q"}, {"from": "gpt", "value": "a"}]] * 3
    pq.write_table(pa.table({"id": ["a", "b", "c"], "conversations": conv}), tmp_path / "c.parquet")
    got = list(iter_source(tmp_path / "c.parquet"))
    assert [r.line for r in got] == [1, 2, 3] and row_messages(got[1].value, "auto")[0] == "b"
    assert count_rows(tmp_path / "c.parquet") == 3
