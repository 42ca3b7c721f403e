"""Lines and JSON values of the users' text files (prompts, conversations), read the same way everywhere.

    for lineno, raw in binary_lines(f):        # bytes of one line, without its "\\n" (and a trailing "\\r")
    value = decode_json(text)                  # JsonLineError(reason) for anything json cannot decode

A line ends at "\\n" only (a trailing "\\r" is dropped): U+2028, U+0085, a lone "\\r" or a form feed
inside a prompt or a JSON string never splits it, unlike ``str.splitlines()`` and text-mode files.
Decoding errors of every kind (bad syntax, nesting too deep for the parser, an integer with more
digits than Python converts) are one `JsonLineError` whose message is a short reason; the caller
adds the file and the line number.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import BinaryIO


class JsonLineError(ValueError):
    """A line that is not valid JSON; the message is the reason, one line."""


def text_lines(text: str) -> Iterator[tuple[int, str]]:
    """(line number from 1, line) of a text, split at "\\n" only; a trailing "\\r" is dropped."""
    for lineno, line in enumerate(text.split("\n"), 1):
        yield lineno, line[:-1] if line.endswith("\r") else line


def binary_lines(f: BinaryIO) -> Iterator[tuple[int, bytes]]:
    """(line number from 1, bytes) of a file opened in binary mode, streamed, split at b"\\n" only."""
    for lineno, raw in enumerate(f, 1):
        raw = raw[:-1] if raw.endswith(b"\n") else raw
        yield lineno, raw[:-1] if raw.endswith(b"\r") else raw


def decode_json(text: str | bytes) -> object:
    """json.loads, with every way it can fail turned into JsonLineError (one line, no position beyond a column)."""
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise JsonLineError(f"{e.msg} at column {e.colno}") from None
    except RecursionError:
        raise JsonLineError("nested too deeply for the JSON parser") from None
    except ValueError as e:  # an integer of more digits than int() converts, bytes that are not UTF-8
        raise JsonLineError(" ".join(str(e).split(";")[0].split())[:120]) from None
